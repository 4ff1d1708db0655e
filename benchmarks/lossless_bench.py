"""Lossless Quest on a GPU (issue 42): dense attention's tokens at Quest's speed, measured.

Three parts, each writing its JSON and markdown table (command, commit, GPU, date) to ``--out-dir``:

* ``check``: the CUDA path (graphs: draft, verify and dense steps; Triton kernels) of a small fp32 random model
  against the dense engine: greedy and seeded-sampling tokens must be identical, fixed rounds and the adaptive
  policy alike.
* ``real``: a real model (an alias staged by ``benchmarks/gpu_eval.py``, e.g. Qwen2.5-Coder-1.5B), continuations of
  the book and of code (:mod:`questkv.eval.agreement`'s texts) at each context, ``--tokens`` greedy tokens, at
  each batch size (half book, half code windows; batch 1: one of each, run apart). Per batch: decode tokens/s of
  dense, lossy Quest (1/16 of the context) and lossless (drafts at 1/16 and 1/8, an engine built for each budget;
  ``--policies``: the engine picks the drafts per round, ``adaptive``, the default, and/or a fixed ``k``, its policy
  switched between runs; ``--draft-dense-layers``: lossless engines whose drafts attend densely in that many first
  layers),
  acceptance, tokens per verify, and the lossless outputs
  against the dense engine's: rows identical, and at each first difference the gap between dense's own
  log-probabilities of its token and of lossless's (a near tie of bf16 rounding when small). At a batch above 1,
  ``dense-alone`` (not timed) decodes each prompt by itself on the dense engine and compares it the same way: how
  often dense's own tokens change with the batch's arithmetic, the floor a bf16 lossless run is read against.
  Each lossless mode also records its speculation policy after the timed run, per batch size its steps ran at
  (the ramp and the tail of a closed batch included): the step times it measured, its acceptance, the ``k`` it
  would pick and the timed run's steps by kind (``policy``; a table of its own), which is where a fixed-``k`` and
  an adaptive run of the same point differ.
* ``shapes``: random weights at the paper's shapes (``--points``), synthetic contexts (``e2e_bench``'s): ms per
  step of the dense engine (asynchronous), of a lossless draft step and of a verify step (fixed ``k``,
  synchronous), and the speed over dense that an acceptance implies (``E(k) * t_dense / (k * t_draft +
  t_verify)``, labelled as implied: random weights accept nothing real), and the step of dense requests on a
  lossless engine (what a lossless request's step costs where its policy decodes densely); on CUDA also each step's
  graph replayed alone (its GPU time; the rest of a step is the host's) and the graphs' heaviest kernels.

Decode tokens/s is ``B * (T - 1) / (t - f)`` with ``t`` the wall time of ``generate`` of ``T`` tokens on an
engine warmed by the same run and ``f`` its slowest request's time to first token (:func:`decode_rate`): prefill
never counts, whether the prefix cache held a prompt or not. (The difference of a ``T``-token and a 2-token run,
used before, gave negative and impossible rates on an H100 at 32k: ``lossless-real-h100-qwen2.5-coder-1.5b-32k``.)
Beside it, the sum of the requests' own decode rates (``RequestMetrics.decode_tokens_per_s``, each from its first
token to its finish): the rate while every row runs. A lossless batch's rows accept different numbers of drafts, so
their lengths drift apart and the batch's wall time ends with its slowest row; dense's rows end together, so there
the two agree, and a server that refills its batch sees the second. With ``--host-steps N`` each timed mode
also runs its prompts once more for ``N`` steps under :func:`~benchmarks.e2e_bench.time_host` (every row decoding,
after a warm-up; then aborted): the host's milliseconds per step and how much of a step it waits for the device.
Two engines of one context are alive together (``--memory`` of the GPU each): the base engine (dense and lossy
requests) and a lossless engine.

    python benchmarks/lossless_bench.py check --out-dir $OUT
    python benchmarks/lossless_bench.py real --model qwen2.5-coder-1.5b --out-dir $OUT
    python benchmarks/lossless_bench.py shapes --out-dir $OUT --acceptance 0.9
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

if __name__ == "__main__":  # run as a file: the checkout importable (questkv, benchmarks.*)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.e2e_bench import (  # noqa: E402
    context_config, kv_bytes_per_token, profile_replay, profile_steps, replay_ms, synthetic_prefill, time_host)
from questkv.config import QuestConfig  # noqa: E402
from questkv.decode.route import StepRoute  # noqa: E402
from questkv.engine.llm import LLM  # noqa: E402
from questkv.engine.sampling_params import SamplingParams  # noqa: E402
from questkv.engine.speculation import expected_tokens  # noqa: E402
from questkv.eval import agreement  # noqa: E402
from questkv.eval.provenance import provenance  # noqa: E402

PAGE, DENSE_LAYERS = 16, 2
WARMUP_RUNS = 3
HOST_WARMUP_STEPS = 10
NEAR_TIE = 0.125
"""A log-probability gap below this is within bf16 rounding of logits of magnitude 16-32 (one unit in the last
place)."""


def lossless_config(k: int, adaptive: bool) -> dict:
    return {"method": "quest", "num_speculative_tokens": k, "adaptive": adaptive}


def source_suffix(record: dict) -> str:
    """A shapes record's name suffix for its drafts: ``-denseN`` where they attend ``N`` layers densely other than
    :data:`DENSE_LAYERS`, and for their pages' source where results were made before the verify step's pages were
    removed (``draft_selection="verify"``, git keeps it)."""
    source = record.get("draft_selection", "quest")
    dense_layers = record.get("draft_dense_layers", DENSE_LAYERS)
    return ("" if dense_layers == DENSE_LAYERS else f"-dense{dense_layers}") + (
        "" if source == "quest" else f"-{source}-pages")


# ---------------------------------------------------------------------------------------------------------------
# check: the CUDA path against the dense engine
# ---------------------------------------------------------------------------------------------------------------


def check(args, save) -> dict:
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
    quest = QuestConfig(token_budget=128, page_size=PAGE, dense_layers=1, dense_context_ratio=1.0)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (700, 1500, 333, 1100)]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    sampled = [SamplingParams(temperature=1.0, top_p=0.9, seed=s, max_tokens=40, ignore_eos=True) for s in range(4)]

    def engine(**kwargs) -> LLM:
        llm = LLM(cfg, load_format="dummy", dtype="float32", device="cuda", max_num_seqs=4,
                  kv_cache_memory=512 << 20, seed=5, **kwargs)
        with torch.no_grad():  # sharper attention than N(0, 0.02): which pages Quest picks matters
            for layer in llm.engine.runner.model.model.layers:
                layer.self_attn.qkv_proj.weight.mul_(8.0)
        return llm

    def run(llm, params) -> list[list[int]]:
        return [list(out.token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]

    dense = engine()
    want = {"greedy": run(dense, greedy), "sampled": run(dense, sampled)}
    del dense
    results = {}
    for name, kwargs in (("lossy-quest", {"quest": quest}),
                         ("lossless-k4", {"quest": quest, "speculative_config": lossless_config(4, False)}),
                         ("lossless-k8", {"quest": quest, "speculative_config": lossless_config(8, False)}),
                         ("lossless-adaptive", {"quest": quest, "speculative_config": lossless_config(4, True)}),
                         ("lossless-k4-eager", {"quest": quest, "speculative_config": lossless_config(4, False),
                                                "enforce_eager": True})):
        llm = engine(**kwargs)
        for mode, params in (("greedy", greedy), ("sampled", sampled)):
            outs = llm.generate(prompts, params, use_tqdm=False)
            got = [list(out.token_ids) for out in outs]
            rates = [out.metrics.acceptance_rate for out in outs]
            results[f"{name}/{mode}"] = {
                "identical": got == want[mode],
                "tokens_match": sum(a == b for x, y in zip(got, want[mode]) for a, b in zip(x, y)),
                "tokens": sum(map(len, want[mode])),
                "acceptance": [None if r is None else round(r, 3) for r in rates],
            }
        del llm
        gc.collect()
    return results


# ---------------------------------------------------------------------------------------------------------------
# real: a real model's acceptance and tokens/s
# ---------------------------------------------------------------------------------------------------------------


def decode_rate(llm: LLM, prompts: list[list[int]], params: SamplingParams, tokens: int, before_timed=None
                ) -> tuple[float, float, list, int]:
    """Decode tokens/s of ``prompts``, the sum of the requests' own decode rates, the outputs, and the CUDA graphs
    captured while timed. The first: the ``tokens - 1`` outputs after each request's first over the wall time of
    ``generate`` less its slowest request's time to first token, so that a prefill (a prompt the prefix cache no
    longer holds, or the last partial page of one it does) never counts as decode time; the second: the rate while
    every row runs (the module docstring says why the two differ). The same run first, untimed, up to
    :data:`WARMUP_RUNS` times until one captures no new graph: it caches the prompts and captures the graphs the
    timed run replays. A lossless round's steps
    (drafts, verifies of each round length the policy picks, steps launched ahead) are captured when they first
    run, which a short warm-up never reaches (captured inside the timed run they gave 0.06x of dense at B=1:
    ``lossless-real-h100-qwen2.5-coder-1.5b``). ``before_timed()``, if given, is called just before the timed run."""
    fields = {**_fields(params), "max_tokens": tokens}
    graphs = llm.engine.runner.graphs
    for _ in range(WARMUP_RUNS):
        before = len(graphs)
        llm.generate(prompts, SamplingParams(**fields), use_tqdm=False)
        if len(graphs) == before:
            break
    if before_timed is not None:
        before_timed()
    before = len(graphs)
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(**fields), use_tqdm=False)
    wall = time.perf_counter() - start
    rate = len(prompts) * (tokens - 1) / (wall - max(o.metrics.time_to_first_token for o in outs))
    return rate, sum(o.metrics.decode_tokens_per_s for o in outs), outs, len(graphs) - before


def _fields(params: SamplingParams) -> dict:
    return {"temperature": params.temperature, "ignore_eos": params.ignore_eos, "token_budget": params.token_budget,
            "dense": params.dense, "speculative_tokens": params.speculative_tokens}


def near_tie_gaps(dense: LLM, prompts, want, got) -> list[dict]:
    """At each row's first difference, dense's own log-probabilities of its token and of the lossless token there
    (teacher-forced on the dense engine: its decode steps; all rows in one batch)."""
    firsts = [(prompt, a, b, next(j for j, (x, y) in enumerate(zip(a, b)) if x != y))
              for prompt, a, b in zip(prompts, want, got) if a != b]
    requests, params = [], []
    for prompt, a, b, i in firsts:
        for token in (a[i], b[i]):
            requests.append(prompt)
            params.append(SamplingParams(temperature=0, max_tokens=i + 1, dense=True, ignore_eos=True,
                                         forced_token_ids=list(a[:i]) + [token]))
    outs = dense.generate(requests, params, use_tqdm=False) if requests else []
    gaps = []
    for n, (_, a, b, i) in enumerate(firsts):
        gap = outs[2 * n].forced_logprobs[i] - outs[2 * n + 1].forced_logprobs[i]
        gaps.append({"position": i, "dense_token": a[i], "lossless_token": b[i], "logprob_gap": round(gap, 4),
                     "near_tie": abs(gap) < NEAR_TIE})
    return gaps


def real(args, save) -> dict:
    """Per context: the base engine (dense and lossy requests) measures every batch first, then a lossless engine
    per draft budget and dense-layer count (alive beside the base, one at a time) runs the same prompts.
    ``save(results)`` after each engine, so a run stopped by a time limit keeps what it measured."""
    results = {"model": args.model, "tokens": args.tokens, "k": args.k, "near_tie_below": NEAR_TIE,
               "kv_cache_dtype": args.kv_cache_dtype, "points": []}
    greedy = dict(temperature=0, ignore_eos=True)
    for context in args.contexts:
        budget16, budget8 = context // 16, context // 8
        common = dict(dtype=args.dtype, device=args.device, max_model_len=context + args.tokens + 4 * PAGE,
                      max_num_seqs=max(args.batches), kv_cache_dtype=args.kv_cache_dtype)
        if args.device == "cuda":
            common["gpu_memory_utilization"] = args.memory
        elif args.kv_cache_gib is not None:
            common["kv_cache_memory"] = int(args.kv_cache_gib * 2**30)
        base = LLM(args.model, quest=QuestConfig(token_budget=budget16, page_size=PAGE, dense_layers=DENSE_LAYERS),
                   **common)
        texts = {}
        for corpus, task in (("book", "agreement_book"), ("code", "agreement_code")):
            text, _ = agreement.load_text(task)
            texts[corpus] = agreement.contexts(base.tokenizer, text, context + args.tokens + 1,
                                               max(1, max(args.batches) // 2), args.tokens)
        points = []
        for batch in args.batches:
            groups = ([("book", texts["book"][:1]), ("code", texts["code"][:1])] if batch == 1 else
                      [("book+code", texts["book"][:batch // 2] + texts["code"][:batch // 2])])
            for corpus, prompts in groups:
                point = {"context": context, "batch": batch, "corpus": corpus, "modes": {}}
                rate, rows_rate, dense_outs, captured = decode_rate(
                    base, prompts, SamplingParams(dense=True, **greedy), args.tokens)
                point["want"] = [list(o.token_ids) for o in dense_outs]
                point["prompts"] = prompts
                dense = point["modes"]["dense"] = {"tokens_per_s": rate, "speedup": 1.0, "rows_tokens_per_s": rows_rate,
                                                   "rows_speedup": 1.0, "graphs_captured_timed": captured,
                                                   **host_time(base, prompts, SamplingParams(dense=True, **greedy),
                                                               args)}
                rate, rows_rate, outs, captured = decode_rate(base, prompts, SamplingParams(**greedy), args.tokens)
                point["modes"]["quest-1/16"] = {**_rates(rate, rows_rate, dense), "graphs_captured_timed": captured,
                                                **_identity(base, prompts, point["want"], outs, False),
                                                **host_time(base, prompts, SamplingParams(**greedy), args)}
                if batch > 1:  # dense's own arithmetic: each prompt decoded alone, against the batch (not timed)
                    alone = [base.generate([prompt], SamplingParams(dense=True, max_tokens=args.tokens, **greedy),
                                           use_tqdm=False)[0] for prompt in prompts]
                    point["modes"]["dense-alone"] = _identity(base, prompts, point["want"], alone, True)
                points.append(point)
                print(_point_line(point), flush=True)
        results["points"] += [{key: value for key, value in point.items() if key not in ("want", "prompts")}
                              for point in points]
        save(results)
        for dense_layers, (label, budget) in itertools.product(args.draft_dense_layers,
                                                               (("1/16", budget16), ("1/8", budget8))):
            # One lossless engine per budget, alive beside the base: its requests' budget is its own, so that its
            # attention's launch plan is the budget's (a smaller request budget fills the plan's first splits only).
            quest = QuestConfig(token_budget=budget, page_size=PAGE, dense_layers=dense_layers)
            lossless = LLM(args.model, quest=quest, speculative_config=lossless_config(args.k, True), **common)
            suffix = "" if dense_layers == DENSE_LAYERS else f"-dense{dense_layers}"
            for point, stored in zip(points, results["points"][-len(points):]):
                for policy in args.policies:  # its policy switched between runs (the prompts stay in its prefix cache)
                    speculation = lossless.engine.speculation
                    speculation.adaptive = policy == "adaptive"
                    seen = {}
                    rate, rows_rate, outs, captured = decode_rate(
                        lossless, point["prompts"], SamplingParams(token_budget=budget, **greedy), args.tokens,
                        before_timed=lambda: seen.update(speculation.snapshot()))
                    learnt = policy_view(seen, speculation.snapshot())
                    accepted = [o.metrics.acceptance_rate for o in outs if o.metrics.acceptance_rate is not None]
                    per_verify = [o.metrics.mean_tokens_per_verify for o in outs
                                  if o.metrics.mean_tokens_per_verify is not None]
                    stored["modes"][f"lossless-{label}-{policy}{suffix}"] = {
                        **_rates(rate, rows_rate, stored["modes"]["dense"]), "graphs_captured_timed": captured,
                        "acceptance": statistics.mean(accepted) if accepted else None,
                        "tokens_per_verify": statistics.mean(per_verify) if per_verify else None,
                        "policy": learnt,
                        **_identity(base, point["prompts"], point["want"], outs, True),
                        **host_time(lossless, point["prompts"], SamplingParams(token_budget=budget, **greedy), args)}
                print(_point_line(stored), flush=True)
            lossless.close()
            del lossless
            gc.collect()
            save(results)
        base.close()
        del base, points
        gc.collect()
    return results


def _section(intro: str, header: list[str], rows: list[str]) -> list[str]:
    """A markdown table after a blank line and its introducing sentence."""
    return ["", intro, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header), *rows]


def _ms_cell(ms: Optional[float]) -> str:
    return "-" if ms is None else f"{ms:.2f}"


def policy_view(before: dict, after: dict) -> dict:
    """The speculation policy after a timed run (:meth:`~questkv.engine.speculation.SpeculationPolicy.snapshot`),
    per batch size that ran steps in it, with the steps of the timed run alone (``after``'s less ``before``'s):
    what it measured and chose there. Keys are strings (JSON)."""
    view = {}
    for batch, seen in after.items():
        earlier = before.get(batch, {}).get("steps", {})
        steps = {name: count - earlier.get(name, 0) for name, count in seen["steps"].items()
                 if count > earlier.get(name, 0)}
        if steps:
            view[str(batch)] = {**seen, "verify_ms": {str(k): ms for k, ms in seen["verify_ms"].items()},
                                "steps": steps}
    return view


def host_time(llm: LLM, prompts: list[list[int]], params: SamplingParams, args) -> dict:
    """``{"host": ...}``: :func:`~benchmarks.e2e_bench.time_host` over ``args.host_steps`` steps of ``prompts``
    decoding together on ``llm`` (after their prefill and :data:`HOST_WARMUP_STEPS` steps; then aborted), or ``{}``
    without ``--host-steps``. Each request's ``args.tokens`` must outlast the timed steps."""
    if not args.host_steps:
        return {}
    engine = llm.engine
    ids = [engine.add_request(prompt, SamplingParams(**{**_fields(params), "max_tokens": args.tokens}))
           for prompt in prompts]
    while engine.scheduler.num_waiting or engine.scheduler.prefilling is not None:
        engine.step()
    for _ in range(HOST_WARMUP_STEPS):
        engine.step()
    record = time_host(engine, args.host_steps)
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return {"host": record}


