"""The decode step's CUDA graphs and their key policy: which batch sizes and page-table widths get a graph, and
capture, replay and release of the graphs.

A graph is keyed by ``(batch, width, route, selecting)``: the padded batch size, the page-table columns the
step scans (a power of two, so that estimate and select scan at most twice the pages of the longest sequence),
the step's :class:`~questkv.decode.route.StepRoute` (every row dense, every row Quest, or both kinds: its step may
select every column), and whether any row may select
(with selection reuse a step where every row reuses its last selection is a graph of its own, without the
estimate and select launches; a dense step of an engine with a selection memory: whether it keeps the memory's
books, which only a lossy Quest row needs). A lossless verify step (route ``VERIFY``) has its positions per row
in place of ``selecting``. The step's body and its static inputs are the runner's
(:class:`~questkv.engine.model_runner.ModelRunner`); this module only knows the keys.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Callable, Optional

import torch

from questkv.decode.route import StepRoute

__all__ = ["DecodeGraphs", "GraphKey", "graph_batch_sizes", "graph_widths", "table_width"]

logger = logging.getLogger(__name__)

# Batch sizes with a captured decode graph: these, then every multiple of 16 up to max_num_seqs.
_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16)
# Page-table widths with a decode graph: powers of two from this up to max_pages_per_seq.
_MIN_GRAPH_PAGES = 64

GraphKey = tuple[int, int, StepRoute, bool]
Body = Callable[[int, int, StepRoute, bool], torch.Tensor]


def graph_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Decode batch sizes with a captured graph: 1, 2, 4, 8, 16, then multiples of 16, up to ``max_num_seqs``
    (which is always one of them)."""
    sizes = [b for b in _GRAPH_BATCH_SIZES if b < max_num_seqs]
    sizes += list(range(32, max_num_seqs, 16))
    return tuple(sorted(set(sizes + [max_num_seqs])))


def table_width(pages: int, limit: int) -> int:
    """Page-table columns of a captured decode step whose longest sequence holds ``pages`` pages: the next
    power of two, at least ``_MIN_GRAPH_PAGES``, at most ``limit`` (the pages a sequence may hold)."""
    return min(limit, max(_MIN_GRAPH_PAGES, 1 << (pages - 1).bit_length()))


def graph_widths(limit: int) -> list[int]:
    """Every :func:`table_width` of 1 to ``limit`` pages, descending."""
    return sorted({table_width(min(1 << k, limit), limit) for k in range(limit.bit_length() + 1)}, reverse=True)


