"""Quest sparse decoding as a drop-in for HF transformers causal LMs.

After :func:`enable`, every forward call of the model (``generate`` included) runs with a
:class:`QuestCache`: prefill (a forward over several new tokens on an empty cache) is dense
(transformers' own SDPA attention) and writes its keys/values into a questkv
:class:`~questkv.cache.paged.PagedKVCache`; every decode step (one new token per sequence) reads
that paged cache through :func:`questkv.ops.decode.quest_decode`: Quest page selection on layers
``>= config.dense_layers``, dense paged attention below.

Only transformers' extension points are used: a :class:`transformers.Cache` subclass, an
attention function and a mask function registered under the name ``"questkv"``
(``model.set_attn_implementation``), and a forward pre-hook on the model that hands the cache to
the attention function through the forward keyword arguments, which transformers passes down to
every attention call.

Padding: only tokens whose ``attention_mask`` is 1 are written to the paged cache, so pad
positions are never selected nor attended, and a left-padded batch decodes every sequence exactly
as it would decode alone.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Optional

import torch
from torch import nn
from transformers import AttentionInterface, Cache, DynamicCache
from transformers.cache_utils import CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from questkv.cache.paged import LayerPages, PagedKVCache
from questkv.config import QuestConfig
from questkv.ops.decode import quest_decode

__all__ = ["ATTN_IMPLEMENTATION", "SUPPORTED_MODEL_TYPES", "QuestCache", "cache_argument", "disable", "enable", "is_enabled"]

ATTN_IMPLEMENTATION = "questkv"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# Forward keyword that carries the QuestCache down to the attention function.
_CACHE_KWARG = "questkv_cache"
# Tokens of headroom per sequence when the page pool is first sized (it grows by doubling).
_HEADROOM_TOKENS = 256


class QuestCacheLayer(CacheLayerMixin):
    """One layer's view of a :class:`QuestCache` (transformers asks layers for lengths and mask sizes)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, cache: "QuestCache", layer_idx: int) -> None:
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.seen_tokens = 0  # positions (pads included) this layer has processed
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the shared page pool is created on the first forward."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.cache._update_layer(self.layer_idx, key_states, value_states)

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
        self.cache.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("QuestCache does not support beam search (reorder_cache); use greedy or sampling")


