"""What every test shares: Triton under the interpreter, one torch thread per worker, and ``sys.path`` left as found.

A test module or a test that puts a folder on ``sys.path`` makes that folder's modules shadow installed packages
for every later test of its worker (``benchmarks/`` on the path once made transformers import a benchmark script
as the ``kernels`` package). Benchmark scripts are imported as ``from benchmarks import name``; a test that needs
a folder on the path takes ``monkeypatch.syspath_prepend``, which is undone after it.
"""

import os
import sys

import pytest

pytest_plugins = ["pytester"]  # tests/test_benchmark_isolation.py runs a session of its own

# Triton kernels run on CPU tensors under the interpreter; it must be set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

# Test tensors are tiny and pytest-xdist already runs one worker per core: a second intra-op thread
# only adds contention (tens of ms per op on a busy 2-core machine instead of microseconds).
torch.set_num_threads(1)


def _restore_sys_path(before: list[str]) -> str | None:
    """Put ``sys.path`` back to ``before``; say what had changed, or None when nothing had."""
    if sys.path == before:
        return None
    added = [p for p in sys.path if p not in before]
    removed = [p for p in before if p not in sys.path]
    sys.path[:] = before
    return f"changed sys.path (added {added}, removed {removed}): put it back, e.g. with monkeypatch.syspath_prepend"


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    """A test module that changes ``sys.path`` when imported fails to collect, naming what it changed."""
    before = list(sys.path)
    report = yield
    change = _restore_sys_path(before)
    if change is not None:
        report.outcome = "failed"
        report.longrepr = f"{collector.nodeid} {change}"
    return report


@pytest.fixture(autouse=True)
def _sys_path_left_as_found(request: pytest.FixtureRequest):
    """A test that leaves ``sys.path`` changed fails in its teardown (and ``sys.path`` is put back)."""
    before = list(sys.path)
    yield
    change = _restore_sys_path(before)
    if change is not None:
        pytest.fail(f"{request.node.nodeid} {change}", pytrace=False)
