"""PagedKVCache: bounds, ownership and atomic failures, incl. a hypothesis state machine."""

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from questkv import CacheFullError, PagedKVCache

LAYERS, HEADS, DIM, PAGE, POOL = 2, 2, 4, 4, 12


def random_kv(layers, tokens, dtype=torch.float32):
    """Mixed-sign keys with per-dimension offsets, so bounds are not all centred at zero."""
    keys = torch.randn(layers, tokens, HEADS, DIM) * 3 + torch.randn(DIM)
    return keys.to(dtype), torch.randn(layers, tokens, HEADS, DIM).to(dtype)


def snapshot(cache):
    return (
        cache.k_pages.clone(), cache.v_pages.clone(), cache.kmin.clone(), cache.kmax.clone(),
        cache.page_table.clone(), cache.seq_lens.clone(), cache.num_free_pages,
        {s: (cache.pages_of(s), cache.seq_len(s)) for s in cache.sequences},
    )


def assert_same(a, b):
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y)
        else:
            assert x == y


class CacheMachine(RuleBasedStateMachine):
    """Random add / append (prefill chunks and one-token decode steps) / verify (overwrite a sequence's last
    positions, keep a prefix of them: :meth:`PagedKVCache.rewind`) / free; a shadow list of every sequence's keys
    and values is the model."""

    def __init__(self):
        super().__init__()
        self.cache = PagedKVCache(LAYERS, HEADS, DIM, POOL, PAGE, max_seqs=4)
        self.shadow = {}

    @precondition(lambda self: len(self.shadow) < 4)
    @rule()
    def add(self):
        self.shadow[self.cache.add_sequence()] = ([], [])

    @precondition(lambda self: self.shadow)
    @rule(data=st.data())
    def append(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.shadow)), min_size=1, max_size=4, unique=True))
        decode = data.draw(st.booleans())
        counts = [1] * len(ids) if decode else data.draw(
            st.lists(st.integers(0, 9), min_size=len(ids), max_size=len(ids)))
        keys, values = random_kv(LAYERS, sum(counts))
        before = snapshot(self.cache)
        fits = self.cache.can_reserve(ids, counts)
        needed = [self.cache.pages_needed(s, c) for s, c in zip(ids, counts)]
        assert fits == (sum(needed) <= self.cache.num_free_pages)
        try:
            self.cache.append(ids, counts, keys, values)
        except CacheFullError:
            assert not fits
            assert_same(snapshot(self.cache), before)
            return
        assert fits
        assert self.cache.num_free_pages == before[6] - sum(needed)
        start = 0
        for seq_id, count in zip(ids, counts):
            self.shadow[seq_id][0].append(keys[:, start : start + count])
            self.shadow[seq_id][1].append(values[:, start : start + count])
            start += count

    @precondition(lambda self: any(self.cache.seq_len(s) for s in self.shadow))
    @rule(data=st.data())
    def verify(self, data):
        """A lossless round's end: positions from ``start`` on get new keys (the verify's), then the sequence keeps
        ``count`` of its tokens and recomputes the bounds from ``start``."""
        seq_id = data.draw(st.sampled_from(sorted(s for s in self.shadow if self.cache.seq_len(s))))
        length = self.cache.seq_len(seq_id)
        start = data.draw(st.integers(max(0, length - 17), length - 1))
        count = data.draw(st.integers(start, length))
        keys, values = random_kv(LAYERS, length - start)
        slots = self.cache.slots([seq_id], [start], [length - start])
        for layer in range(LAYERS):
            self.cache.write(layer, slots, keys[layer], values[layer])
        self.cache.rewind([seq_id], [count], [start])
        old_keys, old_values = (torch.cat(chunks, dim=1) for chunks in self.shadow[seq_id])
        self.shadow[seq_id] = ([torch.cat([old_keys[:, :start], keys], dim=1)[:, :count]],
                               [torch.cat([old_values[:, :start], values], dim=1)[:, :count]])

    @precondition(lambda self: self.shadow)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.shadow)))
        self.cache.free_sequence(seq_id)
        del self.shadow[seq_id]

    @invariant()
    def pages_owned_once_and_none_leaked(self):
        owned = [p for s in self.cache.sequences for p in self.cache.pages_of(s)]
        assert len(owned) == len(set(owned))
        assert len(owned) + self.cache.num_free_pages == POOL
        if not self.shadow:
            assert self.cache.num_free_pages == POOL

    @invariant()
    def contents_and_bounds_match_the_stored_keys(self):
        for seq_id, (key_chunks, value_chunks) in self.shadow.items():
            keys = torch.cat(key_chunks, dim=1) if key_chunks else torch.empty(LAYERS, 0, HEADS, DIM)
            values = torch.cat(value_chunks, dim=1) if value_chunks else torch.empty(LAYERS, 0, HEADS, DIM)
            length = keys.shape[1]
            pages = self.cache.pages_of(seq_id)
            assert self.cache.seq_len(seq_id) == length == int(self.cache.seq_lens[seq_id])
            assert len(pages) == -(-length // PAGE)
            assert self.cache.page_table[seq_id, : len(pages)].tolist() == pages
            for logical, page in enumerate(pages):
                chunk = slice(logical * PAGE, min(length, (logical + 1) * PAGE))
                written = chunk.stop - chunk.start
                stored = self.cache.k_pages[:, page, :written]
                assert torch.equal(stored, keys[:, chunk])
                assert torch.equal(self.cache.v_pages[:, page, :written], values[:, chunk])
                assert torch.equal(self.cache.kmin[:, page], stored.amin(dim=1))
                assert torch.equal(self.cache.kmax[:, page], stored.amax(dim=1))


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_bounds_are_exact_in_the_cache_dtype(dtype):
    cache = PagedKVCache(1, HEADS, DIM, 4, PAGE, dtype=dtype)
    seq = cache.add_sequence()
    keys, values = random_kv(1, 7, dtype)
    cache.append([seq], [7], keys, values)
    for token in range(7):
        page = cache.pages_of(seq)[token // PAGE]
        assert (cache.kmin[0, page] <= keys[0, token]).all() and (cache.kmax[0, page] >= keys[0, token]).all()
    assert cache.kmin.dtype == dtype


def test_reused_page_does_not_keep_the_previous_owners_bounds():
    cache = PagedKVCache(1, HEADS, DIM, 1, PAGE)
    first = cache.add_sequence()
    cache.append([first], [PAGE], torch.full((1, PAGE, HEADS, DIM), -50.0) + torch.randn(1, PAGE, HEADS, DIM),
                 torch.randn(1, PAGE, HEADS, DIM))
    cache.free_sequence(first)
    second = cache.add_sequence()
    keys, values = random_kv(1, 1)
    cache.append([second], [1], keys, values)
    assert torch.equal(cache.kmin[0, 0], keys[0, 0]) and torch.equal(cache.kmax[0, 0], keys[0, 0])


def test_pool_exhaustion_raises_and_changes_nothing():
    cache = PagedKVCache(LAYERS, HEADS, DIM, 3, PAGE)
    a, b = cache.add_sequence(), cache.add_sequence()
    keys, values = random_kv(LAYERS, 5)
    cache.append([a], [5], keys, values)
    before = snapshot(cache)
    keys, values = random_kv(LAYERS, 6)
    with pytest.raises(CacheFullError, match="page pool exhausted: 2 pages needed, 1 free of 3"):
        cache.append([a, b], [1, 5], keys, values)
    assert_same(snapshot(cache), before)


def test_per_sequence_page_limit_and_sequence_slots():
    cache = PagedKVCache(1, HEADS, DIM, 8, PAGE, max_seqs=1, max_pages_per_seq=2)
    seq = cache.add_sequence()
    with pytest.raises(CacheFullError, match="max_pages_per_seq=2"):
        cache.reserve([seq], [2 * PAGE + 1])
    assert cache.seq_len(seq) == 0 and cache.num_free_pages == 8
    with pytest.raises(CacheFullError, match="sequence slots"):
        cache.add_sequence()


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda c, s: c.reserve([s], [-1]), ValueError, "must be an int >= 0, got -1"),
        (lambda c, s: c.reserve([s, s], [1, 1]), ValueError, "repeated sequence id"),
        (lambda c, s: c.reserve([s], [1, 2]), ValueError, "1 seq_ids but 2 token counts"),
        (lambda c, s: c.reserve([99], [1]), KeyError, "unknown sequence id 99"),
        (lambda c, s: c.free_sequence(7), KeyError, "unknown sequence id 7"),
        (lambda c, s: c.append([s], [2], *random_kv(1, 2)), ValueError, r"keys must have shape \(2, 2, 2, 4\)"),
        (lambda c, s: c.write(5, torch.zeros(1, dtype=torch.long), *[t[0] for t in random_kv(1, 1)]),
         ValueError, r"layer_idx must be in \[0, 2\), got 5"),
    ],
)
def test_bad_input_raises_clearly_and_changes_nothing(call, error, message):
    cache = PagedKVCache(LAYERS, HEADS, DIM, 4, PAGE)
    seq = cache.add_sequence()
    before = snapshot(cache)
    with pytest.raises(error, match=message):
        call(cache, seq)
    assert_same(snapshot(cache), before)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"page_size": 6}, "page_size must be a power of two, got 6"),
        ({"num_pages": 0}, r"PagedKVCache.num_pages must be >= 1, got 0"),
        ({"max_pages_per_seq": 9}, r"max_pages_per_seq must be in \[1, num_pages=8\], got 9"),
        ({"dtype": torch.int32}, "dtype must be a float dtype"),
        ({"model_dtype_layers": [0]}, r"model_dtype_layers must be layers in \[0, 1\) of a pool whose kv_dtype differs"),
        ({"model_dtype_layers": [1], "kv_dtype": torch.float8_e4m3fn}, r"got \[1\] \(kv_dtype torch.float8_e4m3fn\)"),
    ],
)
def test_constructor_validation(kwargs, message):
    args = dict(num_layers=1, num_kv_heads=HEADS, head_dim=DIM, num_pages=8, page_size=PAGE)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        PagedKVCache(**args)


