"""``questkv bench latency``: prefill and per-step decode latency of the engine, dense and Quest side by side.

vLLM's ``benchmark_latency`` shape: every iteration queues ``batch_size`` requests of ``input_len`` random token ids
(greedy, ``ignore_eos``, ``output_len`` tokens each) and steps the engine until they finish. The engine prefills
first: the steps until every request has its first token are the prefill (one step when the batch's prompts fit
:data:`MAX_PREFILL_TOKENS`), the steps after them decode steps, one token per request. Dense and Quest run one after
the other in one process, on the same prompts; each engine is freed before the next is built. Owns the timing and
the report; the engine is :class:`~questkv.engine.llm.LLM`'s.

A lossless Quest engine (``speculative_config``) outputs no token on a draft step and up to ``k + 1`` per request on
a verify step, so its decode step time is that of an equivalent one-token step: the decode steps' time over the
tokens each request gained in them. Its rows add the acceptance rate and the tokens per verify step.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from typing import Any, Callable, Optional

import torch

from questkv.config import QuestConfig
from questkv.validation import check_int

__all__ = ["LatencySpec", "MAX_PREFILL_TOKENS", "RUNS", "format_table", "measure", "run_latency"]

RUNS = ("dense", "quest")
# Prompt tokens of one prefill step, at most (unless one prompt is longer): the runner keeps activation memory for
# that many tokens beside the KV cache, so B=16 at 32k in one step would leave no room for the cache.
MAX_PREFILL_TOKENS = 65536
_REQUEST_MEANS = ("mean_tokens_attended", "acceptance_rate", "mean_tokens_per_verify")
"""The :class:`~questkv.engine.sequence.RequestMetrics` fields an iteration averages over its requests."""


@dataclasses.dataclass(frozen=True)
class LatencySpec:
    """What one latency run measures.

    Attributes:
        input_len: prompt tokens per request. output_len: tokens generated per request.
        batch_size: requests per iteration (decoded together).
        num_iters: timed iterations. num_iters_warmup: untimed ones before them (compilation, allocator).
        seed: the prompts' random token ids.
    """

    input_len: int = 8192
    output_len: int = 128
    batch_size: int = 1
    num_iters: int = 3
    num_iters_warmup: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("LatencySpec.input_len", self.input_len, minimum=1)
        check_int("LatencySpec.output_len", self.output_len, minimum=1)
        check_int("LatencySpec.batch_size", self.batch_size, minimum=1)
        check_int("LatencySpec.num_iters", self.num_iters, minimum=1)
        check_int("LatencySpec.num_iters_warmup", self.num_iters_warmup, minimum=0)
        check_int("LatencySpec.seed", self.seed, minimum=0)

    def engine_kwargs(self) -> dict[str, Any]:
        """Engine settings every run needs: all requests decoded together, their prefill in as few steps as fit,
        unchunked (a chunked prefill would mix decode tokens of the requests already started into the steps of the
        later chunks, and count them as prefill; ``--enable-chunked-prefill`` asks for it)."""
        tokens = max(self.input_len, min(self.batch_size * self.input_len, MAX_PREFILL_TOKENS))
        return {"max_num_seqs": self.batch_size, "max_num_batched_tokens": tokens, "enable_chunked_prefill": False}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(engine, spec: LatencySpec, progress: bool = True, desc: str = "") -> dict[str, Any]:
    """Time ``spec``'s iterations on ``engine`` (an :class:`~questkv.engine.llm_engine.LLMEngine`).

    Returns:
        ``{"prefill_s", "decode_ms_per_step", "decode_tokens_per_s", "e2e_s"}`` (medians over the timed
        iterations; an iteration's prefill is the sum of its prefill steps, its decode step time the median of
        its decode steps, or with a speculative config their total time over the tokens a request gained in them
        (see the module docstring), ``None`` without one), ``"mean_tokens_attended"`` and ``"kv_fraction"`` (of
        the mean context, at most 1: :func:`questkv.generate.kv_read`) of the decode steps,
        ``"acceptance_rate"`` and ``"mean_tokens_per_verify"`` (means over the requests, ``None`` without a
        verify step: :class:`~questkv.engine.sequence.RequestMetrics`), ``"iterations"``: the same per timed
        iteration, and ``"weight_bytes"`` and ``"kv_tokens"``: what the engine holds and how many tokens of KV
        its pool fits.
    """
    from tqdm.auto import tqdm

    from questkv.engine.sampling_params import SamplingParams
    from questkv.generate import kv_read, mean_decode_context

    device = engine.config.torch_device
    lossless = engine.config.speculative_config is not None
    rng = random.Random(spec.seed)  # the same prompts for every engine of a run
    vocab = engine.spec.vocab_size
    params = SamplingParams(temperature=0, max_tokens=spec.output_len, ignore_eos=True)
    iterations = []
    for index in tqdm(range(spec.num_iters_warmup + spec.num_iters), desc=desc or "iterations", disable=not progress):
        prompts = [[rng.randrange(vocab) for _ in range(spec.input_len)] for _ in range(spec.batch_size)]
        lengths = dict.fromkeys((engine.add_request(p, params) for p in prompts), 0)  # output tokens so far
        prefill, decode, decode_tokens, finished = [], [], 0, []
        _synchronize(device)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            # No synchronisation per step: a step returns once the tokens it reports are on the host, so the calls
            # time the steps back to back (under asynchronous scheduling, one step behind the one it launches).
            decoding = all(lengths.values())  # every request had its first token before this step
            before = time.perf_counter()
            outputs = engine.step()
            (decode if decoding else prefill).append(time.perf_counter() - before)
            for out in outputs:
                if out.request_id not in lengths:
                    continue
                if decoding:
                    decode_tokens += len(out.token_ids) - lengths[out.request_id]
                lengths[out.request_id] = len(out.token_ids)
                if out.finished:
                    finished.append(out.metrics)
        e2e = time.perf_counter() - start
        if index < spec.num_iters_warmup:
            continue
        if not decode:
            step_s = None
        elif lossless:  # the time of an equivalent step of one token per request
            step_s = sum(decode) * spec.batch_size / decode_tokens
        else:
            step_s = statistics.median(decode)
        iterations.append({
            "prefill_s": sum(prefill),
            "decode_ms_per_step": None if step_s is None else step_s * 1e3,
            "decode_tokens_per_s": None if step_s is None else spec.batch_size / step_s,
            "e2e_s": e2e,
            "prefill_steps": len(prefill),
            "decode_steps": len(decode),
            **{key: _mean([getattr(metrics, key) for metrics in finished]) for key in _REQUEST_MEANS},
        })
    result = {key: _median([it[key] for it in iterations])
              for key in ("prefill_s", "decode_ms_per_step", "decode_tokens_per_s", "e2e_s", *_REQUEST_MEANS)}
    result["mean_tokens_attended"], result["kv_fraction"] = kv_read(
        result["mean_tokens_attended"], mean_decode_context(spec.input_len, spec.output_len))
    result["iterations"] = iterations
    memory = engine.runner.cache_spec
    result.update(weight_bytes=memory.weight_bytes, kv_tokens=memory.kv_tokens)
    return result


def _median(values: list) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _mean(values: list) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def run_latency(
    make_engine: Callable[[Optional[QuestConfig]], Any],
    spec: LatencySpec,
    quest: QuestConfig,
    runs: tuple[str, ...] = ("dense", "quest"),
    progress: bool = True,
) -> dict[str, Any]:
    """Measure each of ``runs`` (``"dense"``: ``make_engine(None)``, ``"quest"``: ``make_engine(quest)``), one
    engine alive at a time.

    Args:
        make_engine: builds an :class:`~questkv.engine.llm_engine.LLMEngine` for a Quest config or ``None``.
        spec: what to measure. quest: the Quest engine's config.
        runs: which engines, in order.

    Returns:
        ``{"results": {run: measure(...)}, "speedup": dense / Quest decode step time, or None}``.
    """
    if not runs or any(run not in RUNS for run in runs):
        raise ValueError(f"runs must be 'dense' and/or 'quest', got {list(runs)!r}")
    results = {}
    for run in runs:
        engine = make_engine(None if run == "dense" else quest)
        try:
            results[run] = measure(engine, spec, progress=progress, desc=run)
        finally:
            engine.close()  # its pool, graphs and weights, before the next engine sizes its pool
    dense, sparse = (results.get(run, {}).get("decode_ms_per_step") for run in ("dense", "quest"))
    return {"results": results, "speedup": dense / sparse if dense and sparse else None}


def format_table(document: dict[str, Any]) -> str:
    """The runs of :func:`run_latency` (with ``document["quest"]``: the Quest config as a dict, and
    ``document["speculative_config"]``: the Quest engine's, as a dict, or ``None``) as a text table."""
    speculative = document.get("speculative_config")
    header = (f"{'engine':<7} {'budget':>7} {'prefill s':>10} {'decode ms/step':>15} {'decode tok/s':>13} "
              f"{'e2e s':>8} {'attended/step':>14} {'KV read':>8} {'weights GiB':>12} {'KV tokens':>11}")
    header += f" {'accepted':>9} {'tok/verify':>11}" if speculative else ""
    lines = [header, "-" * len(header)]
    for run, row in document["results"].items():
        budget = document["quest"]["token_budget"] if run == "quest" else None
        lines.append(
            f"{run:<7} {'full' if budget is None else budget:>7} {_fmt(row['prefill_s'], '.3f'):>10} "
            f"{_fmt(row['decode_ms_per_step'], '.2f'):>15} {_fmt(row['decode_tokens_per_s'], '.1f'):>13} "
            f"{_fmt(row['e2e_s'], '.2f'):>8} {_fmt(row['mean_tokens_attended'], '.1f'):>14} "
            f"{_fmt(row['kv_fraction'], '.1%'):>8} {_fmt(_gib(row.get('weight_bytes')), '.2f'):>12} "
            f"{_fmt(row.get('kv_tokens'), ','):>11}"
            + (f" {_fmt(row.get('acceptance_rate'), '.1%'):>9} {_fmt(row.get('mean_tokens_per_verify'), '.2f'):>11}"
               if speculative else "")
        )
    if speculative:
        lines.append(f"quest is lossless: up to {speculative['num_speculative_tokens']} Quest draft tokens per round, "
                     "verified by dense attention; its ms/step is per token of a request")
    if document.get("speedup") is not None:
        lines.append(f"decode speedup, dense / Quest (ms per step): {document['speedup']:.2f}x")
    return "\n".join(lines)


def _gib(n: Optional[int]) -> Optional[float]:
    return None if n is None else n / 2**30


def _fmt(value: Optional[float], spec: str) -> str:
    return "n/a" if value is None else format(value, spec)
