"""What one request asks of the engine: how to sample, when to stop, its Quest token budget and its forced outputs.

This module only validates and normalises; the scheduler applies the stops on token ids, the engine the
stop strings (it owns detokenisation), the sampler (``questkv.layers.sampler``) the sampling fields.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional, Union

from questkv.config import check_request_fields
from questkv.validation import check_bool, check_float, check_int, check_optional_int, check_text

__all__ = ["GREEDY_BELOW", "MAX_LOGPROBS", "SamplingParams", "check_length"]

_MAX_SEED = 2**63 - 1  # seeds travel as int64 tensors
GREEDY_BELOW = 1e-5  # a temperature below it is stored as 0 (greedy), as vLLM does: dividing logits by a tiny
# (float32-subnormal) temperature makes them infinite, and the sample would not be the argmax
MAX_LOGPROBS = 20  # the most alternatives per token that SamplingParams.logprobs asks for (OpenAI's and vLLM's limit)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's tokens and when to stop; frozen and validated on construction.

    A request yields exactly one sample: there is no ``n`` (send the same prompt twice, with different seeds,
    for two samples).

    Attributes:
        temperature: logits are divided by it before sampling; ``0`` means greedy (argmax), in which case
            ``top_k``, ``top_p`` and ``seed`` have no effect. Must be >= 0; a positive temperature below
            :data:`GREEDY_BELOW` (``1e-5``) is stored as ``0``: greedy, as vLLM treats it.
        top_p: nucleus sampling: keep the smallest set of most likely tokens whose probability reaches
            ``top_p`` (after ``top_k``); in ``(0, 1]``, ``1`` keeps all.
        top_k: keep the ``top_k`` most likely tokens; ``0`` keeps all. ``-1`` is accepted as vLLM's spelling
            of "off" and stored as ``0``.
        seed: the request's own random seed (``0 <= seed < 2**63``): the same seed, prompt and parameters give
            the same tokens on the same device and dtype, whatever else shares the batch. ``None``: the engine
            picks one.
        max_tokens: the most tokens to generate (>= 1); reaching it finishes with reason ``"length"``.
        stop: strings that end the generation when they appear in the output text (reason ``"stop"``); a
            single string or a list is accepted and stored as a tuple. Empty strings are refused.
        stop_token_ids: token ids that end the generation (reason ``"stop"``), also when ``ignore_eos``.
        ignore_eos: keep generating past the model's end-of-sequence tokens.
        token_budget: this request's Quest token budget per decode step (>= 1); ``None`` uses the engine's.
            The engine refuses a budget above its own configuration's.
        dense: attend every page on every layer (no Quest) even on a Quest engine; excludes ``token_budget`` and
            ``selection_interval``.
        selection_interval: this request's decode steps per page selection (>= 1, see
            :attr:`questkv.QuestConfig.selection_interval`); ``None`` uses the engine's. The engine refuses one
            above its configuration's (whose extra page columns bound how long a selection may be reused).
        speculative_tokens: draft tokens per lossless round on an engine with a ``speculative_config`` (in
            ``[0, 16]``; 0: this request's Quest steps are its output, lossy); ``None`` uses the engine's. Refused
            on an engine without one.
        forced_token_ids: teacher forcing: the request's first outputs are these tokens instead of sampled ones
            (each fed back through its own decode step, as a generated token is, so under Quest it goes through
            page selection); generation continues after them up to ``max_tokens``, which counts them too
            (``max_tokens >= len(forced_token_ids)``). At each forced position the request's sampler still
            runs: :class:`~questkv.engine.sequence.RequestOutput` returns what it chose there
            (``forced_choices``: the argmax when greedy, a seeded draw otherwise) and the log-probability of
            the forced token (``forced_logprobs``). Stops (end-of-sequence, ``stop_token_ids``, ``stop``)
            apply only after the forced tokens. The engine checks the ids against the vocabulary.
        detokenize: keep the output text (``RequestOutput.text``) up to date; ``False`` leaves it empty and saves
            the per-step detokenisation, for callers that read ``token_ids`` only (excludes ``stop``).
        logprobs: return, per output token, its log-probability, its rank and the ``logprobs`` most likely tokens
            with theirs (``RequestOutput.logprobs``; 0: the output token's alone; at most :data:`MAX_LOGPROBS`),
            from the model's logits before temperature, top-k and top-p (vLLM's default). A lossless request's come
            from its verify steps: dense attention's, as a dense engine's. ``None``: none.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    max_tokens: int = 16
    stop: Union[tuple[str, ...], str, Iterable[str], None] = ()
    stop_token_ids: Union[tuple[int, ...], Iterable[int], None] = ()
    ignore_eos: bool = False
    token_budget: Optional[int] = None
    dense: bool = False
    selection_interval: Optional[int] = None
    speculative_tokens: Optional[int] = None
    forced_token_ids: Union[tuple[int, ...], Iterable[int], None] = ()
    detokenize: bool = True
    logprobs: Optional[int] = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # normalised values are written once, here
        temperature = check_float("SamplingParams.temperature", self.temperature, low=0.0)
        set_(self, "temperature", 0.0 if temperature < GREEDY_BELOW else temperature)
        set_(self, "top_p", check_float("SamplingParams.top_p", self.top_p, low=0.0, high=1.0, low_open=True))
        if type(self.top_k) is int and self.top_k == -1:
            set_(self, "top_k", 0)
        check_int("SamplingParams.top_k", self.top_k, minimum=0)
        check_optional_int("SamplingParams.seed", self.seed, minimum=0, maximum=_MAX_SEED)
        check_int("SamplingParams.max_tokens", self.max_tokens, minimum=1)
        set_(self, "stop", _stop_strings(self.stop))
        set_(self, "stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids))
        check_bool("SamplingParams.ignore_eos", self.ignore_eos)
        check_request_fields("SamplingParams", self.token_budget, self.selection_interval, self.dense,
                             self.speculative_tokens)
        check_bool("SamplingParams.detokenize", self.detokenize)
        check_optional_int("SamplingParams.logprobs", self.logprobs, minimum=0, maximum=MAX_LOGPROBS)
        if self.stop and not self.detokenize:
            raise ValueError(f"SamplingParams.stop={list(self.stop)!r} is matched in the output text; it needs "
                             "detokenize=True")
        set_(self, "forced_token_ids", _token_ids("forced_token_ids", self.forced_token_ids))
        if self.forced_token_ids and self.speculative_tokens:
            raise ValueError(f"SamplingParams.speculative_tokens={self.speculative_tokens} drafts tokens, which "
                             "forced_token_ids replaces: set speculative_tokens to 0 or None")
        if len(self.forced_token_ids) > self.max_tokens:
            raise ValueError(
                f"SamplingParams.max_tokens must be >= len(forced_token_ids)={len(self.forced_token_ids)} (it counts "
                f"the forced tokens too), got {self.max_tokens}"
            )

    @property
    def greedy(self) -> bool:
        """``True`` when the request takes the most likely token at every step (``temperature == 0``)."""
        return self.temperature == 0.0


def _stop_strings(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    elif not isinstance(stop, (list, tuple)):
        raise ValueError(f"SamplingParams.stop must be a string or a list of strings, got {stop!r}")
    for item in stop:
        if not isinstance(item, str) or not item:
            raise ValueError(f"SamplingParams.stop must hold non-empty strings, got {item!r} in {list(stop)!r}")
        check_text("SamplingParams.stop", item)
    return tuple(stop)


def _token_ids(name: str, ids) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"SamplingParams.{name} must be a list of token ids, got {ids!r}")
    for i, item in enumerate(ids):
        check_int(f"SamplingParams.{name}[{i}]", item, minimum=0)
    return tuple(ids)


def check_length(num_prompt_tokens: int, max_tokens: int, max_model_len: int, prompt: str = "prompt") -> None:
    """Raise ``ValueError`` unless ``num_prompt_tokens`` and ``max_tokens`` fit ``max_model_len``: the prompt
    leaves room for one generated token and ``max_tokens`` does not run past the context (refused, never
    clamped). The engine's and the server's one rule; ``prompt`` names the prompt in the message (the server's
    ``messages``)."""
    check_int("num_prompt_tokens", num_prompt_tokens, minimum=1)
    check_int("SamplingParams.max_tokens", max_tokens, minimum=1)
    if num_prompt_tokens >= max_model_len:
        raise ValueError(
            f"the {prompt} has {num_prompt_tokens} tokens but max_model_len={max_model_len} allows at most "
            f"{max_model_len - 1}, leaving room for one generated token"
        )
    if num_prompt_tokens + max_tokens > max_model_len:
        raise ValueError(
            f"max_tokens={max_tokens} with the {prompt}'s {num_prompt_tokens} tokens exceeds "
            f"max_model_len={max_model_len}: max_tokens may be at most {max_model_len - num_prompt_tokens}"
        )
