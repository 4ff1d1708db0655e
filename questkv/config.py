"""User-facing configuration of Quest sparse decoding: the one source of Quest's knobs.

Every field of :class:`QuestConfig` carries its allowed values (``minimum`` of an int, ``interval``
``(low, high)`` of a float, both ends included, ``choices`` of a string; ``none``: the command-line word for
``None``, where ``None`` is allowed) and its
command-line metadata (``help``, ``flag``; ``page_policy``: an option of the page policies), so the CLI
flags (:mod:`questkv.cli_args`), the page policies' options (:mod:`questkv.policies.page_selection`) and the
evaluation settings (:mod:`questkv.eval`) take their names, defaults and choices from here.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional, get_args

from questkv.validation import check_bool, check_choice, check_float, check_int, check_optional_int

Selection = Literal["kv_head", "q_head"]
GroupReduction = Literal["sum", "max"]
Backend = Literal["auto", "torch", "triton"]
Rerank = Literal["max", "mass"]

SELECTIONS: tuple[str, ...] = get_args(Selection)
GROUP_REDUCTIONS: tuple[str, ...] = get_args(GroupReduction)
BACKENDS: tuple[str, ...] = get_args(Backend)
RERANKS: tuple[str, ...] = get_args(Rerank)
"""How the evaluation's ``quest-rerank`` page policy scores a page from its keys (``QuestRerankPolicy``'s ``rerank``):
its best logit or its attention mass."""


def _knob(default, help: str, flag: str, minimum: Optional[int] = None, choices: tuple[str, ...] = (),
          none: Optional[str] = None, page_policy: bool = False, interval: Optional[tuple[float, float]] = None):
    """A :class:`QuestConfig` field with its checks and command-line metadata (see the module docstring)."""
    metadata = {"help": help, "flag": flag, "minimum": minimum, "choices": choices, "none": none,
                "page_policy": page_policy, "interval": interval}
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class QuestConfig:
    """How Quest picks the pages that a decode step attends.

    Attributes:
        token_budget: tokens attended per decode step and (sequence, head), counting every
            attended page in full, the current (last, possibly partial) page included. Must be a
            multiple of ``page_size``. ``None`` means dense attention everywhere.
        page_size: tokens per KV-cache page; a power of two.
        dense_layers: layers with index below this stay dense (the paper keeps 2).
        selection: ``"kv_head"`` — one page set per KV head, shared by its query group (the
            group's page scores are combined with ``group_reduction``); ``"q_head"`` — every query
            head selects its own pages (the paper's setting).
        group_reduction: how ``kv_head`` selection combines the query heads' page scores:
            ``"sum"`` or ``"max"``.
        sink_pages: the first pages of every sequence, always attended.
        recent_pages: the most recent full pages before the current one, always attended.
            The current page is always attended in addition.
        backend: ``"auto"`` (Triton kernels for CUDA tensors, the torch reference otherwise),
            ``"torch"`` or ``"triton"``.
        dense_context_ratio: a decode step attends densely while its sequence's context is at most this many
            token budgets (``1``: only while the budget covers the context, where Quest selects every page):
            the route's cost model, :mod:`questkv.decode.route`.
        selection_interval: decode steps per page selection of a sequence (LServe's reuse): a sequence
            estimates and selects on its first decode step and every ``selection_interval``-th one after
            it, and in between attends the pages it selected last plus every page begun since (at most
            :attr:`reuse_extra_pages` more). ``1`` selects every step (the paper). Engine only
            (:class:`questkv.LLM`); a request may lower it.
    """

    token_budget: Optional[int] = _knob(
        None, "tokens attended per decode step, a multiple of the page size; 'full' is dense attention",
        "--budget", minimum=1, none="full",
    )
    page_size: int = _knob(16, "tokens per KV-cache page, a power of two", "--page-size", minimum=1)
    dense_layers: int = _knob(2, "layers below this index decode densely", "--dense-layers", minimum=0)
    selection: Selection = _knob(
        "kv_head", "page selection: one page set per KV head (kv_head) or per query head (q_head)", "--selection",
        choices=SELECTIONS, page_policy=True,
    )
    group_reduction: GroupReduction = _knob(
        "sum", "how kv_head selection combines its query heads' page scores", "--group-reduction",
        choices=GROUP_REDUCTIONS, page_policy=True,
    )
    sink_pages: int = _knob(0, "pages from the start always attended (counted in the budget)", "--sink-pages",
                            minimum=0, page_policy=True)
    recent_pages: int = _knob(
        0, "full pages before the current one always attended (counted in the budget; the current page always is)",
        "--recent-pages", minimum=0, page_policy=True,
    )
    backend: Backend = _knob(
        "auto", "kernels: Triton for CUDA tensors and the torch reference otherwise (auto), or one of them",
        "--backend", choices=BACKENDS,
    )
    dense_context_ratio: float = _knob(
        4.0, "decode steps stay dense while the context holds at most this many token budgets (Quest's estimate and "
        "select cost more than they save there, measured; 1: only while the budget covers the context)",
        "--dense-context-ratio", interval=(1.0, 1e9),
    )
    selection_interval: int = _knob(
        1, "decode steps per page selection of a sequence; in between it attends its last selection plus the pages "
        "begun since (1: select every step, the paper)", "--selection-interval", minimum=1,
    )

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):  # each field's own values, from its metadata
            name, value, meta = f"QuestConfig.{field.name}", getattr(self, field.name), field.metadata
            if meta["choices"]:
                check_choice(name, value, meta["choices"])
            elif value is None and meta["none"] is not None:
                continue
            elif meta["interval"] is not None:
                check_float(name, value, *meta["interval"])
            else:
                check_int(name, value, minimum=meta["minimum"])
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"QuestConfig.page_size must be a power of two, got {self.page_size}")
        if self.token_budget is None:
            return
        if self.token_budget % self.page_size:
            raise ValueError(
                f"QuestConfig.token_budget must be a multiple of page_size={self.page_size}, "
                f"got {self.token_budget}"
            )
        kept = self.forced_pages + 1
        if self.budget_pages < kept:
            raise ValueError(
                f"QuestConfig.token_budget={self.token_budget} holds {self.budget_pages} pages of "
                f"{self.page_size} tokens, fewer than the {kept} always-kept pages "
                f"(sink_pages={self.sink_pages} + recent_pages={self.recent_pages} + the current page); "
                f"allowed: token_budget >= {kept * self.page_size}"
            )

    @property
    def is_dense(self) -> bool:
        """True when no sparsity applies (``token_budget is None``)."""
        return self.token_budget is None

    @property
    def budget_pages(self) -> int:
        """Pages attended per decode step: ``token_budget // page_size``."""
        if self.token_budget is None:
            raise ValueError("QuestConfig.budget_pages is undefined for a dense config (token_budget=None)")
        return self.token_budget // self.page_size

    @property
    def reuse_extra_pages(self) -> int:
        """Pages a reused selection may attend beyond the budget: those begun in the
        ``selection_interval - 1`` steps since it was made, ``ceil((selection_interval - 1) / page_size)``."""
        return -(-(self.selection_interval - 1) // self.page_size)

    @property
    def forced_pages(self) -> int:
        """Sink plus recent pages (the current page not counted)."""
        return self.sink_pages + self.recent_pages

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """Whether decode steps of layer ``layer_idx`` use Quest selection."""
        return self.token_budget is not None and layer_idx >= self.dense_layers

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


PAGE_POLICY_OPTIONS: tuple[str, ...] = tuple(
    field.name for field in dataclasses.fields(QuestConfig) if field.metadata["page_policy"]
)
"""The fields that shape a page selection besides the budget and page size: the options of every
page policy (``quest``, ``oracle``, ``quest-topp``) and of an evaluation's page policies."""


MAX_SPECULATIVE_TOKENS = 16
"""The most draft tokens of one lossless round (the verify step scores at most 17 positions per sequence)."""

SPECULATIVE_METHODS = ("quest",)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Lossless Quest decoding, vLLM's ``speculative_config``: the model drafts with Quest's sparse attention and
    verifies with dense attention, so its output is dense attention's.

    Each round, a sequence decodes up to ``num_speculative_tokens`` draft tokens with its Quest budget (cheap: a
    fraction of the KV bytes), then one dense forward scores them all; it keeps the longest prefix on which the
    draft equals dense attention's choice, plus dense attention's own next token. With temperature > 0 the draft and
    the verify draw each position with the same seeded noise (a Gumbel coupling), so the choice compared is the
    dense step's own draw: the output is the dense engine's sample, token for token, not only in distribution. The
    draft's K/V are overwritten by the verify's and the rejected ones dropped.

    Attributes:
        method: ``"quest"``, the only drafter: the model itself with Quest's sparse attention.
        num_speculative_tokens: the most draft tokens per round, in ``[1, 16]``; a request may ask for fewer (or
            0: lossy Quest) through ``SamplingParams.speculative_tokens``.
        adaptive: the engine picks the drafts of each round, from 0 (dense steps) to ``num_speculative_tokens``, by
            the step times and acceptance it measures (:mod:`questkv.engine.speculation`), so that lossless is never
            much slower than dense; ``False``: every round drafts ``num_speculative_tokens`` (tests, sweeps).

    A round's drafts all attend one selection, its first draft's Quest estimate and top-K. (Pages chosen by the
    verify step's attention mass, as Vegas and SparseSpec do, kept more drafts at 2k on Qwen2.5-Coder-1.5B but made
    the verify step 1.36-1.58x slower on an H200, which cost more than the gain bought: removed, git keeps it;
    ``docs/results.md``, "Lossless draft pages".)
    """

    method: str = "quest"
    num_speculative_tokens: int = 4
    adaptive: bool = True

    def __post_init__(self) -> None:
        check_choice("SpeculativeConfig.method", self.method, SPECULATIVE_METHODS)
        check_int("SpeculativeConfig.num_speculative_tokens", self.num_speculative_tokens, minimum=1,
                  maximum=MAX_SPECULATIVE_TOKENS)
        check_bool("SpeculativeConfig.adaptive", self.adaptive)

    @classmethod
    def from_value(cls, value: object, owner: str = "speculative_config") -> Optional["SpeculativeConfig"]:
        """``value`` as a config: ``None``, a :class:`SpeculativeConfig`, or a dict of its fields (vLLM's form,
        ``{"method": "quest", "num_speculative_tokens": 4}``); ``ValueError`` naming an unknown key."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{owner} must be a dict like {{'method': 'quest', 'num_speculative_tokens': 4}} or "
                             f"None, got {type(value).__name__}")
        names = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"{owner} has unknown keys {unknown}; allowed: {sorted(names)}")
        return cls(**value)


def check_request_fields(owner: str, token_budget: object, selection_interval: object, dense: object,
                         speculative_tokens: object = None) -> None:
    """``ValueError`` unless a request's own Quest fields are well formed, whatever its engine: ``token_budget``
    and ``selection_interval`` ``None`` or an int >= 1, ``speculative_tokens`` ``None`` or an int in ``[0, 16]``,
    ``dense`` a bool that excludes the others. ``owner`` names them in the message (``"SamplingParams"``;
    ``"quest"``, the server's request object)."""
    check_optional_int(f"{owner}.token_budget", token_budget, minimum=1)
    check_optional_int(f"{owner}.selection_interval", selection_interval, minimum=1)
    check_optional_int(f"{owner}.speculative_tokens", speculative_tokens, minimum=0, maximum=MAX_SPECULATIVE_TOKENS)
    check_bool(f"{owner}.dense", dense)
    for name, value in (("token_budget", token_budget), ("selection_interval", selection_interval),
                        ("speculative_tokens", speculative_tokens)):
        if dense and value is not None:
            raise ValueError(f"{owner}.dense=True attends every page; it excludes {name}={value}")


@dataclasses.dataclass(frozen=True)
class RequestQuest:
    """One request's Quest settings, resolved against its engine's :class:`QuestConfig` once, at admission
    (:meth:`resolve`): what the runner, the attention accounting and the server's echo read.

    Attributes:
        token_budget: tokens the request's sparse layers attend per decode step (a multiple of the page size
            within the engine's budget); ``None``: the request decodes densely (it asked to, or the engine is
            dense).
        selection_interval: decode steps per page selection (``1`` when dense).
        speculative_tokens: draft tokens per lossless round (:class:`SpeculativeConfig`); 0: the request's Quest
            steps are its output (lossy), or it is dense.
    """

    token_budget: Optional[int] = None
    selection_interval: int = 1
    speculative_tokens: int = 0

    @property
    def dense(self) -> bool:
        """Whether the request attends every page on every layer."""
        return self.token_budget is None

    @classmethod
    def resolve(cls, engine: Optional[QuestConfig], token_budget: Optional[int] = None,
                selection_interval: Optional[int] = None, dense: bool = False,
                owner: str = "SamplingParams", speculative_tokens: Optional[int] = None,
                speculative: Optional[SpeculativeConfig] = None) -> "RequestQuest":
        """The settings a request asking for ``token_budget`` / ``selection_interval`` / ``dense`` /
        ``speculative_tokens`` (``None``: the engine's) gets on an engine configured with ``engine`` (``None`` or
        dense: no Quest) and ``speculative`` (``None``: no lossless mode).

        Raises:
            ValueError: naming ``owner.field``, the value and what is allowed: a malformed field
                (:func:`check_request_fields`), a budget or interval on an engine without Quest, a budget that
                is not a multiple of the page size within ``[page_size * (forced pages + 1), engine budget]``, an
                interval above the engine's (whose extra page columns bound how long a selection is reused),
                draft tokens on an engine without a speculative config.
        """
        check_request_fields(owner, token_budget, selection_interval, dense, speculative_tokens)
        if speculative is None and speculative_tokens:
            raise ValueError(f"{owner}.speculative_tokens={speculative_tokens} needs an engine with lossless Quest "
                             "(speculative_config={'method': 'quest', 'num_speculative_tokens': k})")
        if engine is None or engine.is_dense:
            for name, value in (("token_budget", token_budget), ("selection_interval", selection_interval)):
                if value is not None:
                    raise ValueError(f"{owner}.{name}={value} needs an engine with Quest "
                                     "(quest=QuestConfig(token_budget=...))")
            return cls()
        if dense:
            return cls()
        budget = engine.token_budget if token_budget is None else token_budget
        lowest = engine.page_size * (engine.forced_pages + 1)
        if budget % engine.page_size or not lowest <= budget <= engine.token_budget:
            raise ValueError(
                f"{owner}.token_budget must be a multiple of page_size={engine.page_size} in "
                f"[{lowest}, {engine.token_budget}] (the engine's budget), got {budget}"
            )
        interval = engine.selection_interval if selection_interval is None else selection_interval
        if interval > engine.selection_interval:
            raise ValueError(
                f"{owner}.selection_interval must be in [1, {engine.selection_interval}] (the engine's "
                f"QuestConfig.selection_interval, which sizes the reused selections), got {interval}"
            )
        drafts = 0 if speculative is None else speculative.num_speculative_tokens
        return cls(budget, interval, drafts if speculative_tokens is None else speculative_tokens)