@functools.lru_cache(maxsize=None)
def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for every capture of the process: cuBLAS keeps a workspace (32 MiB on Hopper)
    per stream it ever ran on, so a new stream per engine would leave one behind each time."""
    return torch.cuda.Stream(device)


class DecodeGraphs:
    """One CUDA graph per key, captured on first use (or all at once by the runner), in one memory pool.

    Args:
        batch_sizes: the batch sizes that get graphs (empty: every step runs eagerly, e.g. on CPU).
        max_pages_per_seq: the widest page table.
        device: the CUDA device.
        warmup_keeps: tensors that the eager warm-up run before a capture must leave as they were: counters a step
            adds to (a graph captured on first use runs its step once more when it replays), and the tokens a step
            reads and then overwrites (the in-flight inputs that its replay reads again).
        reusing_steps: the engine reuses selections (``selection_interval`` > 1): the graphs of steps where no row
            selects are captured at start too.
        sparse: the engine has Quest layers: its Quest steps are captured at start, beside the dense ones.
        dense_pages: with ``sparse``, the widest page table of a step routed dense by its context (the route's
            ratio times the budget): dense steps are captured at start up to its graph width.
        verify_lengths: the positions per row of the lossless verify steps (2 to ``num_speculative_tokens + 1``;
            empty without speculation): captured at start at every batch size and width, and so are the dense
            and mixed steps then.

    ``body(batch, width, route, selecting)``, passed to :meth:`replay` and :meth:`capture`, runs one decode step
    over the runner's static inputs and returns its ``[batch, vocab]`` float32 logits; device ops only (capturable).
    """

    def __init__(self, batch_sizes: tuple[int, ...], max_pages_per_seq: int, device: torch.device,
                 warmup_keeps: tuple[torch.Tensor, ...] = (), reusing_steps: bool = False, sparse: bool = False,
                 dense_pages: int = 0, verify_lengths: tuple[int, ...] = ()) -> None:
        self.batch_sizes = batch_sizes
        self.verify_lengths = verify_lengths
        self.reusing_steps = reusing_steps
        self.sparse = sparse
        self.dense_pages = dense_pages
        self.warmup_keeps = warmup_keeps
        self.max_pages_per_seq = max_pages_per_seq
        self._device = device
        self._graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if batch_sizes else None

    def padded(self, batch: int) -> int:
        """The captured batch size a step of ``batch`` sequences runs at (``batch`` itself past the largest)."""
        return next((size for size in self.batch_sizes if size >= batch), batch)

    def width(self, pages: int) -> int:
        """Page-table columns of a step whose longest sequence holds ``pages`` pages (``pages`` without graphs)."""
        return table_width(pages, self.max_pages_per_seq) if self.batch_sizes else pages

    def covers(self, key: GraphKey) -> bool:
        """Whether the step of ``key`` runs as a graph (its batch size has graphs); otherwise it runs eagerly."""
        return key[0] in self.batch_sizes

    def replay(self, key: GraphKey, body: Body) -> torch.Tensor:
        """Replay the graph of ``key`` (one that :meth:`covers`), capturing it from ``body`` first if new; its
        ``[batch, vocab]`` logits."""
        if key not in self._graphs:
            self.capture_late(key, functools.partial(self.capture, key, body))
        graph, logits = self._graphs[key]
        graph.replay()
        return logits

    def capture_late(self, key: GraphKey, capture: Callable[[], None]) -> None:
        """Run ``capture`` (the capture of ``key``'s graph, with any it brings along) for a step that needs it now,
        and log how long that step waited for it: a key the startup capture does not cover."""
        began = time.perf_counter()
        capture()
        logger.info("a step waited %.0f ms for the capture of its CUDA graph (batch %d, width %d, %s, %s)",
                    1e3 * (time.perf_counter() - began), key[0], key[1], key[2].value, key[3])

    def missing(self) -> list[GraphKey]:
        """The keys a server captures at start, largest first, that have no graph yet: every batch size and width
        of a dense engine's steps; a Quest engine's Quest steps and its dense steps up to the width of
        ``dense_pages`` (no dense request: a mixed step is captured when it first runs), with ``reusing_steps``
        each also without selection (a dense step then keeps no books in the selection memory); and a verify
        step of each of :attr:`verify_lengths` at every width (keyed by its positions per row instead), beside dense
        and mixed steps at every width (a lossless engine's policy may run a step densely at any length, and a row
        that joins while others draft decodes densely at first)."""
        selecting = (True, False) if self.reusing_steps else (True,)
        widths = graph_widths(self.max_pages_per_seq)
        short = self.sparse and not self.verify_lengths  # a lossless engine's policy may step densely at any length
        dense_widths = [w for w in widths if w <= self.width(self.dense_pages)] if short else widths
        keys = []
        for batch in sorted(self.batch_sizes, reverse=True):
            if self.sparse:
                keys += [(batch, width, StepRoute.SPARSE, select) for width in widths for select in selecting]
            keys += [(batch, width, StepRoute.DENSE, select) for width in dense_widths for select in selecting]
            if self.verify_lengths:  # rows joining while others draft (a new row's first steps are dense)
                keys += [(batch, width, StepRoute.MIXED, select) for width in widths for select in selecting]
            keys += [(batch, width, StepRoute.VERIFY, q_len) for width in widths for q_len in self.verify_lengths]
        return [key for key in keys if key not in self._graphs]

    def capture(self, key: GraphKey, body: Body) -> None:
        """Capture the step of ``key``. The current static inputs are only read: warm-up and capture write K/V to
        the slots they name."""
        stream = _capture_stream(self._device)
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            self.warm_up(key, body)
        torch.cuda.current_stream(self._device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = body(*key)
        self._graphs[key] = (graph, logits)

    def warm_up(self, key: GraphKey, body: Body) -> None:
        """Run the step of ``key`` eagerly once, as :meth:`capture` does before it captures (its kernels compile
        outside the capture), and leave :attr:`warmup_keeps` as they were: the replay that follows runs the step
        again, reading them."""
        kept = [tensor.clone() for tensor in self.warmup_keeps]
        body(*key)
        for tensor, value in zip(self.warmup_keeps, kept):
            tensor.copy_(value)

    def latest(self, route: Optional[StepRoute] = None) -> torch.cuda.CUDAGraph:
        """The graph captured last, of ``route`` when given (what a benchmark replays)."""
        graphs = [graph for key, (graph, _) in self._graphs.items() if route is None or key[2] == route]
        if not graphs:
            raise LookupError(f"no CUDA graph of route {route} was captured")
        return graphs[-1]

    def release(self) -> None:
        """Drop every graph and the pool."""
        for graph, _ in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self._pool = None

    def __len__(self) -> int:
        return len(self._graphs)

    def __contains__(self, key: GraphKey) -> bool:
        return key in self._graphs