def test_batch_returns_padded_table_and_lengths():
    cache = PagedKVCache(1, HEADS, DIM, 8, PAGE, max_pages_per_seq=4)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append([a, b], [9, 2], *random_kv(1, 11))
    table, lens = cache.batch([b, a])
    assert table.shape == (2, 3) and table.dtype == torch.int32
    assert lens.tolist() == [2, 9]
    assert table[0, :1].tolist() == cache.pages_of(b) and table[1].tolist() == cache.pages_of(a)
    fixed, _ = cache.batch([a], max_pages=4)
    assert fixed.shape == (1, 4)


def test_allocate_grows_lengths_and_pages_without_slots():
    cache = PagedKVCache(1, HEADS, DIM, 8, PAGE)
    a, b = cache.add_sequence(), cache.add_sequence()
    assert cache.pages_needed(a, 5) == 2 and cache.pages_for_tokens(5) == 2
    cache.allocate([a, b], [5, 1])
    assert (cache.seq_len(a), cache.seq_len(b)) == (5, 1)
    assert cache.seq_lens[[a, b]].tolist() == [5, 1]
    assert cache.page_table[a, :2].tolist() == cache.pages_of(a)
    assert cache.pages_needed(a, 3) == 0 and cache.pages_needed(a, 4) == 1
    assert cache.num_free_pages == 5


