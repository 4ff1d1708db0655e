"""Markdown and PNG report of an end-to-end run (``benchmarks/e2e_bench.py``): every number comes from its JSON.

    python benchmarks/e2e_report.py benchmarks/results/e2e-h200.json

writes ``e2e-h200.md`` and ``e2e-h200.png`` next to the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

if __name__ == "__main__":  # run as a file: the checkout importable (questkv, benchmarks.*)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from questkv.models.shapes import DUMMY_SHAPES  # noqa: E402

# Derived targets (the brief's, not measurements): point (model, batch, context) and the bound
DENSE_FLOOR_POINT, DENSE_FLOOR_FACTOR = ("llama3.1-8b", 1, 32 * 1024), 1.15
HF_EAGER_POINT, HF_EAGER_FACTOR = ("llama3.1-8b", 1, 32 * 1024), 12.0
HF_STATIC_POINT, HF_STATIC_FACTOR = ("llama3.1-8b", 1, 32 * 1024), 3.5
PLOT_MODEL = "llama3.1-8b"
BASE_CONTEXT = 1024  # the "attention is negligible" point of e2e_bench.py's POINTS


def _k(context: int) -> str:
    return f"{context // 1024}k" if context % 1024 == 0 else str(context)


def _f(x: Optional[float], digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _num_layers(model: str) -> Optional[int]:
    shape = DUMMY_SHAPES.get(model)
    return shape[1]["num_hidden_layers"] if shape else None


def _find(points: list[dict], key: tuple) -> Optional[dict]:
    return next((p for p in points if (p["model"], p["batch"], p["context"]) == key), None)


def _met(measured: float, target: float) -> str:
    if measured >= target:
        return "yes"
    return f"NO (missed by {(target - measured) / target * 100:.1f} %)"


def _name(p: dict) -> str:
    return f"{p['model']} B={p['batch']} {_k(p['context'])}"


def budget_note(points: list[dict]) -> str:
    """'budget 2048 at ≤ 64k, 4096 at 128k' from the points' budgets and contexts."""
    by_budget: dict[int, list[int]] = {}
    for p in points:
        by_budget.setdefault(p["budget"], []).append(p["context"])
    parts = []
    for i, (budget, contexts) in enumerate(sorted(by_budget.items(), key=lambda kv: max(kv[1]))):
        lo, hi = min(contexts), max(contexts)
        if lo == hi:
            where = f"at {_k(hi)}"
        elif i == 0:
            where = f"at ≤ {_k(hi)}"
        else:
            where = f"at {_k(lo)}–{_k(hi)}"
        parts.append(f"{budget} {where}")
    return "budget " + ", ".join(parts)