class QuestCache(Cache):
    """A transformers ``Cache`` whose storage is a questkv :class:`PagedKVCache`.

    Positions are counted as transformers counts them (a left-padded batch has pad positions), but
    only tokens with ``attention_mask == 1`` are stored: sequence ``b`` of the batch is sequence
    ``seq_ids[b]`` of the page pool and holds exactly its real tokens. The pool grows by doubling.

    ``copy.deepcopy(cache)`` snapshots it (e.g. reuse one prefill for several decode configs).

    Args:
        model_config: the model's ``PretrainedConfig`` (layer and head counts).
        page_size: tokens per page; must equal the ``page_size`` of the ``QuestConfig`` in use.
    """

    def __init__(self, model_config, page_size: int = 16) -> None:
        num_layers = model_config.num_hidden_layers
        super().__init__(layers=[QuestCacheLayer(self, i) for i in range(num_layers)])
        self.num_kv_heads = model_config.num_key_value_heads
        self.head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
        self.page_size = page_size
        self.config: Optional[QuestConfig] = None
        self.reset()

    def reset(self) -> None:
        """Forget every token (a fresh, empty cache)."""
        self.paged: Optional[PagedKVCache] = None
        self.seq_ids: list[int] = []
        self.token_mask = torch.zeros(0, 0, dtype=torch.bool)  # [batch, positions]: stored or pad
        self._pending: Optional[torch.Tensor] = None
        self._step: Optional[dict] = None
        for layer in self.layers:
            layer.seen_tokens = 0

    # -- one forward pass ------------------------------------------------------------------------

    def begin_forward(self, new_token_mask: torch.Tensor, config: QuestConfig) -> None:
        """Announce a forward over ``new_token_mask.shape[1]`` new positions.

        Args:
            new_token_mask: ``[batch, new_positions]`` bool, True where the token is real (stored),
                False for padding.
            config: the Quest config of this forward's decode attention.
        """
        if config.page_size != self.page_size:
            raise ValueError(
                f"QuestConfig.page_size={config.page_size} differs from the cache's page_size={self.page_size}"
            )
        self.config = config
        self._pending = new_token_mask.bool()

    @property
    def is_decode_step(self) -> bool:
        """True inside a forward of one new position over a non-empty cache: attention reads the pages."""
        return self._step is not None and self._step["decode"]

    def _start_forward(self, key_states: torch.Tensor) -> None:
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
        self._step = {
            "mask": mask,
            # Flat (batch * new_positions) rows of the real tokens: found once per forward, not per layer.
            "rows": mask.flatten().nonzero().squeeze(1),
            "stored_slots": None,  # every stored token's slot, built on the first dense read of this forward
            "slots": slots,
            "page_table": page_table,
            "seq_lens": seq_lens,
            "past": past,
            "decode": new_positions == 1 and past > 0,
        }

    def _update_layer(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Store one layer's new keys/values ``[batch, num_kv_heads, new_positions, head_dim]``.

        Returns what transformers' attention receives: the new keys/values themselves on prefill
        of an empty cache and on decode steps (where :func:`questkv_attention` reads the pages),
        otherwise the full dense keys/values ``[batch, num_kv_heads, positions, head_dim]``.
        """
        if layer_idx == 0:
            self._start_forward(key_states)
        step = self._step
        layer = self.layers[layer_idx]
        if step is None or layer.seen_tokens != step["past"]:
            raise RuntimeError(f"QuestCache layer {layer_idx} updated out of order (layer 0 must start every forward)")
        mask = step["mask"]
        rows = step["rows"]
        keys = key_states.transpose(1, 2).flatten(0, 1).index_select(0, rows)  # [stored tokens, num_kv_heads, head_dim]
        values = value_states.transpose(1, 2).flatten(0, 1).index_select(0, rows)
        self.paged.write(layer_idx, step["slots"], keys, values)
        layer.seen_tokens += mask.shape[1]
        if step["past"] == 0 or step["decode"]:
            return key_states, value_states
        return self._dense_kv(layer_idx)

    def attend(self, layer_idx: int, query: torch.Tensor, scaling: Optional[float]) -> torch.Tensor:
        """Decode attention of one layer through :func:`quest_decode`.

        Args:
            query: ``[batch, num_q_heads, head_dim]``, post-RoPE.

        Returns:
            ``[batch, num_q_heads, head_dim]``.
        """
        config = self.config
        if not config.is_sparse_layer(layer_idx):
            config = dataclasses.replace(config, token_budget=None)
        return quest_decode(query, *self.decode_view(layer_idx), config, scaling)

    def decode_view(self, layer_idx: int) -> tuple[LayerPages, torch.Tensor, torch.Tensor]:
        """What the current forward's attention reads for one layer: the layer's pages and bounds,
        the page table ``[batch, max_pages]`` int32 and the lengths ``[batch]`` int32 (new tokens included)."""
        if self._step is None:
            raise RuntimeError("QuestCache.decode_view is only defined inside a forward")
        return self.paged.layer(layer_idx), self._step["page_table"], self._step["seq_lens"]

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
        lengths = [pool.seq_len(seq) for seq in self.seq_ids]
        need = sum(-(-(n + c) // self.page_size) - -(-n // self.page_size) for n, c in zip(lengths, counts))
        if need <= pool.num_free_pages:
            return
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
        if self._step["stored_slots"] is None:
            self._step["stored_slots"] = self._stored_slots(self.paged)
        slots = self._step["stored_slots"]
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
        ``([batch, new_positions, num_q_heads, head_dim], None)``. Decode steps run Quest over the
        paged cache; everything else is transformers' SDPA attention.
    """
    if questkv_cache is not None and questkv_cache.is_decode_step:
        out = questkv_cache.attend(module.layer_idx, query[:, :, 0], scaling)
        return out.unsqueeze(1), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


AttentionInterface.register(ATTN_IMPLEMENTATION, questkv_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


@dataclasses.dataclass
class _QuestState:
    config: QuestConfig
    original_attn_implementation: str
    hook: torch.utils.hooks.RemovableHandle
    positional: tuple[str, ...]  # forward's positional parameter names
    cache_argument: str


def cache_argument(model: nn.Module) -> str:
    """Name of the forward argument that takes the cache: ``"cache"`` (transformers >= 5.2x) or ``"past_key_values"``."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def is_enabled(model: nn.Module) -> bool:
    return isinstance(getattr(model, "_questkv", None), _QuestState)


def _check_model(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES or not hasattr(model, "generate"):
        raise ValueError(
            f"questkv.enable supports causal LMs of model_type {', '.join(SUPPORTED_MODEL_TYPES)}; "
            f"got {type(model).__name__} (model_type={model_type!r})"
        )
    layer_types = getattr(config, "layer_types", None) or []
    sliding = getattr(config, "sliding_window", None) if model_type == "mistral" else None
    if any(kind != "full_attention" for kind in layer_types) or sliding is not None:
        raise ValueError(
            f"questkv.enable does not support sliding-window attention (model_type={model_type!r}, "
            f"sliding_window={getattr(config, 'sliding_window', None)!r}, layer_types={sorted(set(layer_types))}); "
            "disable it in the model config (sliding_window=None / use_sliding_window=False) if your contexts fit"
        )


def _check_config(model: nn.Module, config: QuestConfig) -> None:
    if not isinstance(config, QuestConfig):
        raise ValueError(f"config must be a questkv.QuestConfig, got {type(config).__name__}")
    num_layers = model.config.num_hidden_layers
    if not config.is_dense and config.dense_layers >= num_layers:
        raise ValueError(
            f"QuestConfig.dense_layers={config.dense_layers} leaves no sparse layer in a model of {num_layers} layers; "
            f"allowed: dense_layers < {num_layers}, or token_budget=None for dense decoding"
        )


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
        cache = QuestCache(model.config, state.config.page_size)
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
    cache.begin_forward(new_mask, state.config)
    kwargs[state.cache_argument] = cache
    kwargs[_CACHE_KWARG] = cache
    return (), kwargs


def enable(model: nn.Module, config: QuestConfig) -> nn.Module:
    """Run the model's decode steps through Quest (in place); calling it again swaps the config.

    Args:
        model: a transformers causal LM of a supported family (Llama, Mistral, Qwen2, Qwen3).
        config: the Quest settings; ``token_budget=None`` decodes densely from the paged cache.

    Returns:
        ``model``. Raises ``ValueError`` for an unsupported model or an invalid config.
    """
    _check_model(model)
    _check_config(model, config)
    if is_enabled(model):
        model._questkv.config = config
        return model
    original = model.config._attn_implementation
    positional = tuple(
        name
        for name, parameter in inspect.signature(model.forward).parameters.items()
        if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)
    )
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    hook = model.register_forward_pre_hook(_pre_forward, with_kwargs=True)
    model._questkv = _QuestState(config, original, hook, positional, cache_argument(model))
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
