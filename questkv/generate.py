"""Streaming text generation with Quest sparse decoding (the ``questkv generate`` command)."""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch

from questkv.config import QuestConfig
from questkv.validation import check_float, check_int


@dataclasses.dataclass(frozen=True)
class GenerationStats:
    """Token counts and speeds of one generation. Prefill time runs to the first new token."""

    prompt_tokens: int
    new_tokens: int
    prefill_seconds: float
    decode_seconds: float

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first one, per second of decode."""
        steps = self.new_tokens - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else float("nan")


def _timing_streamer(tokenizer):
    from transformers import TextStreamer

    class TimingStreamer(TextStreamer):
        """Streams to stdout and records when every new token arrives."""

        def __init__(self) -> None:
            super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
            self.token_times: list[float] = []

        def put(self, value: torch.Tensor) -> None:
            if not self.next_tokens_are_prompt:
                self.token_times.append(time.perf_counter())
            super().put(value)

    return TimingStreamer()


def generate_text(
    prompt: str,
    quest: Optional[QuestConfig] = None,
    model: str = "smollm2-135m",
    device: str = "cpu",
    dtype: str = "bfloat16",
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    chat: bool = False,
    seed: int = 0,
) -> GenerationStats:
    """Load ``model``, enable Quest with ``quest`` (default ``QuestConfig()``: dense), stream a
    continuation of ``prompt`` to stdout.

    ``temperature == 0`` decodes greedily; otherwise sampling with ``temperature`` and ``top_p``
    (passed to ``model.generate`` unchanged).
    """
    from questkv.integrations.hf import enable
    from questkv.models import load_model

    check_int("max_new_tokens", max_new_tokens, minimum=1)
    check_float("temperature", temperature, low=0)
    check_float("top_p", top_p, low=0, high=1, low_open=True)
    config = QuestConfig() if quest is None else quest
    lm, tokenizer = load_model(model, device=device, dtype=dtype)
    enable(lm, config)
    if chat:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    inputs = tokenizer(prompt, return_tensors="pt").to(lm.device)
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else {"do_sample": False}
    torch.manual_seed(seed)
    streamer = _timing_streamer(tokenizer)
    start = time.perf_counter()
    lm.generate(**inputs, max_new_tokens=max_new_tokens, streamer=streamer, pad_token_id=tokenizer.eos_token_id, **sampling)
    times = streamer.token_times
    return GenerationStats(
        prompt_tokens=inputs["input_ids"].shape[1],
        new_tokens=len(times),
        prefill_seconds=times[0] - start,
        decode_seconds=times[-1] - times[0],
    )