def targets_section(record: dict) -> list[str]:
    points = record["points"]
    lines = ["## Targets", "",
             "Speedup = engine dense ms/token ÷ engine Quest ms/token; ideal = dense bytes floor ÷ Quest bytes floor.", "",
             "| model | B | context | budget | ideal (bytes) | target | measured | met |",
             "|---|---|---|---|---|---|---|---|"]
    for p in points:
        if p.get("target") is None:
            continue
        lines.append(f"| {p['model']} | {p['batch']} | {_k(p['context'])} | {p['budget']} | {p['ideal_speedup']:.2f}× | "
                     f"{p['target']:.2f}× | {p['speedup']:.2f}× | {_met(p['speedup'], p['target'])} |")
    derived_header = ["", "Derived targets:", "", "| target | point | bound | measured | met |", "|---|---|---|---|---|"]
    lines += derived_header
    p = _find(points, DENSE_FLOOR_POINT)
    if p:
        bound = DENSE_FLOOR_FACTOR * p["floor_dense_ms"]
        ms = p["engine_dense"]["ms_per_token"]
        met = "yes" if ms <= bound else f"NO (missed by {(ms - bound) / bound * 100:.1f} %)"
        lines.append(f"| engine dense within {DENSE_FLOOR_FACTOR}× of its bytes floor | {_name(p)} | "
                     f"≤ {bound:.2f} ms ({DENSE_FLOOR_FACTOR} × {p['floor_dense_ms']:.2f}) | {ms:.2f} ms "
                     f"({ms / p['floor_dense_ms']:.2f}× floor) | {met} |")
    p = _find(points, HF_EAGER_POINT)
    if p and "hf_eager" in p:
        ratio = p["hf_eager"]["ms_per_token"] / p["engine_quest"]["ms_per_token"]
        lines.append(f"| engine Quest ≥ {HF_EAGER_FACTOR:g}× faster than HF eager | {_name(p)} | ≥ {HF_EAGER_FACTOR:g}× | "
                     f"{ratio:.2f}× ({p['hf_eager']['ms_per_token']:.2f} / {p['engine_quest']['ms_per_token']:.2f} ms) | "
                     f"{_met(ratio, HF_EAGER_FACTOR)} |")
    p = _find(points, HF_STATIC_POINT)
    if p and "hf_static" in p:
        static_ms = p["hf_static"]["ms_per_token"]
        eager_ms = p["hf_eager"]["ms_per_token"] if "hf_eager" in p else None
        if eager_ms is not None and static_ms > eager_ms:
            lines.append(f"| engine Quest ≥ {HF_STATIC_FACTOR:g}× faster than HF static | {_name(p)} | ≥ {HF_STATIC_FACTOR:g}× | "
                         f"HF static {static_ms:.2f} ms/token > HF eager {eager_ms:.2f}: invalid (recompiled per call; "
                         f"not a steady-state time) | not evaluated |")
        else:
            ratio = static_ms / p["engine_quest"]["ms_per_token"]
            lines.append(f"| engine Quest ≥ {HF_STATIC_FACTOR:g}× faster than HF static | {_name(p)} | ≥ {HF_STATIC_FACTOR:g}× | "
                         f"{ratio:.2f}× ({static_ms:.2f} / {p['engine_quest']['ms_per_token']:.2f} ms) | "
                         f"{_met(ratio, HF_STATIC_FACTOR)} |")
    if lines[-1] == derived_header[-1]:  # none of the derived targets' points was run
        del lines[-len(derived_header):]
    return lines + [""]


def all_points_section(record: dict) -> list[str]:
    lines = ["## All points", "",
             "ms = host wall time per decode step (the timed window of back-to-back steps); graph = GPU time of one "
             "replay of the decode CUDA graph (replays back to back); "
             "host = ms − graph; floors = bytes read ÷ copy bandwidth. Pairs are dense / Quest.", "",
             "| model | B | context | budget | dense ms | Quest ms | speedup | ideal | dense floor ms | Quest floor ms | "
             "dense/floor | Quest/floor | graph ms | host ms | tokens/s | Quest tokens attended | HF eager ms | "
             "engine prefill s |",
             "|" + "---|" * 18]
    for p in record["points"]:
        d, q = p["engine_dense"], p["engine_quest"]
        hf = p.get("hf_eager", {}).get("ms_per_token")
        lines.append(
            f"| {p['model']} | {p['batch']} | {_k(p['context'])} | {p['budget']} | {d['ms_per_token']:.2f} | "
            f"{q['ms_per_token']:.2f} | {p['speedup']:.2f}× | {p['ideal_speedup']:.2f}× | {p['floor_dense_ms']:.2f} | "
            f"{p['floor_quest_ms']:.2f} | {d['ms_per_token'] / p['floor_dense_ms']:.2f} | "
            f"{q['ms_per_token'] / p['floor_quest_ms']:.2f} | {d['graph_replay_ms']:.2f} / {q['graph_replay_ms']:.2f} | "
            f"{d['ms_per_token'] - d['graph_replay_ms']:.2f} / {q['ms_per_token'] - q['graph_replay_ms']:.2f} | "
            f"{d['tokens_per_s']:.0f} / {q['tokens_per_s']:.0f} | {_f(q.get('mean_tokens_attended'), 0)} | "
            f"{_f(hf)} | {_f(p.get('prefill_s'))} |")
    hf_lines = []
    for p in record["points"]:
        for kind in ("hf_eager", "hf_static"):
            if kind in p:
                hf_lines.append(f"- {_name(p)} {kind.replace('_', ' ')}: {p[kind]['ms_per_token']:.2f} ms/token; "
                                f"the short generate run (prefill + 4 tokens) took {p[kind]['prefill_s']:.2f} s")
    if hf_lines:
        lines += ["", "HF transformers baselines (ms/token = difference of two `generate` runs of different lengths):", ""]
        lines += hf_lines
    return lines + [""]