def _rates(rate: float, rows_rate: float, dense: dict) -> dict:
    """A mode's two decode rates (:func:`decode_rate`) and each over dense's."""
    return {"tokens_per_s": rate, "speedup": rate / dense["tokens_per_s"], "rows_tokens_per_s": rows_rate,
            "rows_speedup": rows_rate / dense["rows_tokens_per_s"]}


def _identity(dense: LLM, prompts, want, outs, gaps: bool) -> dict:
    got = [list(o.token_ids) for o in outs]
    record = {"rows_identical": sum(a == b for a, b in zip(want, got)), "rows": len(want),
              "tokens_match": sum(x == y for a, b in zip(want, got) for x, y in zip(a, b)),
              "tokens": sum(map(len, want))}
    if gaps and record["rows_identical"] < len(want):
        record["first_differences"] = near_tie_gaps(dense, prompts, want, got)
    return record


def _point_line(point: dict) -> str:
    cells = [f"{name} {mode['speedup']:.2f}x" if "speedup" in mode
             else f"{name} {mode['rows_identical']}/{mode['rows']} rows" for name, mode in point["modes"].items()]
    return f"{point['context']} B={point['batch']} {point['corpus']}: " + ", ".join(cells)


# ---------------------------------------------------------------------------------------------------------------
# shapes: step times at the paper's shapes, random weights
# ---------------------------------------------------------------------------------------------------------------

