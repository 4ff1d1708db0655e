"""Does the Triton select's time follow each row's real page count, not the page-table width?

Times :func:`questkv.ops.triton.select_pages_into` on one GPU (CUDA events around CUDA-graph
replays of ``--calls`` back-to-back calls, median over ``--iters`` replays after ``--warmup``) with
``num_kv_heads`` = 8 score rows per sequence, a budget of 2048 tokens (128 pages of 16) and one
sink and two recent pages, at these points (sequence lengths ``(pages - 1) * 16 + 6`` tokens, so
2049 pages is a 32768 + 6 token prompt):

* B=1, page-table width 2048 (one chunk, ``SINGLE``): 1024 and 2048 pages;
* B=1, page-table width 4096 (the engine's width for 2049-4096 pages): 2048, 2049, 3000, 4096 pages;
* B=32, 2048 pages, widths 2048 and 4096.

Each point runs the launcher's own choice of path (``split=None``) and both paths forced, and the
one-program path's chunk loop for every ``--row-blocks`` chunk size (``select._ROW_BLOCK``, with the
one-chunk kernel of narrow tables switched off); every output is
checked against :func:`questkv.ops.reference.select_pages` bit for bit (eagerly and after the
replays). Prints a markdown table and writes JSON to ``--out``.

    python benchmarks/select_cliff.py --out benchmarks/results/select-cliff-h200.json
    TRITON_INTERPRET=1 python benchmarks/select_cliff.py --smoke --out /tmp/select-cliff-smoke.json   # CPU

``--smoke`` runs tiny shapes (2 heads, 32-column tables, chunks of 8 pages, a budget of 8 pages)
through the Triton interpreter on the CPU, with wall-clock timing: a check that the script runs,
not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

if __name__ == "__main__":  # run as a file: the checkout importable (questkv, benchmarks.*)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PAGE_SIZE = 16
HEADS = 8
BUDGET_TOKENS = 2048
SINK, RECENT = 1, 2
# (batch, pages, page-table width)
POINTS = [(1, 1024, 2048), (1, 2048, 2048), (1, 2048, 4096), (1, 2049, 4096), (1, 3000, 4096), (1, 4096, 4096), (32, 2048, 2048), (32, 2048, 4096)]
SMOKE_POINTS = [(1, 16, 32), (1, 17, 32), (1, 24, 32), (1, 32, 32), (2, 16, 16)]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON results path")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    parser.add_argument("--iters", type=int, default=None, help="timed graph replays (default 200; smoke 2)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed replays first")
    parser.add_argument("--calls", type=int, default=8, help="select calls captured per graph replay")
    parser.add_argument("--row-blocks", default=None,
                        help="comma-separated chunk sizes of the one-program path to time "
                             "(default 512,1024,2048; smoke 8)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.iters = args.iters or (2 if args.smoke else 200)
    args.row_blocks = [int(b) for b in (args.row_blocks or ("8" if args.smoke else "512,1024,2048")).split(",")]
    if args.iters < 1 or args.calls < 1 or any(b < 1 or b & (b - 1) for b in args.row_blocks):
        parser.error("--iters and --calls must be >= 1 and every --row-blocks a power of two")
    return args


def make_case(batch: int, heads: int, pages: int, width: int, device, gen):
    """Scores ``[batch, heads, width]`` float32 (random where the pages are, ``-inf`` past them, as the
    estimate writes) and ``seq_lens`` ``[batch]`` int32 of ``pages`` pages each."""
    import torch

    scores = torch.randn(batch, heads, width, generator=gen).to(device)
    scores[..., pages:] = float("-inf")
    lens = torch.full((batch,), (pages - 1) * PAGE_SIZE + 6, dtype=torch.int32, device=device)
    return scores, lens


def time_cuda(call: Callable[[], object], iters: int, warmup: int, calls: int) -> float:
    """Median GPU microseconds of ``call()``: ``calls`` calls captured in one CUDA graph (after an eager
    call that compiles), ``iters`` replays timed with CUDA events after ``warmup`` replays."""
    from benchmarks.graph_timing import graph_replay_us

    return graph_replay_us([call], iters, warmup, cycles=calls)


def time_cpu(call: Callable[[], object], iters: int) -> float:
    """Median wall microseconds of ``call()`` after one untimed call (smoke runs only)."""
    call()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def run_point(batch: int, pages: int, width: int, args, device, gen) -> list[dict]:
    """Every variant of one point: ``dispatch`` (``split=None``), ``split``, and ``row/<chunk>`` (the chunk
    loop, also in tables narrow enough for the one-chunk kernel)."""
    import torch

    from questkv.ops import reference
    from questkv.ops.triton import select

    heads, budget_pages = (2, 8) if args.smoke else (HEADS, BUDGET_TOKENS // PAGE_SIZE)
    scores, lens = make_case(batch, heads, pages, width, device, gen)
    want = reference.select_pages(scores, lens, PAGE_SIZE, budget_pages, SINK, RECENT)
    buffers = select.select_buffers(batch, heads, width, scores.device)
    default_block, default_single = select._ROW_BLOCK, select._ROW_SINGLE_PAGES
    variants = [("dispatch", None, default_block, default_single), ("split", True, default_block, default_single)]
    variants += [(f"row/{block}", False, block, 0) for block in args.row_blocks]
    rows = []
    for name, split, block, single_pages in variants:
        select._ROW_BLOCK, select._ROW_SINGLE_PAGES = block, single_pages
        try:
            out = torch.full_like(want, 12345)

            def call():
                return select.select_pages_into(out, scores, lens, PAGE_SIZE, budget_pages, SINK, RECENT, None,
                                                buffers, split)

            call()
            eager_ok = bool(torch.equal(out, want))
            out.fill_(12345)
            if args.smoke:
                us = time_cpu(call, args.iters)
            else:
                us = time_cuda(call, args.iters, args.warmup, args.calls)
            ok = eager_ok and bool(torch.equal(out, want))
            launch = select.row_launch(width)
        finally:
            select._ROW_BLOCK, select._ROW_SINGLE_PAGES = default_block, default_single
        took_split = select.takes_split_path(batch, heads, width, split)
        rows.append(dict(batch=batch, heads=heads, pages=pages, max_pages=width, budget_pages=budget_pages,
                         variant=name, path="split" if took_split else ("one chunk" if launch["SINGLE"] else "row"),
                         row_block=None if took_split else launch["BLOCK"],
                         median_us=round(us, 2), matches_reference=ok))
        print(f"B={batch} pages={pages} width={width} {name:>10}: {us:9.2f} us  "
              f"{'ok' if ok else 'MISMATCH'}", file=sys.stderr, flush=True)
    return rows


def table_lines(rows: list[dict], unit: str) -> list[str]:
    """One markdown row per point, one column per variant."""
    variants = list(dict.fromkeys(row["variant"] for row in rows))
    points = list(dict.fromkeys((row["batch"], row["pages"], row["max_pages"]) for row in rows))
    lines = ["| B | pages | table width | " + " | ".join(f"{v} {unit}" for v in variants) + " |",
             "|---|---|---|" + "---|" * len(variants)]
    for point in points:
        cells = []
        for variant in variants:
            row = next(r for r in rows if (r["batch"], r["pages"], r["max_pages"]) == point and r["variant"] == variant)
            cell = f"{row['median_us']:.1f}" + ("" if row["matches_reference"] else " (MISMATCH)")
            if variant == "dispatch":
                cell += f" ({row['path']})"
            cells.append(cell)
        lines.append(f"| {point[0]} | {point[1]} | {point[2]} | " + " | ".join(cells) + " |")
    return lines


def _commit() -> str:
    from questkv.eval.provenance import git_commit  # $QUESTKV_COMMIT on the GPU machine, whose .git may be stale

    return git_commit()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch
    import triton

    if args.smoke:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        from questkv.ops.triton import select

        select._ROW_BLOCK = min(args.row_blocks)  # several chunks per row at these sizes
        points = SMOKE_POINTS
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --smoke on a CPU", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        points = POINTS
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    for batch, pages, width in points:
        rows += run_point(batch, pages, width, args, device, gen)
    unit = "wall µs (interpreter)" if args.smoke else "µs"
    lines = table_lines(rows, unit)
    print("\n".join(lines))
    result = dict(
        commit=_commit(), smoke=args.smoke,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        torch=torch.__version__, triton=triton.__version__, page_size=PAGE_SIZE, sink_pages=SINK,
        recent_pages=RECENT, iters=args.iters, warmup=args.warmup, calls_per_replay=args.calls,
        timing="wall clock, interpreter" if args.smoke else "CUDA events over CUDA-graph replays, median",
        all_match=all(row["matches_reference"] for row in rows), rows=rows, table="\n".join(lines),
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["all_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