def where_time_goes(record: dict) -> list[str]:
    points = record["points"]
    base = _find(points, (PLOT_MODEL, 1, BASE_CONTEXT))
    if base is None:
        return []
    bandwidth = record["bandwidth_bytes_per_s"]
    weights_ms = base["engine_dense"]["weight_bytes"] / bandwidth * 1e3
    layers = _num_layers(PLOT_MODEL)
    dense_layers = record["dense_layers"]
    bd, bq = base["engine_dense"]["graph_replay_ms"], base["engine_quest"]["graph_replay_ms"]
    lines = ["## Where the time goes", "",
             f"- {PLOT_MODEL} B=1 at {_k(BASE_CONTEXT)} (attention negligible): decode graph {bd:.2f} ms dense, "
             f"{bq:.2f} ms Quest, vs a weights-only floor of {weights_ms:.2f} ms "
             f"({base['engine_dense']['weight_bytes'] / 1e9:.2f} GB at {bandwidth / 1e12:.2f} TB/s): the non-attention "
             f"cost (weights, elementwise, LM head) is {bd / weights_ms:.2f}× the weights floor, "
             f"{bd - weights_ms:.2f} ms above it.",
             f"- Attention time ≈ graph ms − the same engine's graph ms at {_k(BASE_CONTEXT)}. Quest per sparse layer = "
             f"Quest attention ÷ ({layers} − {dense_layers}) layers; the {dense_layers} dense layers are included in the "
             f"numerator, so it is an upper bound.", "",
             "| context | budget | dense attention ms | Quest attention ms | Quest µs per sparse layer | "
             "dense K/V bytes floor ms (whole context) | Quest K/V + bounds bytes floor ms |",
             "|---|---|---|---|---|---|---|"]
    rows = sorted((p for p in points if p["model"] == PLOT_MODEL and p["batch"] == 1 and p["context"] != BASE_CONTEXT),
                  key=lambda p: p["context"])
    for p in rows:
        da = p["engine_dense"]["graph_replay_ms"] - bd
        qa = p["engine_quest"]["graph_replay_ms"] - bq
        per_layer = qa * 1e3 / (layers - dense_layers) if layers else None
        lines.append(f"| {_k(p['context'])} | {p['budget']} | {da:.2f} | {qa:.2f} | {_f(per_layer, 1)} | "
                     f"{p['floor_dense_ms'] - weights_ms:.2f} | {p['floor_quest_ms'] - weights_ms:.2f} |")
    return lines + [""]


def host_overlap_section(record: dict) -> list[str]:
    """Synchronous vs asynchronous host loop and the kernels of one decode step, for the points that have them."""
    points = [p for p in record["points"] if "sync" in p["engine_dense"]]
    if not points:
        return []
    lines = ["## Host overlap (async scheduling) and kernels per step", "",
             "ms = wall time per `engine.step()` over a steady window of back-to-back steps; graph = GPU time of one "
             "replay of the decode graph (replays back to back); host = ms − graph (the host time the GPU waits for; target ≤ 0.1 ms); kernels = kernels "
             "in one replay (torch profiler), per layer = kernels ÷ layers. Pairs are dense / Quest.", "",
             "| model | B | context | budget | sync ms | async ms | graph ms | host ms sync | host ms async | "
             "host ≤ 0.1 ms | kernels | kernels per layer |",
             "|" + "---|" * 12]
    for p in points:
        d, q = p["engine_dense"], p["engine_quest"]
        layers = _num_layers(p["model"])
        host = [r["ms_per_token"] - r["graph_replay_ms"] for r in (d, q)]
        per_layer = " / ".join(_f(r["kernels"]["count"] / layers, 1) if layers else "–" for r in (d, q))
        lines.append(
            f"| {p['model']} | {p['batch']} | {_k(p['context'])} | {p['budget']} | "
            f"{d['sync']['ms_per_token']:.2f} / {q['sync']['ms_per_token']:.2f} | "
            f"{d['ms_per_token']:.2f} / {q['ms_per_token']:.2f} | {d['graph_replay_ms']:.2f} / {q['graph_replay_ms']:.2f} | "
            f"{d['sync']['ms_per_token'] - d['graph_replay_ms']:.2f} / {q['sync']['ms_per_token'] - q['graph_replay_ms']:.2f} | "
            f"{host[0]:.2f} / {host[1]:.2f} | {'yes' if max(host) <= 0.1 else 'NO'} | "
            f"{d['kernels']['count']} / {q['kernels']['count']} | {per_layer} |")
    lines += ["", "Kernels of one decode step by GPU time (first point; µs summed over the step, count in brackets):", ""]
    for kind in ("engine_dense", "engine_quest"):
        kernels = points[0][kind]["kernels"]
        top = "; ".join(f"`{k['name']}` {k['us']:.0f} ({k['count']})" for k in kernels["top"])
        lines.append(f"- {kind.split('_')[1]} ({_name(points[0])}, {kernels['count']} kernels, {kernels['us']:.0f} µs): {top}")
    return lines + [""]