POINTS = {  # name: (model, batch, context, budget, quantization)
    "llama2-7b-int4-b1-32k": ("llama2-7b", 1, 32 * 1024, 2048, "int4"),
    "llama3.1-8b-b16-32k": ("llama3.1-8b", 16, 32 * 1024, 2048, None),
    "llama3.1-8b-b4-128k": ("llama3.1-8b", 4, 128 * 1024, 4096, None),
    "llama3.1-8b-b8-32k": ("llama3.1-8b", 8, 32 * 1024, 2048, None),  # these two fit an 80 GB card (H100)
    "llama3.1-8b-b2-128k": ("llama3.1-8b", 2, 128 * 1024, 4096, None),
    # the real lossless runs' model (Qwen2.5-Coder-1.5B's shape): where its Quest step's time goes
    "qwen2.5-1.5b-b1-32k": ("qwen2.5-1.5b", 1, 32 * 1024, 2048, None),
    "qwen2.5-1.5b-b16-32k": ("qwen2.5-1.5b", 16, 32 * 1024, 2048, None),
    "qwen2.5-1.5b-b32-32k": ("qwen2.5-1.5b", 32, 32 * 1024, 2048, None),
}


def _shape_engine(cfg, batch, context, quantization, steps, device, dense: bool = False, **kwargs) -> LLM:
    need = batch * (context + steps * 20 + 4 * PAGE) * kv_bytes_per_token(cfg) * (2 * PAGE + 2) // (2 * PAGE)
    llm = LLM(cfg, load_format="dummy", dtype="bfloat16", device=device, max_num_seqs=batch,
              max_model_len=context + PAGE * 8, kv_cache_memory=int(need * 1.05) + (256 << 20),
              quantization=quantization, enable_chunked_prefill=False, **kwargs)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=steps * 18, ignore_eos=True, dense=dense)
    for _ in range(batch):
        prompt = torch.randint(0, cfg.vocab_size, (context - steps * 18 - 2,), generator=gen).tolist()
        llm.engine.add_request(prompt, params)
    synthetic_prefill(llm.engine)
    return llm


