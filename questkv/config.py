"""User-facing configuration of Quest sparse decoding."""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

Selection = Literal["kv_head", "q_head"]
GroupReduction = Literal["sum", "max"]
Backend = Literal["auto", "torch", "triton"]

SELECTIONS = ("kv_head", "q_head")
GROUP_REDUCTIONS = ("sum", "max")
BACKENDS = ("auto", "torch", "triton")


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"QuestConfig.{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"QuestConfig.{name} must be >= {minimum}, got {value}")


def _check_choice(name: str, value, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"QuestConfig.{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


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
    """

    token_budget: Optional[int] = None
    page_size: int = 16
    dense_layers: int = 2
    selection: Selection = "kv_head"
    group_reduction: GroupReduction = "sum"
    sink_pages: int = 0
    recent_pages: int = 0
    backend: Backend = "auto"

    def __post_init__(self) -> None:
        _check_int("page_size", self.page_size, 1)
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"QuestConfig.page_size must be a power of two, got {self.page_size}")
        _check_int("dense_layers", self.dense_layers, 0)
        _check_int("sink_pages", self.sink_pages, 0)
        _check_int("recent_pages", self.recent_pages, 0)
        _check_choice("selection", self.selection, SELECTIONS)
        _check_choice("group_reduction", self.group_reduction, GROUP_REDUCTIONS)
        _check_choice("backend", self.backend, BACKENDS)
        if self.token_budget is None:
            return
        _check_int("token_budget", self.token_budget, 1)
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
    def forced_pages(self) -> int:
        """Sink plus recent pages (the current page not counted)."""
        return self.sink_pages + self.recent_pages

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """Whether decode steps of layer ``layer_idx`` use Quest selection."""
        return self.token_budget is not None and layer_idx >= self.dense_layers

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