def reuse_section(record: dict) -> list[str]:
    """Quest selecting every step vs every C steps (``QuestConfig.selection_interval``), for the points timed with
    reuse (``--selection-intervals``)."""
    points = [p for p in record["points"] if "engine_quest_reuse" in p]
    if not points:
        return []
    lines = ["## Selection reuse", "",
             "Quest selecting its pages every decode step (C = 1) vs every C steps (in between: the last selection plus "
             "the pages begun since); ms = wall per step over the timed window (every phase), graph = one replay of the last "
             "staged step (for C > 1 its flags are those of that one step, usually a reusing one); speedups over the "
             "engine dense.", "",
             "| model | B | context | budget | C | dense ms | Quest ms (graph) | speedup | target | met |",
             "|" + "---|" * 10]
    for p in points:
        runs = {"1": (p["engine_quest"], p["speedup"]),
                **{c: (run, p["speedup_reuse"][c]) for c, run in p["engine_quest_reuse"].items()}}
        target = p.get("target")
        for c, (run, speedup) in runs.items():
            lines.append(
                f"| {p['model']} | {p['batch']} | {_k(p['context'])} | {p['budget']} | {c} | "
                f"{p['engine_dense']['ms_per_token']:.2f} | {run['ms_per_token']:.2f} ({run['graph_replay_ms']:.2f}) | "
                f"{speedup:.2f}× | {_f(target)}{'×' if target else ''} | {_met(speedup, target) if target else '–'} |")
    return lines + [""]



def interleaved_section(record: dict) -> list[str]:
    """The points timed with both engines alive in alternating rounds (``--interleaved``, ``time_pair``)."""
    points = [p for p in record["points"] if "interleaved" in p]
    if not points:
        return []
    lines = ["## Dense and Quest side by side (interleaved rounds)", "",
             "Both engines held at once; each round times a few asynchronous steps of one, then of the other (the "
             "order alternating), and one graph replay measure of each; medians over rounds, the speedup the median of "
             "the per-round ratios dense / Quest. QuestConfig.dense_context_ratio of the run: "
             f"{points[0].get('dense_context_ratio', '–')}; engine allocated first: "
             f"{points[0]['interleaved'].get('built_first', 'dense')}.", "",
             "| model | B | context | budget | dense ms | Quest ms | speedup | dense graph ms | Quest graph ms | "
             "graph speedup | rounds |", "|" + "---|" * 11]
    for p in points:
        pair = p["interleaved"]
        lines.append(f"| {p['model']} | {p['batch']} | {_k(p['context'])} | {p['budget']} | "
                     f"{pair['dense']['ms_per_token']:.2f} | {pair['quest']['ms_per_token']:.2f} | "
                     f"{pair['speedup']:.3f}× | {pair['dense']['graph_replay_ms']:.3f} | "
                     f"{pair['quest']['graph_replay_ms']:.3f} | {pair['graph_speedup']:.3f}× | {pair['rounds']} |")
    return lines + [""]


def dense_linear_section(record: dict) -> list[str]:
    """The engine dense with its float linears through questkv's one-row GEMV (the default) against cuBLAS at every
    row, for the points timed both ways (``--dense-cublas``), with the bytes floor."""
    points = [p for p in record["points"] if "engine_dense_cublas" in p]
    if not points:
        return []
    lines = ["## Float linears at one row: GEMV vs cuBLAS (engine dense)", "",
             "Two dense engines of the same run: the default (one row of a small float weight through questkv's GEMV) "
             "and every float linear on cuBLAS; ms = wall per step (graph replay in brackets); kernels = one replay's.",
             "", "| model | B | context | GEMV ms (graph) | cuBLAS ms (graph) | cuBLAS / GEMV | floor ms | GEMV / floor | "
             "cuBLAS / floor | kernels GEMV / cuBLAS |", "|" + "---|" * 10]
    for p in points:
        g, c = p["engine_dense"], p["engine_dense_cublas"]
        floor = p["floor_dense_ms"]
        lines.append(
            f"| {p['model']} | {p['batch']} | {_k(p['context'])} | {g['ms_per_token']:.2f} ({g['graph_replay_ms']:.2f}) | "
            f"{c['ms_per_token']:.2f} ({c['graph_replay_ms']:.2f}) | {c['ms_per_token'] / g['ms_per_token']:.3f} | "
            f"{floor:.2f} | {g['ms_per_token'] / floor:.3f} | {c['ms_per_token'] / floor:.3f} | "
            f"{g['kernels']['count']} / {c['kernels']['count']} |")
    lines += ["", "Kernels of the cuBLAS engine's step (first point; µs summed over the step, count in brackets): "
              + "; ".join(f"`{k['name']}` {k['us']:.0f} ({k['count']})" for k in points[0]["engine_dense_cublas"]["kernels"]["top"])]
    return lines + [""]


