"""End-to-end decode speed on a GPU: the questkv engine dense vs Quest, HF transformers baselines, bytes floor.

Random ("dummy") weights at real shapes (``questkv.models.shapes``), bf16, page 16, dense_layers 2. Per
point, in one run: engine dense and engine Quest (CUDA graphs), HF eager SDPA and HF static cache where
chosen, and the bytes floor. Before timing, a correctness check: the engine's CUDA path (Triton kernels,
CUDA graphs) against its eager torch-reference path and against HF, on a small fp32 model (tokens must
be identical) and at the 8B shape in bf16 (agreement reported).

Decode contexts are filled synthetically: the scheduler admits each request and allocates its pages as
usual, then random K/V (and their page bounds) are written instead of running the prompt through the
model; decode reads the same bytes either way. Prefill is timed for real, separately, at batch 1.

    python benchmarks/e2e_bench.py --out-dir benchmarks/results --tag h200
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

if __name__ == "__main__":  # run as a file: the checkout importable (questkv, benchmarks.*)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from questkv.config import QuestConfig  # noqa: E402
from questkv.engine.llm import LLM  # noqa: E402
from questkv.engine.sampling_params import SamplingParams  # noqa: E402
from questkv.eval.provenance import provenance  # noqa: E402
from questkv.layers.linear import Linear  # noqa: E402
from questkv.layers.quantized_linear import QuantizedLinear, model_weight_bytes  # noqa: E402
from questkv.models.shapes import dummy_config  # noqa: E402
from questkv.ops.triton import _common as triton_common  # noqa: E402

PAGE = 16
DENSE_LAYERS = 2
# (model, batch, context, budget, target speedup of Quest over the engine dense, or None: report)
POINTS = [
    ("llama3.1-8b", 1, 1024, 2048, None),  # weights and fixed costs: attention is negligible here
    ("llama3.1-8b", 1, 128 * 1024, 4096, 1.6),
    ("llama3.1-8b", 16, 32 * 1024, 2048, 2.6),
    ("llama3.1-8b", 4, 128 * 1024, 4096, 2.8),
    ("llama2-7b", 1, 32 * 1024, 2048, 1.74),  # the paper's point: 1.74x fp16, 2.23x with 4-bit weights
    ("llama3.1-8b", 1, 32 * 1024, 2048, None),
    ("llama3.1-8b", 1, 8 * 1024, 2048, None),
    ("llama3.1-8b", 1, 64 * 1024, 2048, None),
    ("llama3.1-8b", 4, 32 * 1024, 2048, None),
    ("llama3.1-8b", 4, 1024, 2048, None),  # the route's short contexts (with points 0, 5, 6, 8): never below dense
    ("llama3.1-8b", 4, 8 * 1024, 2048, None),
    ("llama3.1-8b", 32, 8 * 1024, 2048, None),  # 32 rows through the linears: int4 dense against bf16 dense
]
INT4_TARGETS = {("llama2-7b", 1, 32 * 1024): 2.23}  # a point's target with --quantization int4, where it differs
WARMUP_STEPS, TIMED_STEPS = 6, 32


def context_config(name: str, context: int):
    """:func:`~questkv.models.shapes.dummy_config` of shape ``name`` with positions for ``context`` tokens and the
    steps after them (at least 4096): a benchmark's context may exceed the shape's own limit (llama2-7b at 32k)."""
    return dummy_config(name, max_position_embeddings=max(context + 1024, 4096))


def kv_bytes_per_token(cfg, layers=None) -> int:
    heads = cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return (layers if layers is not None else cfg.num_hidden_layers) * 2 * heads * head_dim * 2


def floor_ms(cfg, weight_bytes, batch, context, budget, bandwidth) -> tuple[float, float]:
    """Bytes floor of one decode step, dense and Quest: weights + K/V (+ page bounds) read."""
    layers = cfg.num_hidden_layers
    per_layer = kv_bytes_per_token(cfg, 1)
    dense = weight_bytes + batch * context * per_layer * layers
    pages = math.ceil(context / PAGE)
    sparse_tokens = min(context, budget)
    # per sparse layer: the selected pages' K+V (budget tokens) and every page's kmin+kmax (2 rows of K size)
    quest = weight_bytes + batch * (
        DENSE_LAYERS * context * per_layer
        + (layers - DENSE_LAYERS) * (sparse_tokens * per_layer + pages * per_layer)
    )
    return dense / bandwidth * 1e3, quest / bandwidth * 1e3


def measure_bandwidth() -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), median of 20."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * (2 << 30) / statistics.median(times[5:])


def synthetic_prefill(engine) -> None:
    """Admit every waiting request with random K/V and bounds in its pages instead of a model forward."""
    cache = engine.cache
    gen = torch.Generator(device=cache.device).manual_seed(0)
    while engine.scheduler.num_waiting:
        batch = engine.scheduler.schedule()
        if batch.num_decodes:
            raise RuntimeError("a decode came before every request was admitted")
        pages = torch.tensor([p for seq in batch.seqs for p in cache.pages_of(seq.cache_id)], device=cache.device)
        for layer in range(cache.num_layers):
            stored = cache.layer(layer)  # K/V and bounds in the layer's dtype (fp8, or the model's)
            shape = (len(pages),) + tuple(stored.k_pages.shape[1:])
            keys = torch.randn(shape, generator=gen, device=cache.device, dtype=cache.dtype).to(stored.k_pages.dtype)
            values = torch.randn(shape, generator=gen, device=cache.device, dtype=cache.dtype)
            stored.k_pages[pages] = keys
            stored.v_pages[pages] = values.to(stored.v_pages.dtype)
            wide = keys.to(cache.dtype)  # (no min/max kernels for fp8; exact: min and max pick one of the keys)
            stored.kmin[pages] = wide.amin(1).to(stored.kmin.dtype)
            stored.kmax[pages] = wide.amax(1).to(stored.kmax.dtype)
        engine.scheduler.update(batch, [1] * len(batch.seqs))


def time_engine(cfg, quest, batch, context, seed=0, quantization=None, linear_backend="auto",
                quantize_lm_head=False) -> dict:
    """ms per decode step of ``batch`` sequences at ``context`` tokens (synthetic prefill), with the host loop
    synchronous and asynchronous (``EngineConfig.async_scheduling``), on one engine, side by side; the GPU time
    of one graph replay; the kernels of one decode step (torch profiler over a replay). ``linear_backend``: the
    float linear layers' backend (``"torch"``: cuBLAS at every row, where ``"auto"`` takes questkv's GEMV for one
    row and a small weight).

    Each mode's time is the wall time of the timed window of ``engine.step()`` calls over its steps (no
    synchronisation between calls: a synchronous step waits for its own tokens, an asynchronous one for the
    step launched before it); the median call is kept beside it."""
    steps = WARMUP_STEPS + TIMED_STEPS
    total = 2 * steps + 2
    need = batch * (context + total + 2 * PAGE) * kv_bytes_per_token(cfg) * (2 * PAGE + 2) // (2 * PAGE)
    # Unchunked: the synthetic prefill admits every request before the first decode step.
    llm = LLM(cfg, quest=quest, load_format="dummy", dtype="bfloat16", device="cuda", max_num_seqs=batch,
              max_model_len=context + PAGE, kv_cache_memory=int(need * 1.05) + (256 << 20), seed=seed,
              quantization=quantization, quantize_lm_head=quantize_lm_head, enable_chunked_prefill=False)
    engine = llm.engine
    for module in engine.runner.model.modules():  # before the first decode step captures its graph
        if isinstance(module, Linear):
            module.backend = linear_backend
    params = SamplingParams(temperature=0, max_tokens=total + 4, ignore_eos=True)
    gen = torch.Generator().manual_seed(seed)
    # The prompt leaves room for the timed steps: every step's KV length stays within ``context``.
    for _ in range(batch):
        engine.add_request(torch.randint(0, cfg.vocab_size, (context - total - 2,), generator=gen).tolist(), params)
    synthetic_prefill(engine)
    result = {}
    for mode in ("sync", "async"):
        # The engine reads the mode at every step: switching it between the runs times both on one engine.
        engine.config = dataclasses.replace(engine.config, async_scheduling=mode == "async")
        torch.cuda.synchronize()
        times = []
        for i in range(steps):
            start = time.perf_counter()
            outputs = engine.step()
            times.append(time.perf_counter() - start)
            if (mode == "sync" or i > 0) and (len(outputs) != batch or outputs[0].finished):
                raise RuntimeError(f"{mode} decode step {i} returned {len(outputs)} outputs")
        timed = times[WARMUP_STEPS:]
        ms = sum(timed) / len(timed) * 1e3  # the timed window's wall time per step: calls run back to back
        result[mode] = {"ms_per_token": ms, "tokens_per_s": batch / ms * 1e3,
                        "median_call_ms": statistics.median(timed) * 1e3,
                        "spread_ms": [min(timed) * 1e3, max(timed) * 1e3]}
    attended = engine.scheduler.running[0].metrics().mean_tokens_attended if engine.scheduler.running else None
    graphs = len(engine.runner.graphs)
    graph_ms = replay_ms(engine.runner)
    kernels = profile_replay(engine.runner)
    model = engine.runner.model
    weight_bytes = model_weight_bytes(model)
    del llm, engine, outputs, model
    gc.collect()
    torch.cuda.empty_cache()
    for mode in result.values():
        mode["exposed_host_ms"] = mode["ms_per_token"] - graph_ms
    return {**result["async"], "sync": result["sync"], "mean_tokens_attended": attended, "graphs": graphs,
            "weight_bytes": weight_bytes, "graph_replay_ms": graph_ms,
            "kernels": kernels}


def time_pair(cfg, quest, batch, context, rounds: int = 8, steps_per_round: int = 8, seed=0,
              built_first: str = "dense") -> dict:
    """The dense engine and the Quest engine alive side by side, timed in alternation: ``rounds`` rounds, each
    timing ``steps_per_round`` asynchronous decode steps of one engine, then of the other (the first of the two
    alternating by round), and one graph replay measure (:func:`replay_ms`) of each; after 6 warm-up steps each.
    Returns each engine's median over rounds of ms per step and of the graph replay, and the medians of the
    per-round ratios dense / Quest: a ratio that the order of the runs or clocks cannot bias. ``built_first``
    (``"dense"`` or ``"quest"``): the engine allocated first (its memory placement; swap it to see its effect)."""
    total = 6 + rounds * steps_per_round + 4
    need = batch * (context + total + 2 * PAGE) * kv_bytes_per_token(cfg) * (2 * PAGE + 2) // (2 * PAGE)
    engines = {}
    order = (("dense", None), ("quest", quest))
    for name, config in (order if built_first == "dense" else order[::-1]):
        llm = LLM(cfg, quest=config, load_format="dummy", dtype="bfloat16", device="cuda", max_num_seqs=batch,
                  max_model_len=context + PAGE, kv_cache_memory=int(need * 1.05) + (256 << 20), seed=seed,
                  enable_chunked_prefill=False, async_scheduling=True)
        gen = torch.Generator().manual_seed(seed)
        params = SamplingParams(temperature=0, max_tokens=total + 4, ignore_eos=True)
        for _ in range(batch):
            llm.engine.add_request(torch.randint(0, cfg.vocab_size, (context - total - 2,), generator=gen).tolist(),
                                   params)
        synthetic_prefill(llm.engine)
        for _ in range(6):
            llm.engine.step()
        engines[name] = llm
    ms, graph = time_rounds({name: engines[name] for name in ("dense", "quest")}, rounds, steps_per_round,
                            replay=True)
    result = {name: {"ms_per_token": statistics.median(ms[name]), "graph_replay_ms": statistics.median(graph[name]),
                     "ms_rounds": ms[name], "graph_rounds": graph[name]} for name in engines}
    result["speedup"] = statistics.median(d / q for d, q in zip(ms["dense"], ms["quest"]))
    result["graph_speedup"] = statistics.median(d / q for d, q in zip(graph["dense"], graph["quest"]))
    result["rounds"], result["steps_per_round"], result["built_first"] = rounds, steps_per_round, built_first
    for llm in engines.values():
        llm.close()
    del engines
    gc.collect()
    torch.cuda.empty_cache()
    return result


def time_rounds(engines: dict, rounds: int, steps_per_round: int, replay: bool = False) -> tuple[dict, dict]:
    """Engines (``{name: LLM}``, alive together) timed in alternation: ``rounds`` rounds, each timing
    ``steps_per_round`` asynchronous steps of every engine in turn, the order reversed every other round. Returns
    ``(ms, graph)``: per name, the ms per step of each round and, with ``replay``, one :func:`replay_ms` per round
    (else empty lists)."""
    ms = {name: [] for name in engines}
    graph = {name: [] for name in engines}
    order = list(engines)
    for r in range(rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            engine = engines[name].engine
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps_per_round):
                engine.step()
            torch.cuda.synchronize()
            ms[name].append((time.perf_counter() - start) / steps_per_round * 1e3)
            if replay:
                graph[name].append(replay_ms(engine.runner))
    return ms, graph


def replay_ms(runner, replays: int = 20, route=None) -> float:
    """GPU time of one replay of the last captured decode graph (of ``route``, a ``StepRoute``, when given):
    ``replays`` replays back to back between two CUDA events (after 5 untimed), divided by their number. The decode
    step without the host's scheduling, input copy and sampling; back to back, as the engine's steps run, so no
    replay pays an idle GPU's launch latency."""
    graph = runner.graphs.latest(route)
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def _kernels_by_name(prof) -> dict[str, list]:
    """A torch profile's device kernels by name: ``[count, summed µs]`` (copies and memsets left out)."""
    by_name: dict[str, list] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA or event.name.startswith(("Memcpy", "Memset")):
            continue
        entry = by_name.setdefault(event.name, [0, 0.0])
        entry[0] += 1
        entry[1] += event.device_time
    return by_name