def shape_point(name: str, k: int, acceptances: list[float], steps: int = 40, device: str = "cuda",
                dense_layers: int = DENSE_LAYERS, trace: Optional[Path] = None) -> dict:
    """The dense engine's step (timed once) and the lossless engine's rounds of ``k`` drafts and a verify (timed
    whole: drafts are launched ahead of their update) at the point ``name``; the Quest engines attend their first
    ``dense_layers`` layers densely (``QuestConfig.dense_layers``). ``trace``: where the lossless rounds' profile
    writes its timeline (:func:`~benchmarks.e2e_bench.profile_steps`; gzipped where the name ends in ``.gz``)."""
    model, batch, context, budget, quantization = POINTS[name]
    cfg = context_config(model, context)
    quest = QuestConfig(token_budget=budget, page_size=PAGE, dense_layers=dense_layers)
    llm = _shape_engine(cfg, batch, context, quantization, steps, device, async_scheduling=True)
    engine = llm.engine
    for _ in range(6):
        engine.step()
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _synchronize(device)
    dense_ms = (time.perf_counter() - start) / steps * 1e3
    record = {"model": model, "batch": batch, "context": context, "budget": budget, "quantization": quantization,
              "k": k, "draft_dense_layers": dense_layers, "dense_ms": dense_ms, "dense_host": time_host(engine, steps),
              "dense_profile": profile_steps(engine, 2 * (k + 1))}
    # GPU time of each step's graph alone (CUDA): what the host adds is the rest
    if device == "cuda":
        with contextlib.suppress(LookupError):  # a route that captured no graph: its figures are left out
            record["dense_graph_ms"] = replay_ms(engine.runner, route=StepRoute.DENSE)
            record["dense_kernels"] = profile_replay(engine.runner, top=10, route=StepRoute.DENSE)
    llm.close()
    del llm, engine
    gc.collect()
    # lossy Quest (what a draft step runs, decoded asynchronously): its step, and whether the host keeps up
    record.update(_steady_step(_shape_engine(cfg, batch, context, quantization, steps, device, quest=quest,
                                             async_scheduling=True), steps, device, StepRoute.SPARSE, "quest"))
    record["quest_ms"] = record["quest_host"]["wall"]
    llm = _shape_engine(cfg, batch, context, quantization, steps, device, quest=quest,
                        speculative_config=lossless_config(k, False))
    engine = llm.engine
    ends = []  # when each step that launched a verify returned: consecutive ones are one round apart
    for i in range(steps + 2 * (k + 1)):
        verifies = engine.scheduler.step_tokens["verify"]
        engine.step()
        if i >= 2 * (k + 1) and engine.scheduler.step_tokens["verify"] > verifies:  # (graphs captured)
            ends.append(time.perf_counter())
    record["round_host"] = time_host(engine, 4 * (k + 1))  # four rounds' worth of steps
    record["round_profile"] = profile_steps(engine, 2 * (k + 1), trace=trace)  # two rounds' worth of steps
    if device == "cuda":
        with contextlib.suppress(LookupError):
            record["draft_graph_ms"] = replay_ms(engine.runner, route=StepRoute.SPARSE)
            record["draft_kernels"] = profile_replay(engine.runner, top=16, route=StepRoute.SPARSE)
            record["verify_kernels"] = profile_replay(engine.runner, top=10, route=StepRoute.VERIFY)
            record["verify_graph_ms"] = replay_ms(engine.runner, route=StepRoute.VERIFY)
    llm.close()
    del llm, engine
    gc.collect()
    # Dense requests on a lossless engine: the step a lossless request takes where its policy decodes densely
    # (the engine's selection memory and its rows launched ahead of a verify add work to the dense engine's step).
    record.update(_steady_step(_shape_engine(cfg, batch, context, quantization, steps, device, dense=True, quest=quest,
                                             speculative_config=lossless_config(k, True), async_scheduling=True),
                               steps, device, StepRoute.DENSE, "lossless_dense", kernels=True))
    # A round's wall time (k drafts and a verify; under asynchronous scheduling drafts are launched ahead, so a
    # single step's wall time is not its cost).
    record["round_ms"] = round_ms = (ends[-1] - ends[0]) / (len(ends) - 1) * 1e3
    record["implied"] = [{"acceptance": a, "tokens_per_round": expected_tokens(a, k),
                          "speedup": expected_tokens(a, k) * record["dense_ms"] / round_ms} for a in acceptances]
    print(f"{name}: dense {record['dense_ms']:.2f} ms, round of {k} drafts and a verify {round_ms:.2f} ms; implied "
          + ", ".join(f"{i['speedup']:.2f}x at {i['acceptance']}" for i in record["implied"]), flush=True)
    return record


