"""The lossless verify step's attention on one GPU: k + 1 queries per sequence against the one-query dense decode.

A verify step attends, for every drafting sequence, its last ``k + 1`` positions over the whole cache (causal among
them). The engine runs it with the decode kernel's multi-query form (``ops.paged_decode_attention`` with ``q``
``[batch, queries, heads, dim]``: the query group's heads times the positions share each K/V tile); the paged
prefill kernel, which served the verify step before, is timed beside it. Per point (model shape, batch, context)
and query count, after checking both kernels against the torch reference on small ragged data and against each
other on the point's data: median µs per layer under CUDA graphs (``benchmarks/graph_timing.py``, enough
independent layers per replay that L2 holds none of the next), the ratio to the one-query dense decode (issue
target: at most 1.15 for 2 to 9 queries) and the bytes floor (one layer's K/V at the measured copy bandwidth).

Usage (on the GPU machine)::

    python benchmarks/verify_attention.py --out-dir $OUT --tag h200

Writes ``verify-attention-<tag>.json`` and ``.md`` (command, commit, GPU, date) and prints the table last.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

if __name__ == "__main__":  # run as a file: the checkout importable (questkv, benchmarks.*)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernels_bench import (  # noqa: E402
    DEVICE,
    DTYPE,
    MODELS,
    PAGE_SIZE,
    copy_bandwidth,
    graph_equals_eager,
    point_data,
    time_graph,
)
from questkv.config import QuestConfig  # noqa: E402
from questkv.decode import QuestDecodeStep  # noqa: E402
from questkv.eval.provenance import git_commit  # noqa: E402
from questkv.ops import reference  # noqa: E402
from questkv.ops import triton as kernels  # noqa: E402
from questkv.ops.triton import decode_attention as attention  # noqa: E402

POINTS = [  # (model, batch, context): the four points at the 8B shape, and llama2-7b's MHA
    ("llama3.1-8b", 1, 32768),
    ("llama3.1-8b", 16, 32768),
    ("llama3.1-8b", 4, 131072),
    ("llama3.1-8b", 1, 131072),
    ("llama2-7b", 1, 32768),
]
QUERIES = [2, 3, 5, 9, 17]
TARGET = 1.15  # verify attention / one-query dense decode attention, at most, for 2 to 9 queries


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    out, want = out.double(), want.double()
    return float("nan") if out.isnan().any() else ((out - want).norm() / want.norm()).item()


def check_small(gen: torch.Generator, lengths=(3001, 40, 1777), queries_list=QUERIES, models=MODELS,
                device=DEVICE) -> list[dict]:
    """Both verify kernels against the reference: ragged lengths (one shorter than a key block), every model shape,
    bf16 and fp8 pools, 2 to 17 queries."""
    checks = []
    for model, (hq, hkv, d) in models.items():
        for pool_dtype in (DTYPE, torch.float8_e4m3fn):
            lens = torch.tensor(lengths, dtype=torch.int32, device=device)
            width = -(-max(lengths) // PAGE_SIZE)
            num_pages = len(lengths) * width
            k_pages = torch.randn(num_pages, PAGE_SIZE, hkv, d, device=device, generator=gen).to(pool_dtype)
            v_pages = torch.randn(num_pages, PAGE_SIZE, hkv, d, device=device, generator=gen).to(pool_dtype)
            table = torch.randperm(num_pages, device=device, generator=gen).view(len(lengths), width).int()
            for queries in queries_list:
                q = torch.randn(len(lengths), queries, hq, d, device=device, generator=gen).to(DTYPE)
                want = reference.paged_decode_attention(q, k_pages, v_pages, table, lens)
                got = kernels.paged_decode_attention(q, k_pages, v_pages, table, lens)
                starts = torch.arange(len(lengths) + 1, dtype=torch.int32, device=device) * queries
                prefill = kernels.paged_prefill_attention(q.flatten(0, 1), k_pages, v_pages, table, starts, lens, queries)
                for name, out in (("decode kernel", got), ("prefill kernel", prefill.view_as(q))):
                    err = rel_err(out, want)
                    checks.append({"check": f"{model} {str(pool_dtype).split('.')[-1]} {queries} queries, {name}",
                                   "rel_err": err, "ok": err <= 1e-2})
    return checks


def run_point(model: str, batch: int, context: int, args, floor_tbps: float) -> dict:
    hq, hkv, d = MODELS[model]
    data = point_data(model, batch, context, context, args.max_gb)
    layers, table, lens, n_layers, gen = data["layers"], data["table"], data["lens"], data["n_layers"], data["gen"]
    reps, warmup = args.reps, args.warmup
    config = QuestConfig(backend="triton")
    point = {"model": model, "batch": batch, "context": context, "n_layers": n_layers, "kv_bytes": data["kv_bytes"],
             "floor_us": data["kv_bytes"] / (floor_tbps * 1e12) * 1e6, "queries": []}
    one = QuestDecodeStep(config, batch, hq, hkv, d, data["npages"], DTYPE, DEVICE)
    q1 = data["q"]
    point["one_query_us"] = time_graph(lambda i: one.dense(q1, layers[i], table, lens), n_layers, reps, warmup)
    for queries in args.queries:
        step = QuestDecodeStep(config, batch, hq, hkv, d, data["npages"], DTYPE, DEVICE, num_queries=queries)
        q = torch.randn(batch * queries, hq, d, device=DEVICE, dtype=DTYPE, generator=gen)
        starts = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE) * queries
        decode_us = time_graph(lambda i: step.dense(q, layers[i], table, lens), n_layers, reps, warmup)
        prefill_us = time_graph(lambda i: kernels.paged_prefill_attention(
            q, layers[i].k_pages, layers[i].v_pages, table, starts, lens, queries), n_layers, reps, warmup)
        got = step.dense(q, layers[0], table, lens).clone()
        prefill = kernels.paged_prefill_attention(q, layers[0].k_pages, layers[0].v_pages, table, starts, lens, queries)
        if args.sweep:
            def enqueue_fresh(queries=queries, q=q):  # a step built under the configuration being timed
                fresh = QuestDecodeStep(config, batch, hq, hkv, d, data["npages"], DTYPE, DEVICE, num_queries=queries)
                return lambda i: fresh.dense(q, layers[i], table, lens)
            sweep, sweep_err = sweep_configs(enqueue_fresh, n_layers, reps, warmup, got)
        row = {"queries": queries, "decode_kernel_us": decode_us, "prefill_kernel_us": prefill_us,
               "decode_kernel_ratio": decode_us / point["one_query_us"],
               "prefill_kernel_ratio": prefill_us / point["one_query_us"],
               "kernels_rel_err": rel_err(got, prefill),
               "graph_equals_eager": graph_equals_eager(lambda: step.dense(q, layers[0], table, lens))}
        if args.sweep:
            row["sweep_us"], row["sweep_rel_err"] = sweep, sweep_err
        point["queries"].append(row)
        print(f"{model} B={batch} L={context} {queries} queries: decode kernel {decode_us:.1f} µs "
              f"({row['decode_kernel_ratio']:.2f}x one query {point['one_query_us']:.1f}), prefill kernel "
              f"{prefill_us:.1f} ({row['prefill_kernel_ratio']:.2f}x)", flush=True)
    return point


SWEEP_CONFIGS = [(64, 4, 3, 64), (128, 4, 2, 64), (128, 3, 2, 64), (64, 3, 3, 64), (128, 2, 3, 64), (64, 2, 3, 64),
                 (64, 4, 2, 64), (64, 3, 2, 64), (32, 4, 3, 64), (32, 4, 2, 64), (32, 3, 3, 64),
                 (128, 2, 3, 32), (64, 4, 2, 32), (32, 4, 3, 32)]
"""(keys per iteration, programs per SM the split plan aims at, pipeline stages, most rows of a program's query tile)
that ``--sweep`` tries for the multi-query grids (``_CONFIG["verify"]`` and ``["verify-64"]`` alike: tiles of up to
32 rows and of 64; at most 32 rows a tile, 9 queries of a group of 4 take two tiles of 5 positions, each reading the
keys). What each compiles to for sm_90 (registers, programs an SM holds): ``benchmarks/sass_loop.py --verify``."""


def sweep_configs(make_enqueue, n_layers: int, reps: int, warmup: int, want: torch.Tensor
                  ) -> tuple[dict[str, float], dict[str, float]]:
    """µs per layer of ``make_enqueue()`` (an enqueue built, with its buffers and so its split plan, under the
    configuration) under each of :data:`SWEEP_CONFIGS` for the multi-query grids, and each configuration's relative
    error on layer 0 against ``want`` (the module's own launch); the module's own settings are restored after.
    (Tiles padded to 64 rows, Hopper's warpgroup MMA, were slower or no faster at every point on an H100:
    verify-attention-h100-tiles.md, commit 618ca59.)"""
    times, errors = {}, {}
    for keys, per_sm, stages, rows in SWEEP_CONFIGS:
        name = f"{keys} keys, {per_sm}/SM, {stages} stages" + ("" if rows == 64 else f", tiles of {rows} rows")
        with multi_query_launch(keys, per_sm, stages, rows):
            enqueue = make_enqueue()
            errors[name] = rel_err(enqueue(0), want)
            times[name] = time_graph(enqueue, n_layers, reps, warmup)
    return times, errors


@contextlib.contextmanager
def multi_query_launch(keys: int, per_sm: int, stages: int, rows: int):
    """The multi-query grids' launch (``_CONFIG["verify"]`` and ``["verify-64"]``: keys per iteration, programs per
    SM the split plan aims at, pipeline stages) and the most rows of a query tile (``_MAX_QUERY_ROWS``) set in
    ``questkv.ops.triton.decode_attention`` while the block runs, the module's own restored after."""
    saved, saved_rows = dict(attention._CONFIG), attention._MAX_QUERY_ROWS
    attention._CONFIG.update({"verify": (keys, per_sm, stages), "verify-64": (keys, per_sm, stages)})
    attention._MAX_QUERY_ROWS = rows
    try:
        yield
    finally:
        attention._CONFIG.clear()
        attention._CONFIG.update(saved)
        attention._MAX_QUERY_ROWS = saved_rows


def table_lines(points: list[dict]) -> list[str]:
    lines = ["| point | queries | one query µs (floor) | verify, decode kernel µs | ratio | verify, prefill kernel µs "
             "| ratio | target ≤ 1.15 (2–9 queries) |", "|---|---|---|---|---|---|---|---|"]
    for p in points:
        for r in p["queries"]:
            judged = "met" if r["decode_kernel_ratio"] <= TARGET else "missed"
            lines.append(f"| {p['model']} B={p['batch']}/{p['context'] // 1024}k | {r['queries']} | "
                         f"{p['one_query_us']:.1f} ({p['floor_us']:.1f}) | {r['decode_kernel_us']:.1f} | "
                         f"{r['decode_kernel_ratio']:.2f} | {r['prefill_kernel_us']:.1f} | {r['prefill_kernel_ratio']:.2f} | "
                         f"{judged if 2 <= r['queries'] <= 9 else '—'} |")
    return lines


def sweep_lines(points: list[dict]) -> list[str]:
    """The ``--sweep`` table: per point and query count, µs under each configuration, the fastest in bold, and
    "(wrong)" beside a configuration whose output is off the module's launch by more than 1e-2."""
    rows = [(p, r) for p in points for r in p["queries"] if "sweep_us" in r]
    if not rows:
        return []
    configs = list(rows[0][1]["sweep_us"])
    lines = ["Launch configurations of the multi-query kernel (µs per layer):", "",
             "| point | queries | " + " | ".join(configs) + " |", "|---|---|" + "---|" * len(configs)]
    for p, r in rows:
        best = min(r["sweep_us"].values())
        cells = [(f"**{us:.1f}**" if us == best else f"{us:.1f}")
                 + ("" if r["sweep_rel_err"][name] < 1e-2 else " (wrong)") for name, us in r["sweep_us"].items()]
        lines.append(f"| {p['model']} B={p['batch']}/{p['context'] // 1024}k | {r['queries']} | " + " | ".join(cells)
                     + " |")
    return lines + [""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--queries", default=",".join(map(str, QUERIES)), help="queries per sequence (k + 1)")
    parser.add_argument("--points", default=None, help="model:batch:context,... (default: the issue's points)")
    parser.add_argument("--sweep", action="store_true",
                        help="also time the multi-query kernel under each launch configuration")
    parser.add_argument("--reps", type=int, default=50, help="timed graph replays per measurement")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--max-gb", type=float, default=60.0, help="GPU memory for the pools of one point")
    parser.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--tag", default="h200")
    args = parser.parse_args()
    args.queries = [int(q) for q in args.queries.split(",")]
    points_arg = POINTS if args.points is None else [
        (m, int(b), int(c)) for m, b, c in (p.split(":") for p in args.points.split(","))]
    if not torch.cuda.is_available():
        print("benchmarks/verify_attention.py needs a CUDA GPU", file=sys.stderr)
        return 2
    info = {"command": "python " + " ".join([sys.argv[0], *sys.argv[1:]]), "commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "python": platform.python_version(),
            "dtype": str(DTYPE), "page_size": PAGE_SIZE}
    print(json.dumps(info), flush=True)
    checks = check_small(torch.Generator(device=DEVICE).manual_seed(7))
    for c in checks:
        print(f"check {c['check']}: rel_err {c['rel_err']:.2e} {'ok' if c['ok'] else 'FAIL'}", flush=True)
    info["copy_tbps"] = copy_bandwidth()
    points = []
    write_results(Path(args.out_dir), args.tag, info, checks, points)
    if all(c["ok"] for c in checks):
        for model, batch, context in points_arg:
            points.append(run_point(model, batch, context, args, info["copy_tbps"]))
            torch.cuda.empty_cache()
            write_results(Path(args.out_dir), args.tag, info, checks, points)  # a run cut short keeps its points
    print((Path(args.out_dir) / f"verify-attention-{args.tag}.md").read_text())
    return 0 if all(c["ok"] for c in checks) else 1


def write_results(out_dir: Path, tag: str, info: dict, checks: list[dict], points: list[dict]) -> None:
    """``verify-attention-<tag>.json`` and ``.md`` under ``out_dir``: provenance, checks and the points so far."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"verify-attention-{tag}.json").write_text(json.dumps(
        {"info": info, "checks": checks, "points": points}, indent=1))
    md = [f"# Verify attention (k + 1 queries per sequence) on {info['gpu']}", "",
          f"- command: `{info['command']}`", f"- commit: {info['commit']}", f"- date: {info['date']}",
          f"- torch {info['torch']}, triton {info['triton']}; {info['dtype']} pools, page size {PAGE_SIZE}; "
          f"copy bandwidth {info['copy_tbps']:.2f} TB/s (the floor: one layer's K/V at it)",
          f"- checks against the torch reference: {sum(c['ok'] for c in checks)} of {len(checks)} ok", "",
          *table_lines(points), "", *sweep_lines(points)]
    (out_dir / f"verify-attention-{tag}.md").write_text("\n".join(md))


if __name__ == "__main__":
    sys.exit(main())
