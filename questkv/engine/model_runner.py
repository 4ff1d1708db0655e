"""The runner: one scheduled step in tensors — stage the inputs, run the model, sample.

It owns the :class:`~questkv.cache.paged.PagedKVCache` (sized by :func:`~questkv.engine.kv_pool.plan_cache`),
one :class:`~questkv.decode.step.QuestDecodeStep` per decode shape (shared by every layer), the static decode
inputs and, on CUDA, the :class:`~questkv.engine.cuda_graphs.DecodeGraphs` that replay a whole decode step
(K/V append, every layer's attention, the LM head) over them. It never changes a
:class:`~questkv.engine.sequence.Sequence` (the scheduler allocates pages and updates sequences).

With tensor parallelism every rank has a runner over its shard of the model and its KV heads' page pool (the same
page count on every rank: each plans, the smallest wins). Rank 0's turns each step into a :class:`StepMessage`
(the pages its scheduler added since the last message, and the prefill tokens and/or the packed decode inputs:
about 2 KB per decode step at batch 32, pickled in ~15 µs on the host) and sends it to the other ranks before
running it (:class:`~questkv.engine.tp_workers.WorkerPool`); they run it with :meth:`ModelRunner.run_step`, the same
code from the packed inputs on. Rank 0 samples from the gathered logits and broadcasts the tokens, so every rank
holds them for an asynchronous step's inputs.

A step is decode-only (its rows staged into the packed decode inputs and run by :meth:`ModelRunner._decode_body`,
under a CUDA graph on CUDA) or has prefill rows (:meth:`ModelRunner._run_prefill`, eager). With chunked prefill the
latter may also carry decode rows (a mixed step): they are staged into the same packed inputs and padded to a
captured batch size as a decode-only step's, so that their attention is the decode step's, over the same
:class:`~questkv.decode.step.QuestDecodeStep` and selection memory, and the model runs once over the decode tokens
followed by the prefill tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import torch

from questkv.cache.paged import PagedKVCache
from questkv.config import MAX_SPECULATIVE_TOKENS
from questkv.decode.context import DecodeRows, PrefillRows, StepContext
from questkv.decode.selection_memory import ReuseRows, SelectionMemory, is_due
from questkv.decode.route import StepRoute, step_route
from questkv.decode.step import QuestDecodeStep
from questkv.distributed.group import TensorParallel
from questkv.engine.engine_config import EngineConfig
from questkv.engine.cuda_graphs import DecodeGraphs, GraphKey, graph_batch_sizes
from questkv.engine.kv_pool import plan_cache
from questkv.engine.speculation import draft_reuse_steps
from questkv.engine.sequence import Sequence
from questkv.engine.step_data import PrefillInputs, SampledTokens, ScheduledBatch, StepMessage
from questkv.engine.step_tokens import StepTokens
from questkv.layers.attention import bind_cache, prepare_prefill
from questkv.models.fusion import fuse_elementwise
from questkv.models.llama import LlamaForCausalLM, ModelSpec
from questkv.ops.pages import ReusedSelections

# Rows of the packed decode inputs: token ids, positions, sequence lengths, token budgets, page-table rows, the
# row of the previous step's sampled tokens that holds a row's input token (-1: the id is in _IDS), whether
# the row's phase makes it select (selection reuse), whether it decodes densely (its route), and whether it is
# launched ahead of its verify's update (1: its position and length move by the drafts that verify kept).
_IDS, _POS, _LENS, _BUDGETS, _ROWS, _SRC, _DUE, _DENSE, _AHEAD = range(9)
NUM_INPUTS = 9
# A verify step's staged rows per verified row: first position, KV length, page-table row, and the row of the
# previous step's sampled tokens that holds its last input token (-1: that id is staged).
_VERIFY_INPUTS = 4


class ModelRunner:
    """Runs prefill and decode steps of one model over one page pool and samples their tokens.

    Args:
        config: the engine's config.
        model: the model, weights loaded, on ``config.torch_device`` (with tensor parallelism: this rank's shard).
        spec: its shape (the whole model's).
        max_model_len: tokens per sequence the pool must hold.
        tp: this rank's tensor-parallel group (connected), or ``None`` on one device.
        send: rank 0's way to the other ranks (``WorkerPool.send``) with tensor parallelism, else ``None``.
    """

    def __init__(self, config: EngineConfig, model: LlamaForCausalLM, spec: ModelSpec, max_model_len: int,
                 tp: Optional[TensorParallel] = None, send: Optional[Callable[[StepMessage], None]] = None) -> None:
        self.config = config
        self.model = model
        self.spec = spec
        self.device = config.torch_device
        self.tp, self._send = tp, send
        quest = config.quest
        reuse = draft_reuse_steps(config.speculative_config)
        if quest is not None and not quest.is_dense and reuse > quest.selection_interval:
            quest = dataclasses.replace(quest, selection_interval=reuse)  # the buffers and the memory sized for it
        self._quest = quest  # the config of the decode steps' buffers
        max_seqs = config.max_num_seqs + 1
        size = 1 if tp is None else tp.size
        self.num_q_heads, num_kv_heads = spec.num_q_heads // size, spec.num_kv_heads // size  # this rank's
        sel_heads = self.num_q_heads if quest is not None and quest.selection == "q_head" else num_kv_heads
        sparse_layers = 0 if quest is None or quest.is_dense else sum(map(quest.is_sparse_layer, range(spec.num_layers)))
        self._selection_shape = (sparse_layers, sel_heads)  # of a step's selections, per row
        memory_args = (spec.num_layers, sel_heads, max_seqs)
        # Quantized layers keep their packed weights as buffers; the selection memory is sized like them, up front.
        weight_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        memory_bytes = 0 if quest is None else SelectionMemory.nbytes(quest, *memory_args)
        local = dataclasses.replace(spec, num_q_heads=self.num_q_heads, num_kv_heads=num_kv_heads)
        wide = model.plan_fp8_kv(torch.finfo(config.torch_kv_dtype).max) if config.kv_cache_dtype != "auto" else ()
        self.cache_spec = plan_cache(config, local, max_model_len, self.device, weight_bytes, memory_bytes, wide)
        if tp is not None:  # one page table drives every rank: each pool holds as many pages as the smallest
            pages = tp.all_min(self.cache_spec.num_pages, self.device)
            self.cache_spec = dataclasses.replace(self.cache_spec, num_pages=pages)
        self._mirrored: dict[int, int] = {}  # rank 0: pages of each sequence the other ranks' page tables hold
        self.cache = PagedKVCache(
            spec.num_layers, num_kv_heads, spec.head_dim, self.cache_spec.num_pages, config.page_size,
            max_seqs=max_seqs, max_pages_per_seq=self.cache_spec.max_pages_per_seq,
            dtype=config.torch_dtype, device=self.device, kv_dtype=config.torch_kv_dtype, model_dtype_layers=wide,
            prefix_caching=config.enable_prefix_caching, hash_salt=config.prefix_cache_salt(),
        )
        self.cache.track_rewinds = send is not None  # rank 0 tells the other ranks its lossless rewinds
        self.memory = SelectionMemory(quest, *memory_args, self.device) if memory_bytes else None
        bind_cache(model, self.cache)
        if config.use_cuda_graphs and config.compile_elementwise:
            fuse_elementwise(model)
        # Padding rows of a captured batch write and read one token here, never a request's page.
        self.scratch_seq = self.cache.add_sequence()
        # (a padding row of a verify step feeds up to MAX_SPECULATIVE_TOKENS + 1 positions)
        self.cache.allocate([self.scratch_seq], [1 if config.speculative_config is None else MAX_SPECULATIVE_TOKENS + 1])
        self.budget = config.quest.token_budget if config.quest is not None else None
        batch_sizes = graph_batch_sizes(config.max_num_seqs) if config.use_cuda_graphs else ()
        dense_pages = 0 if self.budget is None else self.cache.pages_for_tokens(
            min(int(quest.dense_context_ratio * self.budget), self.cache.max_pages_per_seq * config.page_size))
        rows = max(batch_sizes, default=config.max_num_seqs)
        verify_len = 1 if config.speculative_config is None else config.speculative_config.num_speculative_tokens + 1
        # The sampler, and what the next step reads.
        self.tokens = StepTokens(rows, self.device, config.seed, tp, max_queries=verify_len)
        counters = self.memory.counters if self.memory is not None else ()
        self.graphs = DecodeGraphs(batch_sizes, self.cache.max_pages_per_seq, self.device,
                                   warmup_keeps=(*counters, self.tokens.sampled),
                                   reusing_steps=self.memory is not None, sparse=self.budget is not None,
                                   dense_pages=dense_pages, verify_lengths=tuple(range(2, verify_len + 1)))
        # Rank 0's mirror of the selection memory: the cache slots that hold a selection a next step may reuse
        # (a prefill clears its slots, a step with a dense request its rows', any other decode step sets its rows').
        self._kept: set[int] = set()
        pin = self.device.type == "cuda"
        # Two pinned staging buffers, used in turn: a step is staged while the copy of the one before may
        # still be queued behind the GPU (asynchronous scheduling).
        self._host_inputs = [torch.zeros((NUM_INPUTS, rows), dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._flip = 0
        self._inputs = torch.zeros((NUM_INPUTS, rows), dtype=torch.int64, device=self.device)
        # A verify step's static inputs (lossless): per row its first position, KV length, page-table row, token
        # budget and in-flight source, and its input tokens (the last one resolved by the step where in flight).
        verify_rows = rows if config.speculative_config is not None else 0
        self._verify_inputs = torch.zeros((_VERIFY_INPUTS, verify_rows), dtype=torch.int64, device=self.device)
        self._verify_ids = torch.zeros((verify_rows, MAX_SPECULATIVE_TOKENS + 1), dtype=torch.int64, device=self.device)
        self._host_verify = torch.zeros((_VERIFY_INPUTS + MAX_SPECULATIVE_TOKENS + 1, verify_rows), dtype=torch.int64,
                                        pin_memory=pin)
        # Every CUDA graph writes its logits here: an output of its own per graph held [rows, vocab] float32 for each
        # batch size, page-table width, route (and verify length) until the engine closed (GBs at a 150k vocabulary).
        # A step's sampling reads them before the next step is launched on the stream.
        logit_rows = rows * verify_len
        self._graph_logits = (torch.empty((logit_rows, spec.vocab_size), dtype=torch.float32, device=self.device)
                              if batch_sizes else None)
        self._steps: dict[tuple[int, int, StepRoute, int], QuestDecodeStep] = {}

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> SampledTokens:
        """Launch one step for ``batch`` (its pages already allocated by the scheduler) and its sampling, without
        waiting for the device: a decode-only step, or one with prefill rows (and possibly decode rows before
        them). A decode input token still in flight (sampled by the step launched just before, see the scheduler)
        is read from that step's tokens on the device.

        Returns:
            The sampled tokens: one per sampling sequence (``batch.seqs[:batch.num_sampled]``: every decode row
            and each prefill row but a partial one), ``num_new_tokens`` on a verify row, in batch order, read by
            :meth:`SampledTokens.token_ids`.
        """
        if batch.num_verifies == len(batch.seqs) and len(set(batch.num_new_tokens)) == 1:
            logits = self._verify(batch)
            return self.tokens.sample(logits, batch, self._verify_ids[:len(batch.seqs), :batch.num_new_tokens[0]],
                                      drawn=True)
        if batch.num_prefills:
            return self.tokens.sample(self._prefill(batch), batch)
        return self.tokens.sample(self._decode(batch), batch, drawn=True)

    def _prefill(self, batch: ScheduledBatch) -> torch.Tensor:
        """``[num_sampled, vocab]`` float32 logits of a step with prefill rows: each decode row's token, then each
        sampling prefill row's last token (a partial one, the batch's last, samples nothing). A prefill row that
        already holds tokens (prefix-cache pages, possibly written by an earlier sequence of this very step, or its
        own earlier chunks) computes only the step's (positions from there on), attending those too."""
        n = batch.num_decodes
        ids, in_flight = [], []
        for seq, seq_len, new in zip(batch.seqs[n:], batch.seq_lens[n:], batch.num_new_tokens[n:]):
            tokens, flying = seq.input_tokens(seq_len, new)  # a verify row: its drafts too
            if flying:  # (only a verify row's last draft, launched just before)
                in_flight.append((len(ids) + new - 1, self.tokens.row_of(seq)))
            ids += tokens
        inputs = PrefillInputs(batch.seq_ids[n:], batch.num_new_tokens[n:], batch.seq_lens[n:], batch.partial, ids,
                               batch.num_verifies, tuple(in_flight))
        self._kept.difference_update(inputs.seq_ids)
        if not n:
            self._publish(batch, prefill=inputs)
            return self._run_prefill(inputs)
        key, host = self._stage_decode(batch.seqs[:n], batch.seq_lens[:n], batch.dense_rows, batch.ahead)
        self._publish(batch, prefill=inputs, decode=(host.numpy(), key))
        logits = self._run_prefill(inputs, key)  # [padded + sampling prefill rows, vocab]
        return logits if key[0] == n else torch.cat([logits[:n], logits[key[0]:]])  # without the padding rows

    def _run_prefill(self, inputs: PrefillInputs, decode: Optional[GraphKey] = None) -> torch.Tensor:
        """:meth:`_prefill` from its inputs on (every rank runs this), eagerly: the prefill rows of ``inputs``
        after the ``decode`` rows (the key of the packed decode inputs already staged, see :meth:`_stage_decode`), if
        any, in one forward. Returns ``[padded + sampling prefill rows, vocab]`` float32 logits (padding rows
        included: ``padded`` is ``decode[0]``, 0 without decode rows)."""
        positions, starts, cached = [], [0], []
        for seq_len, new in zip(inputs.seq_lens, inputs.num_new_tokens):
            cached.append(seq_len - new)  # a prefix-cache hit or earlier chunks
            positions.extend(range(cached[-1], seq_len))
            starts.append(starts[-1] + new)
        slots = self.cache.slots(inputs.seq_ids, cached, inputs.num_new_tokens)
        page_table, seq_lens = self.cache.batch(inputs.seq_ids)
        prefill = PrefillRows(page_table, seq_lens, starts, cached if any(cached) else None)
        tokens = torch.tensor([inputs.token_ids, positions], dtype=torch.int64).to(self.device, non_blocking=True)
        if inputs.in_flight:  # a verify row's last draft, read from the step before's sampled tokens
            index, source = torch.tensor(inputs.in_flight, dtype=torch.int64).to(self.device, non_blocking=True).T
            tokens[0, index] = self.tokens.sampled[source]
        # The partial sequence, if any, is the last one: its last token samples nothing. A verify row samples at
        # every position.
        picked = [i for r in range(inputs.num_verifies) for i in range(starts[r], starts[r + 1])]
        picked += [end - 1 for end in starts[inputs.num_verifies + 1:len(starts) - inputs.partial]]
        last = torch.tensor(picked, dtype=torch.int64).to(self.device, non_blocking=True)
        if self.memory is not None:  # the prefill rows' slots held their previous sequences' selections and counters
            rows = torch.tensor(inputs.seq_ids, dtype=torch.int64).to(self.device, non_blocking=True)
            self.memory.forget(rows[:inputs.num_verifies])  # a verify row's sequence goes on: its counters too
            self.memory.restart(rows[inputs.num_verifies:])
        if decode is None:
            hidden = self.model(tokens[0], tokens[1], StepContext(slots, prefill=prefill))
            return self.model.compute_logits(hidden[last])  # [num_sampled, vocab]
        padded = decode[0]
        ids, decode_positions, decode_slots, rows = self._decode_rows(*decode)
        ctx = StepContext(torch.cat([decode_slots, slots]), decode=rows, prefill=prefill)
        hidden = self.model(torch.cat([ids, tokens[0]]), torch.cat([decode_positions, tokens[1]]), ctx)
        self._store_selections(padded, rows)
        picked = torch.cat([torch.arange(padded, device=self.device), last + padded])
        return self.model.compute_logits(hidden[picked])  # [padded + sampling prefill rows, vocab]

    def _verify(self, batch: ScheduledBatch) -> torch.Tensor:
        """``[rows * q_len, vocab]`` float32 logits of a step of verify rows only, each of ``q_len`` positions (a
        lossless round's last verified token and its drafts; rounds stay aligned, so this is the usual verify
        step): staged into static inputs and run by :meth:`_verify_body`, under a CUDA graph keyed by the padded
        batch, the page-table width and ``q_len``."""
        rows, q_len = len(batch.seqs), batch.num_new_tokens[0]
        padded = self.graphs.padded(rows)
        width = self.graphs.width(self.cache.pages_for_tokens(max(batch.seq_lens)))
        host = self._host_verify[:_VERIFY_INPUTS + q_len, :padded]
        host[:_VERIFY_INPUTS] = self._verify_padding(q_len)[:, None]
        host[_VERIFY_INPUTS:].zero_()
        staged = []  # per row: its _VERIFY_INPUTS, then its q_len input tokens
        for seq, seq_len in zip(batch.seqs, batch.seq_lens):
            tokens, flying = seq.input_tokens(seq_len, q_len)
            staged.append([seq_len - q_len, seq_len, seq.cache_id, self.tokens.row_of(seq) if flying else -1, *tokens])
        host[:, :rows] = torch.tensor(staged, dtype=torch.int64).T
        key = (padded, width, StepRoute.VERIFY, q_len)
        self._publish(batch, verify=(host.numpy(), key, batch.seq_ids))
        return self._run_verify(host, key, batch.seq_ids)[:rows * q_len]

    def _run_verify(self, host, key: GraphKey, seq_ids: tuple[int, ...]) -> torch.Tensor:
        """:meth:`_verify` from its staged host inputs on (every rank runs this): ``host`` ``[_VERIFY_INPUTS + q_len,
        padded]`` int64 (first positions, KV lengths, page-table rows, the rows of the step before's
        sampled tokens that hold in-flight last inputs, then the input tokens; a tensor or a numpy array), the graph
        ``key``, the verified sequences ``seq_ids``. Returns ``[padded * q_len, vocab]`` float32 logits."""
        padded, q_len = key[0], key[3]
        if self.graphs.covers(key) and key not in self.graphs:
            self.graphs.capture_late(key, functools.partial(self._capture_verify_graphs, padded, key[1]))
        host = torch.as_tensor(host)
        self._verify_inputs[:, :padded].copy_(host[:_VERIFY_INPUTS], non_blocking=True)
        self._verify_ids[:padded, :q_len].copy_(host[_VERIFY_INPUTS:].T, non_blocking=True)
        self._kept.difference_update(seq_ids)
        return self._run_step(key, self._verify_body)

    def _capture_verify_graphs(self, batch: int, width: int) -> None:
        """Capture the verify graph of every round length (2 to ``num_speculative_tokens + 1`` positions per row) at
        this padded batch size and page-table width: an adaptive policy that changes its round length later never
        waits for a capture mid-run. Every rank runs it (its collectives meet)."""
        for q_len in self.graphs.verify_lengths:
            key = (batch, width, StepRoute.VERIFY, q_len)
            if key not in self.graphs:
                self._capture_verify(key)

    def _capture_verify(self, key: GraphKey) -> None:
        """Capture the verify step of ``key`` on padding rows only (the scratch sequence)."""
        batch, q_len = key[0], key[3]
        self._verify_inputs[:, :batch] = self._verify_padding(q_len).to(self.device)[:, None]
        self._verify_ids[:batch, :q_len].zero_()
        self.graphs.capture(key, self._verify_body)

    def _verify_padding(self, q_len: int) -> torch.Tensor:
        """``[_VERIFY_INPUTS]`` int64 staged inputs of a verify step's padding row of ``q_len`` positions: the
        scratch sequence's first positions, its last input token staged."""
        return torch.tensor([0, q_len, self.scratch_seq, -1])

    def _verify_body(self, batch: int, width: int, route: StepRoute, q_len: int) -> torch.Tensor:
        """One verify step over the static verify inputs (graph-capturable: device ops only): ``batch`` rows of
        ``q_len`` positions each, attending their cached tokens and, causally, each other densely (a dense decode
        step of ``q_len`` queries per row, :func:`~questkv.ops.paged_decode_attention`); ``[batch * q_len, vocab]``
        float32 logits, row after row, and their greedy tokens and next inputs (:meth:`StepTokens.draw_greedy`: a
        greedy batch's sampling launches nothing more)."""
        first, seq_lens, table_rows, sources = self._verify_inputs[:, :batch]
        positions = first[:, None] + torch.arange(q_len, device=self.device)  # [batch, q_len] int64
        page_table = self.cache.page_table.index_select(0, table_rows)[:, :width]  # [batch, width] int32
        page_size = self.cache.page_size
        slots = page_table.gather(1, positions // page_size).long() * page_size + positions % page_size
        step = self._step(batch, width, route, q_len)
        rows = DecodeRows(page_table, seq_lens.to(torch.int32), step, dense=True, num_queries=q_len)
        staged = self._verify_ids[:batch, :q_len]
        # The last inputs in flight, resolved in place: the sampler reads the step's drafts there (StepTokens.sample).
        staged[:, -1] = torch.where(sources >= 0, self.tokens.sampled[sources.clamp(min=0)], staged[:, -1])
        if self.memory is not None:  # the next round's first draft selects afresh; the selection rate counts on
            self.memory.forget(table_rows)
        hidden = self.model(staged.reshape(-1), positions.reshape(-1), StepContext(slots.reshape(-1), decode=rows))
        logits = self.model.compute_logits(hidden, self._logits_out(batch * q_len))
        self.tokens.draw_greedy(logits, staged)
        return logits

    def _decode(self, batch: ScheduledBatch) -> torch.Tensor:
        """``[len(batch.seqs), vocab]`` float32 logits of a decode-only step (every row a decode row)."""
        key, host = self._stage_decode(batch.seqs, batch.seq_lens, batch.dense_rows, batch.ahead)
        self._publish(batch, decode=(host.numpy(), key))  # pickled at once: no copy
        return self._run_step(key, self._decode_body)[:len(batch.seqs)]

    def _run_step(self, key: GraphKey, body: Callable[..., torch.Tensor]) -> torch.Tensor:
        """Step ``key``'s logits: its CUDA graph replayed, or ``body`` run eagerly (a batch size without graphs)."""
        return self.graphs.replay(key, body) if self.graphs.covers(key) else body(*key)

    def _stage_decode(self, seqs: tuple[Sequence, ...], seq_lens: tuple[int, ...], dense_rows: tuple[bool, ...],
                      ahead: tuple[int, ...]) -> tuple[GraphKey, torch.Tensor]:
        """Stage the decode rows ``seqs`` (KV lengths ``seq_lens``, routes ``dense_rows`` and rows launched ahead of
        their verify ``ahead``: the scheduler's :attr:`ScheduledBatch.dense_rows` and :attr:`ScheduledBatch.ahead`;
        :meth:`_stage_inputs`); return their graph key and staged host inputs.
        The key: the padded batch size, the page-table width, the route, and whether any row may select (not when
        every row is off its phase or drafting, and its slot keeps a selection, whose pages begun since never
        outgrow the extra columns: :meth:`SelectionMemory.rows` then finds no row active; a dense step of an engine
        with a selection memory: whether it keeps the memory's books). A mixed step's decode rows use a decode-only
        step's key and buffers. Updates the mirror of the selection memory."""
        padded = self.graphs.padded(len(seqs))
        width = self.graphs.width(self.cache.pages_for_tokens(max(seq_lens)))
        dense_rows = list(dense_rows)
        route = step_route(dense_rows)
        if route == StepRoute.DENSE and any(ahead):
            raise RuntimeError(f"a dense step launched rows ahead of their verify ({ahead}): only drafts are")
        host = self._stage_inputs(seqs, seq_lens, padded, width, dense_rows, ahead)
        slots = [seq.cache_id for seq in seqs]
        if route == StepRoute.DENSE:
            # The memory counts and forgets a lossy Quest request's dense step (its selection rate counts the step,
            # its next sparse step selects afresh); a dense request needs neither, nor does a lossless one (its rate
            # is over its drafts, a round's first draft selects): their dense steps are the dense engine's.
            selecting = self.memory is None or any(not seq.quest.dense and not seq.quest.speculative_tokens
                                                   for seq in seqs)
        else:
            selecting = (self.memory is None or route != StepRoute.SPARSE or bool(host[_DUE, :len(seqs)].any())
                         or not self._kept.issuperset(slots))
        if self.memory is not None:  # a dense row's step forgets its selection, a Quest row's keeps one
            self._kept.update(slot for slot, dense in zip(slots, dense_rows) if not dense)
            self._kept.difference_update(slot for slot, dense in zip(slots, dense_rows) if dense)
        return (padded, width, route, selecting), host

    def _publish(self, batch: ScheduledBatch, **step) -> None:
        """Rank 0 with tensor parallelism: send the other ranks the step (``prefill=`` and/or ``decode=`` of
        :class:`StepMessage`) and the page-table rows that changed for it; nothing on one device."""
        if self._send is None:
            return
        bound_pages, bound_counts = [], []
        for kept, pages, counts in self.cache.rewinds:  # the lossless verifies since the last message
            for seq_id, held in kept:
                if seq_id in self._mirrored:
                    self._mirrored[seq_id] = min(self._mirrored[seq_id], held)
            bound_pages += pages
            bound_counts += counts
        self.cache.rewinds.clear()
        updates = []
        for i, seq_id in enumerate(batch.seq_ids):
            prefill = i >= batch.num_decodes  # a prefill row (re)starts the sequence's row
            start = 0 if prefill else self._mirrored[seq_id]
            pages = self.cache.pages_from(seq_id, start)
            if pages or prefill:
                updates.append((seq_id, start, pages, self.cache.seq_len(seq_id)))
            self._mirrored[seq_id] = start + len(pages)
        count = sum(map(batch.num_sampled_tokens, range(batch.num_sampled)))
        self._send(StepMessage(tuple(updates), count=count, rows=batch.num_sampled,
                               bounds=(bound_pages, bound_counts), **step))

    def run_step(self, message: StepMessage) -> None:
        """Run one step rank 0 sent (a rank other than 0 with tensor parallelism): follow its page table, run the
        model over the step's inputs (the collectives meet rank 0's) and take the sampled tokens it broadcasts."""
        for update in message.pages:
            self.cache.mirror(*update)
        self.cache.recompute_bounds(*message.bounds)
        if message.capture:
            self.prepare_startup()
            return
        if message.verify is not None:
            self._run_verify(*message.verify)
            self.tokens.follow(message.count, message.rows, verifies=True)
            return
        key = None
        if message.decode is not None:
            host, key = message.decode
            staged = self._host_inputs[self._flip][:, :key[0]]  # pinned, in turn: the copy does not wait
            self._flip ^= 1
            staged.copy_(torch.from_numpy(host))
            self._inputs[:, :key[0]].copy_(staged, non_blocking=True)
        if message.prefill is not None:
            self._run_prefill(message.prefill, key)
        else:
            self._run_step(key, self._decode_body)
        verifies = message.prefill is not None and bool(message.prefill.num_verifies)
        self.tokens.follow(message.count, message.rows, verifies)

    def _stage_inputs(self, seqs: tuple[Sequence, ...], seq_lens: tuple[int, ...], padded: int, width: int,
                      dense_rows: list[bool], ahead: tuple[int, ...]) -> torch.Tensor:
        """Copy the packed decode inputs of the decode rows ``seqs`` (their KV lengths ``seq_lens``, page-table width
        ``width``, whether each decodes densely ``dense_rows``, the drafts of the verify each follows in flight
        ``ahead``, see :attr:`ScheduledBatch.ahead`: staged as if it kept none) to the device; rows past them (up
        to the padded batch ``padded``) read and write one token of the scratch sequence. Returns the host copy,
        ``[NUM_INPUTS, padded]`` int64."""
        host = self._host_inputs[self._flip][:, :padded]
        self._flip ^= 1
        host[_IDS].zero_()
        host[_POS].zero_()
        host[_LENS].fill_(1)
        host[_BUDGETS].fill_(self.budget or 0)
        host[_ROWS].fill_(self.scratch_seq)
        host[_SRC].fill_(-1)
        host[_DUE].fill_(1)
        host[_DENSE].zero_()
        host[_AHEAD].zero_()
        if seqs:
            rows = []
            if len(dense_rows) != len(seqs):
                raise RuntimeError(f"{len(seqs)} decode rows staged with {len(dense_rows)} routes")
            for seq, seq_len, dense, drafts in zip(seqs, seq_lens, dense_rows, ahead or (0,) * len(seqs)):
                seq_len -= drafts
                position = seq_len - 1
                token = seq.last_token
                known = not drafts and seq.holds_token(seq_len - 1)  # else the token in flight from the last step
                if not known and seq.is_forced(position - seq.num_prompt_tokens):
                    # A forced output in flight: its token is known here (the in-flight one is the sampler's choice).
                    token, known = seq.sampling_params.forced_token_ids[position - seq.num_prompt_tokens], True
                # A lossless round's drafts reuse one selection: its first draft's (its verify step cleared the
                # memory's row).
                due = (seq.num_drafts <= 1 if seq.quest.speculative_tokens
                       else is_due(seq_len, seq.num_prompt_tokens, seq.quest.selection_interval))
                rows.append([token if known else 0, position, seq_len,
                             seq.quest.token_budget or self.budget or 0, seq.cache_id,
                             -1 if known else self.tokens.row_of(seq), int(due), int(dense), int(drafts > 0)])
            host[:, :len(rows)] = torch.tensor(rows, dtype=torch.int64).T
        self._inputs[:, :padded].copy_(host, non_blocking=True)
        return host

    @torch.inference_mode()
    def prepare_startup(self, progress: bool = False) -> None:
        """What ``graph_capture="startup"`` runs at start, on every rank (the others when rank 0's capture message
        comes): every decode graph captured (:meth:`capture_decode_graphs`), then the eager prefill attention over
        cached pages compiled in every launch configuration (:func:`~questkv.layers.attention.prepare_prefill`), so
        that no serving step waits for a capture or a compile."""
        self.capture_decode_graphs(progress)
        prepare_prefill(self.model, self.cache)

    @torch.inference_mode()
    def capture_decode_graphs(self, progress: bool = False) -> int:
        """Capture the decode graph of every batch size and page-table width a step can use (compiling their
        kernels), with speculation also the verify graph of every round length, largest first; those already
        captured are kept (part of :meth:`prepare_startup`). Only the scratch sequence's tokens are written.

        Returns:
            The number of graphs captured by this call.
        """
        from tqdm.auto import tqdm

        keys = self.graphs.missing()
        if self._send is not None and keys:
            self._send(StepMessage((), capture=True))  # the other ranks capture theirs alongside (the collectives meet)
        for key in tqdm(keys, desc="capturing decode graphs", disable=not progress):
            if key[2] == StepRoute.VERIFY:
                self._capture_verify(key)
                continue
            self._stage_inputs((), (), *key[:2], [], ())
            self.graphs.capture(key, self._decode_body)
        return len(keys)

    def _decode_body(self, batch: int, width: int, route: StepRoute, selecting: bool) -> torch.Tensor:
        """One decode-only step over the packed inputs (graph-capturable: device ops only); ``[batch, vocab]``
        float32 logits, and their greedy tokens (:meth:`StepTokens.draw_greedy`)."""
        ids, positions, slots, rows = self._decode_rows(batch, width, route, selecting)
        hidden = self.model(ids, positions, StepContext(slots, decode=rows))
        self._store_selections(batch, rows)
        logits = self.model.compute_logits(hidden, self._logits_out(batch))
        self.tokens.draw_greedy(logits)
        return logits

    def _logits_out(self, rows: int) -> Optional[torch.Tensor]:
        """Where a graph body's ``rows`` logits go: the graphs' shared ``[rows, vocab]`` output (``None`` without
        graphs: a new tensor each step)."""
        return None if self._graph_logits is None else self._graph_logits[:rows]

    def _decode_rows(self, batch: int, width: int, route: StepRoute, selecting: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DecodeRows]:
        """The decode rows of the packed inputs (the first ``batch``, padding included) as the model reads them:
        ``[batch]`` int64 input ids (an in-flight token read from the previous step's sampled tokens), ``[batch]``
        int64 positions, ``[batch]`` int64 slots, and the rows' attention metadata (device ops only; on CPU the
        host's claim that no row selects, ``selecting=False``, is checked against the memory's flags)."""
        inputs = self._inputs[:, :batch]
        source = inputs[_SRC].clamp(min=0)
        ids = torch.where(inputs[_SRC] >= 0, self.tokens.sampled[source], inputs[_IDS])
        positions, seq_lens = inputs[_POS], inputs[_LENS]
        if self.config.speculative_config is not None and route != StepRoute.DENSE:
            # A row launched ahead of its verify (a draft: never routed dense) moves by the drafts that verify kept.
            positions, seq_lens = inputs[_POS:_LENS + 1] + self.tokens.kept_drafts[source] * inputs[_AHEAD]
        page_table = self.cache.page_table.index_select(0, inputs[_ROWS])[:, :width]  # [batch, width] int32
        page_size = self.cache.page_size
        slots = page_table.gather(1, (positions // page_size)[:, None])[:, 0].long() * page_size + positions % page_size
        budgets = None if route == StepRoute.DENSE else inputs[_BUDGETS].to(torch.int32)
        seq_lens = seq_lens.to(torch.int32)
        step = self._step(batch, width, route)
        reuse = None
        if route == StepRoute.MIXED:
            reuse = self._mixed_rows(inputs, seq_lens, step.selected.shape[-1])
        elif self.memory is not None:
            if route == StepRoute.DENSE:  # nothing selects
                if selecting:
                    self.memory.count_dense_step(inputs[_ROWS])
            else:
                reuse = self.memory.rows(inputs[_ROWS], inputs[_DUE], seq_lens, selecting)
                if not selecting and self.device.type == "cpu":  # free here; a sync (and no capture) on CUDA
                    wrong = ((reuse.active != 0) & (inputs[_ROWS] != self.scratch_seq)).nonzero()[:, 0].tolist()
                    if wrong:
                        raise RuntimeError(f"rows {wrong} select in a step launched without selection: the host's "
                                           "mirror of the selection memory is out of step")
        return ids, positions, slots, DecodeRows(page_table, seq_lens, step, budgets, reuse,
                                                 dense=route == StepRoute.DENSE)

    def _mixed_rows(self, inputs: torch.Tensor, seq_lens: torch.Tensor, columns: int) -> ReuseRows:
        """The selections of a step with dense and Quest rows (:class:`StepRoute` ``MIXED``), ``columns`` wide (the
        step's, >= the page-table width): a dense row "selects" every page it holds and runs no estimate or select
        (``active`` 0); a Quest row selects by its budget, or reuses its kept selection, as in a Quest step. With
        selection reuse the memory's rows are kept in :attr:`ReuseRows.stored` for :meth:`_store_selections`."""
        dense = inputs[_DENSE] != 0  # [batch] bool
        pages = torch.arange(columns, dtype=torch.int32, device=self.device)
        count = (seq_lens + self.cache.page_size - 1) // self.cache.page_size  # [batch] int32
        every_page = torch.where(pages[None, :] < count[:, None], pages[None, :], -1)  # [batch, columns] int32
        layers, heads = self._selection_shape
        stored = None
        if self.memory is not None:
            stored = self.memory.rows(inputs[_ROWS], inputs[_DUE], seq_lens)
            kept = torch.nn.functional.pad(stored.selected, (0, columns - stored.selected.shape[-1]), value=-1)
            active = stored.active * (~dense).to(torch.int32)
        else:
            kept = torch.full((layers, dense.shape[0], heads, columns), -1, dtype=torch.int32, device=self.device)
            active = (~dense).to(torch.int32)
        selected = torch.where(dense[None, :, None, None], every_page[None, :, None, :], kept)  # [L, B, H, columns]
        rows = ReusedSelections(active, selected, seq_lens, count)  # the layers read active and selected only
        return ReuseRows(rows, stored=stored)

    def _store_selections(self, batch: int, rows: DecodeRows) -> None:
        """After the forward, keep the selections of the first ``batch`` decode rows for selection reuse
        (:meth:`SelectionMemory.store_step`)."""
        if rows.reuse is not None and self.memory is not None:
            self.memory.store_step(self._inputs[_ROWS, :batch], rows.reuse, self._inputs[_DENSE, :batch] != 0)

    def _step(self, batch: int, width: int, route: StepRoute, num_queries: int = 1) -> QuestDecodeStep:
        """The decode step (buffers) of ``batch`` rows of ``num_queries`` queries each (a verify step's ``q_len``)
        over ``width`` page-table columns, for ``route``; built once per shape."""
        key = (batch, width, route, num_queries)
        if key not in self._steps:
            dense = route in (StepRoute.DENSE, StepRoute.VERIFY)
            quest = None if dense else self._quest
            if route == StepRoute.MIXED:  # selections as wide as the page table: a dense row's hold every page
                quest = dataclasses.replace(quest, token_budget=max(width * self.cache.page_size, quest.token_budget))
            self._steps[key] = QuestDecodeStep.for_cache(quest, self.cache, batch, self.num_q_heads, width, num_queries,
                                                         row_budgets=route != StepRoute.MIXED)
        return self._steps[key]

    def selection_rate(self, seq: Sequence, slot: Optional[int], discard_last: bool = False) -> Optional[float]:
        """The finished request's :attr:`~questkv.engine.sequence.RequestMetrics.selection_rate` (its cache slot
        ``slot``, now freed: its counters stay until the slot's next prefill; ``discard_last``: its latest decode
        step's tokens were discarded, see :meth:`SelectionMemory.selection_rate`); reads the device once."""
        if seq.quest.dense or slot is None:
            return None
        if self.memory is None:
            return 1.0  # every decode step selects
        return self.memory.selection_rate(slot, discard_last)

    def release(self) -> None:
        """Free the device memory of the page pool, the decode graphs and the weights now; the runner is unusable
        afterwards. Storages are emptied in place, so that no reference left elsewhere (a view, a cycle that
        only the garbage collector would break) keeps them alive."""
        self.graphs.release()
        self._steps.clear()
        cache = self.cache
        tensors = [*cache.tensors(), *self.tokens.tensors(), self._inputs,
                   *self.model.parameters(), *self.model.buffers()]
        if self._graph_logits is not None:
            tensors.append(self._graph_logits)
        if self.memory is not None:
            tensors += [self.memory.pages, self.memory.selected_at]
        for tensor in tensors:
            tensor.untyped_storage().resize_(0)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

