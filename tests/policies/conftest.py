"""Fixtures of the policy tests: paged caches of known keys and brute-force attention (from tests/helpers.py)."""

import pytest

from tests.helpers import OneLayerCache, dense_probs, random_cache as build_random_cache


@pytest.fixture(scope="session")
def random_cache():
    """``random_cache(lens, num_kv_heads=2, head_dim=8, page_size=4, extra_tokens=0)``: a
    :class:`tests.helpers.OneLayerCache` of random mixed-sign keys (shared per-dim offsets) and values."""
    return build_random_cache


@pytest.fixture(scope="session")
def brute_probs():
    """:func:`tests.helpers.dense_probs`."""
    return dense_probs


@pytest.fixture(scope="session")
def cache_of():
    """``cache_of(keys, values, page_size, extra_tokens=0)``: a :class:`tests.helpers.OneLayerCache` of
    given tensors."""
    return OneLayerCache