def _steady_step(llm: LLM, steps: int, device: str, route: StepRoute, prefix: str, kernels: bool = False) -> dict:
    """``llm``'s step with its requests decoding, after a warm-up, as ``{prefix}_host`` (:func:`time_host` over
    ``steps`` steps) and on CUDA ``{prefix}_graph_ms`` (its ``route`` graph replayed alone) and, with ``kernels``,
    ``{prefix}_kernels``; closes ``llm``."""
    for _ in range(6):
        llm.engine.step()
    record = {f"{prefix}_host": time_host(llm.engine, steps)}
    if device == "cuda":
        with contextlib.suppress(LookupError):  # a route that captured no graph: its figures are left out
            record[f"{prefix}_graph_ms"] = replay_ms(llm.engine.runner, route=route)
            if kernels:
                record[f"{prefix}_kernels"] = profile_replay(llm.engine.runner, top=10, route=route)
    llm.close()
    del llm
    gc.collect()
    return record


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def shapes(args, save) -> dict:
    results = {"points": []}
    for name, dense_layers in itertools.product(args.points, args.draft_dense_layers):
        trace = None if args.trace_dir is None else args.trace_dir / f"trace-{name}-dense{dense_layers}.json.gz"
        results["points"].append(shape_point(name, args.k, args.acceptance, device=args.device,
                                             dense_layers=dense_layers, trace=trace))
        save(results)
    return results


