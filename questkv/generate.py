"""Streaming generation on the engine (the ``questkv generate`` command): one request, its text printed as it grows.

Owns the step loop of a single request and its statistics; the engine (:class:`~questkv.engine.llm_engine.LLMEngine`)
owns scheduling, sampling, detokenisation and the metrics this module reads back.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Optional, TextIO

from questkv.config import QuestConfig
from questkv.validation import check_bool, check_int

__all__ = ["GenerationStats", "generate_text", "kv_read", "mean_decode_context", "stream_request"]

_STDOUT = object()  # the default stream: sys.stdout when called (not when defined: tests swap it)
_PARTIAL = "\ufffd"  # what a tokenizer decodes an incomplete UTF-8 sequence to: held back until it completes


def mean_decode_context(prompt_tokens: int, new_tokens: int) -> float:
    """KV tokens a decode step of a request holds, averaged over its decode steps: the first new token comes from
    the prefill, decode step ``i`` (1 ... ``new_tokens - 1``) holds ``prompt_tokens + i``."""
    return prompt_tokens + new_tokens / 2


def kv_read(mean_tokens_attended: Optional[float], mean_context: float) -> tuple[Optional[float], Optional[float]]:
    """The KV tokens a decode step read and their share of the KV cache: ``(tokens, tokens / mean_context)``,
    ``tokens`` = ``min(mean_tokens_attended, mean_context)`` (both means over the decode steps).

    The engine counts each page a Quest layer selects in full, the current, partial page too, so a budget that
    covers a short context counts up to a page per sparse layer more tokens than the context holds; a decode step
    never reads more than its whole context, hence the cap (on the means: the engine reports no step's count).

    Returns:
        ``(None, None)`` without a decode step (``mean_tokens_attended is None``).
    """
    if mean_tokens_attended is None:
        return None, None
    tokens = min(mean_tokens_attended, mean_context)
    return tokens, tokens / mean_context


@dataclasses.dataclass(frozen=True)
class GenerationStats:
    """Token counts, speeds and attention of one generation.

    Attributes:
        prompt_tokens: tokens of the prompt (after the chat template, if any).
        new_tokens: tokens generated.
        prefill_seconds: arrival to the first new token (the engine's ``time_to_first_token``).
        decode_tokens_per_s: tokens after the first per second; ``None`` with fewer than two tokens.
        mean_tokens_attended: KV tokens one decode step attended, averaged over steps, layers and heads, at most
            :attr:`mean_context` (:func:`kv_read`); ``None`` without a decode step.
        finish_reason: ``"stop"`` or ``"length"``.
        acceptance_rate, mean_tokens_per_verify, acceptance_by_position: lossless Quest (``speculative_config``):
            the share of draft tokens its verify steps kept, the tokens each verify step output and the share kept
            per draft position of a round; ``None`` without a verify step.
    """

    prompt_tokens: int
    new_tokens: int
    prefill_seconds: float
    decode_tokens_per_s: Optional[float]
    mean_tokens_attended: Optional[float]
    finish_reason: Optional[str]
    acceptance_rate: Optional[float] = None
    mean_tokens_per_verify: Optional[float] = None
    acceptance_by_position: Optional[tuple[float, ...]] = None

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else float("nan")

    @property
    def mean_context(self) -> float:
        """Mean KV tokens per decode step (:func:`mean_decode_context`): what a dense step reads."""
        return mean_decode_context(self.prompt_tokens, self.new_tokens)

    @property
    def kv_fraction(self) -> Optional[float]:
        """The share of the KV cache one decode step read, at most 1.0 (dense) (:func:`kv_read`)."""
        return kv_read(self.mean_tokens_attended, self.mean_context)[1]

    def summary(self) -> str:
        """One line: prompt, prefill, decode, attention and (lossless Quest) the drafts kept."""
        decode = "n/a" if self.decode_tokens_per_s is None else f"{self.decode_tokens_per_s:.1f} tok/s"
        line = (f"prompt: {self.prompt_tokens} tokens | prefill: {self.prefill_tokens_per_s:.1f} tok/s "
                f"({self.prefill_seconds:.2f} s to the first token) | decode: {self.new_tokens} tokens, {decode}")
        if self.mean_tokens_attended is not None:
            line += (f" | attended: {self.mean_tokens_attended:.1f} tokens per step "
                     f"({self.kv_fraction:.1%} of the KV cache)")
        if self.acceptance_rate is not None:
            by_position = " / ".join(f"{rate:.0%}" for rate in self.acceptance_by_position)
            line += (f" | lossless: {self.acceptance_rate:.1%} of the drafts kept ({by_position} by position), "
                     f"{self.mean_tokens_per_verify:.2f} tokens per verify step")
        return line


def stream_request(engine, prompt, params, stream: Optional[TextIO] = None, progress: bool = False):
    """Add one request to ``engine``, step until it finishes, writing its text to ``stream`` as it grows.

    Args:
        engine: an :class:`~questkv.engine.llm_engine.LLMEngine` (other requests may share it).
        prompt: text or token ids.
        params: its :class:`~questkv.engine.sampling_params.SamplingParams`.
        stream: where the text goes (flushed every step); ``None``: nowhere.
        progress: until the first token, a tqdm bar on stderr counting the prompt tokens the engine's steps
            prefilled (a long prompt's chunks move it), erased once the text starts.

    Returns:
        The request's final :class:`~questkv.engine.sequence.RequestOutput`.
    """
    from tqdm.auto import tqdm

    request_id = engine.add_request(prompt, params)
    counted = engine.scheduler.step_tokens  # input tokens of the launched steps, by kind of row
    before = counted["prefill"]
    printed, last = "", None
    with tqdm(desc="prefill", unit="tok", leave=False, disable=not progress) as prefill:
        while last is None or not last.finished:
            if not engine.has_unfinished_requests():
                raise RuntimeError(f"request {request_id} is unfinished but the engine has no request left")
            outputs = engine.step()
            prefill.update(counted["prefill"] - before - prefill.n)
            for out in outputs:
                if out.request_id != request_id:
                    continue
                prefill.close()  # its first token: the prefill is done (closing again does nothing)
                last = out
                text = out.text if out.finished else out.text.rstrip(_PARTIAL)
                if stream is not None and text.startswith(printed) and len(text) > len(printed):
                    stream.write(text[len(printed):])
                    stream.flush()
                    printed = text
    return last


def generate_text(
    prompt: str,
    quest: Optional[QuestConfig] = None,
    model: str = "smollm2-135m",
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    chat: bool = False,
    seed: int = 0,
    stream: Optional[TextIO] = _STDOUT,
    progress: bool = True,
    **engine_kwargs,
) -> GenerationStats:
    """Build the engine for ``model`` (dense, or Quest with ``quest``), stream a continuation of ``prompt``.

    Args:
        prompt: the prompt text; with ``chat``, the user message rendered by the tokenizer's chat template.
        quest: Quest on decode steps; ``None`` or a dense config (``token_budget=None``): dense.
        model: an alias, HF folder or ``.gguf`` (what :func:`questkv.load_model` takes).
        max_new_tokens: the most tokens to generate (it stops earlier at the model's end of sequence).
        temperature, top_p: sampling; ``temperature == 0`` is greedy.
        seed: the engine's and the request's seed.
        stream: where the text goes as it is generated (default stdout); ``None``: nowhere.
        progress: a tqdm bar on stderr counting the prompt tokens prefilled until the first token
            (:func:`stream_request`).
        **engine_kwargs: other :class:`~questkv.engine.engine_config.EngineConfig` fields (``device``, ``dtype``,
            ``max_model_len``, ``enforce_eager``, ``speculative_config`` for lossless Quest, ...).

    Raises:
        ValueError: a bad argument (checked before the model loads), a prompt the engine refuses, or
            ``chat`` with a tokenizer that has no chat template.
    """
    from questkv.engine.llm import LLM
    from questkv.engine.sampling_params import SamplingParams

    check_int("max_new_tokens", max_new_tokens, minimum=1)
    check_bool("chat", chat)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_new_tokens,
                            seed=seed if temperature > 0 else None)
    if quest is not None and not isinstance(quest, QuestConfig):
        raise ValueError(f"quest must be a QuestConfig or None, got {type(quest).__name__}")
    stream = sys.stdout if stream is _STDOUT else stream
    llm = LLM(model, quest=quest, seed=seed, max_num_seqs=1, **engine_kwargs)
    request = render_chat(llm.tokenizer, prompt) if chat else prompt
    out = stream_request(llm.engine, request, params, stream, progress)
    if stream is not None:
        stream.write("\n")
        stream.flush()
    metrics = out.metrics
    context = mean_decode_context(len(out.prompt_token_ids), len(out.token_ids))
    return GenerationStats(
        prompt_tokens=len(out.prompt_token_ids),
        new_tokens=len(out.token_ids),
        prefill_seconds=metrics.time_to_first_token,
        decode_tokens_per_s=metrics.decode_tokens_per_s,
        mean_tokens_attended=kv_read(metrics.mean_tokens_attended, context)[0],
        finish_reason=out.finish_reason,
        acceptance_rate=metrics.acceptance_rate,
        mean_tokens_per_verify=metrics.mean_tokens_per_verify,
        acceptance_by_position=metrics.acceptance_by_position,
    )


def render_chat(tokenizer, message: str) -> list[int]:
    """Token ids of ``message`` as the user's turn under ``tokenizer``'s chat template, ready for the reply.

    Raises:
        ValueError: no tokenizer or no chat template.
    """
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("--chat needs a tokenizer with a chat template; this model's tokenizer has none")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=True,
                                        add_generation_prompt=True)
    if hasattr(ids, "keys"):  # transformers may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