def idle_gaps(spans: list[tuple[float, float, str]], steps: int, top: int = 8, least_us: float = 5.0) -> list[dict]:
    """Where the device idles: its intervals ``spans`` (``(start µs, end µs, name)``, kernels and copies) sorted by start,
    and each gap of at least ``least_us`` between the end of all before and the next start, summed per pair of the
    interval ending last before the gap and the one starting after it; the ``top`` pairs by idle time, per step
    (``after``, ``before``, ``us``, ``count``)."""
    pairs: dict[tuple[str, str], list] = {}
    reach, last = float("-inf"), None
    for begin, end, name in sorted(spans):
        if last is not None and begin - reach >= least_us:
            entry = pairs.setdefault((last, name), [0, 0.0])
            entry[0] += 1
            entry[1] += begin - reach
        if end >= reach:
            reach, last = end, name
    ranked = sorted(pairs.items(), key=lambda item: -item[1][1])[:top]
    return [{"after": after[:60], "before": before[:60], "us": us / steps, "count": count / steps}
            for (after, before), (count, us) in ranked]


def profile_replay(runner, top: int = 12, route=None) -> dict:
    """The kernels of one replay of the last captured decode graph (of ``route`` when given; torch profiler, CUDA
    activity): their count, summed GPU µs, and the ``top`` names by time with their count and µs."""
    from torch.profiler import ProfilerActivity, profile

    graph = runner.graphs.latest(route)
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    by_name = _kernels_by_name(prof)
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])
    return {"count": sum(n for n, _ in by_name.values()), "us": sum(us for _, us in by_name.values()),
            "top": [{"name": name[:90], "count": n, "us": us} for name, (n, us) in ranked[:top]]}


