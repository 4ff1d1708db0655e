"""Launch configurations of the estimate and attention kernels, timed side by side on one GPU.

For each point (Llama-3.1-8B attention by default, ``--model llama2-7b`` for MHA, ``--model qwen2.5-1.5b``
for a group of 6 query heads on 2 KV heads; bf16, page 16) and each
configuration, the script builds a fresh
:class:`~questkv.decode.QuestDecodeStep` with the kernels' module constants set to that configuration, checks
its output against the torch reference on the point's data, and times under CUDA graphs (the method and data of
``benchmarks/kernels_bench.py``):

* dense paged decode (``step.dense``) over tokens per inner iteration x programs per SM x pipeline stages x warps;
* sparse attention over a fixed selection (``step.attend``, the rows' budgets passed as the engine passes them),
  the same grid;
* the estimate (``step.estimate``) over pages per block x blocks per program x stages x warps.

``--kv-cache-dtype fp8`` sweeps the attention on float8 e4m3 pages (the pools cast, bounds their min / max) under
bf16 queries, with the grid kinds and split plans of an fp8 cache.

The current defaults are one of the configurations, so each table shows what a change would gain in the same run.
Writes ``kernel-sweep-<tag>.json`` and ``.md``.

    python benchmarks/kernel_sweep.py --out-dir benchmarks/results --tag h200
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import platform
import sys
from pathlib import Path
from typing import Iterator

import torch

if __name__ == "__main__":  # run as a file: the checkout importable (questkv, benchmarks.*)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernels_bench import (  # noqa: E402
    DEVICE, DTYPE, MODELS, PAGE_SIZE, _rel_err, cast_layer, point_data, time_graph,
)

from questkv.config import QuestConfig  # noqa: E402
from questkv.decode import QuestDecodeStep  # noqa: E402
from questkv.eval.provenance import git_commit  # noqa: E402
from questkv.ops import reference  # noqa: E402
from questkv.ops.triton import decode_attention as attention_kernel  # noqa: E402
from questkv.ops.triton import estimate as estimate_kernel  # noqa: E402

# (batch, context, budget)
POINTS = [(1, 32768, 2048), (1, 131072, 4096), (8, 32768, 2048), (32, 32768, 2048), (16, 32768, 2048)]
KERNELS = ("dense", "sparse", "estimate")
ATTENTION_GRID = {"tokens_per_iter": (64, 128, 256), "programs_per_sm": (2, 3, 4, 8), "num_stages": (2, 3),
                  "num_warps": (4, 8)}
ESTIMATE_GRID = {"block_p": (32, 64, 128), "blocks_per_program": (1, 2), "num_stages": (2,), "num_warps": (4, 8)}


@contextlib.contextmanager
def attention_config(kind: str, tokens_per_iter: int, programs_per_sm: int, num_stages: int,
                     num_warps: int) -> Iterator[None]:
    """The attention kernel's launch constants for grids of ``kind`` (``attention.grid_kind``) set to these (the
    warps of a one-query tile, 16 rows), restored after."""
    module = attention_kernel
    saved = (dict(module._CONFIG), dict(module._WARPS_BY_ROWS))
    module._CONFIG[kind] = (tokens_per_iter, programs_per_sm, num_stages)
    module._WARPS_BY_ROWS[16] = num_warps
    try:
        yield
    finally:
        module._CONFIG, module._WARPS_BY_ROWS = saved


@contextlib.contextmanager
def estimate_config(block_p: int, blocks_per_program: int, num_stages: int, num_warps: int) -> Iterator[None]:
    """The estimate kernel's launch constants set to these, restored after."""
    module = estimate_kernel
    saved = (module._BLOCK_P, module._BLOCKS_PER_PROGRAM, module._NUM_STAGES, module._NUM_WARPS)
    module._BLOCK_P, module._BLOCKS_PER_PROGRAM, module._NUM_STAGES, module._NUM_WARPS = (
        block_p, blocks_per_program, num_stages, num_warps)
    try:
        yield
    finally:
        module._BLOCK_P, module._BLOCKS_PER_PROGRAM, module._NUM_STAGES, module._NUM_WARPS = saved


def _kinds(batch: int, model: str, fp8: bool = False) -> dict:
    """The attention grid kind of the dense and the sparse kernel at ``batch`` (KV heads of ``model``) on ``fp8``
    pages or not."""
    heads = MODELS[model][1]
    return {"dense": attention_kernel.grid_kind(True, batch * heads, fp8),
            "sparse": attention_kernel.grid_kind(False, batch * heads, fp8)}


def defaults(batch: int, model: str, fp8: bool = False) -> dict:
    a, e = attention_kernel, estimate_kernel
    attention = {
        kernel: dict(zip(("tokens_per_iter", "programs_per_sm", "num_stages"), a._CONFIG[kind]),
                     num_warps=a._WARPS_BY_ROWS[16])
        for kernel, kind in _kinds(batch, model, fp8).items()}
    return {
        **attention,
        "estimate": {"block_p": e._BLOCK_P, "blocks_per_program": e._BLOCKS_PER_PROGRAM, "num_stages": e._NUM_STAGES,
                     "num_warps": e._NUM_WARPS},
    }


