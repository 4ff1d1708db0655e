"""One request's state as the engine carries it (:class:`Sequence`), and what the user gets back.

The scheduler moves a sequence between statuses and appends its sampled tokens; the engine fills the text
(detokenisation) and the attention metric (``tokens_attended_sum`` / ``decode_steps``). Timestamps are
``time.perf_counter()`` seconds. Nothing here touches tensors or the KV cache.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import time
from typing import Any, Optional, Union

from questkv.config import RequestQuest
from questkv.engine.sampling_params import SamplingParams

__all__ = ["Logprob", "RequestMetrics", "RequestOutput", "Sequence", "SequenceStatus"]


class SequenceStatus(enum.Enum):
    """Where a sequence is: queued, in the running batch, or finished (and why)."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> Optional[str]:
        """``"stop"``, ``"length"`` or ``"abort"`` once finished, else ``None``."""
        return self.value if self in _FINISHED else None


_FINISHED = frozenset(
    {SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED}
)


@dataclasses.dataclass(eq=False)
class Sequence:
    """One request: its prompt, the tokens generated so far and where it stands.

    Attributes:
        request_id: the caller's name for the request, unique among live requests.
        prompt_token_ids: the prompt, at least one token.
        sampling_params: how to sample and when to stop.
        prompt: the prompt text when the request came as text (for :class:`RequestOutput`), else ``None``.
        quest: its Quest settings, resolved against the engine's at admission (the engine sets them; the default
            is dense).
        arrival_time: when the request arrived.
        output_token_ids: tokens generated so far, kept across preemptions (they are recomputed, not lost).
        status: see :class:`SequenceStatus`.
        cache_id: the ``PagedKVCache`` sequence id while the sequence holds pages (running), else ``None``.
        stop_reason: the stop string or the ``stop_token_ids`` entry that finished it; ``None`` otherwise,
            an end-of-sequence token included (as in vLLM).
        first_token_time, finished_time: when the first output token was appended and when it finished.
        num_preemptions: how often it lost its pages and went back to the waiting queue.
        num_in_flight: tokens that launched steps will sample for it and :meth:`Scheduler.update` has not yet
            appended: 0 between synchronous steps, at most 2 under asynchronous scheduling (the step being
            processed and the one launched after it).
        tokens_attended_sum, decode_steps: the engine adds the tokens one decode step attended (mean over
            layers and heads) and counts the steps; their ratio is ``mean_tokens_attended``.
        sparse_tokens_attended_sum: the same for the tokens one Quest (sparse) layer attended, mean over its
            heads; stays 0 for a dense request or engine.
        selection_rate: the engine's :attr:`RequestMetrics.selection_rate`, set when the request finishes.
        forced_choices, forced_logprobs: per forced output (``sampling_params.forced_token_ids``) so far, the
            token the sampler chose there and the log-probability of the forced token; the scheduler appends
            them with the outputs (kept across preemptions, as the outputs are).
        output_logprobs: per output token, with ``sampling_params.logprobs`` set, the log-probabilities of that token
            and of the most likely ones (:attr:`RequestOutput.logprobs`); empty without.
        forced_text_len: the length of the output text once every forced token is in it (the engine searches
            stop strings only past it); ``None`` until then, 0 without forced tokens.
        num_prefilled_tokens: the tokens its latest prefill put in the KV cache (computed or shared), so far while
            the prefill is chunked: K/V that a prefill of the same tokens reproduces, whatever its later (possibly
            sparse) decode steps attended.
        page_hashes: the prefix cache's hash chain of its leading full pages (of prompt and outputs), computed by
            the scheduler when it first tries to admit the sequence and extended as needed: an admission that
            waits (a long prompt at the head of a full queue) hashes nothing again.
        num_cached_tokens: the tokens of its first prefill whose pages it shared from the prefix cache (not
            computed); ``None`` until it is first admitted.
        detokenizer: the engine's :class:`~questkv.engine.detokenizer.IncrementalDetokenizer` of the
            output, ``None`` without a tokenizer or when the request asks for no text
            (``SamplingParams.detokenize=False``).
        draft_token_ids: a lossless request's (``quest.speculative_tokens``) tentative tokens of its current round,
            sampled by its Quest draft steps and not output until a verify step keeps them; the cache holds their
            positions too (see :mod:`questkv.engine.scheduler`).
        num_drafts_in_flight: its draft steps launched and not yet updated (at most 2, under asynchronous
            scheduling: a round's drafts and its verify are launched one step ahead of their update, like decode
            steps, and so is the next round's first draft, ahead of the verify's update).
        round_drafts: the most drafts of its current round: the engine's choice when the round's first draft was
            scheduled (:meth:`Rounds.count_draft <questkv.engine.rounds.Rounds.count_draft>`), which holds to the
            round's verify whatever the engine picks meanwhile.
        verify_in_flight: the drafts its verify step in flight checks (``draft_token_ids`` until its update), 0
            when none is: the drafts of the next round, whose first may be launched meanwhile, are counted apart.
        num_verify_steps: a lossless request's verify steps so far.
        draft_tokens_by_position, accepted_tokens_by_position: per draft position ``i`` (0: a round's first draft),
            the verify steps whose round drafted it and those that kept it (a draft is kept only after every one
            before it, so neither grows along the positions; both as long as the longest round); their sums are
            :attr:`num_draft_tokens` and :attr:`num_accepted_tokens` (the token each verify adds after the kept
            drafts is not counted).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    prompt: Optional[str] = None
    quest: RequestQuest = dataclasses.field(default_factory=RequestQuest)
    arrival_time: float = dataclasses.field(default_factory=time.perf_counter)
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    cache_id: Optional[int] = None
    stop_reason: Union[int, str, None] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_preemptions: int = 0
    num_in_flight: int = 0
    tokens_attended_sum: float = 0.0
    decode_steps: int = 0
    sparse_tokens_attended_sum: float = 0.0
    selection_rate: Optional[float] = None
    forced_choices: list[int] = dataclasses.field(default_factory=list)
    forced_logprobs: list[float] = dataclasses.field(default_factory=list)
    output_logprobs: list[dict[int, "Logprob"]] = dataclasses.field(default_factory=list)
    forced_text_len: Optional[int] = None
    num_prefilled_tokens: int = 0
    page_hashes: list[bytes] = dataclasses.field(default_factory=list)
    num_cached_tokens: Optional[int] = None
    detokenizer: Optional[Any] = None
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_drafts_in_flight: int = 0
    round_drafts: int = 0
    verify_in_flight: int = 0
    num_verify_steps: int = 0
    draft_tokens_by_position: list[int] = dataclasses.field(default_factory=list)
    accepted_tokens_by_position: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"Sequence.request_id must be a non-empty str, got {self.request_id!r}")
        ids = self.prompt_token_ids
        if not isinstance(ids, (list, tuple)) or not ids:
            raise ValueError(f"Sequence.prompt_token_ids must be a non-empty list of token ids, got {ids!r}")
        if not set(map(type, ids)) <= {int} or min(ids) < 0:  # one C-speed pass; the loop only names the culprit
            for i, token in enumerate(ids):
                if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                    raise ValueError(f"Sequence.prompt_token_ids[{i}] must be an int >= 0, got {token!r}")
        if not isinstance(self.sampling_params, SamplingParams):
            raise ValueError(f"Sequence.sampling_params must be a SamplingParams, got {self.sampling_params!r}")
        self.prompt_token_ids = tuple(ids)  # immutable: outputs share it instead of copying it every step
        self.output_token_ids = list(self.output_token_ids)
        if self.forced_text_len is None and not self.sampling_params.forced_token_ids:
            self.forced_text_len = 0
        if not self.sampling_params.detokenize:
            self.detokenizer = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then generated tokens (a new list)."""
        return list(self.prompt_token_ids) + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt, outputs and drafts in a row, without copying the whole sequence (a
        verify or prefill row of a long context reads only its new tokens)."""
        taken, offset = [], 0
        for part in (self.prompt_token_ids, self.output_token_ids, self.draft_token_ids):
            lo, hi = max(start - offset, 0), min(end - offset, len(part))
            if lo < hi:
                taken.extend(part[lo:hi])
            offset += len(part)
        return taken

    @property
    def num_forced_tokens(self) -> int:
        """``len(sampling_params.forced_token_ids)``."""
        return len(self.sampling_params.forced_token_ids)

    def is_forced(self, index: int) -> bool:
        """Whether output ``index`` (0-based) is a forced token."""
        return index < len(self.sampling_params.forced_token_ids)

    @property
    def num_drafts(self) -> int:
        """Drafts of its current round, updated (``draft_token_ids``) or in flight (a round being verified is
        done: its drafts are not counted)."""
        return len(self.draft_token_ids) + self.num_drafts_in_flight - self.verify_in_flight

    @property
    def last_token(self) -> int:
        """The newest token (a draft one during a lossless round): the input of the next decode step."""
        if self.draft_token_ids:
            return self.draft_token_ids[-1]
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def holds_token(self, position: int) -> bool:
        """Whether the token at ``position`` (prompt, outputs, then drafts) is on the host, not in flight."""
        return position < self.num_tokens + len(self.draft_token_ids)

    def input_tokens(self, seq_len: int, count: int) -> tuple[list[int], bool]:
        """The input tokens of positions ``[seq_len - count, seq_len)`` (a prefill or verify row), and whether the last
        one is still in flight (launched just before, not yet appended; then its place holds 0)."""
        if self.holds_token(seq_len - 1):
            return self.token_slice(seq_len - count, seq_len), False
        return self.token_slice(seq_len - count, seq_len - 1) + [0], True

    def ends_in_flight(self, max_model_len: int) -> bool:
        """Whether its tokens in flight surely finish it by length (no further step is needed)."""
        flying = self.num_in_flight
        return bool(flying) and (self.num_output_tokens + flying >= self.sampling_params.max_tokens
                                 or self.num_tokens + flying >= max_model_len)

    def max_cached_tokens(self, max_model_len: int) -> int:
        """The most tokens it ever caches: all but its last possible token."""
        return min(self.num_prompt_tokens + self.sampling_params.max_tokens, max_model_len) - 1

    def token_stop(self, token: int, eos_token_ids: frozenset, max_model_len: int, forced: bool = False
                   ) -> Optional[tuple[SequenceStatus, Optional[int]]]:
        """The stop that its just-appended output ``token`` hits (status and stop reason), if any: end-of-sequence
        (``eos_token_ids``, unless ``ignore_eos``) and ``stop_token_ids``, except at a forced output, then
        ``max_tokens`` and ``max_model_len``."""
        params = self.sampling_params
        if not forced and not params.ignore_eos and token in eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED, None
        if not forced and token in params.stop_token_ids:
            return SequenceStatus.FINISHED_STOPPED, token
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            return SequenceStatus.FINISHED_LENGTH, None
        return None

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> Optional[str]:
        """``"stop"``, ``"length"``, ``"abort"``, or ``None`` while unfinished."""
        return self.status.finish_reason

    def sampling_seed(self, engine_seed: int) -> int:
        """The request's sampling seed: ``SamplingParams.seed``, or one derived from ``engine_seed`` and the request id
        (the same in every process)."""
        if self.sampling_params.seed is not None:
            return self.sampling_params.seed
        return (engine_seed * 0x9E3779B1 + _request_hash(self.request_id)) % (1 << 62)

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens the request's verify steps scored."""
        return sum(self.draft_tokens_by_position)

    @property
    def num_accepted_tokens(self) -> int:
        """Draft tokens the request's verify steps kept."""
        return sum(self.accepted_tokens_by_position)

    def metrics(self) -> RequestMetrics:
        """The request's metrics so far (decode speed only once finished)."""
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival_time
        decode_tps = None
        if self.finished_time is not None and self.first_token_time is not None and self.num_output_tokens > 1:
            elapsed = self.finished_time - self.first_token_time
            decode_tps = (self.num_output_tokens - 1) / elapsed if elapsed > 0 else None
        mean_attended = self.tokens_attended_sum / self.decode_steps if self.decode_steps else None
        sparse = self.sparse_tokens_attended_sum / self.decode_steps if self.decode_steps else None
        sparse = None if self.quest.dense or not self.sparse_tokens_attended_sum else sparse
        drafted, accepted = self.num_draft_tokens, self.num_accepted_tokens
        acceptance = accepted / drafted if drafted else None
        per_verify = (accepted + self.num_verify_steps) / self.num_verify_steps if self.num_verify_steps else None
        by_position = tuple(kept / scored for kept, scored in
                            zip(self.accepted_tokens_by_position, self.draft_tokens_by_position)) or None
        return RequestMetrics(ttft, decode_tps, mean_attended, self.num_preemptions, sparse,
                              self.num_cached_tokens or 0, self.selection_rate, acceptance, per_verify, by_position)