def profile_steps(engine, steps: int, top: int = 12, trace: Optional[Path] = None) -> dict:
    """Where the wall time of ``steps`` engine steps goes (torch profiler; the caller has warmed the engine up), per
    step. On CUDA, a pass with device activity only (little host overhead): ``wall_ms``; ``gpu_busy_ms``, the union
    of the device's kernel and copy intervals, and ``gpu_idle_ms``, the rest (where: ``gpu_gaps``, :func:`idle_gaps`);
    ``gpu_kernels``, every kernel by summed time (µs and launches per step, copies left out; a CUDA graph's kernels
    are listed one by one). Then a pass with
    host activity too (it adds host time per operation: compare its figures with each other): ``phases_ms``, the
    host's time in the engine's three phases (``schedule``: the scheduler; ``launch``: the runner staging inputs and
    launching the step and its sampling; ``process``: waiting for a step's tokens and appending them, stops and
    outputs), and
    ``host_ops``, the ``top`` host operations by self time (µs per step; a wait for the device shows as
    ``cudaEventSynchronize``). ``trace``: that pass's timeline written there as a Chrome trace, gzipped where
    the name ends in ``.gz`` (host operations and the kernels they launched, for ``chrome://tracing`` or Perfetto)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = engine.runner.device.type == "cuda"

    def run(activities):
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            if cuda:
                torch.cuda.synchronize()
            return prof, (time.perf_counter() - start) * 1e6

    record = {"steps": steps, "wall_ms": None, "gpu_busy_ms": None, "gpu_idle_ms": None, "gpu_kernels": []}
    if cuda:
        prof, wall_us = run([ProfilerActivity.CUDA])
        spans = [(event.time_range.start, event.time_range.end, event.name) for event in prof.events()
                 if event.device_type == torch.autograd.DeviceType.CUDA]  # kernels and copies
        busy_us, reach = 0.0, float("-inf")
        for begin, end, _ in sorted(spans):  # the union of the device's intervals
            busy_us += max(0.0, end - max(begin, reach))
            reach = max(reach, end)
        ranked = sorted(_kernels_by_name(prof).items(), key=lambda item: -item[1][1])
        record.update(wall_ms=wall_us / steps / 1e3, gpu_busy_ms=busy_us / steps / 1e3,
                      gpu_idle_ms=(wall_us - busy_us) / steps / 1e3,
                      gpu_kernels=[{"name": name[:90], "us": us / steps, "count": count / steps}
                                   for name, (count, us) in ranked],
                      gpu_gaps=idle_gaps(spans, steps))
    phases = {"schedule": (engine.scheduler, "schedule"), "launch": (engine.runner, "execute"),
              "process": (engine, "_process")}

    def labelled(name, method):
        def run_labelled(*args, **kwargs):
            with record_function(f"questkv::{name}"):
                return method(*args, **kwargs)
        return run_labelled

    for name, (owner, attr) in phases.items():  # an instance attribute shadows the method until deleted
        setattr(owner, attr, labelled(name, getattr(owner, attr)))
    try:
        prof, wall_us = run([ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    finally:
        for owner, attr in phases.values():
            delattr(owner, attr)
    if trace is not None:
        prof.export_chrome_trace(str(trace))  # (gzipped by torch where the name ends in .gz)
    phase_us, host_us = dict.fromkeys(phases, 0.0), {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            continue
        if event.name.startswith("questkv::"):
            phase_us[event.name.removeprefix("questkv::")] += event.cpu_time_total
        else:
            host_us[event.name] = host_us.get(event.name, 0.0) + event.self_cpu_time_total
    ranked = sorted(host_us.items(), key=lambda item: -item[1])[:top]
    record.update(host_wall_ms=wall_us / steps / 1e3,
                  phases_ms={name: us / steps / 1e3 for name, us in phase_us.items()},
                  host_ops=[{"name": name[:90], "us": us / steps} for name, us in ranked])
    return record


def time_host(engine, steps: int) -> dict:
    """Where the host's time of ``steps`` engine steps goes, timed without a profiler (``perf_counter`` around the
    phases; the caller has warmed the engine up), ms per step: ``wall``; ``schedule`` (the scheduler); ``launch``
    (the runner staging inputs and launching the step and its sampling), of which ``replay`` (the host's call of a
    CUDA graph's replay) and ``sample`` (launching the sampling); ``process`` (appending a step's tokens, stops,
    outputs), of which ``wait`` (blocked on the device for the tokens). ``busy`` is the wall less ``wait``: where it
    reaches the device's time per step, the host, not the device, sets the pace. ``kinds``: the same per step of
    each kind that the steps launched (``verify``: a lossless verify; ``decode``: any other step), with its
    ``steps``, so that a round's draft and verify steps are told apart."""
    from questkv.engine.step_data import SampledTokens

    runner = engine.runner
    spent = dict.fromkeys(("schedule", "launch", "replay", "sample", "process", "wait"), 0.0)

    def timed(name, method):
        def run_timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start
        return run_timed

    instances = {"schedule": (engine.scheduler, "schedule"), "launch": (runner, "execute"),
                 "replay": (runner.graphs, "replay"), "sample": (runner.tokens, "sample"),
                 "process": (engine, "_process")}
    for name, (owner, attr) in instances.items():  # an instance attribute shadows the method until deleted
        setattr(owner, attr, timed(name, getattr(owner, attr)))
    waits = {attr: getattr(SampledTokens, attr) for attr in ("token_ids", "logprobs_by_row")}
    for attr, method in waits.items():
        setattr(SampledTokens, attr, timed("wait", method))
    kinds: dict[str, dict[str, float]] = {}
    step_tokens = engine.scheduler.step_tokens  # the tokens of each kind the steps launched so far
    try:
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            before, launched, verify_tokens = dict(spent), time.perf_counter(), step_tokens["verify"]
            engine.step()
            kind = kinds.setdefault("verify" if step_tokens["verify"] > verify_tokens else "decode",
                                    dict.fromkeys((*spent, "wall", "steps"), 0.0))
            for name, seconds in spent.items():
                kind[name] += seconds - before[name]
            kind["wall"] += time.perf_counter() - launched
            kind["steps"] += 1
        wall = time.perf_counter() - start
    finally:
        for owner, attr in instances.values():
            delattr(owner, attr)
        for attr, method in waits.items():
            setattr(SampledTokens, attr, method)
    record = _per_step(spent, wall, steps)
    record["kinds"] = {name: _per_step(kind, kind.pop("wall"), int(kind.pop("steps"))) for name, kind in kinds.items()}
    return record


