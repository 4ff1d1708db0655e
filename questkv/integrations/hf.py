"""Quest sparse decoding as a drop-in for HF transformers causal LMs: the transformers side only.

After :func:`enable`, every forward call of the model (``generate`` included) runs with a
:class:`QuestCache`: prefill (a forward over several new tokens on an empty cache) is dense
(transformers' own SDPA attention) and writes its keys/values into a questkv
:class:`~questkv.cache.paged.PagedKVCache`; every decode step (one new token per sequence) reads
that paged cache. ``enable(model, policy)`` runs any :mod:`questkv.policies` policy (an eviction
baseline, the oracle, adaptive top-p) on the sparse layers instead: the evaluation path.

What lives where:

* this module: the transformers protocol — the :class:`QuestCache` (a ``Cache`` subclass), the
  attention and mask functions registered under the name ``"questkv"``
  (``model.set_attn_implementation``), the forward pre-hook that hands the cache to the attention
  function through the forward keyword arguments (transformers passes them down to every
  attention call), and :func:`enable` / :func:`disable`. The cache does the pad bookkeeping
  (which positions hold real tokens, the slots of the stored ones, dense K/V for a multi-token
  forward over a non-empty cache), sizes and grows the page pool, and records the prefill
  attention when asked;
* :class:`questkv.integrations.layer_decoder.LayerDecoder`, built once per :func:`enable`: which route
  each layer's decode steps take (dense paged attention below ``dense_layers``, Quest or the
  policy from there on), through one :class:`~questkv.decode.QuestDecodeStep` per decode shape,
  and the budget accounting (``mean_tokens_attended``), in a
  :class:`~questkv.integrations.layer_decoder.DecodeState` each cache owns;
* :class:`questkv.integrations.forward_state.ForwardState`: what one forward writes and reads (frozen);
* :func:`questkv.policies.eviction.prefill_attention`: the prefill attention that seeds H2O.

Padding: only tokens whose ``attention_mask`` is 1 are written to the paged cache, so pad
positions are never selected nor attended, and a left-padded batch decodes every sequence exactly
as it would decode alone.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Optional, Union

import torch
from torch import nn
from transformers import AttentionInterface, Cache, DynamicCache
from transformers.cache_utils import CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from questkv.cache.paged import PagedKVCache
from questkv.config import QuestConfig
from questkv.decode.route import decodes_densely
from questkv.integrations.forward_state import ForwardState
from questkv.integrations.layer_decoder import DecodeState, LayerDecoder
from questkv.models.families import FAMILIES, MODEL_TYPES
from questkv.ops import LayerPages
from questkv.policies.base import DecodePolicy
from questkv.policies.eviction import prefill_attention

__all__ = ["ATTN_IMPLEMENTATION", "QuestCache", "cache_argument", "disable", "enable", "is_enabled"]

ATTN_IMPLEMENTATION = "questkv"
# Forward keyword that carries the QuestCache down to the attention function.
_CACHE_KWARG = "questkv_cache"
# Tokens of headroom per sequence when the page pool is first sized (it grows by doubling).
_HEADROOM_TOKENS = 256


class QuestCacheLayer(CacheLayerMixin):
    """One layer's lengths and mask sizes, which transformers asks layers for.

    Storage is the :class:`QuestCache`'s, which stores every layer in :meth:`QuestCache.update`; a
    layer keeps no reference to its cache, so a cache is freed as soon as it is dropped (no cycle).
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.seen_tokens = 0  # positions (pads included) this layer has processed
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the shared page pool is created on the first forward."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise RuntimeError("a QuestCache layer is updated through QuestCache.update(key_states, value_states, layer_idx)")

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        # transformers 5.24 passes the query length, older 5.x the cache positions of the queries.
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        return self.seen_tokens + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise RuntimeError("a QuestCache is reset as a whole: QuestCache.reset()")