# ---------------------------------------------------------------------------------------------------------------


def table(part: str, record: dict) -> str:
    lines = []
    if part == "check":
        lines += ["| engine / sampling | identical to dense | tokens matching | acceptance per prompt |", "|---|---|---|---|"]
        lines += [f"| {name} | {r['identical']} | {r['tokens_match']}/{r['tokens']} | {r['acceptance']} |"
                  for name, r in record["results"].items()]
    elif part == "real":
        modes = list(dict.fromkeys(mode for point in record["results"]["points"] for mode in point["modes"]))
        lines += ["| context | B | text | " + " | ".join(modes) + " |", "|---" * (3 + len(modes)) + "|"]
        for point in record["results"]["points"]:
            cells = []
            for mode in modes:
                m = point["modes"].get(mode)
                if m is None:  # a run stopped before this mode
                    cells.append("–")
                    continue
                cell = f"{m['tokens_per_s']:.0f} tok/s ({m['speedup']:.2f}×)" if "tokens_per_s" in m else "not timed"
                if "rows_tokens_per_s" in m:  # (results before the rows' own rates have none)
                    cell += f", rows running {m['rows_tokens_per_s']:.0f} tok/s ({m['rows_speedup']:.2f}×)"
                if "rows_identical" in m:
                    cell += f", {m['rows_identical']}/{m['rows']} rows = dense"
                if m.get("acceptance") is not None:
                    cell += f", α {m['acceptance']:.2f}, {m['tokens_per_verify']:.2f}/verify"
                ties = m.get("first_differences")
                if ties:
                    cell += (f", {sum(t['near_tie'] for t in ties)}/{len(ties)} differences at near ties (largest gap "
                             f"{max(abs(t['logprob_gap']) for t in ties):.3f})")
                if m.get("graphs_captured_timed"):
                    cell += f", {m['graphs_captured_timed']} graphs captured while timed"
                cells.append(cell)
            lines.append(f"| {point['context']} | {point['batch']} | {point['corpus']} | " + " | ".join(cells) + " |")
        hosted = [(point, name, mode["host"]) for point in record["results"]["points"]
                  for name, mode in point["modes"].items() if "host" in mode]
        if hosted:  # the host per step of each mode (e2e_bench.time_host), its rows all decoding
            lines += _section(
                "The host per step, no profiler (ms), every row decoding: `busy` is the wall less the wait for the "
                "device's tokens; where it reaches the wall, the host sets the pace.",
                ["context", "B", "text", "mode", "wall", "busy", "wait", "schedule", "launch (graph replay, sampling)",
                 "process"],
                [f"| {p['context']} | {p['batch']} | {p['corpus']} | {label} | {h['wall']:.2f} | {h['busy']:.2f} | "
                 f"{h['wait']:.2f} | {h['schedule']:.2f} | {h['launch']:.2f} ({h['replay']:.2f}, {h['sample']:.2f}) | "
                 f"{h['process']:.2f} |" for p, name, host in hosted for label, h in _host_rows(name, host)])
        learnt = [(point, name, batch, seen) for point in record["results"]["points"]
                  for name, mode in point["modes"].items() for batch, seen in mode.get("policy", {}).items()]
        if learnt:  # what the speculation policy measured and chose, per batch size that ran in the timed run
            lines += _section(
                "The speculation policy after each timed run, per batch size of its steps (running means, ms; "
                "`k now`: the drafts it would pick, fixed rounds or not; steps: those of the timed run).",
                ["context", "B", "text", "mode", "rows", "dense", "draft", "verify by drafts", "acceptance", "k now",
                 "steps"],
                [f"| {p['context']} | {p['batch']} | {p['corpus']} | {name} | {batch} | {_ms_cell(seen['dense_ms'])} | "
                 f"{_ms_cell(seen['draft_ms'])} | " + ", ".join(f"{k}: {ms:.2f}" for k, ms in seen["verify_ms"].items())
                 + f" | {seen['acceptance']:.3f} | {seen['k']} | "
                 + ", ".join(f"{kind} {count}" for kind, count in seen["steps"].items()) + " |"
                 for p, name, batch, seen in learnt])
    else:
        lines += ["| point | dense ms/step | lossy Quest ms/step | round ms (k drafts + verify) | implied speedup "
                  "(acceptance) |", "|---|---|---|---|---|"]
        for p in record["results"]["points"]:
            implied = ", ".join(f"{i['speedup']:.2f}× ({i['acceptance']})" for i in p["implied"])
            name = (f"{p['model']} {p['quantization'] or 'bf16'} B={p['batch']} {p['context'] // 1024}k/{p['budget']}"
                    f"{source_suffix(p)}")
            quest = f"{p['quest_ms']:.2f}" if "quest_ms" in p else "–"
            lines.append(f"| {name} | {p['dense_ms']:.2f} | {quest} | {p['round_ms']:.2f} (k={p['k']}) | {implied} |")
        graphed = [p for p in record["results"]["points"] if "verify_graph_ms" in p and "dense_graph_ms" in p]
        if graphed:  # the GPU time of each step's graph alone, and the verify graph's heaviest kernels
            lines += ["", "| point | dense graph ms | draft graph ms | verify graph ms | a round's graphs ms (k "
                      "drafts + verify) | round less its graphs ms | verify's top kernels (count, µs) |",
                      "|---|---|---|---|---|---|---|"]
            for p in graphed:
                top = "; ".join(f"{t['name'][:50]} ({t['count']}, {t['us']:.0f})"
                                for t in p["verify_kernels"]["top"][:5])
                graphs = p["k"] * p["draft_graph_ms"] + p["verify_graph_ms"]
                lines.append(f"| {p['model']} B={p['batch']} {p['context'] // 1024}k"
                             f"{source_suffix(p)} | {p['dense_graph_ms']:.2f} | "
                             f"{p['draft_graph_ms']:.2f} | {p['verify_graph_ms']:.2f} | {graphs:.2f} | "
                             f"{p['round_ms'] - graphs:.2f} | {top} |")
        kernels = [p for p in record["results"]["points"] if "draft_kernels" in p and "dense_kernels" in p]
        if kernels:  # each graph's kernels: how many, their summed GPU time, the heaviest
            lines += ["", "| point | graph | kernels | GPU µs | heaviest kernels (count, µs) |", "|---|---|---|---|---|"]
            for p in kernels:
                for graph in ("dense", "lossless_dense", "draft", "verify"):
                    prof = p.get(f"{graph}_kernels")
                    if prof is not None:
                        top = "; ".join(f"{t['name'][:48]} ({t['count']}, {t['us']:.0f})" for t in prof["top"][:8])
                        label = "dense, on the lossless engine" if graph == "lossless_dense" else graph
                        lines.append(f"| {p['model']} B={p['batch']} {p['context'] // 1024}k{source_suffix(p)} | "
                                     f"{label} | {prof['count']} | {prof['us']:.0f} | {top} |")
        timed = [p for p in record["results"]["points"] if "round_host" in p]
        if timed:  # the host's time per step without a profiler (e2e_bench.time_host)
            lines += ["", "The host per step, no profiler (ms): `busy` is the wall less the wait for the device's tokens; "
                      "where it reaches the device's step time, the host sets the pace.", "",
                      "| point | engine | wall | busy | wait | schedule | launch (graph replay, sampling) | process |",
                      "|---|---|---|---|---|---|---|---|"]
            for p in timed:
                for engine, key in (("dense", "dense_host"), ("dense, on the lossless engine", "lossless_dense_host"),
                                    ("lossy Quest", "quest_host"), (f"lossless k={p['k']}", "round_host")):
                    if key not in p:  # (runs before the lossless engine's dense step was timed)
                        continue
                    for label, h in _host_rows(engine, p[key]):
                        lines.append(f"| {p['model']} B={p['batch']} {p['context'] // 1024}k{source_suffix(p)} | "
                                     f"{label} | {h['wall']:.2f} | {h['busy']:.2f} | {h['wait']:.2f} | "
                                     f"{h['schedule']:.2f} | {h['launch']:.2f} "
                                     f"({h['replay']:.2f}, {h['sample']:.2f}) | {h['process']:.2f} |")
        profiled = [p for p in record["results"]["points"] if "round_profile" in p]
        if profiled:  # where a step's wall time goes, per step (torch profiler: its own host overhead included)
            lines += ["", "Per step, two passes of the torch profiler: device activity only (wall, GPU busy and idle, "
                      "the heaviest kernels), then host activity too (its phases and operations, slowed by it).", "",
                      "| point | engine | wall ms/step | GPU busy | GPU idle | heaviest kernels (µs/step) | host: "
                      "schedule / launch / process | heaviest host ops (µs/step) |", "|---|---|---|---|---|---|---|---|"]
            for p in profiled:
                for engine, prof in (("dense", p["dense_profile"]), (f"lossless k={p['k']}", p["round_profile"])):
                    wall, busy, idle = ("–" if prof[key] is None else f"{prof[key]:.2f}"
                                        for key in ("wall_ms", "gpu_busy_ms", "gpu_idle_ms"))
                    kernels = "; ".join(f"{k['name'][:40]} {k['us']:.0f}" for k in prof.get("gpu_kernels", [])[:6]) or "–"
                    phases = " / ".join(f"{prof['phases_ms'][name]:.2f}" for name in ("schedule", "launch", "process"))
                    ops = "; ".join(f"{op['name'][:40]} {op['us']:.0f}" for op in prof["host_ops"][:5])
                    lines.append(f"| {p['model']} B={p['batch']} {p['context'] // 1024}k"
                                 f"{source_suffix(p)} | {engine} | {wall} | {busy} | {idle} | "
                                 f"{kernels} | {phases} | {ops} |")
            gaps = [(p, p["round_profile"]["gpu_gaps"]) for p in profiled if p["round_profile"].get("gpu_gaps")]
            if gaps:
                lines += ["", "The lossless engine's GPU idle gaps, per step (device-only pass): the kernel or copy that "
                          "ended before each and the one that started after it.", "",
                          "| point | after | before | µs/step | gaps/step |", "|---|---|---|---|---|"]
                lines += [f"| {p['model']} B={p['batch']} {p['context'] // 1024}k{source_suffix(p)} | "
                          f"{g['after'][:50]} | {g['before'][:50]} | {g['us']:.0f} | {g['count']:.1f} |"
                          for p, rows in gaps for g in rows]
    head = record["provenance"]
    return "\n".join([f"# Lossless Quest: {part}", "",
                      f"`{head['command']}` — commit {head['commit']}, {head['machine']}, {head['date']}", "",
                      *lines, ""])