def _per_step(spent: dict[str, float], wall: float, steps: int) -> dict:
    """:func:`time_host`'s record of ``steps`` steps that took ``wall`` seconds, ``spent`` of them in each phase."""
    return {**{name: seconds / steps * 1e3 for name, seconds in spent.items()},
            "wall": wall / steps * 1e3, "busy": (wall - spent["wait"]) / steps * 1e3, "steps": steps}


def time_prefill(cfg, quest, context, quantization=None, quantize_lm_head=False) -> float:
    """Seconds of one real engine prefill of ``context`` tokens (batch 1, weights in ``quantization``), after a
    short warm-up prefill."""
    need = (context + 64) * kv_bytes_per_token(cfg) * 2
    llm = LLM(cfg, quest=quest, load_format="dummy", device="cuda", max_num_seqs=1, max_model_len=context + 64,
              kv_cache_memory=need + (256 << 20), enable_chunked_prefill=False,  # the prefill in one step
              quantization=quantization, quantize_lm_head=quantize_lm_head)
    engine = llm.engine
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    engine.add_request(torch.randint(0, cfg.vocab_size, (1024,), generator=gen).tolist(), params)
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request(torch.randint(0, cfg.vocab_size, (context,), generator=gen).tolist(), params)
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()
    return seconds


def hf_model(cfg):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    return model.eval()


def time_hf(model, batch, context, static: bool) -> dict:
    """ms per decode token of HF ``generate`` (greedy): the difference of two runs of different lengths.

    ``static``: one ``StaticCache`` of a fixed length, reset before each run, so that ``generate``'s
    automatic compilation of the decode step happens once (in a warm-up run) and is reused."""
    from transformers import StaticCache

    ids = torch.randint(0, model.config.vocab_size, (batch, context), device="cuda")
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    short, long = 4, 4 + TIMED_STEPS
    cache = StaticCache(config=model.config, max_cache_len=context + long + 8) if static else None

    def run(new_tokens):
        extra = {}
        if cache is not None:
            cache.reset()
            extra["past_key_values"] = cache
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs, **extra)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    if static:
        run(long)  # compiles the decode step
    t_short, t_long = run(short), run(long)
    ms = (t_long - t_short) / (long - short) * 1e3
    return {"ms_per_token": ms, "tokens_per_s": batch / ms * 1e3, "prefill_s": t_short}


