"""PagedKVCache's prefix caching: page hashes, reference counts, sharing, eviction (incl. a hypothesis state machine).

Keys encode what they hold (token id, position, layer), so a sequence's stored K/V can be checked against its
tokens wherever its pages come from: its own writes or the prefix cache.
"""

import hashlib
import random
import struct

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from questkv import PagedKVCache
from questkv.cache.page_hashes import page_hashes
from questkv.cache.paged import CacheFullError

LAYERS, HEADS, DIM, PAGE, POOL, SEQS = 2, 1, 4, 2, 10, 4


def encoded_kv(tokens, start):
    """Keys and values ``[LAYERS, len(tokens), HEADS, DIM]`` that spell each token, its position and the layer."""
    n = len(tokens)
    keys = torch.zeros(LAYERS, n, HEADS, DIM)
    keys[..., 0] = torch.tensor(tokens, dtype=torch.float32)[None, :, None]
    keys[..., 1] = torch.arange(start, start + n, dtype=torch.float32)[None, :, None]
    keys[..., 2] = torch.arange(LAYERS, dtype=torch.float32)[:, None, None]
    keys[..., 3] = -keys[..., 0] - 1
    return keys, keys * 2 + 1


def append(cache, seq_id, tokens, start):
    """Write ``tokens`` at positions ``start..`` of ``seq_id`` (allocating), checking that no written page is shared."""
    slots = cache.reserve([seq_id], [len(tokens)])
    for page in (slots // PAGE).tolist():
        assert cache.refcount(page) == 1, f"page {page} is written while shared"
    keys, values = encoded_kv(tokens, start)
    for layer in range(LAYERS):
        cache.write(layer, slots, keys[layer], values[layer])


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random sequences over a two-token alphabet (so prefixes repeat) start on the prefix cache's pages, grow,
    register their full pages and free them, in a pool small enough to evict; the model is each sequence's tokens."""

    def __init__(self):
        super().__init__()
        self.cache = PagedKVCache(LAYERS, HEADS, DIM, POOL, PAGE, max_seqs=SEQS, prefix_caching=True, hash_salt=b"m")
        self.tokens = {}  # sequence id -> its tokens

    @precondition(lambda self: len(self.tokens) < SEQS)
    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=9))
    def add(self, tokens):
        cache = self.cache
        hit = cache.match_prefix(tokens, (len(tokens) - 1) // PAGE)
        assert len(hit) * PAGE < len(tokens)
        free, cost = cache.num_free_pages, cache.prefix_cost(hit)
        need = cache.pages_for_tokens(len(tokens)) - len(hit) + cost
        seq_id = cache.add_sequence()
        cache.share_prefix(seq_id, hit)
        assert cache.num_free_pages == free - cost  # evictable hit pages are taken back
        new = tokens[len(hit) * PAGE:]
        if not cache.can_reserve([seq_id], [len(new)]):
            assert need > free
            cache.free_sequence(seq_id)
            assert cache.num_free_pages == free
            return
        assert need <= free
        append(cache, seq_id, new, len(hit) * PAGE)
        cache.register(seq_id, tokens)
        assert cache.num_free_pages == free - need
        self.tokens[seq_id] = list(tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def grow(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        more = data.draw(st.lists(st.integers(0, 1), min_size=1, max_size=3))
        if not self.cache.can_reserve([seq_id], [len(more)]):
            with pytest.raises(CacheFullError):
                self.cache.allocate([seq_id], [len(more)])
            return
        append(self.cache, seq_id, more, len(self.tokens[seq_id]))
        self.tokens[seq_id] += more
        self.cache.register(seq_id, self.tokens[seq_id])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.cache.free_sequence(seq_id)
        del self.tokens[seq_id]

    @invariant()
    def every_page_is_free_evictable_or_held_with_its_reference_count(self):
        cache = self.cache
        held = {}
        for seq_id in cache.sequences:
            pages = cache.pages_of(seq_id)
            assert len(pages) == len(set(pages))  # no page twice in one sequence
            for page in pages:
                held[page] = held.get(page, 0) + 1
        free, evictable = set(cache._free_pages), set(cache._evictable)
        assert len(free) == len(cache._free_pages)
        assert not free & evictable and not free & set(held) and not evictable & set(held)  # never evicted while held
        assert len(free) + len(evictable) + len(held) == POOL  # nothing leaked
        assert cache.num_free_pages == len(free) + len(evictable)
        for page in range(POOL):
            assert cache.refcount(page) == held.get(page, 0)
        assert evictable <= set(cache._hash_of)
        assert {page: digest for digest, page in cache._page_of.items()} == cache._hash_of
        if not self.tokens:
            assert not held

    @invariant()
    def shared_pages_are_full_cached_pages_of_equal_tokens(self):
        cache = self.cache
        for seq_id, tokens in self.tokens.items():
            pages = cache.pages_of(seq_id)
            hashes = page_hashes(tokens, PAGE, b"m")
            assert cache.num_registered_pages(seq_id) == len(hashes)
            for j, page in enumerate(pages):
                if cache.refcount(page) > 1 or page in cache._hash_of:
                    assert (j + 1) * PAGE <= len(tokens)  # full in every sequence that holds it
                    assert cache._hash_of.get(page, hashes[j]) == hashes[j]

    @invariant()
    def stored_keys_values_and_bounds_spell_each_sequences_tokens(self):
        cache = self.cache
        for seq_id, tokens in self.tokens.items():
            assert cache.seq_len(seq_id) == len(tokens) == int(cache.seq_lens[seq_id])
            pages = cache.pages_of(seq_id)
            assert cache.page_table[seq_id, :len(pages)].tolist() == pages
            keys, values = encoded_kv(tokens, 0)
            for j, page in enumerate(pages):
                written = min(PAGE, len(tokens) - j * PAGE)
                stored = cache.k_pages[:, page, :written]
                assert torch.equal(stored, keys[:, j * PAGE:j * PAGE + written])
                assert torch.equal(cache.v_pages[:, page, :written], values[:, j * PAGE:j * PAGE + written])
                if written == PAGE:
                    assert torch.equal(cache.kmin[:, page], stored.amin(dim=1))
                    assert torch.equal(cache.kmax[:, page], stored.amax(dim=1))


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)


def test_a_freed_prefix_is_shared_then_evicted_least_recently_freed_first():
    cache = PagedKVCache(LAYERS, HEADS, DIM, 4, PAGE, max_seqs=3, prefix_caching=True)
    a, b = [1, 2, 3, 4, 5], [7, 8, 9, 10, 11]
    for tokens in (a, b):
        seq = cache.add_sequence()
        append(cache, seq, tokens[:4], 0)  # two full pages each
        cache.register(seq, tokens[:4])
        cache.free_sequence(seq)
    assert cache.num_free_pages == 4 and cache.num_cached_pages == 4
    assert len(cache.match_prefix(a)) == 2 and len(cache.match_prefix(a, max_pages=1)) == 1
    assert cache.match_prefix([1, 2, 9, 9, 9]) == cache.match_prefix(a)[:1]
    assert cache.match_prefix([2, 1, 3, 4]) == []  # a page is named by its tokens and all before it
    seq = cache.add_sequence()
    cache.share_prefix(seq, cache.match_prefix(b))
    assert cache.seq_len(seq) == 4 and cache.num_free_pages == 2
    first = cache.match_prefix(a)[0]
    cache.allocate([seq], [2])  # evicts one of a's pages: its last page first, so its first still hits
    assert cache.match_prefix(a) == [first] and cache.num_cached_pages == 3
    cache.allocate([seq], [2])
    assert cache.match_prefix(a) == [] and cache.num_cached_pages == 2 and cache.num_free_pages == 0


def test_without_prefix_caching_nothing_is_cached():
    cache = PagedKVCache(LAYERS, HEADS, DIM, 4, PAGE)
    seq = cache.add_sequence()
    append(cache, seq, [1, 2, 3, 4], 0)
    cache.register(seq, [1, 2, 3, 4])
    assert cache.match_prefix([1, 2, 3, 4, 5]) == [] and cache.num_cached_pages == 0
    cache.free_sequence(seq)
    assert cache.num_free_pages == 4


def test_the_chain_hashes_each_page_with_the_one_before_it():
    tokens = [random.randrange(1 << 40) for _ in range(random.randint(5, 40))]
    chain, parent = [], b"s"
    for j in range(len(tokens) // PAGE):  # one link at a time: blake2b of the parent and the page's int64 ids
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(struct.pack(f"<{PAGE}q", *tokens[j * PAGE:(j + 1) * PAGE]))
        parent = digest.digest()
        chain.append(parent)
    assert page_hashes(tokens, PAGE, b"s") == chain
    assert page_hashes(tokens[:PAGE - 1], PAGE, b"s") == []
    assert page_hashes(tokens, PAGE, b"s", chain[-1], len(chain)) == []


def test_salt_separates_hash_chains():
    assert page_hashes([1, 2, 3, 4], PAGE, b"a") != page_hashes([1, 2, 3, 4], PAGE, b"b")
    chain = page_hashes([1, 2, 3, 4, 5, 6], PAGE, b"a")
    assert page_hashes([1, 2, 3, 4, 5, 6], PAGE, b"a", chain[0], 1) == chain[1:]