def test_can_reserve_answers_without_changing_anything():
    cache = PagedKVCache(1, HEADS, DIM, 3, PAGE, max_pages_per_seq=2)
    a = cache.add_sequence()
    before = snapshot(cache)
    assert cache.can_reserve([a], [8]) and not cache.can_reserve([a], [9])
    b = cache.add_sequence()
    cache.allocate([b], [4])
    assert cache.can_reserve([a], [8]) and not cache.can_reserve([a, b], [8, 1])
    cache.free_sequence(b)
    assert_same(snapshot(cache), before)


def test_a_mirror_that_follows_pages_from_holds_the_same_page_table_slots_and_lengths():
    source = PagedKVCache(1, 1, 4, num_pages=16, page_size=4, max_seqs=4, max_pages_per_seq=8)
    mirror = PagedKVCache(1, 1, 4, num_pages=16, page_size=4, max_seqs=4, max_pages_per_seq=8)
    a, b = source.add_sequence(), source.add_sequence()
    source.allocate([a, b], [6, 9])
    sent = {}
    for _ in range(2):  # a whole row first, then only the pages added since
        for seq in (a, b):
            pages = source.pages_from(seq, sent.get(seq, 0))
            mirror.mirror(seq, sent.get(seq, 0), pages, source.seq_len(seq))
            sent[seq] = sent.get(seq, 0) + len(pages)
        source.allocate([a, b], [5, 1])
        source.allocate([a, b], [0, 0])
    for seq in (a, b):
        pages = source.pages_from(seq, sent[seq])
        mirror.mirror(seq, sent[seq], pages, source.seq_len(seq))
    assert all(torch.equal(x, y) for x, y in zip(mirror.batch([a, b]), source.batch([a, b])))
    assert torch.equal(mirror.slots([a, b], [0, 3], [11, 7]), source.slots([a, b], [0, 3], [11, 7]))
    with pytest.raises(ValueError, match="mirror: pages \\[5, 6\\) of sequence 0 do not follow its"):
        mirror.mirror(a, 5, [1], 20)