def _tiny_llama():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)


def _sharpened_engine(cfg, quest, **kwargs) -> LLM:
    """A small fp32 CUDA engine of random weights whose QKV projections are scaled up 8× (sharper attention than
    N(0, 0.02): which pages a selection picks matters)."""
    llm = LLM(cfg, quest=quest, load_format="dummy", dtype="float32", device="cuda", max_num_seqs=4,
              kv_cache_memory=256 << 20, seed=5, **kwargs)
    with torch.no_grad():
        for layer in llm.engine.runner.model.model.layers:
            layer.self_attn.qkv_proj.weight.mul_(8.0)
    return llm


def _agreement(got: list[list[int]], want: list[list[int]]) -> dict:
    return {"identical": got == want, "tokens_match": sum(a == b for x, y in zip(got, want) for a, b in zip(x, y)),
            "tokens": sum(len(y) for y in want)}


def _engine_paths(quest, build):
    """The CUDA path (graphs, Triton) and the eager torch-reference path of one engine, one after the other:
    ``(path, llm)`` with ``llm = build(quest, **kwargs)``; the reference's Quest ops, page cache, float and quantized
    linear layers run the torch reference. Each engine is dropped before the next is built (the caller drops its
    name)."""
    for path, kwargs in (("cuda-graphs", {}), ("eager-reference", {"enforce_eager": True})):
        q = quest if quest is None or path == "cuda-graphs" else QuestConfig(**{**quest.to_dict(), "backend": "torch"})
        llm = build(q, **kwargs)
        if path == "eager-reference":
            llm.engine.cache.backend = "torch"
            for module in llm.engine.runner.model.modules():
                if isinstance(module, QuantizedLinear):
                    module.set_backend("torch")
                elif isinstance(module, Linear) or (hasattr(module, "backend") and hasattr(module, "pages")):
                    module.backend = "torch"
        yield path, llm
        del llm
        gc.collect()


def check_tiny_fp32() -> dict:
    """Engine CUDA path (Triton, graphs) == eager torch-reference path, greedy tokens on a small fp32 Llama: three
    prompts per setting, and one prompt dense and Quest (``-batch-1``: decode steps of one row, the batch-1
    graphs and launch plans), and requests of budget 256 on engines built for 512 (``-requests-256``: the attention
    spreads each row's smaller selection over the larger plan's splits; with reuse, its extra columns after it).
    Each request asks for log-probabilities (``SamplingParams.logprobs=2``): ``logprobs_max_abs_diff``, the largest
    difference between the two paths' log-probabilities of the same token at a position where their tokens agree,
    and ``logprobs_same_tokens``, whether each such position lists the same tokens."""
    cfg = _tiny_llama()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (700, 1500, 333)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    results = {}
    for name, quest in (("dense", None), ("quest-256", QuestConfig(token_budget=256)),
                        ("quest-256-reuse-4", QuestConfig(token_budget=256, selection_interval=4)),
                        ("quest-full", QuestConfig(token_budget=2048)),
                        ("quest-full-reuse-4", QuestConfig(token_budget=2048, selection_interval=4)),
                        ("quest-512-requests-256", QuestConfig(token_budget=512)),
                        ("quest-512-requests-256-reuse-4", QuestConfig(token_budget=512, selection_interval=4)),
                        ("dense-batch-1", None), ("quest-256-batch-1", QuestConfig(token_budget=256))):
        tokens, rates, logprobs = {}, {}, {}
        request = dataclasses.replace(params, token_budget=256) if "requests-256" in name else params
        for path, llm in _engine_paths(quest, lambda q, **kwargs: _sharpened_engine(cfg, q, **kwargs)):
            outs = llm.generate(prompts[:1] if name.endswith("batch-1") else prompts, request, use_tqdm=False)
            tokens[path] = [list(o.token_ids) for o in outs]
            rates[path] = [o.metrics.selection_rate for o in outs]
            logprobs[path] = [o.logprobs for o in outs]
            del llm
        results[name] = _agreement(tokens["cuda-graphs"], tokens["eager-reference"])
        results[name].update(_logprobs_agreement(tokens, logprobs))
        if quest is not None and quest.selection_interval > 1:  # the share of (step, layer, head) that selected
            results[name]["selection_rates"] = rates
        if name == "dense":
            results["dense_tokens"] = tokens["cuda-graphs"]
        if name.startswith("quest-full"):
            results[name]["equals_dense"] = tokens["cuda-graphs"] == results["dense_tokens"]
    results.pop("dense_tokens")
    return results


def _logprobs_agreement(tokens: dict, logprobs: dict) -> dict:
    """The two paths' log-probabilities (``RequestOutput.logprobs`` per path) at the positions of each request up to
    the first where their tokens differ: the largest absolute difference for the same token and whether every such
    position lists the same tokens."""
    diff, same = 0.0, True
    for got_tokens, want_tokens, got, want in zip(tokens["cuda-graphs"], tokens["eager-reference"],
                                                  logprobs["cuda-graphs"], logprobs["eager-reference"]):
        for a, b, entry, ref in zip(got_tokens, want_tokens, got, want):
            if a != b:
                break
            same &= set(entry) == set(ref)
            diff = max([diff] + [abs(entry[t].logprob - ref[t].logprob) for t in set(entry) & set(ref)])
    return {"logprobs_max_abs_diff": diff, "logprobs_same_tokens": same}


