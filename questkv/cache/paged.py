"""Paged KV cache with per-page key bounds, shared by many sequences of different lengths.

With ``prefix_caching`` a full page is also named by a hash chain of its tokens (see :func:`page_hashes`) and
shared read-only by every sequence whose tokens start with it: pages carry reference counts, and a page whose
last reference goes keeps its K/V, bounds and hash (cached, evictable) until the pool needs it (least recently
freed first). A full page's K/V and key bounds never change, so a sharing sequence reads exactly the bounds its
own prefill would have written.
"""

from __future__ import annotations

import collections
from typing import Iterable, Optional, Sequence

import torch

from questkv import ops
from questkv.cache.page_hashes import page_hashes
from questkv.ops.pages import LayerPages
from questkv.validation import check_int


class CacheFullError(RuntimeError):
    """The page pool (or a sequence's page-table row, or the sequence slots) has no room left."""


class PagedKVCache:
    """A pool of KV pages for ``num_layers`` layers, with a page table per sequence.

    A physical page holds ``page_size`` consecutive tokens of one sequence in every layer, so one
    page table serves all layers. Storage (per layer ``l``, see :meth:`layer`):

    * ``k_pages[l]``, ``v_pages[l]``: ``[num_pages, page_size, num_kv_heads, head_dim]`` (``kv_dtype``, default
      ``dtype``; ``torch.float8_e4m3fn`` for an fp8 cache, where the ``model_dtype_layers`` keep ``dtype``);
    * ``kmin[l]``, ``kmax[l]``: ``[num_pages, num_kv_heads, head_dim]``, element-wise min / max of
      the page's stored keys, in the layer's K/V dtype (exact: min and max pick one of their inputs);
    * ``page_table``: ``[max_seqs, max_pages_per_seq]`` int32 and ``seq_lens``: ``[max_seqs]``
      int32, on ``device``, indexed by sequence id (padded, fixed shape: usable under CUDA graphs).

    ``model_dtype_layers`` (an fp8 pool only) keep their K/V and bounds in ``dtype``: the layers whose keys e4m3 would
    round past use (:meth:`~questkv.models.llama.LlamaForCausalLM.fp8_fragile_layers`).

    Appending is two steps so that a model can write layer by layer: :meth:`reserve` allocates
    pages and advances the lengths once per forward pass, :meth:`write` stores one layer's K/V.
    :meth:`append` does both for all layers at once. A scheduler asks :meth:`pages_needed` /
    :meth:`can_reserve` and calls :meth:`allocate` (pages and lengths, no slots).

    Prefix caching (``prefix_caching=True``, hashes salted with ``hash_salt``, e.g. the model's identity): a
    scheduler calls :meth:`match_prefix` for a new sequence's tokens (with their hash chain, kept by the caller and
    extended by :meth:`extend_hashes`), :meth:`share_prefix` to start it on the
    cached pages found, :meth:`allocate` for the rest, and :meth:`register` once the K/V of its full pages are
    written or launched. Pages are written only at positions :meth:`allocate` added, which lie past every shared
    (full) page, so a page is never written once shared; a page registered when it is allocated (its K/V launched
    in the same step) may be shared by a later sequence of that step, which reads it after the step's writes.
    :attr:`num_free_pages` counts the evictable cached pages as free. Without prefix caching every page has one
    reference and nothing is cached.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int = 16,
        max_seqs: int = 64,
        max_pages_per_seq: Optional[int] = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        backend: str = "auto",
        prefix_caching: bool = False,
        hash_salt: bytes = b"",
        kv_dtype: Optional[torch.dtype] = None,
        model_dtype_layers: Sequence[int] = (),
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("max_seqs", max_seqs),
        ):
            check_int(f"PagedKVCache.{name}", value, minimum=1)
        if page_size & (page_size - 1):
            raise ValueError(f"PagedKVCache.page_size must be a power of two, got {page_size}")
        if max_pages_per_seq is None:
            max_pages_per_seq = num_pages
        check_int("PagedKVCache.max_pages_per_seq", max_pages_per_seq)
        if not 1 <= max_pages_per_seq <= num_pages:
            raise ValueError(
                f"PagedKVCache.max_pages_per_seq must be in [1, num_pages={num_pages}], got {max_pages_per_seq}"
            )
        if not dtype.is_floating_point or dtype.itemsize < 2:
            raise ValueError(f"PagedKVCache.dtype must be a float dtype of 2 or 4 bytes, got {dtype}")
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        if kv_dtype not in (dtype, torch.float8_e4m3fn):
            raise ValueError(f"PagedKVCache.kv_dtype must be dtype ({dtype}) or torch.float8_e4m3fn, got {kv_dtype}")
        wide = list(model_dtype_layers)
        if wide and (kv_dtype == dtype or not all(isinstance(i, int) and 0 <= i < num_layers for i in wide)):
            raise ValueError(f"PagedKVCache.model_dtype_layers must be layers in [0, {num_layers}) of a pool whose "
                             f"kv_dtype differs from dtype, got {wide} (kv_dtype {kv_dtype})")
        wide = sorted(set(wide))
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_seqs = max_seqs
        self.max_pages_per_seq = max_pages_per_seq
        self.backend = backend
        self._dtype, self._kv_dtype, self.model_dtype_layers = dtype, kv_dtype, tuple(wide)
        # One stack of pages and bounds per dtype (a LayerPages whose tensors lead with the stack's layers), and
        # where each layer lies: (stack, index in it).
        narrow = [i for i in range(num_layers) if i not in wide]
        self._stacks: list[LayerPages] = []
        self._layer_at: list[tuple[int, int]] = [(0, 0)] * num_layers
        for layers, stored in ((narrow, kv_dtype), (wide, dtype)):
            if layers:
                for index, layer in enumerate(layers):
                    self._layer_at[layer] = (len(self._stacks), index)
                self._stacks.append(self._allocate(len(layers), num_kv_heads, head_dim, stored, device))
        self.page_table = torch.zeros((max_seqs, max_pages_per_seq), dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self._free_pages: list[int] = list(range(num_pages - 1, -1, -1))
        self._free_seqs: list[int] = list(range(max_seqs - 1, -1, -1))
        self._pages: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        self.prefix_caching = bool(prefix_caching)
        self.hash_salt = bytes(hash_salt)
        self._refs: dict[int, int] = {}  # page -> sequences holding it (every allocated page)
        self._hash_of: dict[int, bytes] = {}  # cached page -> its hash
        self._page_of: dict[bytes, int] = {}  # hash -> cached page
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # refs 0, oldest first
        self._seq_hashes: dict[int, list[bytes]] = {}  # sequence -> hashes of its leading full pages
        # Rank 0 with tensor parallelism: the rewinds since its last step message, ((sequence, pages kept) of each
        # sequence, the pages and counts whose bounds were recomputed); see ModelRunner._publish.
        self.track_rewinds = False
        self.rewinds: list[tuple[list[tuple[int, int]], list[int], list[int]]] = []

    def _allocate(self, layers: int, num_kv_heads: int, head_dim: int, stored: torch.dtype,
                  device: torch.device | str) -> LayerPages:
        shape = (layers, self.num_pages, self.page_size, num_kv_heads, head_dim)
        # (an fp8 stack's bounds start at 0: a page's first write restarts them before anything reads them)
        low, high = (float("inf"), float("-inf")) if stored == self._dtype else (0.0, 0.0)
        bounds_shape = (layers, self.num_pages, num_kv_heads, head_dim)
        return LayerPages(torch.zeros(shape, dtype=stored, device=device),
                          torch.zeros(shape, dtype=stored, device=device),
                          torch.full(bounds_shape, low, device=device).to(stored),
                          torch.full(bounds_shape, high, device=device).to(stored))

    def _only_stack(self) -> LayerPages:
        if len(self._stacks) > 1:
            raise ValueError(f"this pool keeps layers {list(self.model_dtype_layers)} in {self._dtype} and the others "
                             f"in {self._kv_dtype}: no one tensor holds every layer; read a layer with layer(i)")
        return self._stacks[0]

    @property
    def k_pages(self) -> torch.Tensor:
        """Every layer's keys ``[num_layers, num_pages, page_size, num_kv_heads, head_dim]`` (a pool of one dtype)."""
        return self._only_stack().k_pages

    @property
    def v_pages(self) -> torch.Tensor:
        """Every layer's values, shaped as :attr:`k_pages` (a pool of one dtype)."""
        return self._only_stack().v_pages

    @property
    def kmin(self) -> torch.Tensor:
        """Every layer's page key minima ``[num_layers, num_pages, num_kv_heads, head_dim]`` (a pool of one dtype)."""
        return self._only_stack().kmin

    @property
    def kmax(self) -> torch.Tensor:
        """Every layer's page key maxima, shaped as :attr:`kmin` (a pool of one dtype)."""
        return self._only_stack().kmax

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of pages and bounds (to free their memory)."""
        return [tensor for stack in self._stacks for tensor in stack]

    @property
    def num_layers(self) -> int:
        return len(self._layer_at)

    @property
    def num_kv_heads(self) -> int:
        return self._stacks[0].k_pages.shape[3]

    @property
    def head_dim(self) -> int:
        return self._stacks[0].k_pages.shape[4]

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype: the attention outputs'."""
        return self._dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype K and V are stored in (:attr:`dtype`, or ``torch.float8_e4m3fn``; :attr:`model_dtype_layers`
        keep :attr:`dtype`)."""
        return self._kv_dtype

    @property
    def device(self) -> torch.device:
        return self._stacks[0].k_pages.device

    @property
    def num_free_pages(self) -> int:
        """Pages :meth:`allocate` can take: never used, or cached with no reference (evicted on demand)."""
        return len(self._free_pages) + len(self._evictable)

    @property
    def num_cached_pages(self) -> int:
        """Pages that hold a registered full page of tokens (shared, owned or evictable)."""
        return len(self._hash_of)

    def num_registered_pages(self, seq_id: int) -> int:
        """Leading full pages of ``seq_id`` that :meth:`register` (or :meth:`share_prefix`) has hashed."""
        self._check_seq(seq_id)
        return len(self._seq_hashes[seq_id])

    def refcount(self, page: int) -> int:
        """How many sequences hold ``page`` (0: free or evictable)."""
        return self._refs.get(page, 0)

    @property
    def sequences(self) -> list[int]:
        """Ids of the live sequences, in allocation order."""
        return list(self._pages)

    def layer(self, layer_idx: int) -> LayerPages:
        """Views of one layer's pages and bounds (no copy)."""
        stack, index = self._layer_at[layer_idx]
        return LayerPages(*(tensor[index] for tensor in self._stacks[stack]))

    def seq_len(self, seq_id: int) -> int:
        self._check_seq(seq_id)
        return self._lens[seq_id]

    def pages_of(self, seq_id: int) -> list[int]:
        """Physical pages of ``seq_id`` in logical order (a copy)."""
        self._check_seq(seq_id)
        return list(self._pages[seq_id])

    def pages_from(self, seq_id: int, start: int) -> list[int]:
        """Physical pages of ``seq_id`` from logical page ``start`` on (a copy of those only)."""
        self._check_seq(seq_id)
        return self._pages[seq_id][start:]

    def mirror(self, seq_id: int, start: int, pages: Sequence[int], seq_len: int) -> None:
        """Make sequence ``seq_id`` of this pool hold ``pages`` from logical page ``start`` on (its pages before
        ``start`` kept) and ``seq_len`` tokens: page table, lengths and the bookkeeping :meth:`slots`
        and :meth:`batch` read. A tensor-parallel worker's pool follows rank 0's page table so
        (rank 0's :meth:`pages_from`); it allocates nothing, counts no reference and caches no prefix."""
        owned = self._pages.setdefault(seq_id, [])
        if not 0 <= start <= len(owned) or start + len(pages) > self.max_pages_per_seq:
            raise ValueError(f"mirror: pages [{start}, {start + len(pages)}) of sequence {seq_id} do not follow its "
                             f"{len(owned)} pages within max_pages_per_seq={self.max_pages_per_seq}")
        del owned[start:]
        owned.extend(pages)
        self._lens[seq_id] = seq_len
        if pages:
            self.page_table[seq_id, start:start + len(pages)] = self._to_device(torch.tensor(pages, dtype=torch.int32))
        self.seq_lens[seq_id] = seq_len

    def pages_for_tokens(self, num_tokens: int) -> int:
        """Pages that hold ``num_tokens`` tokens of one sequence: ``ceil(num_tokens / page_size)``."""
        return -(-num_tokens // self.page_size)

    def pages_needed(self, seq_id: int, num_tokens: int) -> int:
        """Pages to allocate so that sequence ``seq_id`` holds ``num_tokens`` more tokens."""
        self._check_seq(seq_id)
        return self.pages_for_tokens(self._lens[seq_id] + num_tokens) - len(self._pages[seq_id])

    def can_reserve(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> bool:
        """Whether :meth:`reserve` / :meth:`allocate` of the same arguments would succeed (pool and
        per-sequence page limits; the arguments themselves must be valid)."""
        try:
            self._plan(list(seq_ids), list(num_tokens))
        except CacheFullError:
            return False
        return True

    def add_sequence(self) -> int:
        """Start an empty sequence and return its id (a row of ``page_table``)."""
        if not self._free_seqs:
            raise CacheFullError(f"all {self.max_seqs} sequence slots are in use; free one or raise max_seqs")
        seq_id = self._free_seqs.pop()
        self._pages[seq_id] = []
        self._lens[seq_id] = 0
        self._seq_hashes[seq_id] = []
        self.seq_lens[seq_id] = 0
        return seq_id

    def free_sequence(self, seq_id: int) -> None:
        """Drop a sequence's references and return its id; a page nobody holds any more goes back to the pool,
        or, when it holds a registered full page, stays cached (evictable, the sequence's last page first)."""
        self._check_seq(seq_id)
        for page in reversed(self._pages.pop(seq_id)):
            self._refs[page] -= 1
            if self._refs[page]:
                continue
            del self._refs[page]
            if page in self._hash_of:
                self._evictable[page] = None
            else:
                self._free_pages.append(page)
        del self._lens[seq_id]
        del self._seq_hashes[seq_id]
        self.seq_lens[seq_id] = 0
        self._free_seqs.append(seq_id)

    def extend_hashes(self, hashes: list[bytes], token_ids: Sequence[int]) -> None:
        """Extend ``hashes``, the hash chain (:func:`page_hashes`, this cache's salt) of the leading full pages of
        ``token_ids``, in place to all its full pages: a caller that keeps the chain of a growing token list (the
        scheduler keeps one per sequence) hashes each page once, however often it asks."""
        full = len(token_ids) // self.page_size
        if full > len(hashes):
            parent = hashes[-1] if hashes else b""
            hashes.extend(page_hashes(token_ids[:full * self.page_size], self.page_size, self.hash_salt, parent,
                                      len(hashes)))

    def match_prefix(self, token_ids: Sequence[int], max_pages: Optional[int] = None,
                     hashes: Optional[Sequence[bytes]] = None) -> list[int]:
        """The cached pages that hold the leading full pages of ``token_ids`` (at most ``max_pages``), in order;
        ``[]`` without prefix caching. Changes nothing. ``hashes``: the chain of ``token_ids``' full pages (from
        :meth:`extend_hashes`), else the pages are hashed here."""
        if not self.prefix_caching:
            return []
        limit = len(token_ids) // self.page_size if max_pages is None else min(max_pages, len(token_ids) // self.page_size)
        if hashes is None:
            hashes = page_hashes(token_ids[:limit * self.page_size], self.page_size, self.hash_salt)
        elif len(hashes) < limit:
            raise ValueError(f"match_prefix: {len(hashes)} hashes for {limit} full pages of token_ids")
        pages = []
        for digest in hashes[:limit]:  # a miss ends the prefix
            page = self._page_of.get(digest)
            if page is None:
                break
            pages.append(page)
        return pages

    def prefix_cost(self, pages: Iterable[int]) -> int:
        """Free pages that sharing ``pages`` takes: the evictable ones among them."""
        return sum(page in self._evictable for page in pages)

    def share_prefix(self, seq_id: int, pages: Sequence[int]) -> None:
        """Start the empty sequence ``seq_id`` on the cached full ``pages`` (from :meth:`match_prefix`): it holds
        their ``len(pages) * page_size`` tokens, read-only."""
        self._check_seq(seq_id)
        if self._lens[seq_id]:
            raise ValueError(f"share_prefix: sequence {seq_id} already holds {self._lens[seq_id]} tokens")
        if len(pages) > self.max_pages_per_seq:
            raise CacheFullError(f"share_prefix: {len(pages)} pages exceed max_pages_per_seq={self.max_pages_per_seq}")
        for page in pages:
            if page not in self._hash_of:
                raise ValueError(f"share_prefix: page {page} holds no cached prefix")
        for page in pages:
            self._evictable.pop(page, None)
            self._refs[page] = self._refs.get(page, 0) + 1
        self._pages[seq_id] = list(pages)
        self._lens[seq_id] = len(pages) * self.page_size
        self._seq_hashes[seq_id] = [self._hash_of[page] for page in pages]
        if pages:
            index = self._to_device(torch.tensor(pages, dtype=torch.int32))
            self.page_table[seq_id, :len(pages)] = index
        self.seq_lens[seq_id] = self._lens[seq_id]

    def register(self, seq_id: int, token_ids: Sequence[int], hashes: Optional[Sequence[bytes]] = None) -> None:
        """Make the full pages of ``seq_id`` shareable: ``token_ids`` are its tokens from position 0 (their K/V
        written, or launched before any step that may read them); pages past ``min(len(token_ids),
        seq_len)`` or partly filled are left alone. A page whose hash is already cached elsewhere stays private
        (the same tokens computed twice). A no-op without prefix caching. ``hashes``: the chain of
        ``token_ids``' full pages (from :meth:`extend_hashes`), else the new pages are hashed here."""
        if not self.prefix_caching:
            return
        self._check_seq(seq_id)
        known = self._seq_hashes[seq_id]
        full = min(len(token_ids), self._lens[seq_id]) // self.page_size
        if full <= len(known):
            return
        if hashes is not None and len(hashes) < full:
            raise ValueError(f"register: {len(hashes)} hashes for {full} full pages of sequence {seq_id}")
        if hashes is not None:
            new = hashes[len(known):full]
        else:
            parent = known[-1] if known else b""
            new = page_hashes(token_ids[:full * self.page_size], self.page_size, self.hash_salt, parent, len(known))
        pages = self._pages[seq_id]
        for digest in new:
            page = pages[len(known)]
            if page not in self._hash_of and digest not in self._page_of:
                self._hash_of[page] = digest
                self._page_of[digest] = page
            known.append(digest)

    def reset_prefix_cache(self) -> None:
        """Forget every cached page (after a failed step, whose registered pages may never have been written):
        evictable pages become free, held ones stay with their sequences but can no longer be found; a live
        sequence's pages registered before are not offered again."""
        self._free_pages.extend(reversed(self._evictable))
        self._evictable.clear()
        self._hash_of.clear()
        self._page_of.clear()

    def _take_page(self) -> int:
        """A page for a sequence: a never-used one, else the least recently freed cached one (forgetting it)."""
        if self._free_pages:
            page = self._free_pages.pop()
        else:
            page, _ = self._evictable.popitem(last=False)
            del self._page_of[self._hash_of.pop(page)]
        self._refs[page] = 1
        return page

    def allocate(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> None:
        """Make room for ``num_tokens[i]`` new tokens at the end of sequence ``seq_ids[i]``:
        allocate pages, extend the page table and advance the lengths (all layers share them).
        Either every sequence grows or, on error (``CacheFullError``, ``ValueError``), nothing
        changes. The device tables are updated with one copy each, not one per sequence."""
        seq_ids, num_tokens = list(seq_ids), list(num_tokens)
        new_pages = self._plan(seq_ids, num_tokens)
        rows, cols, pages = [], [], []
        for seq_id, count, extra in zip(seq_ids, num_tokens, new_pages):
            owned = self._pages[seq_id]
            for _ in range(extra):
                rows.append(seq_id)
                cols.append(len(owned))
                owned.append(self._take_page())
                pages.append(owned[-1])
            self._lens[seq_id] += count
        if pages:
            index = self._to_device(torch.tensor([rows, cols, pages], dtype=torch.long))
            self.page_table.index_put_((index[0], index[1]), index[2].to(torch.int32))
        if seq_ids:
            lens = self._to_device(torch.tensor([[s, self._lens[s]] for s in seq_ids], dtype=torch.long))
            self.seq_lens[lens[:, 0]] = lens[:, 1].to(torch.int32)

    def rewind(self, seq_ids: Sequence[int], num_tokens: Sequence[int], bounds_from: Sequence[int]) -> None:
        """Shorten each sequence ``seq_ids[i]`` to its first ``num_tokens[i]`` tokens (freeing the pages past them)
        and recompute the key bounds of its pages that hold positions ``[bounds_from[i], num_tokens[i])`` from the
        keys they now hold (:func:`~questkv.ops.reference.recompute_key_bounds`): after a lossless verify step,
        whose draft keys widened the bounds and whose rejected positions are dropped. Pages before ``bounds_from``
        are not touched, so a shared or registered page must lie before it; checked before anything changes."""
        seq_ids, num_tokens, bounds_from = list(seq_ids), list(num_tokens), list(bounds_from)
        if not len(seq_ids) == len(num_tokens) == len(bounds_from):
            raise ValueError(f"rewind got {len(seq_ids)} sequences, {len(num_tokens)} lengths, {len(bounds_from)} starts")
        size = self.page_size
        for seq_id, count, start in zip(seq_ids, num_tokens, bounds_from):
            self._check_seq(seq_id)
            if not 0 <= start <= count <= self._lens[seq_id]:
                raise ValueError(f"rewind: sequence {seq_id} of {self._lens[seq_id]} tokens cannot keep {count} "
                                 f"tokens with bounds recomputed from position {start}")
            for page in self._pages[seq_id][start // size:]:
                if self._refs[page] > 1 or page in self._hash_of:
                    raise ValueError(f"rewind: page {page} of sequence {seq_id} is shared or cached; it lies before "
                                     f"position {start}")
        pages, counts = [], []
        for seq_id, count, start in zip(seq_ids, num_tokens, bounds_from):
            owned = self._pages[seq_id]
            kept = self.pages_for_tokens(count)
            for page in reversed(owned[kept:]):
                del self._refs[page]
                self._free_pages.append(page)
            del owned[kept:]
            self._lens[seq_id] = count
            for index in range(start // size, kept):
                pages.append(owned[index])
                counts.append(min(size, count - index * size))
        if seq_ids:
            lens = self._to_device(torch.tensor([[s, self._lens[s]] for s in seq_ids], dtype=torch.long))
            self.seq_lens[lens[:, 0]] = lens[:, 1].to(torch.int32)
        self.recompute_bounds(pages, counts)
        if self.track_rewinds:
            self.rewinds.append(([(seq_id, len(self._pages[seq_id])) for seq_id in seq_ids], pages, counts))

    def recompute_bounds(self, pages: Sequence[int], counts: Sequence[int]) -> None:
        """Set the key bounds of ``pages`` from their first ``counts`` keys (:meth:`rewind`'s; a tensor-parallel
        worker's pool repeats rank 0's rewinds so, its page table following by :meth:`mirror`)."""
        if pages:
            index = self._to_device(torch.tensor([list(pages), list(counts)], dtype=torch.long))
            for stack in self._stacks:
                ops.recompute_key_bounds(stack.k_pages, stack.kmin, stack.kmax, index[0], index[1])

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` on the cache's device without waiting for the device's queued work (a pinned copy on CUDA:
        a blocking copy would wait for every step already launched, defeating asynchronous scheduling)."""
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def reserve(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> torch.Tensor:
        """:meth:`allocate`, then the slots of the new tokens.

        Returns:
            ``[sum(num_tokens)]`` int64 slots (``page * page_size + offset``) on the cache's device,
            sequence after sequence, in token order: the ``slots`` argument of :meth:`write`.
        """
        seq_ids, num_tokens = list(seq_ids), list(num_tokens)
        starts = [self._lens[s] if s in self._lens else 0 for s in seq_ids]
        self.allocate(seq_ids, num_tokens)
        return self.slots(seq_ids, starts, num_tokens)

    def slots(self, seq_ids: Sequence[int], starts: Sequence[int], num_tokens: Sequence[int]) -> torch.Tensor:
        """Slots of the already allocated positions ``[starts[i], starts[i] + num_tokens[i])`` of
        every sequence ``seq_ids[i]``: ``[sum(num_tokens)]`` int64 on the cache's device."""
        slots = []
        for seq_id, start, count in zip(seq_ids, starts, num_tokens):
            self._check_seq(seq_id)
            if not 0 <= start <= start + count <= self._lens[seq_id]:
                raise ValueError(
                    f"slots: positions [{start}, {start + count}) are not allocated in sequence {seq_id} "
                    f"of {self._lens[seq_id]} tokens"
                )
            if count:
                positions = torch.arange(start, start + count)
                page_ids = torch.tensor(self._pages[seq_id], dtype=torch.long)[positions // self.page_size]
                slots.append(page_ids * self.page_size + positions % self.page_size)
        return torch.cat(slots).to(self.device) if slots else torch.empty(0, dtype=torch.long, device=self.device)

    def _plan(self, seq_ids: list[int], num_tokens: list[int]) -> list[int]:
        """New pages per sequence for :meth:`allocate`; raises before anything changes."""
        if len(seq_ids) != len(num_tokens):
            raise ValueError(f"reserve got {len(seq_ids)} seq_ids but {len(num_tokens)} token counts")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"reserve got a repeated sequence id in {seq_ids}")
        new_pages = []
        for seq_id, count in zip(seq_ids, num_tokens):
            self._check_seq(seq_id)
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"token count for sequence {seq_id} must be an int >= 0, got {count!r}")
            need = self.pages_for_tokens(self._lens[seq_id] + count)
            if need > self.max_pages_per_seq:
                raise CacheFullError(
                    f"sequence {seq_id} would need {need} pages, more than max_pages_per_seq={self.max_pages_per_seq}"
                )
            new_pages.append(need - len(self._pages[seq_id]))
        if sum(new_pages) > self.num_free_pages:
            raise CacheFullError(
                f"page pool exhausted: {sum(new_pages)} pages needed, {self.num_free_pages} free of {self.num_pages}"
            )
        return new_pages

    def write(self, layer_idx: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store one layer's keys and values ``[len(slots), num_kv_heads, head_dim]`` at ``slots``
        (from :meth:`reserve`) and update that layer's page bounds."""
        expected = (slots.shape[0], self.num_kv_heads, self.head_dim)
        for name, tensor in (("keys", keys), ("values", values)):
            if tuple(tensor.shape) != expected:
                raise ValueError(f"write: {name} must have shape {expected}, got {tuple(tensor.shape)}")
        if not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"write: layer_idx must be in [0, {self.num_layers}), got {layer_idx}")
        ops.append_kv(*self.layer(layer_idx), slots, keys, values, backend=self.backend)

    def append(
        self, seq_ids: Sequence[int], num_tokens: Sequence[int], keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        """Reserve and write all layers: ``keys``/``values`` are ``[num_layers, sum(num_tokens),
        num_kv_heads, head_dim]``, sequence after sequence. Returns the slots."""
        expected = (self.num_layers, sum(num_tokens), self.num_kv_heads, self.head_dim)
        for name, tensor in (("keys", keys), ("values", values)):
            if tuple(tensor.shape) != expected:
                raise ValueError(f"append: {name} must have shape {expected}, got {tuple(tensor.shape)}")
        slots = self.reserve(seq_ids, num_tokens)
        for layer_idx in range(self.num_layers):
            self.write(layer_idx, slots, keys[layer_idx], values[layer_idx])
        return slots

    def batch(self, seq_ids: Sequence[int], max_pages: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Page table ``[len(seq_ids), max_pages]`` int32 and lengths ``[len(seq_ids)]`` int32 on the
        cache's device. ``max_pages`` defaults to the longest sequence's page count; a fixed value
        (e.g. ``max_pages_per_seq``) gives a shape that does not change from step to step."""
        for seq_id in seq_ids:
            self._check_seq(seq_id)
        if max_pages is None:
            max_pages = max((len(self._pages[s]) for s in seq_ids), default=0)
        elif not 0 <= max_pages <= self.max_pages_per_seq:
            raise ValueError(f"batch: max_pages must be in [0, max_pages_per_seq={self.max_pages_per_seq}], got {max_pages}")
        rows = torch.tensor(list(seq_ids), dtype=torch.long).to(self.device)
        return self.page_table[rows, :max_pages], self.seq_lens[rows]

    def _check_seq(self, seq_id: int) -> None:
        if seq_id not in self._pages:
            raise KeyError(f"unknown sequence id {seq_id!r}; live sequences: {sorted(self._pages)}")