def grid(space: dict) -> list[dict]:
    return [dict(zip(space, values)) for values in itertools.product(*space.values())]


def sweep_point(batch: int, context: int, budget: int, args) -> dict:
    """Every configuration of ``args.kernels`` at one point of ``args.model``."""
    hq, hkv, d = MODELS[args.model]
    data = point_data(args.model, batch, context, budget, args.max_gb)
    layers, table, lens, q, n_layers = data["layers"], data["table"], data["lens"], data["q"], data["n_layers"]
    npages = data["npages"]
    fp8 = args.kv_cache_dtype == "fp8"
    kv_dtype = torch.float8_e4m3fn if fp8 else DTYPE
    if fp8:  # each layer's pages cast in place of the bf16 ones, bounds the cast keys' min / max
        for i, layer in enumerate(layers):
            layers[i] = cast_layer(layer, kv_dtype)
            del layer
        torch.cuda.empty_cache()
    quest = QuestConfig(token_budget=budget, backend="triton")
    planned = QuestConfig(token_budget=max(budget, args.engine_budget or budget), backend="triton")
    # the rows' budgets, passed as the engine passes them (below the step's with --engine-budget: its splits share
    # the row's pages)
    budgets = torch.full((batch,), budget, dtype=torch.int32, device=DEVICE)
    base = QuestDecodeStep(quest, batch, hq, hkv, d, npages, DTYPE, DEVICE, kv_dtype=kv_dtype)
    base(q, layers[0], table, lens)
    selected = base.selected.clone()
    dense_ref = reference.paged_decode_attention(q, layers[0].k_pages, layers[0].v_pages, table, lens)
    sparse_ref = reference.paged_decode_attention(q, layers[0].k_pages, layers[0].v_pages, table, lens, selected)
    scores_ref = reference.page_scores(q, layers[0].kmin, layers[0].kmax, table, lens, PAGE_SIZE)
    reps, warmup = args.reps, args.warmup
    rows = {"dense": [], "sparse": [], "estimate": []}
    for kind in [k for k in ("dense", "sparse") if k in args.kernels]:
        for cfg in grid(ATTENTION_GRID):
            with attention_config(_kinds(batch, args.model, fp8)[kind], **cfg):
                step = QuestDecodeStep(planned if kind == "sparse" else QuestConfig(backend="triton"),
                                       batch, hq, hkv, d, npages, DTYPE, DEVICE, kv_dtype=kv_dtype)
                if kind == "dense":
                    err = _rel_err(step.dense(q, layers[0], table, lens), dense_ref)
                    micros = time_graph(lambda i: step.dense(q, layers[i], table, lens), n_layers, reps, warmup)
                else:  # (a step built for a larger budget: the selection in its first columns, the rest empty)
                    step.selected.fill_(-1)
                    step.selected[..., :selected.shape[-1]].copy_(selected)
                    err = _rel_err(step.attend(q, layers[0], table, lens, budgets=budgets), sparse_ref)
                    micros = time_graph(lambda i: step.attend(q, layers[i], table, lens, budgets=budgets), n_layers,
                                        reps, warmup)
            rows[kind].append({**cfg, "us": micros, "rel_err": err, "ok": bool(err <= 1e-2)})
    for cfg in grid(ESTIMATE_GRID) if "estimate" in args.kernels else []:
        with estimate_config(**cfg):
            step = QuestDecodeStep(quest, batch, hq, hkv, d, npages, DTYPE, DEVICE, kv_dtype=kv_dtype)
            got = step.estimate(q, layers[0], table, lens)
            finite = torch.isfinite(scores_ref)
            err = _rel_err(got[finite], scores_ref[finite])
            micros = time_graph(lambda i: step.estimate(q, layers[i], table, lens), n_layers, reps, warmup)
        rows["estimate"].append({**cfg, "us": micros, "rel_err": err, "ok": bool(err <= 1e-5)})
    del data, layers
    torch.cuda.empty_cache()
    return {"batch": batch, "context": context, "budget": budget, "n_layers": n_layers,
            "kv_bytes": data_bytes(batch, context, args.model, kv_dtype), **rows}


def data_bytes(batch: int, context: int, model: str, kv_dtype: torch.dtype = DTYPE) -> int:
    _, hkv, d = MODELS[model]
    return batch * context * hkv * d * 2 * torch.tensor([], dtype=kv_dtype).element_size()