def _paths_agree(quest, build, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Greedy tokens of ``prompts`` on the CUDA-graph path against the eager torch-reference path of the engine
    ``build`` makes (:func:`_engine_paths`)."""
    tokens = {}
    for path, llm in _engine_paths(quest, build):
        tokens[path] = [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    return _agreement(tokens["cuda-graphs"], tokens["eager-reference"])


def check_quantized_fp32(method: str = "int4", quantize_lm_head: bool = False) -> dict:
    """An int4 or int8 engine's CUDA path (graphs and the quantized kernels: int4 from the K-major words, the
    layers' only copy of the codes, decode rows through ``int4_gemv`` at batch 1 and ``int4_words_matmul`` at batch 3
    (float32: the tensor-core kernel takes bf16 / fp16 only, ``check_int4_bf16_rows``), prefill through the float
    weight written from the words; int8 through the Triton kernel and the dequantizing GEMM) against its eager torch-reference path (every quantized layer on the
    ``torch`` backend), a small fp32 Llama quantized at load (its LM head too with ``quantize_lm_head``), one prompt
    and three, dense and Quest."""
    cfg = _tiny_llama()
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (900, 1300, 420)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = {}
    for name, quest in (("dense", None), ("quest-256", QuestConfig(token_budget=256))):
        for batch in (1, 3):
            def build(q, **kwargs):
                return LLM(cfg, quest=q, quantization=method, load_format="dummy", dtype="float32", device="cuda",
                           max_num_seqs=batch, kv_cache_memory=256 << 20, seed=6, quantize_lm_head=quantize_lm_head,
                           **kwargs)

            results[f"{name}-batch-{batch}"] = _paths_agree(quest, build, prompts[:batch], params)
    return results


def check_int4_bf16_rows() -> dict:
    """The bf16 int4 kernels by rows (``INT4_KERNELS``: the GEMV at batch 1, the tensor-core kernel
    ``int4_mma`` at 2, 5 and 16 rows, ``int4_words_matmul`` at 20, prefill through the float weight written from
    the words) on the CUDA-graph path against the eager torch-reference path, a small bf16 Llama quantized at load,
    dense, greedy tokens. bf16 rounds differently in every kernel, so this reports agreement; the fp32 check
    (``check_quantized_fp32``) is the exact one."""
    cfg = _tiny_llama()
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 512, (int(n),), generator=gen).tolist()
               for n in torch.randint(60, 700, (20,), generator=gen)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    results = {}
    for batch in (1, 2, 5, 16, 20):
        def build(q, **kwargs):
            return LLM(cfg, quest=q, quantization="int4", load_format="dummy", dtype="bfloat16", device="cuda",
                       max_num_seqs=batch, kv_cache_memory=256 << 20, seed=6, **kwargs)

        results[f"dense-batch-{batch}"] = _paths_agree(None, build, prompts[:batch], params)
    return results


def check_chunked_prefix_fp32() -> dict:
    """Chunked prefill and prefix-cache hits on the CUDA path (Triton, graphs) == one-step prefill without the
    prefix cache, greedy tokens on a small fp32 Llama, dense and Quest: prompts that share a 1024-token prefix
    are sent one after another (the later ones hit its pages) to an engine with 96-token chunks, which then
    prefill the rest attending the cached pages (``ops.paged_prefill_attention``; CI runs its reference on the CPU)."""
    cfg = _tiny_llama()
    gen = torch.Generator().manual_seed(11)
    shared = torch.randint(0, 512, (1024,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, 512, (n,), generator=gen).tolist() for n in (300, 517, 41)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = {}
    for name, quest in (("dense", None), ("quest-256", QuestConfig(token_budget=256))):
        tokens, cached = {}, {}
        for path, kwargs in (("one-step", {"enable_prefix_caching": False, "enable_chunked_prefill": False}),
                             ("chunked-prefix", {"max_num_batched_tokens": 96})):
            llm = _sharpened_engine(cfg, quest, **kwargs)
            outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
            tokens[path] = [list(o.token_ids) for o in outs]
            cached[path] = [o.metrics.num_cached_tokens for o in outs]
            del llm
            gc.collect()
        results[name] = {**_agreement(tokens["chunked-prefix"], tokens["one-step"]),
                         "cached_tokens": cached["chunked-prefix"]}
    return results


def _staggered(llm: LLM, prompts: list[list[int]], params: SamplingParams, every: int = 3) -> tuple[list, int]:
    """Step ``llm``'s engine, adding ``prompts[i]`` before step ``i * every`` (later prompts arrive while earlier
    ones decode). Returns each prompt's greedy tokens and how many launched steps mixed decode and prefill rows."""
    engine, execute = llm.engine, llm.engine.runner.execute
    mixed = []
    engine.runner.execute = lambda batch: mixed.append(bool(batch.num_decodes and batch.num_prefills)) or execute(batch)
    ids, outputs, pending, step = [], {}, list(prompts), 0
    while pending or engine.has_unfinished_requests():
        if pending and step % every == 0:
            ids.append(engine.add_request(pending.pop(0), params))
        outputs.update((out.request_id, out) for out in engine.step())
        step += 1
    del engine.runner.execute
    return [list(outputs[i].token_ids) for i in ids], sum(mixed)


def check_mixed_steps_fp32() -> dict:
    """Mixed steps on the CUDA path == unchunked prefill, greedy tokens on a small fp32 Llama: five prompts (41 to
    1500 tokens) arrive every 3 engine steps while the earlier ones decode, into an engine with 96-token steps
    (decode rows padded to a captured batch beside prefill chunks, one eager forward; asynchronous scheduling) and
    into one without chunking (decode-only steps under CUDA graphs), dense, Quest 256 and Quest 256 with C = 4."""
    cfg = _tiny_llama()
    gen = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (700, 1500, 333, 900, 41)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = {}
    for name, quest in (("dense", None), ("quest-256", QuestConfig(token_budget=256)),
                        ("quest-256-reuse-4", QuestConfig(token_budget=256, selection_interval=4))):
        tokens, mixed = {}, {}
        for path, kwargs in (("unchunked", {"enable_chunked_prefill": False}), ("mixed", {"max_num_batched_tokens": 96})):
            llm = _sharpened_engine(cfg, quest, **kwargs)
            tokens[path], mixed[path] = _staggered(llm, prompts, params)
            del llm
            gc.collect()
        results[name] = {**_agreement(tokens["mixed"], tokens["unchunked"]), "mixed_steps": mixed["mixed"]}
    return results