def _host_rows(name: str, host: dict) -> list[tuple[str, dict]]:
    """The rows of one engine's :func:`~benchmarks.e2e_bench.time_host` record in a host table: all its steps, then,
    where it launched verifies, the steps of each kind apart (records before the split have no ``kinds``)."""
    kinds = host.get("kinds", {})
    if "verify" not in kinds:
        return [(name, host)]
    return [(name, host)] + [(f"{name}: {kind['steps']} steps launching {'a' if label == 'verify' else 'no'} verify",
                              kind) for label, kind in sorted(kinds.items())]


def render(paths: list[Path]) -> None:
    """Rewrite each result's markdown table from its JSON (``lossless-PART-TAG.json``), with this script's tables."""
    for path in paths:
        part = path.name.removeprefix("lossless-").split("-")[0]
        path.with_suffix(".md").write_text(table(part, json.loads(path.read_text())))


def main() -> None:
    if sys.argv[1:2] == ["render"]:  # (no measurement: the tables again, from the JSON files given)
        render([Path(arg) for arg in sys.argv[2:]])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="`lossless_bench.py render FILE.json...` rewrites the tables from results.")
    parser.add_argument("part", choices=("check", "real", "shapes"), help="what to measure (see the module docstring)")
    parser.add_argument("--out-dir", type=Path, required=True, help="where the JSON and the markdown table go")
    parser.add_argument("--tag", default="h200", help="the files' suffix: lossless-PART-TAG.{json,md}")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="real: the model alias or folder")
    parser.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768], help="real: context lengths")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32], help="real: batch sizes (even, or 1)")
    parser.add_argument("--tokens", type=int, default=256, help="real: generated tokens per request")
    parser.add_argument("--host-steps", type=int, default=0,
                        help="real: also time the host over this many steps of each mode (0: not)")
    parser.add_argument("--memory", type=float, default=0.4, help="real: gpu_memory_utilization of each engine")
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="real on the CPU: each engine's KV cache in GiB (default: the engine's, 1 GiB)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="real, shapes: cpu for a smoke run")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="real: the dtype")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"), help="real: the K/V pages")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per round (the adaptive policy's maximum)")
    parser.add_argument("--draft-dense-layers", type=int, nargs="+", default=[DENSE_LAYERS],
                        help="real, shapes: the lossless engines' dense layers (QuestConfig.dense_layers; one "
                             "engine each, shapes: one point each): the layers its drafts attend densely; modes and "
                             "points of a value other than the default are suffixed -denseN")
    parser.add_argument("--policies", nargs="+", default=["adaptive"], choices=("adaptive", "fixed"),
                        help="real: the lossless engine's k policies (adaptive: the engine picks the drafts per round)")
    parser.add_argument("--points", nargs="+", default=list(POINTS)[:3], choices=list(POINTS), help="shapes: the points")
    parser.add_argument("--trace-dir", type=Path, default=None,
                        help="shapes: write each point's lossless rounds' profile timeline there "
                             "(trace-POINT-denseN.json.gz, a Chrome trace: host operations and their kernels)")
    parser.add_argument("--acceptance", type=float, nargs="+", default=[0.8, 0.9, 0.95],
                        help="shapes: per-token acceptances to imply speed from (measure them with `real`)")
    args = parser.parse_args()
    if args.host_steps < 0 or (args.host_steps and args.host_steps + HOST_WARMUP_STEPS >= args.tokens):
        parser.error(f"--host-steps: {args.host_steps} must be 0, or a count whose steps after the "
                     f"{HOST_WARMUP_STEPS} warm-up ones fit in --tokens {args.tokens}")
    for batch in args.batches:
        if batch != 1 and batch % 2:
            parser.error(f"--batches: {batch} is odd; a batch is half book, half code windows (or 1)")
    head = provenance(args.device)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"lossless-{args.part}-{args.tag}"

    def save(results: dict) -> dict:
        record = {"provenance": head, "results": results}
        stem.with_name(stem.name + ".json").write_text(json.dumps(record, indent=1))
        stem.with_name(stem.name + ".md").write_text(table(args.part, record))
        return record

    print(table(args.part, save({"check": check, "real": real, "shapes": shapes}[args.part](args, save))))


if __name__ == "__main__":
    main()