def _token_checks(heading: str, results: dict, extra=lambda r: "") -> list[str]:
    """Markdown lines of a token-agreement check: its heading, then one line per setting (``extra(r)`` appended)."""
    lines = [heading, ""]
    lines += [f"- {name}: identical {r['identical']} ({r['tokens_match']}/{r['tokens']} tokens match){extra(r)}"
              for name, r in results.items()]
    return lines + [""]


def weights_lines(record: dict) -> list[str]:
    """One line per model: its dense engine's weights (and, in records of engines that held a second copy of int4
    codes, what they held)."""
    seen, lines = set(), []
    for p in record["points"]:
        d = p["engine_dense"]
        key = (p["model"], p["batch"])
        if "weight_bytes" not in d or key in seen:
            continue
        seen.add(key)
        held = f", {d['weight_bytes_held'] / 1e9:.2f} GB held" if "weight_bytes_held" in d else ""
        lines.append(f"- {p['model']} at max_num_seqs={p['batch']}: weights {d['weight_bytes'] / 1e9:.2f} GB "
                     f"({d['weight_bytes'] / 2**30:.2f} GiB){held}")
    return lines


def render_markdown(record: dict) -> str:
    prov = record.get("provenance", {})
    bw = record["bandwidth_bytes_per_s"]
    lines = ["# End-to-end decode: questkv engine dense vs Quest (random weights, real shapes)", "",
             f"- command: `{prov.get('command', '?')}`",
             f"- commit: `{prov.get('commit', '?')}`",
             f"- GPU: {prov.get('machine', '?')}; date: {prov.get('date', '?')}",
             f"- torch {prov.get('torch', '?')}, transformers {prov.get('transformers', '?')}, python {prov.get('python', '?')}",
             "", "## Settings", "",
             f"- dtype {record.get('dtype', '?')}, linear weights {record.get('quantization') or 'not quantized'}"
             f"{', LM head quantized too' if record.get('quantize_lm_head') else ''}, "
             f"page size {record['page_size']}, dense_layers {record['dense_layers']}",
             *weights_lines(record),
             f"- {record.get('warmup_steps', '?')} warm-up + {record.get('timed_steps', '?')} timed decode steps per point"
             "; contexts filled synthetically (random K/V), prefill timed separately",
             f"- device-to-device copy bandwidth {bw / 1e12:.2f} TB/s (used for the bytes floors)", ""]
    lines += ["## Correctness checks", ""]
    fp32 = record.get("check_fp32")
    if fp32:
        def reuse(r):
            extra = f"; equals dense: {r['equals_dense']}" if "equals_dense" in r else ""
            if "selection_rates" in r:
                extra += "; selection rates " + ", ".join(
                    f"{path} {' / '.join(f'{x:.3f}' for x in xs)}" for path, xs in r["selection_rates"].items())
            if "logprobs_max_abs_diff" in r:
                extra += (f"; logprobs: same tokens {r['logprobs_same_tokens']}, largest difference "
                          f"{r['logprobs_max_abs_diff']:.2e}")
            return extra

        lines += _token_checks("fp32 small Llama: CUDA-graph/Triton path vs eager torch-reference path, greedy tokens:",
                               fp32, reuse)
    chunked = record.get("check_chunked_prefix_fp32")
    if chunked:
        lines += _token_checks("fp32 small Llama, CUDA path: chunked prefill (96-token chunks) with prefix-cache hits "
                               "(three prompts sharing a 1024-token prefix, sent one after another) vs one-step prefill "
                               "without the prefix cache, greedy tokens:", chunked,
                               lambda r: f"; cached tokens per prompt {r['cached_tokens']}")
    mixed = record.get("check_mixed_steps_fp32")
    if mixed:
        lines += _token_checks("fp32 small Llama, CUDA path: five prompts arriving every 3 steps while the earlier ones "
                               "decode, steps of at most 96 tokens mixing decode rows and prefill chunks vs no chunking, "
                               "greedy tokens:", mixed, lambda r: f"; {r['mixed_steps']} mixed steps")
    b8 = record.get("check_8b_bf16")
    if b8:
        lines.append("llama3.1-8b shape, bf16, random weights, against HF eager: agreeing prefix of free-running greedy "
                     "tokens; teacher-forced on HF's tokens, top-1 agreement and the relative L2 error of the next-token "
                     "logits after the prefill and after 8 decode steps (HF's own top-2 logit gap beside it):")
        lines.append("")
        for name, r in b8.items():
            line = f"- {name}: agreeing prefix {r['agreeing_prefix']} of {r['tokens']}"
            if "logits_rel_err" in r:
                errs = ", ".join(f"{e:.4f}" for e in r["logits_rel_err"])
                gaps = ", ".join(f"{g:.3f}" for g in r["hf_logit_gap_top2"])
                line += (f"; teacher-forced top-1 {r['top1_agreement_teacher_forced']} of {r['tokens']}; "
                         f"logits rel. error {errs} (HF top-2 gap {gaps})")
            lines.append(line)
        lines.append("")
    quantized = {m: record.get(f"check_{m}_fp32") for m in ("int4", "int8")}
    for method, check in quantized.items():
        if check:
            lines += _token_checks(f"fp32 small Llama quantized to {method} at load, one prompt and three: CUDA-graph "
                                   f"path (the {method} kernels) vs eager torch-reference path, greedy tokens:", check)
    int4_bf16 = record.get("check_int4_bf16_rows")
    if int4_bf16:
        lines += _token_checks("bf16 small Llama quantized to int4 at load, 1 / 2 / 5 / 16 / 20 prompts (the int4 "
                               "kernels by rows: GEMV, tensor-core MMA, Triton words): CUDA-graph path vs eager "
                               "torch-reference path, greedy tokens (bf16: agreement, not identity, expected):",
                               int4_bf16)
    if not fp32 and not b8 and not chunked and not mixed and not any(quantized.values()) and not int4_bf16:
        lines += ["(not run)", ""]
    if record["points"]:  # none: a --checks-only run
        lines += (targets_section(record) + all_points_section(record) + interleaved_section(record)
                  + reuse_section(record) + dense_linear_section(record) + host_overlap_section(record) + where_time_goes(record))
    return "\n".join(lines)


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for p in record["points"] if p["model"] == PLOT_MODEL]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, batch in enumerate(sorted({p["batch"] for p in points})):
        ps = sorted((p for p in points if p["batch"] == batch), key=lambda p: p["context"])
        x = [p["context"] / 1024 for p in ps]
        c = colors[i % len(colors)]
        ax.plot(x, [p["engine_quest"]["ms_per_token"] for p in ps], "-o", color=c, label=f"B={batch} Quest")
        ax.plot(x, [p["engine_dense"]["ms_per_token"] for p in ps], "--s", color=c, label=f"B={batch} dense")
        ax.plot(x, [p["floor_quest_ms"] for p in ps], ":", color="grey", lw=1)
        ax.plot(x, [p["floor_dense_ms"] for p in ps], ":", color="grey", lw=1)
    ax.plot([], [], ":", color="grey", lw=1, label="bytes floors")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (k tokens)")
    ax.set_ylabel("ms per decode step")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    prov = record.get("provenance", {})
    ax.set_title(f"{PLOT_MODEL}, {prov.get('machine', '')}, bf16: {budget_note(points)}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", type=Path, help="e2e-TAG.json written by benchmarks/e2e_bench.py")
    args = parser.parse_args(argv)
    record: dict[str, Any] = json.loads(args.json.read_text())
    md, png = args.json.with_suffix(".md"), args.json.with_suffix(".png")
    md.write_text(render_markdown(record))
    if not record["points"]:
        print(f"wrote {md} (no timed points: no plot)")
        return
    plot(record, png)
    print(f"wrote {md} and {png}")


if __name__ == "__main__":
    main()