@dataclasses.dataclass(frozen=True)
class RequestMetrics:
    """How one request went.

    Attributes:
        time_to_first_token: seconds from arrival to the first generated token (queueing and prefill).
        decode_tokens_per_s: tokens after the first per second, from the first token to the finish
            (preemption stalls included); ``None`` until finished or with fewer than two tokens.
        mean_tokens_attended: KV tokens one decode step attended, averaged over the request's decode steps
            (and over layers and heads): the context length when dense, about the budget with Quest.
        num_preemptions: how often the request lost its pages and was recomputed.
        mean_sparse_tokens_attended: KV tokens one decode step attended in each Quest (sparse) layer, averaged
            over the request's decode steps and those layers' heads (what the HF drop-in's
            ``QuestCache.mean_tokens_attended`` measures); ``None`` for a dense request or engine.
        num_cached_tokens: prompt tokens whose prefill the prefix cache skipped at the request's admission (whole
            pages, as vLLM's ``num_cached_tokens``); 0 without a hit or with prefix caching off.
        selection_rate: the fraction of (decode step, sparse layer, selecting head) that estimated and selected
            pages (1 without selection reuse, about ``1 / selection_interval`` with it; a lossless request's, over its
            draft steps: one per round), counted on the device since the request's last (re)prefill; set once it
            finishes, ``None`` before, for a dense request or engine, or without decode (or draft) steps. With tensor
            parallelism: rank 0's heads.
        acceptance_rate: a lossless request's draft tokens that its verify steps kept, over those they scored
            (``None`` without a verify step).
        mean_tokens_per_verify: output tokens per verify step of a lossless request (kept drafts plus dense
            attention's own token: between 1 and ``speculative_tokens + 1``), ``None`` without one.
        acceptance_by_position: per draft position of a lossless round (0: its first draft), the share of the
            verify steps whose round drafted it that kept it (vLLM's acceptance per position: where it falls low,
            fewer drafts per round would do), ``None`` without a verify step.
    """

    time_to_first_token: Optional[float]
    decode_tokens_per_s: Optional[float]
    mean_tokens_attended: Optional[float]
    num_preemptions: int
    mean_sparse_tokens_attended: Optional[float] = None
    num_cached_tokens: int = 0
    selection_rate: Optional[float] = None
    acceptance_rate: Optional[float] = None
    mean_tokens_per_verify: Optional[float] = None
    acceptance_by_position: Optional[tuple[float, ...]] = None