def best_lines(points: list[dict], model: str, fp8: bool = False) -> list[str]:
    lines = ["| point | kernel | default µs | best µs | best configuration | default / best |", "|---|---|---|---|---|---|"]
    for p in points:
        default = defaults(p["batch"], model, fp8)
        label = f"B={p['batch']}, L={p['context'] // 1024}k, budget {p['budget']}"
        for kind in [k for k in KERNELS if p[k]]:
            ok = [r for r in p[kind] if r["ok"]]
            if not ok:
                lines.append(f"| {label} | {kind} | - | - | no configuration passed its check | - |")
                continue
            best = min(ok, key=lambda r: r["us"])
            base = next((r for r in ok if all(r[k] == v for k, v in default[kind].items())), None)
            config = ", ".join(f"{k} {best[k]}" for k in default[kind])
            base_us = "-" if base is None else f"{base['us']:.1f}"
            ratio = "-" if base is None else f"{base['us'] / best['us']:.2f}×"
            lines.append(f"| {label} | {kind} | {base_us} | {best['us']:.1f} | {config} | {ratio} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=30, help="timed graph replays per measurement")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-gb", type=float, default=60.0, help="GPU memory for the pools per point")
    parser.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--tag", default="h200")
    parser.add_argument("--model", default="llama3.1-8b", choices=sorted(MODELS), help="attention shape")
    parser.add_argument("--points", type=int, nargs="+", default=list(range(len(POINTS))),
                        choices=range(len(POINTS)), help="indices into POINTS (batch, context, budget): "
                        + ", ".join(f"{i}: {p}" for i, p in enumerate(POINTS)))
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS, help="kernels to sweep")
    parser.add_argument("--engine-budget", type=int, default=None,
                        help="sparse: time the attention of a step built for this larger budget (a request's smaller "
                             "selection in its first columns, the rest empty), as an engine serves a request whose "
                             "token_budget is below its own")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                        help="the pages' dtype: the model's (bf16) or float8 e4m3")
    parser.add_argument("--fp8-scores", default="e4m3", choices=("e4m3", "f16"),
                        help="fp8 pages: scores in e4m3 tensor-core dots (the default) or keys converted to float16")
    parser.add_argument("--attention-grid", type=json.loads, default=None,
                        help="the attention configurations as JSON, keys as ATTENTION_GRID's (default: that grid)")
    args = parser.parse_args()
    attention_kernel.E4M3_DOTS = args.fp8_scores == "e4m3"
    if args.attention_grid is not None:
        unknown = set(args.attention_grid) ^ set(ATTENTION_GRID)
        if unknown:
            parser.error(f"--attention-grid must have exactly the keys {sorted(ATTENTION_GRID)}, got "
                         f"{sorted(args.attention_grid)}")
        ATTENTION_GRID.clear()
        ATTENTION_GRID.update(args.attention_grid)
    fp8 = args.kv_cache_dtype == "fp8"
    if not torch.cuda.is_available():
        print("benchmarks/kernel_sweep.py needs a CUDA GPU", file=sys.stderr)
        return 2
    info = {
        "command": "python " + " ".join([sys.argv[0], *sys.argv[1:]]),
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": __import__("triton").__version__, "python": platform.python_version(),
        "model": args.model, "dtype": str(DTYPE), "kv_cache_dtype": args.kv_cache_dtype, "page_size": PAGE_SIZE,
        "engine_budget": args.engine_budget, "fp8_scores": args.fp8_scores if fp8 else None,
        "defaults": {POINTS[i][0]: defaults(POINTS[i][0], args.model, fp8) for i in args.points},
    }
    points = []
    for batch, context, budget in (POINTS[i] for i in args.points):
        points.append(sweep_point(batch, context, budget, args))
        print("\n".join(best_lines(points[-1:], args.model, fp8)[2:]), flush=True)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"kernel-sweep-{args.tag}.json").write_text(json.dumps({"info": info, "points": points}, indent=1))
    md = [f"# Kernel launch configurations on {info['gpu']}", "",
          f"- command: `{info['command']}`", f"- commit: `{info['commit']}`, date: {info['date']}",
          f"- torch {info['torch']}, triton {info['triton']}; {args.model} attention, {DTYPE} queries, "
          f"{'float8 e4m3' if fp8 else DTYPE} pages, page {PAGE_SIZE}"
          + (f", scores in {'e4m3 tensor-core dots' if args.fp8_scores == 'e4m3' else 'float16 dots'}" if fp8 else "")
          + "; sparse attention given the rows' budgets"
          + (f"; sparse steps built for a budget of {args.engine_budget}" if args.engine_budget else ""),
          "- median GPU µs per call under CUDA graphs (kernels_bench.py's method); every configuration checked against "
          "the torch reference on the point's data (attention 1e-2, estimate 1e-5 relative error)",
          "- grids: attention " + json.dumps(ATTENTION_GRID) + "; estimate " + json.dumps(ESTIMATE_GRID),
          "", "## Best against the defaults", "", *best_lines(points, args.model, fp8), ""]
    (out_dir / f"kernel-sweep-{args.tag}.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
