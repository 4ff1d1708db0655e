"""Streaming text generation with Quest sparse decoding (the ``questkv generate`` command)."""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch

from questkv.config import QuestConfig


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
    model: str = "smollm2-135m",
    device: str = "cpu",
    dtype: str = "bfloat16",
    budget: Optional[int] = None,
    page_size: int = 16,
    dense_layers: int = 2,
    selection: str = "kv_head",
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    chat: bool = False,
    seed: int = 0,
) -> GenerationStats:
    """Load ``model``, enable Quest with ``budget`` (``None`` = dense), stream a continuation of ``prompt`` to stdout.

    ``temperature == 0`` decodes greedily; otherwise sampling with ``temperature`` and ``top_p``
    (passed to ``model.generate`` unchanged).
    """
    from questkv.integrations.hf import enable
    from questkv.models import load_model

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    config = QuestConfig(token_budget=budget, page_size=page_size, dense_layers=dense_layers, selection=selection)
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