@dataclasses.dataclass(frozen=True)
class Logprob:
    """A token's log-probability at one output position (vLLM's ``Logprob``): ``logprob`` the natural log of its
    probability under the model's logits (``log_softmax`` in float32, before temperature, top-k and top-p), ``rank``
    1 plus the number of tokens the model found strictly more likely."""

    logprob: float
    rank: int


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """One request's result (or, while ``finished`` is ``False``, its progress so far).

    Attributes:
        request_id, prompt, prompt_token_ids: as submitted (``prompt`` is ``None`` for token-id prompts).
        text: the generated text, detokenised by the engine (a matched stop string is not included).
        token_ids: the generated tokens.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"``, or ``None`` while running.
        stop_reason: the stop string or stop token id that matched, else ``None``.
        finished: whether the request is done.
        metrics: see :class:`RequestMetrics`.
        quest: the request's Quest settings as the engine resolved them (:class:`~questkv.config.RequestQuest`).
        forced_choices: per forced output so far (``SamplingParams.forced_token_ids``), the token the request's
            sampler chose there (greedy: the argmax); empty without forced tokens.
        forced_logprobs: per forced output so far, the natural log-probability of the forced token
            (``log_softmax`` of the float32 logits the sampler saw); empty without forced tokens.
        logprobs: with ``SamplingParams.logprobs = N``, per output token a dict from token id to :class:`Logprob`:
            the output token's and those of the ``N`` most likely tokens (``N`` or ``N + 1`` entries, the output
            token first), as vLLM's ``CompletionOutput.logprobs``; ``None`` without.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: tuple[int, ...]
    text: str
    token_ids: tuple[int, ...]
    finish_reason: Optional[str]
    stop_reason: Union[int, str, None]
    finished: bool
    metrics: RequestMetrics
    quest: RequestQuest = RequestQuest()
    forced_choices: tuple[int, ...] = ()
    forced_logprobs: tuple[float, ...] = ()
    logprobs: Optional[tuple[dict[int, Logprob], ...]] = None

    @classmethod
    def from_sequence(cls, seq: Sequence, text: str) -> RequestOutput:
        """Snapshot ``seq`` with the engine's detokenised ``text``."""
        return cls(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            text=text,
            token_ids=tuple(seq.output_token_ids),
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            finished=seq.is_finished,
            metrics=seq.metrics(),
            quest=seq.quest,
            forced_choices=tuple(seq.forced_choices),
            forced_logprobs=tuple(seq.forced_logprobs),
            logprobs=None if seq.sampling_params.logprobs is None else tuple(seq.output_logprobs),
        )


@functools.lru_cache(maxsize=4096)
def _request_hash(text: str) -> int:
    """A process-independent hash of ``text`` (Python's ``hash`` is salted per process); cached, since a sampled
    request asks at every step."""
    value = 0
    for byte in text.encode():
        value = (value * 1_000_003 + byte) % (1 << 61)
    return value
