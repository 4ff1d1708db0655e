"""Every layer's decode attention under one Quest setting, and the tokens it attends.

A :class:`LayerDecoder` is built once per setting (a :class:`~questkv.config.QuestConfig`, and
optionally a :class:`~questkv.policies.DecodePolicy` for the sparse layers) and decides then, once,
the route of every layer's decode steps:

* ``"dense"``: dense paged attention, :meth:`QuestDecodeStep.dense` (layers below
  ``config.dense_layers``, and every layer of a dense config without a policy);
* ``"sparse"``: Quest page selection, :meth:`QuestDecodeStep.sparse`;
* ``"policy"``: the policy's :meth:`~questkv.policies.DecodePolicy.decode` (the torch reference ops:
  the evaluation path of the baselines).

It keeps one :class:`QuestDecodeStep` per decode shape it sees (``batch``, ``max_pages``, heads,
dtype, device), shared by all layers, so repeated steps of a fixed shape reuse their buffers, and it
does the budget accounting: ``mean_tokens_attended`` is the mean, over (sequence, selection head,
sparse layer, decode step), of the tokens a sparse layer's decode step attends, the current token
included (Quest charges every selected page in full; policies report their own charge).

What one batch of sequences accumulates across steps (the policies' per-layer state, the token
tallies) lives in a :class:`DecodeState` the caller owns, one per batch (per
:class:`~questkv.integrations.hf.QuestCache`), so one decoder serves many caches. The HF drop-in's
router (the engine routes in ``layers/attention.py``); no transformers here: the transformers protocol
stays in :mod:`questkv.integrations.hf`.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Literal, Optional

import torch

from questkv.config import QuestConfig
from questkv.decode.step import QuestDecodeStep, sparse_tokens_attended
from questkv.ops.pages import LayerPages
from questkv.policies.base import DecodePolicy
from questkv.validation import check_int

Route = Literal["dense", "sparse", "policy"]
ROUTES: tuple[str, ...] = ("dense", "sparse", "policy")

# (batch, max_pages, num_q_heads, num_kv_heads, head_dim, dtype, device): one QuestDecodeStep each.
_StepKey = tuple[int, int, int, int, int, torch.dtype, torch.device]


@dataclasses.dataclass
class DecodeState:
    """What decoding one batch of sequences accumulates over its decode steps.

    Attributes:
        policy_states: policy layer -> the state :meth:`DecodePolicy.init_state` returned for it
            (``None`` for a stateless policy), created at the layer's first decode step.
        policy_key: ``repr`` of the policy that created ``policy_states``.
        tokens_attended_sum: ``[batch]`` float64 (a 0-dim zero before the first charge): tokens
            attended per sequence, summed over (sparse layer, decode step), each the mean over the
            selection heads.
        sparse_steps: (sparse layer, decode step) pairs in ``tokens_attended_sum``.
    """

    policy_states: dict[int, Any] = dataclasses.field(default_factory=dict)
    policy_key: Optional[str] = None
    tokens_attended_sum: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    sparse_steps: int = 0

    @property
    def holds_policy_state(self) -> bool:
        """True once a stateful policy (an eviction policy) has state: it cannot be dropped."""
        return any(state is not None for state in self.policy_states.values())

    def charge(self, tokens_attended: torch.Tensor, layers: int = 1) -> None:
        """Add ``layers`` sparse layer-steps that attended ``tokens_attended`` ``[batch]`` tokens each."""
        device = tokens_attended.device
        self.tokens_attended_sum = self.tokens_attended_sum.to(device) + tokens_attended.double() * layers
        self.sparse_steps += layers

    @property
    def mean_tokens_attended_per_sequence(self) -> Optional[torch.Tensor]:
        """``[batch]`` float64 :attr:`mean_tokens_attended` of every sequence (``None`` before any
        sparse decode step)."""
        return self.tokens_attended_sum / self.sparse_steps if self.sparse_steps else None

    @property
    def mean_tokens_attended(self) -> Optional[float]:
        """Mean tokens attended per (sequence, selection head, sparse layer, decode step) (``None``
        before any sparse decode step). Reading it synchronises the device."""
        per_sequence = self.mean_tokens_attended_per_sequence
        return None if per_sequence is None else float(per_sequence.mean())


class LayerDecoder:
    """Routes each layer's decode attention (decided at construction) and accounts its tokens.

    Args:
        config: the Quest config: ``dense_layers``, and the selection of the ``"sparse"`` layers
            (``token_budget=None``: every layer dense). With a ``policy``, ``token_budget`` must be
            ``None`` (the policy has its own budget) and ``page_size`` the policy's.
        num_layers: layers of the model.
        policy: run layers ``>= config.dense_layers`` through this policy instead of Quest.
        max_cached_steps: decode shapes whose :class:`QuestDecodeStep` is kept (least recently used
            dropped first): a fixed page-table width (the engine's) needs one per batch size; a
            page table that grows with the sequences (the HF drop-in's) makes a new one every
            ``page_size`` decode steps.

    Attributes:
        routes: ``num_layers`` routes, one of :data:`ROUTES` per layer.
    """

    def __init__(
        self,
        config: QuestConfig,
        num_layers: int,
        policy: Optional[DecodePolicy] = None,
        max_cached_steps: int = 8,
    ) -> None:
        if not isinstance(config, QuestConfig):
            raise ValueError(f"LayerDecoder.config must be a questkv.QuestConfig, got {type(config).__name__}")
        check_int("LayerDecoder.num_layers", num_layers, minimum=1)
        check_int("LayerDecoder.max_cached_steps", max_cached_steps, minimum=1)
        if policy is not None:
            if not isinstance(policy, DecodePolicy):
                raise ValueError(f"LayerDecoder.policy must be a questkv.policies.DecodePolicy, got {type(policy).__name__}")
            if not config.is_dense:
                raise ValueError(
                    f"LayerDecoder.config.token_budget must be None with a policy (the policy's budget applies), "
                    f"got {config.token_budget}"
                )
            if policy.page_size != config.page_size:
                raise ValueError(
                    f"LayerDecoder.policy.page_size={policy.page_size} differs from QuestConfig.page_size={config.page_size}"
                )
        self.config = config
        self.policy = policy
        self.policy_key = None if policy is None else repr(policy)
        self.num_layers = num_layers
        sparse_route: Route = "policy" if policy is not None else "sparse"
        sparse = policy is not None or not config.is_dense
        self.routes: tuple[Route, ...] = tuple(
            sparse_route if sparse and layer >= config.dense_layers else "dense" for layer in range(num_layers)
        )
        self._quest_layers = self.routes.count("sparse")
        # Plain functions, not bound methods: no decoder -> method -> decoder cycle keeps the buffers alive.
        run = {"dense": LayerDecoder._dense, "sparse": LayerDecoder._sparse, "policy": LayerDecoder._policy}
        self._run = tuple(run[route] for route in self.routes)
        self.max_cached_steps = max_cached_steps
        self._steps: collections.OrderedDict[_StepKey, QuestDecodeStep] = collections.OrderedDict()
        # The routes of the forward being decoded, on its device: copied once per forward, read by every Quest layer.
        self._dense_mask: tuple[tuple[tuple[bool, ...], torch.device], Optional[torch.Tensor]] = (((), None), None)

    @property
    def uses_prefill_attention(self) -> bool:
        """Whether the policy seeds its state with the prefill's attention (``prefill_scores``)."""
        return self.policy is not None and self.policy.uses_prefill_attention

    def __deepcopy__(self, memo: dict) -> "LayerDecoder":
        # Shared, not copied (a cache snapshot keeps its decoder): it holds no per-sequence state,
        # only the routes and scratch buffers that every call overwrites.
        return self

    def __repr__(self) -> str:
        what = self.policy_key if self.policy is not None else repr(self.config)
        return f"LayerDecoder({what}, routes={list(self.routes)})"

    # -- the step objects ------------------------------------------------------------------------

    def step(
        self,
        batch: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_pages: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> QuestDecodeStep:
        """The :class:`QuestDecodeStep` of one decode shape, built on first use and then reused."""
        device = torch.device(device)
        key = (batch, max_pages, num_q_heads, num_kv_heads, head_dim, dtype, device)
        step = self._steps.get(key)
        if step is None:
            step = QuestDecodeStep(self.config, batch, num_q_heads, num_kv_heads, head_dim, max_pages, dtype, device)
            self._steps[key] = step
            while len(self._steps) > self.max_cached_steps:
                self._steps.popitem(last=False)
        else:
            self._steps.move_to_end(key)
        return step

    def _step_for(self, q: torch.Tensor, layer: LayerPages, page_table: torch.Tensor) -> QuestDecodeStep:
        batch, num_q_heads, head_dim = q.shape
        return self.step(batch, num_q_heads, layer.k_pages.shape[2], head_dim, page_table.shape[1], q.dtype, q.device)

    # -- one layer's decode attention ------------------------------------------------------------

    def decode(
        self,
        layer_idx: int,
        q: torch.Tensor,
        layer: LayerPages,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        sm_scale: Optional[float] = None,
        budgets: Optional[torch.Tensor] = None,
        state: Optional[DecodeState] = None,
        prefill_scores: Optional[Callable[[int], Optional[torch.Tensor]]] = None,
        dense_rows: Optional[list[bool]] = None,
    ) -> torch.Tensor:
        """Decode attention of layer ``layer_idx`` along its route.

        Args:
            q: ``[batch, num_q_heads, head_dim]``, post-RoPE, one query per sequence.
            layer: the layer's pages and bounds (:meth:`PagedKVCache.layer`).
            page_table: ``[batch, max_pages]`` int32; seq_lens: ``[batch]`` int32, the current
                token included (its K/V already written).
            sm_scale: softmax scale, default ``1 / sqrt(head_dim)``.
            budgets: ``[batch]`` int32 per-sequence token budgets of the ``"sparse"`` layers (see
                :meth:`QuestDecodeStep.sparse`; ``None``: ``config.token_budget``).
            state: where the step's tokens attended are charged, and the policy layers' state
                (required on ``"policy"`` layers; ``None`` elsewhere: no accounting).
            prefill_scores: for a policy that ``uses_prefill_attention``, called once per policy
                layer when its state is created: ``layer_idx`` -> ``[batch, num_kv_heads, >= prefill
                tokens]`` float32 attention every stored token received in the prefill (each
                sequence's tokens in order), or ``None``.
            dense_rows: per sequence, whether its step decodes densely on ``"sparse"`` layers too
                (:func:`~questkv.decode.route.decodes_densely` of its length and ``config.token_budget``: the
                engine's route); ``None``: none does.

        Returns:
            ``[batch, num_q_heads, head_dim]`` in ``q``'s dtype; on ``"dense"`` and ``"sparse"``
            layers the step's ``out`` buffer, which the next call of that shape overwrites.
        """
        if not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"LayerDecoder.decode: layer_idx must be in [0, {self.num_layers}), got {layer_idx}")
        return self._run[layer_idx](self, layer_idx, q, layer, page_table, seq_lens, sm_scale, budgets, state,
                                    prefill_scores, dense_rows)

    def _dense(self, layer_idx, q, layer, page_table, seq_lens, sm_scale, budgets, state, prefill_scores, dense_rows):
        return self._step_for(q, layer, page_table).dense(q, layer, page_table, seq_lens, sm_scale)

    def _sparse(self, layer_idx, q, layer, page_table, seq_lens, sm_scale, budgets, state, prefill_scores,
                dense_rows):
        step = self._step_for(q, layer, page_table)
        dense = None if dense_rows is None or not any(dense_rows) else self._dense_rows_mask(dense_rows, q.device)
        if state is not None and layer_idx == self.config.dense_layers:
            # Every Quest layer attends the same page count: charge them all once per decode step.
            tokens = self.tokens_attended(seq_lens, budgets)
            if dense is not None:  # a row routed dense reads its whole pages, as Quest's accounting charges them
                page = self.config.page_size
                tokens = torch.where(dense, ((seq_lens.long() + page - 1) // page * page).double(), tokens)
            state.charge(tokens, self._quest_layers)
        if dense is None:
            return step.sparse(q, layer, page_table, seq_lens, sm_scale, budgets)
        if all(dense_rows):
            return step.dense(q, layer, page_table, seq_lens, sm_scale)
        sparse = step.sparse(q, layer, page_table, seq_lens, sm_scale, budgets).clone()  # the step's buffer, reused
        return torch.where(dense[:, None, None], step.dense(q, layer, page_table, seq_lens, sm_scale), sparse)

    def _dense_rows_mask(self, dense_rows: list[bool], device: torch.device) -> torch.Tensor:
        """``[batch]`` bool on ``device``: ``dense_rows`` as a tensor, made once for the layers of one forward."""
        key = (tuple(dense_rows), device)
        if self._dense_mask[0] != key:
            self._dense_mask = (key, torch.tensor(dense_rows, device=device))
        return self._dense_mask[1]

    def _policy(self, layer_idx, q, layer, page_table, seq_lens, sm_scale, budgets, state, prefill_scores,
                dense_rows):
        if state is None:
            raise ValueError(f"LayerDecoder.decode of policy layer {layer_idx} needs a DecodeState (the policy's state)")
        if budgets is not None:
            raise ValueError(f"LayerDecoder.decode: per-sequence budgets are for Quest layers, not policy {self.policy_key}")
        policy = self.policy
        if layer_idx not in state.policy_states:
            kwargs = {}
            scores = prefill_scores(layer_idx) if self.uses_prefill_attention and prefill_scores is not None else None
            if scores is not None:
                kwargs["prefill_scores"] = scores
            state.policy_states[layer_idx] = policy.init_state(seq_lens - 1, layer.k_pages.shape[2], **kwargs)
            state.policy_key = self.policy_key
        result = policy.decode(q, layer, page_table, seq_lens, state.policy_states[layer_idx], sm_scale)
        state.charge(result.tokens_attended.double().mean(dim=1))
        return result.out

    # -- accounting ------------------------------------------------------------------------------

    def tokens_attended(self, seq_lens: torch.Tensor, budgets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Tokens one ``"sparse"`` layer's decode step attends per sequence (every selection head
        the same): its pages up to the budget, each counted in full.

        Args:
            seq_lens: ``[batch]`` int32, the current token included.
            budgets: ``[batch]`` int32 token budgets, or ``None`` for ``config.token_budget``.

        Returns:
            ``[batch]`` float64 on ``seq_lens``' device.
        """
        config = self.config
        if config.is_dense:
            raise ValueError("LayerDecoder.tokens_attended needs a sparse QuestConfig (token_budget set)")
        if budgets is None:
            budgets = torch.full_like(seq_lens, config.token_budget)
        return sparse_tokens_attended(seq_lens, budgets, config.page_size)

    # -- continuity of a batch's state -----------------------------------------------------------

    def prepare(self, state: DecodeState, new_positions: int) -> None:
        """Before a forward of ``new_positions`` positions per sequence under this decoder: check
        that ``state`` may continue here, and drop stateless policy states of another setting.

        Raises:
            ValueError: ``state`` holds a stateful policy's state (dropped tokens) and this decoder
                has another setting, or the forward has more than one new position (dense
                attention over the whole cache would bring the dropped tokens back).
        """
        if state.holds_policy_state:
            if self.policy_key != state.policy_key:
                under = self.policy_key if self.policy is not None else repr(self.config)
                raise ValueError(
                    f"this cache holds the decode state of {state.policy_key}; it cannot continue under {under} "
                    "(snapshot the cache with copy.deepcopy before the first decode step instead)"
                )
            if new_positions != 1:
                raise ValueError(
                    f"{state.policy_key} has dropped tokens for good; a forward over {new_positions} new positions "
                    "(dense attention over the whole cache) would bring them back. Decode one token at a time"
                )
        elif self.policy_key != state.policy_key:
            state.policy_states = {}  # stateless policies: the next one starts afresh