def check_8b_against_hf(cfg) -> dict:
    """The engine against HF eager at the 8B shape in bf16 (random weights): next-token logits after a
    2048-token prefill and after 8 greedy decode steps (relative L2 error, top-1 agreement) and the
    agreeing prefix of 16 greedy tokens, for the engine dense with and without the compiled
    elementwise ops and Quest at a budget covering the context."""
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, cfg.vocab_size, (2048,), generator=gen).tolist()
    model = hf_model(cfg)
    state = {k: v for k, v in model.state_dict().items()}
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None,
                              output_logits=True, return_dict_in_generate=True)
    want_tokens = want.sequences[0, 2048:].tolist()
    want_logits = [want.logits[i][0].float() for i in (0, 8)]
    out = {}
    for name, quest, compiled in (("dense", None, True), ("dense-uncompiled", None, False),
                                  ("quest-full", QuestConfig(token_budget=4096), True)):
        llm = LLM(cfg, quest=quest, load_format="dummy", device="cuda", max_num_seqs=1, max_model_len=4096,
                  kv_cache_memory=4 << 30, compile_elementwise=compiled)
        llm.engine.runner.model.load_weights(state.items())
        # teacher-forced on HF's tokens, so that the logits compared belong to the same context
        engine = llm.engine
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        logits, got = [], []
        for step in range(16):
            batch = engine.scheduler.schedule()
            with torch.inference_mode():
                row = engine.runner._prefill(batch) if batch.num_prefills else engine.runner._decode(batch)
            if step in (0, 8):
                logits.append(row[0].float().clone())
            got.append(int(row[0].argmax()))
            engine.scheduler.update(batch, [want_tokens[step]])
        prefix = next((i for i, (a, b) in enumerate(zip(got, want_tokens)) if a != b), len(want_tokens))
        out[name] = {
            "agreeing_prefix": prefix, "tokens": len(want_tokens),
            "top1_agreement_teacher_forced": sum(a == b for a, b in zip(got, want_tokens)),
            "logits_rel_err": [float((a - b).norm() / b.norm()) for a, b in zip(logits, want_logits)],
            "hf_logit_gap_top2": [float(b.topk(2).values.diff().abs()) for b in want_logits],
        }
        del llm, engine
        gc.collect()
    del model, state
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"), help="where the JSON, .md and .png go")
    parser.add_argument("--tag", default="h200", help="file name suffix: e2e-TAG.json")
    parser.add_argument("--skip-hf", action="store_true", help="leave out the HF baselines")
    parser.add_argument("--skip-checks", action="store_true", help="leave out the correctness checks")
    parser.add_argument("--checks", default="fp32,chunked,mixed,8b,int4,int8",
                        help="comma-separated correctness checks to run before timing: fp32 (CUDA path == eager "
                        "reference, tiny fp32 model), chunked (chunked prefill + prefix hits == one-step prefill), "
                        "mixed (steps mixing decodes and prefill chunks == unchunked prefill), 8b (engine vs HF at "
                        "the 8B shape, bf16), int4 / int8 (a quantized engine's CUDA path == its eager reference, tiny "
                        "fp32 model), int4-bf16 (the int4 kernels by rows in bf16 vs the eager reference: "
                        "agreement) (default: all but int4-bf16)")
    parser.add_argument("--checks-only", action="store_true", help="run the correctness checks and no timing")
    parser.add_argument("--points", default="all", help="comma-separated point indices into POINTS, or 'all'")
    parser.add_argument("--quantization", choices=["int4", "int8"], default=None,
                        help="weight-only quantization of both engines' linears (default: bf16)")
    parser.add_argument("--quantize-lm-head", action="store_true",
                        help="with --quantization: the LM head too (EngineConfig.quantize_lm_head), in the timed "
                        "engines and the int4 check")
    parser.add_argument("--dense-cublas", action="store_true",
                        help="also time the engine dense with its float linears on cuBLAS at every row "
                        "(engine_dense_cublas), beside the default that takes questkv's GEMV for one row")
    parser.add_argument("--selection-intervals", default="",
                        help="comma-separated C >= 2: also time a Quest engine that selects every C decode steps "
                        "(QuestConfig.selection_interval) per C (default: none)")
    parser.add_argument("--interleaved", action="store_true",
                        help="also time each point's dense and Quest engines side by side in alternating rounds "
                        "(time_pair: medians of per-round ratios; both engines held at once)")
    parser.add_argument("--interleaved-built-first", choices=["dense", "quest"], default="dense",
                        help="with --interleaved: which engine is allocated first (default: dense)")
    parser.add_argument("--dense-context-ratio", type=float, default=QuestConfig().dense_context_ratio,
                        help="the Quest engines' QuestConfig.dense_context_ratio: decode steps stay dense while the "
                        "context holds at most this many budgets (default: QuestConfig's)")
    args = parser.parse_args()
    try:
        intervals = [int(c) for c in args.selection_intervals.split(",") if c]
    except ValueError:
        parser.error(f"--selection-intervals takes comma-separated ints, got {args.selection_intervals!r}")
    checks = set(args.checks.split(",")) - {""}
    if not checks <= {"fp32", "chunked", "mixed", "8b", "int4", "int8", "int4-bf16"}:
        parser.error(f"--checks takes a comma list of fp32, chunked, mixed, 8b, int4, int8, int4-bf16; got "
                     f"{args.checks!r}")
    if any(c < 2 for c in intervals):
        parser.error(f"--selection-intervals must be >= 2 each, got {args.selection_intervals}")
    record = {"provenance": provenance("cuda"), "page_size": PAGE, "dense_layers": DENSE_LAYERS, "dtype": "bfloat16",
              "warmup_steps": WARMUP_STEPS, "timed_steps": TIMED_STEPS, "pdl": triton_common.PDL,
              "quantization": args.quantization, "quantize_lm_head": args.quantize_lm_head,
              "selection_intervals": intervals, "points": []}
    quant = {"quantization": args.quantization, "quantize_lm_head": args.quantize_lm_head}
    record["bandwidth_bytes_per_s"] = bandwidth = measure_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    if not args.skip_checks:
        for check, key, run in (("fp32", "check_fp32", check_tiny_fp32),
                                ("chunked", "check_chunked_prefix_fp32", check_chunked_prefix_fp32),
                                ("mixed", "check_mixed_steps_fp32", check_mixed_steps_fp32),
                                ("8b", "check_8b_bf16", lambda: check_8b_against_hf(dummy_config("llama3.1-8b"))),
                                *((m, f"check_{m}_fp32", lambda m=m: check_quantized_fp32(m, args.quantize_lm_head))
                                  for m in ("int4", "int8")),
                                ("int4-bf16", "check_int4_bf16_rows", check_int4_bf16_rows)):
            if check in checks:
                record[key] = run()
                print(key, json.dumps(record[key]), flush=True)
    if args.checks_only:
        _write(args, record)
        return
    points = POINTS if args.points == "all" else [POINTS[int(i)] for i in args.points.split(",")]
    for name, batch, context, budget, target in points:
        if args.quantization == "int4":
            target = INT4_TARGETS.get((name, batch, context), target)
        cfg = context_config(name, context)
        quest = QuestConfig(token_budget=budget, page_size=PAGE, dense_layers=DENSE_LAYERS,
                            dense_context_ratio=args.dense_context_ratio)
        point = {"model": name, "batch": batch, "context": context, "budget": budget, "target": target,
                 "dense_context_ratio": args.dense_context_ratio}
        point["engine_dense"] = time_engine(cfg, None, batch, context, **quant)
        point["engine_quest"] = time_engine(cfg, quest, batch, context, **quant)
        if args.dense_cublas:
            point["engine_dense_cublas"] = time_engine(cfg, None, batch, context, linear_backend="torch", **quant)
        weight_bytes = point["engine_dense"]["weight_bytes"]
        dense_floor, quest_floor = floor_ms(cfg, weight_bytes, batch, context, budget, bandwidth)
        point.update(floor_dense_ms=dense_floor, floor_quest_ms=quest_floor, ideal_speedup=dense_floor / quest_floor)
        point["speedup"] = point["engine_dense"]["ms_per_token"] / point["engine_quest"]["ms_per_token"]
        if args.interleaved:
            point["interleaved"] = pair = time_pair(cfg, quest, batch, context,
                                                    built_first=args.interleaved_built_first)
            print(f"{name} B={batch} L={context} interleaved: dense {pair['dense']['ms_per_token']:.2f} ms, quest "
                  f"{pair['quest']['ms_per_token']:.2f} ms, x{pair['speedup']:.3f} (graphs x{pair['graph_speedup']:.3f})",
                  flush=True)
        runs = {"dense": point["engine_dense"], "quest": point["engine_quest"]}
        if args.dense_cublas:
            runs["dense cuBLAS"] = point["engine_dense_cublas"]
        if intervals:
            point["engine_quest_reuse"], point["speedup_reuse"] = {}, {}
        for c in intervals:  # JSON keys: C as a string
            reuse = dataclasses.replace(quest, selection_interval=c)
            runs[f"quest C={c}"] = point["engine_quest_reuse"][str(c)] = time_engine(
                cfg, reuse, batch, context, **quant)
            point["speedup_reuse"][str(c)] = point["engine_dense"]["ms_per_token"] / runs[f"quest C={c}"]["ms_per_token"]
        line = [f"{name} B={batch} L={context} budget={budget}:"]
        for kind, run in runs.items():
            line.append(f"{kind} {run['ms_per_token']:.2f} ms (sync {run['sync']['ms_per_token']:.2f}, graph "
                        f"{run['graph_replay_ms']:.2f}, {run['kernels']['count']} kernels),")
        reused = "".join(f", C={c} x{x:.2f}" for c, x in point.get("speedup_reuse", {}).items())
        print(*line, f"x{point['speedup']:.2f}{reused} (floor {dense_floor:.2f}/{quest_floor:.2f}, target {target}; "
              f"weights {point['engine_dense']['weight_bytes'] / 1e9:.2f} GB)",
              flush=True)
        record["points"].append(point)
        _write(args, record)
    if not args.skip_hf:
        hf_points = [("llama3.1-8b", 1, 32 * 1024, True), ("llama2-7b", 1, 32 * 1024, False),
                     ("llama3.1-8b", 1, 128 * 1024, False)]
        for name, batch, context, static in hf_points:
            point = _find_point(record, name, batch, context)
            if point is None:  # not among --points
                continue
            cfg = context_config(name, context)
            model = hf_model(cfg)
            point["hf_eager"] = time_hf(model, batch, context, static=False)
            print(f"HF eager {name} B={batch} L={context}: {point['hf_eager']['ms_per_token']:.2f} ms", flush=True)
            if static:
                point["hf_static"] = time_hf(model, batch, context, static=True)
                print(f"HF static {name} B={batch} L={context}: {point['hf_static']['ms_per_token']:.2f} ms", flush=True)
            del model
            gc.collect()
            torch.cuda.empty_cache()
            _write(args, record)
    for name, context in (("llama3.1-8b", 32 * 1024), ("llama3.1-8b", 128 * 1024)):
        point = _find_point(record, name, 1, context)
        if point is None:
            continue
        cfg = dummy_config(name, max_position_embeddings=context + 1024)
        point["prefill_s"] = time_prefill(cfg, None, context, **quant)
        print(f"prefill {name} {context}: {point['prefill_s']:.2f} s", flush=True)
        _write(args, record)


def _find_point(record, name: str, batch: int, context: int):
    """The timed point of ``record`` at (model, batch, context), or None when it was not run."""
    return next((p for p in record["points"] if (p["model"], p["batch"], p["context"]) == (name, batch, context)), None)


def _write(args, record) -> None:
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"e2e-{args.tag}.json"
    path.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
