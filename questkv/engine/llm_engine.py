"""The step loop: requests in, one scheduled step at a time, outputs out.

:class:`LLMEngine` wires the scheduler (who runs), the runner (tensors) and the tokenizer (text, stop
strings). Its request interface is small on purpose, for the offline :class:`~questkv.engine.llm.LLM`
and the server alike: :meth:`LLMEngine.add_request`, :meth:`LLMEngine.step`,
:meth:`LLMEngine.abort_request`, :meth:`LLMEngine.has_unfinished_requests`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Optional, Union

import torch

from questkv.config import RequestQuest
from questkv.decode.selection_memory import selection_seq_len
from questkv.decode.step import sparse_tokens_attended
from questkv.engine.engine_config import ROUND_TO_NEAREST, EngineConfig
from questkv.distributed.group import TensorParallel
from questkv.engine.detokenizer import IncrementalDetokenizer
from questkv.engine.loading import load_shard, quantize_shard, skipped_linears
from questkv.engine.model_runner import ModelRunner
from questkv.engine.tp_workers import TensorParallelError, WorkerPool
from questkv.layers.quantized_linear import check_quantizable
from questkv.engine.sampling_params import SamplingParams
from questkv.engine.scheduler import Scheduler
from questkv.engine.speculation import SpeculationPolicy, StepKind
from questkv.engine.sequence import RequestOutput, Sequence, SequenceStatus
from questkv.engine.step_data import SampledTokens, ScheduledBatch
from questkv.validation import check_text

Prompt = Union[str, list[int]]
logger = logging.getLogger("questkv.engine")


class LLMEngine:
    """One model, one page pool, continuous batching.

    With ``config.tensor_parallel_size`` N > 1 this process is rank 0: it loads its shard first (a model whose heads
    do not split fails before any process starts), then starts ranks 1..N-1 (:attr:`workers`, a
    :class:`~questkv.engine.tp_workers.WorkerPool`) and runs the scheduler for all of them. A step that fails then
    raises :class:`~questkv.engine.tp_workers.TensorParallelError` and every later one too (the ranks are out of
    step); :meth:`close` stops the workers.

    Args:
        config: the engine's configuration.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.workers: Optional[WorkerPool] = None
        # Rank 0's shard first: a model that cannot be sharded (heads not divisible) fails before any process starts.
        tp = TensorParallel(0, config.tensor_parallel_size) if config.tensor_parallel_size > 1 else None
        loaded = load_shard(config, tp)
        self.model_name = loaded.name
        self.spec = loaded.spec
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        max_model_len = config.max_model_len or loaded.spec.max_position_embeddings
        if max_model_len > loaded.spec.max_position_embeddings:
            raise ValueError(
                f"EngineConfig.max_model_len={max_model_len} exceeds the model's "
                f"max_position_embeddings={loaded.spec.max_position_embeddings}"
            )
        if config.quest is not None and not config.quest.is_dense:
            if config.quest.dense_layers >= loaded.spec.num_layers:
                raise ValueError(
                    f"QuestConfig.dense_layers={config.quest.dense_layers} leaves no sparse layer in a model of "
                    f"{loaded.spec.num_layers} layers"
                )
        if tp is None:
            quantize_shard(loaded.model, config, None)
            self.runner = ModelRunner(config, loaded.model, loaded.spec, max_model_len)
        else:
            if config.quantization in ROUND_TO_NEAREST:  # a shard that cannot be quantized: before any process
                try:
                    check_quantizable(loaded.model, config.quantization, skipped_linears(config))
                except ValueError as error:
                    raise ValueError(f"{error}, its shard of tensor_parallel_size={tp.size}") from None
            self.workers = WorkerPool(config, max_model_len)
            try:
                self.workers.connect(tp)
                quantize_shard(loaded.model, config, tp)
                self.runner = ModelRunner(config, loaded.model, loaded.spec, max_model_len, tp, self.workers.send)
                self.workers.wait_ready()
                tp.set_timeout(self.workers.timeout)
            except BaseException as error:
                self._fail_start(error)
        logger.info("%s", self.runner.cache_spec.describe())
        if config.use_cuda_graphs and config.graph_capture == "startup":
            self.runner.prepare_startup(progress=True)
        self.cache = self.runner.cache
        self.max_model_len = max_model_len
        self._sparse_layers = (
            0 if config.quest is None or config.quest.is_dense
            else sum(config.quest.is_sparse_layer(i) for i in range(loaded.spec.num_layers))
        )
        self.speculation = (None if config.speculative_config is None
                            else SpeculationPolicy(config.speculative_config.num_speculative_tokens,
                                                   config.speculative_config.adaptive))
        self.scheduler = Scheduler(
            self.cache,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.prefill_tokens_per_step(max_model_len),
            eos_token_ids=self.eos_token_ids,
            max_model_len=max_model_len,
            chunked_prefill=config.enable_chunked_prefill,
            quest=config.quest,
            speculation=self.speculation,
        )
        self._ids = itertools.count()
        # Launched, not yet processed: the step, its tokens, when it was scheduled (time.perf_counter()).
        self._in_flight: Optional[tuple[ScheduledBatch, SampledTokens, float]] = None
        self._last_update = 0.0  # when the last step was processed
        self._graphs_seen = 0  # CUDA graphs captured by the time the last step was processed
        self._closed = False

    def _fail_start(self, error: BaseException) -> None:
        """Kill the workers of a tensor-parallel start that failed and raise: ``error`` itself when it is a
        ``ValueError`` (rank 0's configuration, which every rank shares), already a :class:`TensorParallelError` (the
        rendezvous saw the worker die), or no worker died, else :class:`TensorParallelError` naming the worker that
        did."""
        workers, self.workers = self.workers, None
        failure = workers.fail(error)  # the group is failed: close() kills at once
        workers.close()
        if isinstance(error, (ValueError, TensorParallelError)) or workers.dead_rank is None:
            raise error
        raise failure from error

    def add_request(
        self, prompt: Prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None
    ) -> str:
        """Queue a request; returns its id. Every check runs before anything is queued.

        Args:
            prompt: text (needs the model's tokenizer) or token ids.
            params: sampling, stops and the request's Quest ``token_budget`` (<= the engine's).

        Raises:
            ValueError: an empty or over-long prompt, token ids outside the vocabulary, a budget the
                engine cannot run, or a request that cannot fit the KV cache even alone.
        """
        params = SamplingParams() if params is None else params
        return self._queue(*self.validate_request(prompt, params), params, request_id)

    def add_requests(self, prompts: list[Prompt], params: list[SamplingParams]) -> list[str]:
        """Queue ``prompts[i]`` with ``params[i]``, all or none: every request is checked (as :meth:`add_request`
        checks one) before any is queued, and each prompt is checked once. Returns their ids, in order."""
        if len(prompts) != len(params):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        checked = [self.validate_request(prompt, param) for prompt, param in zip(prompts, params)]
        return [self._queue(*checked_request, param) for checked_request, param in zip(checked, params)]

    def _queue(self, text: Optional[str], token_ids: list[int], quest: RequestQuest, params: SamplingParams,
               request_id: Optional[str] = None) -> str:
        """Queue a request that :meth:`validate_request` accepted; returns its id."""
        request_id = str(next(self._ids)) if request_id is None else request_id
        seq = Sequence(request_id, token_ids, params, prompt=text, quest=quest,
                       detokenizer=None if self.tokenizer is None else IncrementalDetokenizer(self.tokenizer))
        self.scheduler.add(seq)  # checks the length and the pool
        return request_id

    def validate_request(self, prompt: Prompt, params: SamplingParams
                         ) -> tuple[Optional[str], list[int], RequestQuest]:
        """Every check of :meth:`add_request`, changing nothing; returns the prompt's text and token ids and the
        request's Quest settings resolved against the engine's (:meth:`resolve_quest`)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        text, token_ids = self._tokenize(prompt)
        self._check_vocab("SamplingParams.forced_token_ids", params.forced_token_ids)
        quest = self.resolve_quest(params.token_budget, params.selection_interval, params.dense,
                                   speculative_tokens=params.speculative_tokens)
        if params.forced_token_ids and quest.speculative_tokens:  # teacher forcing replaces the drafts
            quest = dataclasses.replace(quest, speculative_tokens=0)
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer; a dummy-weight model has none (use stop_token_ids)")
        self.scheduler.check_fits(len(token_ids), params.max_tokens)
        return text, token_ids, quest

    def resolve_quest(self, token_budget: Optional[int] = None, selection_interval: Optional[int] = None,
                      dense: bool = False, owner: str = "SamplingParams",
                      speculative_tokens: Optional[int] = None) -> RequestQuest:
        """A request's Quest settings on this engine (:meth:`RequestQuest.resolve`; ``ValueError`` naming
        ``owner.field``); reads the engine's configuration only, so any thread may call it."""
        return RequestQuest.resolve(self.config.quest, token_budget, selection_interval, dense, owner,
                                    speculative_tokens, self.config.speculative_config)

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step, then return an output for every live sequence of the step processed:
        that one (synchronous), or the one launched before it (:attr:`EngineConfig.async_scheduling`: the
        device runs the new step while the host appends the tokens, detokenises and checks stops; where the new
        step needs those tokens first, at a lossless round's ends (:meth:`Scheduler.waits_for`), the step before is
        processed before the new one is scheduled, and the new one still stays in flight)."""
        try:
            outputs = []
            asynchronous = self.config.use_async_scheduling
            if asynchronous and self.scheduler.waits_for(None if self._in_flight is None else self._in_flight[0]):
                outputs, self._in_flight = self._process(*self._in_flight), None
            started = time.perf_counter()
            batch = self.scheduler.schedule()
            launched = None if batch is None else (batch, self.runner.execute(batch), started)
            if asynchronous:  # the new step stays in flight; the one before it is processed now, if not yet
                launched, self._in_flight = self._in_flight, launched
            if launched is not None:
                outputs += self._process(*launched)
            return outputs
        except BaseException as error:
            self._in_flight = None  # its tokens are lost: the caller fails the requests with tokens in flight
            self.cache.reset_prefix_cache()  # pages registered for the failed step may hold no K/V
            if self.workers is not None and not isinstance(error, TensorParallelError):
                failure = self.workers.fail(error)  # the ranks are out of step: the engine is done for
                if isinstance(error, Exception):  # (Ctrl-C stays a KeyboardInterrupt)
                    raise failure from error
            raise

    def _record_step(self, batch: ScheduledBatch, started: float) -> None:
        """Tell the speculation policy what a decode, draft or verify step of lossless rows cost (a step with
        prefill work, or without a lossless row, teaches it nothing): the time from its scheduling, or from the
        update of the step before if that came later (a step launched ahead), to its own update. Summed over a
        round, that is the round's time, whichever steps were launched ahead. A time that includes a CUDA graph's
        capture (a first step of its kind, batch size and width: its kernels compiled too) is not a step's cost
        and is not recorded: hundreds of milliseconds in a running mean of milliseconds would keep the policy
        off drafting for many rounds."""
        now = time.perf_counter()
        seconds = now - max(started, self._last_update)
        self._last_update = now
        captured, self._graphs_seen = len(self.runner.graphs) != self._graphs_seen, len(self.runner.graphs)
        rows = batch.num_decodes + batch.num_verifies
        if self.speculation is None or captured or len(batch.seqs) > rows or not any(
                seq.quest.speculative_tokens for seq in batch.seqs):
            return
        kind = StepKind.VERIFY if batch.num_verifies else StepKind.DRAFT if batch.drafts else StepKind.DENSE
        positions = batch.num_new_tokens[batch.num_decodes:rows]  # a verify row's: its round's drafts + 1
        self.speculation.record_step(kind, rows, seconds, max(positions, default=1) - 1)

    def _process(self, batch: ScheduledBatch, sampled: SampledTokens, started: float) -> list[RequestOutput]:
        """Append a launched step's tokens (waiting for them), apply the stops and build the outputs of the
        sequences that were live (finished ones: their tokens are discarded); a partial prefill (a chunk) has no
        token and no output. ``started``: when the step was scheduled."""
        flat = sampled.token_ids()
        tokens, at = [], 0
        for row in range(batch.num_sampled):  # a verify row's tokens as one list
            count = batch.num_sampled_tokens(row)
            verify = batch.num_decodes <= row < batch.num_decodes + batch.num_verifies
            tokens.append(flat[at:at + count] if verify else flat[at])
            at += count
        seqs = batch.seqs[:batch.num_sampled]
        live = [not seq.is_finished for seq in seqs]
        slots = [seq.cache_id for seq in seqs]  # the update frees the finished ones'; their counters stay
        # Asynchronous scheduling: the step launched after this one decodes these sequences once more, to be discarded
        ahead = self._in_flight[0] if self._in_flight is not None else None
        ahead = set() if ahead is None else set(map(id, ahead.seqs[:ahead.num_decodes]))
        if batch.num_decodes:
            self._account_attention(batch, live)
        before = [seq.num_output_tokens for seq in seqs]
        finished = set(map(id, self.scheduler.update(batch, tokens, sampled.logprobs_by_row(batch))))
        outputs = []
        for row, (seq, slot, was_live, had) in enumerate(zip(seqs, slots, live, before)):
            if not was_live or row in batch.drafts and not seq.is_finished:  # a draft adds no output
                continue
            text = self._detokenize(seq)
            if seq.forced_text_len is None and seq.num_output_tokens == seq.num_forced_tokens:
                seq.forced_text_len = len(text)  # stop strings are searched past the forced tokens' text
            if (seq.sampling_params.stop and seq.forced_text_len is not None
                    and (not seq.is_finished or id(seq) in finished)):
                text = self._apply_stop_strings(seq, text, seq.num_output_tokens - had)
            if seq.is_finished and seq.decode_steps:
                seq.selection_rate = self.runner.selection_rate(seq, slot, id(seq) in ahead)  # read once, at the end
            outputs.append(RequestOutput.from_sequence(seq, text))
        self._record_step(batch, started)
        return outputs

    def abort_request(self, request_id: str) -> bool:
        """Abort a waiting or running request and free its pages at once; False if it is unknown."""
        return self.scheduler.abort(request_id)

    def close(self) -> None:
        """Abort every request and free the engine's device memory (pool, graphs, weights) now; idempotent.
        The engine is unusable afterwards."""
        if self._closed:
            return
        self._closed = True
        self._in_flight = None
        for seq in list(self.scheduler.waiting) + list(self.scheduler.running):
            self.scheduler.abort(seq.request_id)
        self.runner.release()
        if self.workers is not None:
            self.workers.close()

    def __del__(self) -> None:
        if hasattr(self, "_closed"):  # a constructor that raised built no runner
            self.close()
        elif getattr(self, "workers", None) is not None:
            self.workers.close()

    def has_unfinished_requests(self) -> bool:
        """Whether a request waits or runs, or a launched step's tokens are still to be processed."""
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def _tokenize(self, prompt: Prompt) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; a dummy-weight model takes token-id prompts only")
            check_text("prompt", prompt)  # a lone surrogate: the tokenizer would raise TypeError
            try:
                token_ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
            except (TypeError, ValueError, UnicodeError) as error:
                raise ValueError(f"prompt: the tokenizer cannot encode this text: {error}") from None
            text = prompt
        elif isinstance(prompt, (list, tuple)) and set(map(type, prompt)) <= {int}:  # C speed: 32k-token prompts
            token_ids, text = list(prompt), None
        else:
            raise ValueError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt is empty: it must hold at least one token")
        self._check_vocab("prompt token ids", token_ids)
        return text, token_ids

    def _check_vocab(self, what: str, token_ids) -> None:
        """``ValueError`` naming ``what`` unless every id of ``token_ids`` is in the vocabulary."""
        if not token_ids or 0 <= min(token_ids) and max(token_ids) < self.spec.vocab_size:
            return
        bad = [t for t in token_ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise ValueError(f"{what} must be in [0, {self.spec.vocab_size}), got {bad[:5]}")

    @staticmethod
    def _detokenize(seq: Sequence) -> str:
        if seq.detokenizer is None:
            return ""
        return seq.detokenizer.update(seq.output_token_ids, final=seq.is_finished)

    def _apply_stop_strings(self, seq: Sequence, text: str, added: int = 1) -> str:
        """Cut ``text`` at the first stop string past the forced tokens' text and finish the request there. When the
        step ``added`` several tokens (a lossless verify), those after the token that completed the stop string are
        dropped, as if the request had stopped there."""
        start = seq.forced_text_len or 0
        hits = [(text.find(stop, start), stop) for stop in seq.sampling_params.stop if stop in text[start:]]
        if not hits:
            return text
        position, stop = min(hits)
        tokens = seq.output_token_ids
        for count in range(len(tokens) - added + 1, len(tokens)):
            if stop in seq.detokenizer.tokenizer.decode(tokens[:count], skip_special_tokens=True)[start:]:
                del tokens[count:], seq.output_logprobs[count:]
                break
        self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED, stop)
        return text[:position]

    def _account_attention(self, batch: ScheduledBatch, live: list[bool]) -> None:
        """Add each live decode row's KV tokens attended in this step, averaged over layers and heads (dense layers
        and rows that decode densely, :attr:`ScheduledBatch.dense_rows`: the whole context; Quest layers:
        Quest's page accounting); ``live``: per sampling row."""
        seqs = batch.seqs[:batch.num_decodes]
        contexts = list(batch.seq_lens[:batch.num_decodes])  # the new token included
        for i in (i for i, drafts in enumerate(batch.ahead) if drafts):  # its verify, updated since, set its length
            contexts[i] = seqs[i].num_tokens + len(seqs[i].draft_token_ids)
        attended = list(map(float, contexts))
        page_size = self.cache.page_size
        sparse_rows = [i for i, seq in enumerate(seqs) if not seq.quest.dense]
        # A Quest request's step routed dense reads its whole pages, as Quest's accounting charges them.
        routed = {i for i in sparse_rows if batch.dense_rows[i]}
        if sparse_rows:
            budgets = [-(-contexts[i] // page_size) * page_size if i in routed else seqs[i].quest.token_budget
                       for i in sparse_rows]
            # A reused selection, made at a shorter length, attends the pages begun since it in full too.
            made_at = [contexts[i] if i in routed else
                       selection_seq_len(contexts[i], seqs[i].num_prompt_tokens, seqs[i].quest.selection_interval)
                       for i in sparse_rows]
            begun = [-(-contexts[i] // page_size) - -(-at // page_size) for i, at in zip(sparse_rows, made_at)]
            sparse = sparse_tokens_attended(torch.tensor(made_at), torch.tensor(budgets), page_size).tolist()
            sparse = [tokens + pages * page_size for tokens, pages in zip(sparse, begun)]  # host: no device sync
            layers = self.spec.num_layers
            for i, tokens in zip(sparse_rows, sparse):
                attended[i] = ((layers - self._sparse_layers) * contexts[i] + self._sparse_layers * tokens) / layers
            sparse_of = dict(zip(sparse_rows, sparse))
        else:
            sparse_of = {}
        for i, (seq, tokens, was_live) in enumerate(zip(seqs, attended, live)):
            if was_live:
                seq.tokens_attended_sum += tokens
                seq.sparse_tokens_attended_sum += sparse_of.get(i, 0.0)
                seq.decode_steps += 1