class QuestCache(Cache):
    """A transformers ``Cache`` whose storage is a questkv :class:`PagedKVCache`.

    Positions are counted as transformers counts them (a left-padded batch has pad positions), but
    only tokens with ``attention_mask == 1`` are stored: sequence ``b`` of the batch is sequence
    ``seq_ids[b]`` of the page pool and holds exactly its real tokens. The pool grows by doubling.

    ``copy.deepcopy(cache)`` snapshots it (e.g. reuse one prefill for several decode configs).

    Decode attention is the enabled model's :class:`LayerDecoder`'s; what it accumulates for this
    batch (a policy's per-layer state, such as an eviction policy's kept tokens, and the tokens
    attended) is :attr:`decode_state`, read through :attr:`policy_states`, :attr:`sparse_steps`,
    :attr:`mean_tokens_attended` and :attr:`mean_tokens_attended_per_sequence`.

    Args:
        model_config: the model's ``PretrainedConfig`` (layer and head counts).
        page_size: tokens per page; must equal the ``page_size`` of the ``QuestConfig`` in use.
        collect_prefill_attention: record, for every layer, the attention each prefilled token
            receives from the prefill queries (summed over queries and each KV head's query group),
            which seeds H2O's accumulated scores. Costs one extra attention pass per prefill.
    """

    def __init__(self, model_config, page_size: int = 16, collect_prefill_attention: bool = False) -> None:
        num_layers = model_config.num_hidden_layers
        super().__init__(layers=[QuestCacheLayer(i) for i in range(num_layers)])
        self.num_kv_heads = model_config.num_key_value_heads
        self.head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
        self.page_size = page_size
        self.collect_prefill_attention = collect_prefill_attention
        self.decoder: Optional[LayerDecoder] = None  # the current forward's (set by begin_forward)
        self.reset()

    def reset(self) -> None:
        """Forget every token (a fresh, empty cache)."""
        self.paged: Optional[PagedKVCache] = None
        self.seq_ids: list[int] = []
        self.token_mask = torch.zeros(0, 0, dtype=torch.bool)  # [batch, positions]: stored or pad
        self._pending: Optional[torch.Tensor] = None
        self._forward: Optional[ForwardState] = None
        self.decode_state = DecodeState()
        self.prefill_attention: dict[int, torch.Tensor] = {}  # layer -> [batch, num_kv_heads, positions] float32
        for layer in self.layers:
            layer.seen_tokens = 0

    @property
    def config(self) -> Optional[QuestConfig]:
        """The Quest config of the current (or last) forward, ``None`` before the first."""
        return None if self.decoder is None else self.decoder.config

    @property
    def policy(self) -> Optional[DecodePolicy]:
        """The policy of the sparse layers in the current (or last) forward, if any."""
        return None if self.decoder is None else self.decoder.policy

    @property
    def policy_states(self) -> dict[int, Any]:
        """Policy layer -> its policy's state, created at the layer's first decode step."""
        return self.decode_state.policy_states

    @property
    def sparse_steps(self) -> int:
        """(sparse layer, decode step) pairs charged to :attr:`mean_tokens_attended`."""
        return self.decode_state.sparse_steps

    @property
    def mean_tokens_attended(self) -> Optional[float]:
        """Mean tokens attended per (sequence, selection head, sparse layer, decode step): the budget
        actually used (``None`` before any sparse decode step). Reading it synchronises the device."""
        return self.decode_state.mean_tokens_attended

    @property
    def mean_tokens_attended_per_sequence(self) -> Optional[torch.Tensor]:
        """``[batch]`` float64: :attr:`mean_tokens_attended` of every sequence (``None`` before any
        sparse decode step)."""
        return self.decode_state.mean_tokens_attended_per_sequence

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """transformers' entry point: store one layer's new keys/values (see :meth:`_update_layer`)."""
        return self._update_layer(layer_idx, key_states, value_states)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("QuestCache does not support beam search (reorder_cache); use greedy or sampling")

    # -- one forward pass ------------------------------------------------------------------------

    def begin_forward(self, new_token_mask: torch.Tensor, decoder: LayerDecoder) -> None:
        """Announce a forward over ``new_token_mask.shape[1]`` new positions.

        Args:
            new_token_mask: ``[batch, new_positions]`` bool, True where the token is real (stored),
                False for padding.
            decoder: the enabled model's :class:`LayerDecoder` (its config's ``page_size`` must be
                the cache's).

        Raises:
            ValueError: a page size other than the cache's; a multi-token forward after an eviction
                policy started dropping tokens; another policy than the one whose state the cache holds.
        """
        if decoder.config.page_size != self.page_size:
            raise ValueError(
                f"QuestConfig.page_size={decoder.config.page_size} differs from the cache's page_size={self.page_size}"
            )
        if decoder.num_layers != len(self.layers):
            raise ValueError(f"the decoder has {decoder.num_layers} layers, the cache {len(self.layers)}")
        decoder.prepare(self.decode_state, new_token_mask.shape[1])
        self.decoder = decoder
        self._pending = new_token_mask.bool()

    @property
    def is_decode_step(self) -> bool:
        """True inside a forward of one new position over a non-empty cache: attention reads the pages."""
        return self._forward is not None and self._forward.is_decode

    def _start_forward(self, key_states: torch.Tensor) -> None:
        """At layer 0: store nothing yet, but reserve the forward's slots and describe it."""
        batch, _, new_positions, _ = key_states.shape
        mask = self._pending
        self._pending = None
        if mask is None:
            raise RuntimeError(
                "QuestCache got keys outside a forward of a questkv-enabled model; call questkv.enable(model, config)"
            )
        if tuple(mask.shape) != (batch, new_positions):
            raise ValueError(f"attention mask of the new tokens has shape {tuple(mask.shape)}, expected {(batch, new_positions)}")
        mask = mask.to(key_states.device)
        counts = mask.sum(dim=1).tolist()
        if self.paged is None:
            pages = sum(-(-(count + _HEADROOM_TOKENS) // self.page_size) for count in counts)
            self.paged = self._new_pool(pages, batch, key_states.dtype, key_states.device)
            self.seq_ids = [self.paged.add_sequence() for _ in range(batch)]
            self.token_mask = mask.new_zeros(batch, 0)
        elif batch != len(self.seq_ids):
            raise ValueError(f"batch size changed from {len(self.seq_ids)} to {batch} within one QuestCache")
        self._ensure_free_pages(counts)
        past = self.token_mask.shape[1]
        slots = self.paged.reserve(self.seq_ids, counts)
        page_table, seq_lens = self.paged.batch(self.seq_ids)
        self.token_mask = torch.cat([self.token_mask, mask], dim=1)
        # Flat (batch * new_positions) rows of the real tokens: found once per forward, not per layer.
        rows = mask.flatten().nonzero().squeeze(1)
        # A chunk over a non-empty cache: every layer then reads all stored K/V (found once here).
        dense_read = ForwardState.needs_stored_slots(new_positions, past)
        stored_slots = self._stored_slots(self.paged) if dense_read else None
        quest = self.decoder.config
        dense_rows = [decodes_densely(quest, quest.token_budget, self.paged.seq_len(seq)) for seq in self.seq_ids]
        self._forward = ForwardState(mask, rows, slots, page_table, seq_lens, past, stored_slots, dense_rows)

    def _update_layer(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Store one layer's new keys/values ``[batch, num_kv_heads, new_positions, head_dim]``.

        Returns what transformers' attention receives: the new keys/values themselves on prefill
        of an empty cache and on decode steps (where :func:`questkv_attention` reads the pages),
        otherwise the full dense keys/values ``[batch, num_kv_heads, positions, head_dim]``.
        """
        if layer_idx == 0:
            self._start_forward(key_states)
        forward = self._forward
        layer = self.layers[layer_idx]
        if forward is None or layer.seen_tokens != forward.past_positions:
            raise RuntimeError(f"QuestCache layer {layer_idx} updated out of order (layer 0 must start every forward)")
        rows = forward.rows
        keys = key_states.transpose(1, 2).flatten(0, 1).index_select(0, rows)  # [stored tokens, num_kv_heads, head_dim]
        values = value_states.transpose(1, 2).flatten(0, 1).index_select(0, rows)
        self.paged.write(layer_idx, forward.slots, keys, values)
        layer.seen_tokens += forward.new_positions
        if forward.reads_dense_kv:
            return self._dense_kv(layer_idx)
        return key_states, value_states

    def attend(self, layer_idx: int, query: torch.Tensor, scaling: Optional[float]) -> torch.Tensor:
        """Decode attention of one layer, through the enabled model's :class:`LayerDecoder`.

        Args:
            query: ``[batch, num_q_heads, head_dim]``, post-RoPE.

        Returns:
            ``[batch, num_q_heads, head_dim]``.
        """
        layer, page_table, seq_lens = self.decode_view(layer_idx)
        out = self.decoder.decode(
            layer_idx, query, layer, page_table, seq_lens, scaling, state=self.decode_state,
            prefill_scores=self._prefill_scores, dense_rows=self._forward.dense_rows,
        )
        # The step's buffer is overwritten by the next layer: autograd must not save it.
        return out.clone() if torch.is_grad_enabled() else out

    def _prefill_scores(self, layer_idx: int) -> Optional[torch.Tensor]:
        """The recorded prefill attention of one layer in stored order, if recorded (H2O's seed)."""
        recorded = self.prefill_attention.get(layer_idx)
        return None if recorded is None else self._stored_order(recorded)

    def record_prefill_attention(
        self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, attention_mask: Optional[torch.Tensor],
        scaling: Optional[float],
    ) -> None:
        """Add the attention every key position receives from this forward's real queries
        (:func:`~questkv.policies.eviction.prefill_attention`) to :attr:`prefill_attention` (see
        ``collect_prefill_attention``).

        Args:
            query: ``[batch, num_q_heads, new_positions, head_dim]``; key: ``[batch, num_kv_heads,
                positions, head_dim]`` (every position so far, as attention reads them).
            attention_mask: transformers' SDPA mask ``[batch, 1, new_positions, positions]`` bool
                (True = attend), or ``None`` for plain causal attention.
        """
        real_queries = self.token_mask[:, -query.shape[2]:]  # pad queries add nothing
        total = prefill_attention(query, key, attention_mask, real_queries, scaling)
        previous = self.prefill_attention.get(layer_idx)
        if previous is not None:
            total[..., : previous.shape[-1]] += previous
        self.prefill_attention[layer_idx] = total

    def _stored_order(self, per_position: torch.Tensor) -> torch.Tensor:
        """``[batch, heads, positions]`` (pads included) -> ``[batch, heads, max stored tokens]``:
        each sequence's real tokens in order, zero past its end."""
        batch, heads, _ = per_position.shape
        mask = self.token_mask[:, : per_position.shape[-1]]
        counts = mask.sum(dim=1)
        out = per_position.new_zeros(batch, heads, int(counts.max()))
        for row in range(batch):
            out[row, :, : int(counts[row])] = per_position[row][:, mask[row]]
        return out

    def decode_view(self, layer_idx: int) -> tuple[LayerPages, torch.Tensor, torch.Tensor]:
        """What the current forward's attention reads for one layer: the layer's pages and bounds,
        the page table ``[batch, max_pages]`` int32 and the lengths ``[batch]`` int32 (new tokens included)."""
        if self._forward is None:
            raise RuntimeError("QuestCache.decode_view is only defined inside a forward")
        return self.paged.layer(layer_idx), self._forward.page_table, self._forward.seq_lens

    # -- storage ---------------------------------------------------------------------------------

    def _new_pool(self, num_pages: int, batch: int, dtype: torch.dtype, device: torch.device) -> PagedKVCache:
        return PagedKVCache(
            num_layers=len(self.layers),
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            num_pages=num_pages,
            page_size=self.page_size,
            max_seqs=batch,
            dtype=dtype,
            device=device,
            backend=self.config.backend,
        )

    def _stored_slots(self, pool: PagedKVCache) -> torch.Tensor:
        """``[stored tokens]`` slots of every stored token, sequence after sequence, in order."""
        page_table, seq_lens = pool.batch(self.seq_ids)
        slots = []
        for row, length in enumerate(seq_lens.tolist()):
            position = torch.arange(length, device=page_table.device)
            slots.append(page_table[row, position // self.page_size].long() * self.page_size + position % self.page_size)
        return torch.cat(slots)

    def _ensure_free_pages(self, counts: list[int]) -> None:
        """Grow the pool (to at least twice its size) when ``counts`` new tokens would not fit."""
        pool = self.paged
        if pool.can_reserve(self.seq_ids, counts):
            return
        lengths = [pool.seq_len(seq) for seq in self.seq_ids]
        need = sum(pool.pages_needed(seq, count) for seq, count in zip(self.seq_ids, counts))
        used = pool.num_pages - pool.num_free_pages
        bigger = self._new_pool(max(2 * pool.num_pages, used + need), len(self.seq_ids), pool.dtype, pool.device)
        new_ids = [bigger.add_sequence() for _ in self.seq_ids]
        new_slots = bigger.reserve(new_ids, lengths)
        old_slots = self._stored_slots(pool)
        for layer_idx in range(pool.num_layers):
            shape = (-1, pool.num_kv_heads, pool.head_dim)
            bigger.write(
                layer_idx,
                new_slots,
                pool.k_pages[layer_idx].view(shape)[old_slots],
                pool.v_pages[layer_idx].view(shape)[old_slots],
            )
        self.paged, self.seq_ids = bigger, new_ids

    def _dense_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys/values in transformers' layout ``[batch, num_kv_heads, positions, head_dim]``
        (zeros at pad positions, which the attention mask hides)."""
        slots = self._forward.stored_slots
        shape = (-1, self.num_kv_heads, self.head_dim)
        pages = self.paged.layer(layer_idx)
        batch, positions = self.token_mask.shape
        out = []
        for source in (pages.k_pages, pages.v_pages):
            dense = source.new_zeros(batch, positions, self.num_kv_heads, self.head_dim)
            dense[self.token_mask] = source.view(shape)[slots]
            out.append(dense.transpose(1, 2))
        return out[0], out[1]


def questkv_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    questkv_cache: Optional[QuestCache] = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function (registered as ``"questkv"``).

    Args:
        query: ``[batch, num_q_heads, new_positions, head_dim]``; key, value:
            ``[batch, num_kv_heads, kv_positions, head_dim]`` as the cache returned them.

    Returns:
        ``([batch, new_positions, num_q_heads, head_dim], None)``. Decode steps read the paged
        cache through its :class:`LayerDecoder` (:meth:`QuestCache.attend`); everything else is
        transformers' SDPA attention.
    """
    if questkv_cache is not None and questkv_cache.is_decode_step:
        out = questkv_cache.attend(module.layer_idx, query[:, :, 0], scaling)
        return out.unsqueeze(1), None
    if questkv_cache is not None and questkv_cache.collect_prefill_attention:
        questkv_cache.record_prefill_attention(module.layer_idx, query, key, attention_mask, scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


AttentionInterface.register(ATTN_IMPLEMENTATION, questkv_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


@dataclasses.dataclass
class _QuestState:
    config: QuestConfig
    policy: Optional[DecodePolicy]
    decoder: LayerDecoder  # built from config and policy once, at enable
    original_attn_implementation: str
    hook: torch.utils.hooks.RemovableHandle
    positional: tuple[str, ...]  # forward's positional parameter names
    cache_argument: str


def cache_argument(model: nn.Module) -> str:
    """Name of the forward argument that takes the cache: ``"cache"`` (transformers >= 5.2x) or ``"past_key_values"``."""
    return _cache_argument_of(type(model))


@functools.lru_cache(maxsize=None)
def _cache_argument_of(model_class: type) -> str:
    # Looked up once per model class: callers ask on every decode step.
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def is_enabled(model: nn.Module) -> bool:
    return isinstance(getattr(model, "_questkv", None), _QuestState)


def _check_model(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES or not hasattr(model, "generate"):
        raise ValueError(
            f"questkv.enable supports causal LMs of model_type {', '.join(MODEL_TYPES)}; "
            f"got {type(model).__name__} (model_type={model_type!r})"
        )
    layer_types = getattr(config, "layer_types", None) or []
    sliding = getattr(config, "sliding_window", None) if FAMILIES[model_type].sliding_window_everywhere else None
    if any(kind != "full_attention" for kind in layer_types) or sliding is not None:
        raise ValueError(
            f"questkv.enable does not support sliding-window attention (model_type={model_type!r}, "
            f"sliding_window={getattr(config, 'sliding_window', None)!r}, layer_types={sorted(set(layer_types))}); "
            "disable it in the model config (sliding_window=None / use_sliding_window=False) if your contexts fit"
        )


def _resolve_config(
    model: nn.Module, config: Union[QuestConfig, DecodePolicy], dense_layers: Optional[int]
) -> tuple[QuestConfig, Optional[DecodePolicy]]:
    """``enable``'s arguments as (the QuestConfig of the forward, the policy of the sparse layers or None)."""
    policy = None
    if isinstance(config, DecodePolicy):
        policy = config
        try:
            config = QuestConfig(token_budget=None, page_size=policy.page_size, **({} if dense_layers is None else {"dense_layers": dense_layers}))
        except ValueError as error:
            raise ValueError(f"enable(model, {policy!r}, dense_layers={dense_layers!r}): {error}") from error
    elif not isinstance(config, QuestConfig):
        raise ValueError(f"config must be a questkv.QuestConfig or a questkv.policies.DecodePolicy, got {type(config).__name__}")
    elif dense_layers is not None:
        raise ValueError(
            f"dense_layers={dense_layers!r} is only for a policy; with a QuestConfig set QuestConfig.dense_layers"
        )
    elif config.selection_interval != 1 and not config.is_dense:
        raise ValueError(
            f"QuestConfig.selection_interval={config.selection_interval}: selection reuse runs in the engine "
            "(questkv.LLM, questkv serve); the HF drop-in selects every "
            "step (allowed: 1)"
        )
    num_layers = model.config.num_hidden_layers
    if (policy is not None or not config.is_dense) and config.dense_layers >= num_layers:
        raise ValueError(
            f"QuestConfig.dense_layers={config.dense_layers} leaves no sparse layer in a model of {num_layers} layers; "
            f"allowed: dense_layers < {num_layers}, or token_budget=None for dense decoding"
        )
    return config, policy


def _pre_forward(model: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook: give the forward a QuestCache and announce its new tokens to it."""
    state: _QuestState = model._questkv
    if len(args) > len(state.positional):
        raise TypeError(f"{type(model).__name__}.forward takes at most {len(state.positional)} positional arguments")
    kwargs = {**dict(zip(state.positional, args)), **kwargs}
    given = [kwargs.pop(name, None) for name in ("cache", "past_key_values")]
    cache = next((c for c in given if c is not None), None)
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = model.config.use_cache
    if cache is None and not use_cache:
        return (), kwargs  # no cache: a plain dense forward
    if cache is None or (type(cache) is DynamicCache and cache.get_seq_length() == 0):
        collect = state.decoder.uses_prefill_attention
        cache = QuestCache(model.config, state.config.page_size, collect_prefill_attention=collect)
    elif not isinstance(cache, QuestCache):
        raise ValueError(
            f"a questkv-enabled model got a non-empty {type(cache).__name__}; pass no cache or a questkv QuestCache"
        )
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs["inputs_embeds"]
    batch, new_positions = tokens.shape[:2]
    mask = kwargs.get("attention_mask")
    if mask is None:
        new_mask = torch.ones(batch, new_positions, dtype=torch.bool, device=tokens.device)
    elif mask.dim() == 2:
        new_mask = mask[:, -new_positions:].bool()
    else:
        raise ValueError(f"a questkv-enabled model needs a 2D attention_mask [batch, positions], got shape {tuple(mask.shape)}")
    cache.begin_forward(new_mask, state.decoder)
    kwargs[state.cache_argument] = cache
    kwargs[_CACHE_KWARG] = cache
    return (), kwargs


def enable(
    model: nn.Module, config: Union[QuestConfig, DecodePolicy], dense_layers: Optional[int] = None
) -> nn.Module:
    """Run the model's decode steps through Quest (in place); calling it again swaps the config.

    Args:
        model: a transformers causal LM of a supported family (:data:`~questkv.models.families.FAMILIES`).
        config: a :class:`QuestConfig` (``token_budget=None`` decodes densely from the paged
            cache), or a :class:`questkv.policies.DecodePolicy` from
            :func:`questkv.policies.make_policy` (``"h2o"``, ``"oracle"``, ...) that then decodes
            every layer from ``dense_layers`` on through the torch reference ops.
        dense_layers: with a policy only: layers below this index decode densely (default: 2, as
            :class:`QuestConfig`).

    Returns:
        ``model``. Raises ``ValueError`` for an unsupported model or an invalid config.
    """
    _check_model(model)
    config, policy = _resolve_config(model, config, dense_layers)
    decoder = LayerDecoder(config, model.config.num_hidden_layers, policy)
    if is_enabled(model):
        model._questkv.config = config
        model._questkv.policy = policy
        model._questkv.decoder = decoder
        return model
    original = model.config._attn_implementation
    positional = tuple(
        name
        for name, parameter in inspect.signature(model.forward).parameters.items()
        if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)
    )
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    hook = model.register_forward_pre_hook(_pre_forward, with_kwargs=True)
    model._questkv = _QuestState(config, policy, decoder, original, hook, positional, cache_argument(model))
    return model


def disable(model: nn.Module) -> nn.Module:
    """Undo :func:`enable` (in place): the original attention implementation, no hook. A no-op if not enabled."""
    if not is_enabled(model):
        return model
    state: _QuestState = model._questkv
    state.hook.remove()
    model.set_attn_implementation(state.original_attn_implementation)
    del model._questkv
    return model