def test_rewind_refuses_a_shared_page_and_bad_lengths_changing_nothing():
    cache = PagedKVCache(LAYERS, HEADS, DIM, POOL, PAGE, max_seqs=4, prefix_caching=True)
    seq = cache.add_sequence()
    cache.append([seq], [10], *random_kv(LAYERS, 10))
    cache.register(seq, list(range(10)))  # its two full pages become shareable
    before = snapshot(cache)
    for lengths, starts, message in (([11], [9], "cannot keep 11"), ([8], [9], "cannot keep 8"),
                                     ([9], [7], "shared or cached"), ([9, 9], [9], "2 lengths")):
        with pytest.raises(ValueError, match=message):
            cache.rewind([seq] * min(len(lengths), 1), lengths, starts)
        assert_same(snapshot(cache), before)
    cache.rewind([seq], [8], [8])  # past the registered pages: the third page goes back to the pool
    assert cache.seq_len(seq) == 8 and len(cache.pages_of(seq)) == 2 and cache.num_free_pages == POOL - 2


def test_an_fp8_pool_keeps_its_model_dtype_layers_in_the_model_dtype_and_writes_every_layer_where_it_lies():
    """Layers 1 and 3 of four in fp32, 0 and 2 in fp8: each layer's view has its dtype, an append stores each layer's
    K/V (exactly in fp32, rounded in fp8) with bounds of what it stored, a rewind recomputes both stacks' bounds, and
    the whole-pool tensors, which no longer exist, are refused naming the layers."""
    fp8 = torch.float8_e4m3fn
    cache = PagedKVCache(4, HEADS, DIM, num_pages=8, page_size=PAGE, kv_dtype=fp8, model_dtype_layers=[3, 1])
    assert cache.model_dtype_layers == (1, 3) and cache.kv_dtype == fp8 and cache.num_layers == 4
    assert [cache.layer(i).k_pages.dtype for i in range(4)] == [fp8, torch.float32, fp8, torch.float32]
    seq = cache.add_sequence()
    n = PAGE + 3
    keys, values = torch.randn(4, n, HEADS, DIM) * 3, torch.randn(4, n, HEADS, DIM)
    cache.append([seq], [n], keys, values)
    page = cache.pages_of(seq)[0]
    for i in range(4):
        pages = cache.layer(i)
        cast = (lambda x: x) if i in (1, 3) else (lambda x: x.to(fp8).float())
        stored = pages.k_pages[cache.pages_of(seq)].flatten(0, 1)[:n].float()
        assert torch.equal(stored, cast(keys[i])), i
        assert torch.equal(pages.v_pages[cache.pages_of(seq)].flatten(0, 1)[:n].float(), cast(values[i]))
        assert torch.equal(pages.kmax[page].float(), cast(keys[i][:PAGE]).amax(0))
    cache.rewind([seq], [PAGE + 1], [PAGE])
    last = cache.pages_of(seq)[1]
    for i in range(4):
        kept = cache.layer(i).k_pages[last, :1].float()
        assert torch.equal(cache.layer(i).kmin[last].float(), kept.amin(0))
    with pytest.raises(ValueError, match=r"keeps layers \[1, 3\] in torch.float32 .* read a layer with layer\(i\)"):
        cache.k_pages
