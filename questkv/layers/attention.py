"""The engine's attention layer: writes the step's K/V into the page pool and attends.

A step's tokens are its decode rows' then its prefill rows' (:class:`~questkv.decode.context.StepContext`), and the
layer attends each part its own way, in one call (a mixed step of chunked prefill has both). Prefill rows: causal
attention of each sequence over its own new tokens (SDPA), or, when a sequence already holds K/V in the pool
(``PrefillRows.cached_lens``: prefix-cache pages, or its earlier chunks of a chunked prefill), paged prefill
attention of all the prefill rows over the pages. Decode rows read the pool through the rows'
:class:`~questkv.decode.step.QuestDecodeStep`: dense paged attention on layers below ``quest.dense_layers`` (and
everywhere without Quest, and for a lossless verify step's few queries per row), Quest page selection above. Which
of the two a layer runs is decided once, at construction.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from questkv import ops
from questkv.cache.paged import PagedKVCache
from questkv.config import QuestConfig
from questkv.decode.context import DecodeRows, PrefillRows, StepContext
from questkv.ops.pages import LayerPages


class Attention(nn.Module):
    """Attention of one decoder layer over the paged KV cache.

    Args:
        layer_idx: the layer's index (its slice of the page pool).
        num_q_heads, num_kv_heads, head_dim: the layer's shape (``num_q_heads % num_kv_heads == 0``).
        sm_scale: softmax scale.
        quest: the engine's Quest config, or ``None`` for dense attention everywhere.

    The page pool is attached with :func:`bind_cache` before the first forward.
    """

    def __init__(
        self,
        layer_idx: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sm_scale: float,
        quest: Optional[QuestConfig] = None,
    ) -> None:
        super().__init__()
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        self.layer_idx = layer_idx
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.sm_scale = sm_scale
        self.sparse = quest is not None and quest.is_sparse_layer(layer_idx)
        self.sparse_index = layer_idx - quest.dense_layers if self.sparse else None  # among the sparse layers
        self._decode = self._sparse_decode if self.sparse else self._dense_decode
        self.pages: Optional[LayerPages] = None
        self.backend = "auto"
        # The K and V scales of an fp8 pool, per KV head (row 0: keys, row 1: values): the pool stores k / k_scale and
        # v / v_scale; the queries and the output carry the scales back. A checkpoint's (set_kv_scale) or, where it
        # gives none, the data-free ones of fit_kv_scales.
        self.register_buffer("kv_scales", torch.ones(2, num_kv_heads), persistent=False)
        self.kv_scales_given = [False, False]  # which row the checkpoint set
        self.scaled = False  # set by bind_cache: the layer's pages in fp8 and scales other than 1
        self.kv_divisors = self.head_scales = None  # kv_scales as the step applies them, set by bind_cache

    def set_kv_scale(self, which: str, value: torch.Tensor, name: str) -> None:
        """Load the checkpoint's ``which`` (``"k"`` or ``"v"``) scale from tensor ``value`` (weight ``name``): one
        positive finite number (per tensor) or one per KV head of this layer (``num_kv_heads``; with tensor
        parallelism, this rank's heads).

        Raises:
            ValueError: naming ``name``, another shape or value.
        """
        if value.numel() not in (1, self.num_kv_heads):
            raise ValueError(f"weight {name!r} must be one number (a per-tensor {which} scale) or "
                             f"{self.num_kv_heads} (one per KV head), got shape {tuple(value.shape)}")
        numbers = value.detach().reshape(-1).float().cpu()
        if not bool(((numbers > 0) & (numbers < float("inf"))).all()):
            raise ValueError(f"weight {name!r} must hold positive finite scales, got {numbers.tolist()}")
        row = 0 if which == "k" else 1
        self.kv_scales[row] = numbers.to(self.kv_scales.device)
        self.kv_scales_given[row] = True

    def fit_kv_scales(self, bounds: torch.Tensor, kv_max: float) -> None:
        """Data-free scales for the rows the checkpoint left unset: per KV head, the smallest power of two ``>= 1``
        that brings ``bounds`` (``[2, num_kv_heads]``, bounds of ``|k|`` and ``|v|`` over every input,
        :meth:`~questkv.models.llama.LlamaAttention.kv_bounds`) within ``kv_max`` (448 for e4m3), so that no key
        or value saturates. Not below 1: e4m3 rounds every normal number to 3 bits whatever its scale, so a smaller
        scale only rescues values under 2**-6 (benchmarks/fp8_kv_scales.py measures it), at the price of the
        scaling ops in every layer; a power of two multiplies and divides exactly."""
        exponents = torch.ceil(torch.log2(bounds.float().cpu() / kv_max)).clamp(min=0)
        for row in (0, 1):
            if not self.kv_scales_given[row]:
                self.kv_scales[row] = torch.exp2(exponents[row]).to(self.kv_scales.device)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: StepContext
    ) -> torch.Tensor:
        """Rotate ``q`` and ``k`` by their positions and store ``k``, ``v`` at ``ctx.slots`` (every row's, before any
        attends; one op, :func:`~questkv.ops.rope_append_kv`), then attend: the decode rows (the leading
        ``ctx.decode.num_tokens`` tokens) as a decode step, the prefill rows after them as a prefill.

        Args:
            q: ``[num_tokens, num_q_heads, head_dim]``, pre-RoPE; rotated in place.
            k: ``[num_tokens, num_kv_heads, head_dim]``, pre-RoPE keys; rotated in place.
            v: ``[num_tokens, num_kv_heads, head_dim]``.
            cos, sin: ``[num_tokens, head_dim // 2]`` in ``q``'s dtype (:meth:`RotaryEmbedding.cos_sin`).

        Returns:
            ``[num_tokens, num_q_heads, head_dim]`` in ``q``'s dtype.
        """
        if self.pages is None:
            raise RuntimeError(f"layer {self.layer_idx} has no page pool: call questkv.layers.attention.bind_cache first")
        if self.scaled:  # (RoPE commutes with a scale: the rotated keys come out divided too)
            k, v = k / self.kv_divisors[0], v / self.kv_divisors[1]
        ops.rope_append_kv(*self.pages, ctx.slots, q, k, v, cos, sin, backend=self.backend)
        if self.scaled:  # q . (k / s) * s: the pages' scores, Quest's estimate included, come out as q . k
            q = q * self.head_scales[0]
        out = self._attend(q, k, v, ctx)
        return out * self.head_scales[1] if self.scaled else out

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        decode, prefill = ctx.decode, ctx.prefill
        if prefill is None:
            return self._decode(q, decode)
        if decode is None:
            return self._prefill(q, k, v, prefill)
        n = decode.num_tokens
        return torch.cat([self._decode(q[:n], decode), self._prefill(q[n:], k[n:], v[n:], prefill)])

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: PrefillRows) -> torch.Tensor:
        """The prefill rows' attention (``q``, ``k``, ``v``: their tokens only). With an fp8 pool the step's keys and
        values are rounded as the pool stores them first, so that a prefill attends what a chunked one, a prefix
        hit and every decode step read from the pages."""
        if rows.cached_lens is not None:
            return self._prefill_after_prefix(q, rows)
        stored = self.pages.k_pages.dtype
        if stored != k.dtype:
            k, v = ops.to_pool_dtype(k, stored).to(k.dtype), ops.to_pool_dtype(v, stored).to(v.dtype)
        return self._causal_prefill(q, k, v, rows.query_starts)

    def _causal_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: list[int]) -> torch.Tensor:
        out = torch.empty_like(q)
        group = self.num_q_heads // self.num_kv_heads
        for begin, end in zip(starts[:-1], starts[1:]):
            qs = q[begin:end].transpose(0, 1)[None]  # [1, Hq, T, D]
            ks = k[begin:end].transpose(0, 1)[None]  # [1, Hkv, T, D]
            vs = v[begin:end].transpose(0, 1)[None]
            if q.is_cuda and group > 1:
                # The flash backend takes equal head counts; expanding K/V keeps long prompts off the math path.
                ks, vs = ks.repeat_interleave(group, dim=1), vs.repeat_interleave(group, dim=1)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.sm_scale)
            else:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.sm_scale, enable_gqa=group > 1)
            out[begin:end] = o[0].transpose(0, 1)
        return out

    def _prefill_after_prefix(self, q: torch.Tensor, rows: PrefillRows) -> torch.Tensor:
        """Prefill where sequence ``i`` already holds ``rows.cached_lens[i]`` tokens in the pool (prefix-cache pages,
        and its earlier chunks, which may end inside a page whose rest this step writes): its new tokens attend those
        and, causally, each other, all read from the pages (the step's K/V are written there already), in one
        :func:`~questkv.ops.paged_prefill_attention` for all the prefill rows (sequences without cached tokens too)."""
        starts = rows.query_starts
        max_query_len = max(end - begin for begin, end in zip(starts[:-1], starts[1:]))
        return ops.paged_prefill_attention(
            q, self.pages.k_pages, self.pages.v_pages, rows.page_table, rows.query_starts_tensor(), rows.seq_lens,
            max_query_len, self.sm_scale, backend=self.backend,
        )

    def _dense_decode(self, q: torch.Tensor, rows: DecodeRows) -> torch.Tensor:
        return rows.step.dense(q, self.pages, rows.page_table, rows.seq_lens, self.sm_scale)

    def _sparse_decode(self, q: torch.Tensor, rows: DecodeRows) -> torch.Tensor:
        if rows.dense:  # the step's route (questkv.decode.route): no row gains from Quest here
            return self._dense_decode(q, rows)
        reuse = rows.reuse
        active = selected = None
        selecting = True
        if reuse is not None:
            active, selected, selecting = reuse.active, reuse.selected[self.sparse_index], reuse.selecting
        return rows.step.sparse(
            q, self.pages, rows.page_table, rows.seq_lens, self.sm_scale, rows.budgets, active, selected, selecting
        )


def bind_cache(model: nn.Module, cache: PagedKVCache) -> None:
    """Attach the page pool to every :class:`Attention` of ``model`` (layer ``i`` gets ``cache.layer(i)``)."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if len(layers) != cache.num_layers:
        raise ValueError(f"the model has {len(layers)} attention layers but the cache holds {cache.num_layers}")
    for module in layers:
        module.pages = cache.layer(module.layer_idx)
        module.backend = cache.backend
        # (read once, here)
        module.scaled = module.pages.k_pages.dtype != cache.dtype and bool((module.kv_scales != 1).any())
        # In the model dtype, so that a step's tensors keep theirs: [2, Hkv, 1] for k and v, [2, Hq, 1] per query head.
        scales = module.kv_scales.to(cache.dtype)
        module.kv_divisors = scales[:, :, None]
        module.head_scales = scales.repeat_interleave(module.num_q_heads // module.num_kv_heads, dim=1)[:, :, None]


def prepare_prefill(model: nn.Module, cache: PagedKVCache) -> int:
    """Compile the prefill attention over cached pages for each kind of pool the model's layers read (the model
    dtype's, fp8's) before the first request (:func:`questkv.ops.prepare_paged_prefill_attention`): a prefill after
    a prefix-cache hit or an earlier chunk would otherwise compile its launch inside a serving step. Returns the
    launches run."""
    prepared, launches = set(), 0
    for module in model.modules():
        if isinstance(module, Attention) and module.pages.k_pages.dtype not in prepared:
            prepared.add(module.pages.k_pages.dtype)
            launches += ops.prepare_paged_prefill_attention(cache.dtype, module.num_q_heads, module.pages.k_pages,
                                                            module.pages.v_pages, cache.max_pages_per_seq,
                                                            module.backend)
    return launches
