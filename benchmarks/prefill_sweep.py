"""Paged prefill attention on one GPU: checked against the torch reference, timed against the path it replaced, and
its launch constants swept.

For each point (Llama-3.1-8B attention: 32 query / 8 KV heads, head_dim 128, bf16, page 16; ``batch`` sequences of
``cached`` tokens already in the pool plus ``new`` tokens, whose K/V are in the pool too) the script

* checks :func:`questkv.ops.triton.paged_prefill_attention` against the reference (float32 math) on the first
  sequence's rows, and times it under every configuration of the grid (module constants of
  :mod:`questkv.ops.triton.prefill_attention`: rows per program, keys per iteration, warps, stages, and the split
  target), the defaults among them;
* times the path the engine ran before (per sequence: gather the prefix K/V from the pages, concatenate the new K/V,
  repeat K/V to the query heads, SDPA aligned bottom-right), and for points without cached tokens the plain prefill
  (``Attention._prefill``: SDPA ``is_causal`` on repeated K/V), which the op could replace.

Times are CUDA-event milliseconds per call, eager (prefill steps are not graphed), median of ``--reps``. Writes
``prefill-sweep-<tag>.json`` and ``.md``.

    python benchmarks/prefill_sweep.py --out-dir benchmarks/results --tag h200
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

if __name__ == "__main__":  # run as a file: the checkout importable (questkv, benchmarks.*)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from questkv.eval.provenance import provenance  # noqa: E402
from questkv.ops import reference  # noqa: E402
from questkv.ops import triton as tk  # noqa: E402
from questkv.ops.triton import prefill_attention as kernel  # noqa: E402

HEADS = (32, 8, 128)  # Llama-3.1-8B: query heads, KV heads, head_dim
PAGE_SIZE = 16
POINTS = [(16, 32768, 48), (16, 32768, 544), (1, 32768, 48), (4, 8192, 2048), (1, 0, 4096), (8, 0, 1024)]
GRID = {"block_m": (64, 128), "block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3, 4)}
SPLIT_TARGETS = (1, 2, 4)  # _SPLIT_PROGRAMS_PER_SM, swept at the defaults


def point_data(batch: int, cached: int, new: int, heads=HEADS, page_size: int = PAGE_SIZE,
               dtype: torch.dtype = torch.bfloat16, device: str = "cuda", seed: int = 0) -> dict:
    """Random pool (pages shuffled), page table and queries of one point; every sequence holds ``cached + new``."""
    num_q, num_kv, head_dim = heads
    gen = torch.Generator(device="cpu").manual_seed(seed)
    seq_len = cached + new
    pages_per_seq = -(-seq_len // page_size)
    num_pages = batch * pages_per_seq
    shape = (num_pages, page_size, num_kv, head_dim)
    k_pages = torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
    v_pages = torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
    table = torch.randperm(num_pages, generator=gen).view(batch, pages_per_seq).to(torch.int32).to(device)
    q = torch.randn(batch * new, num_q, head_dim, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
    starts = torch.arange(0, batch * new + 1, new, dtype=torch.int32).to(device)
    lens = torch.full((batch,), seq_len, dtype=torch.int32).to(device)
    return {"q": q, "k_pages": k_pages, "v_pages": v_pages, "page_table": table, "query_starts": starts,
            "seq_lens": lens, "cached": cached, "new": new}


def args_of(data: dict) -> tuple:
    return (data["q"], data["k_pages"], data["v_pages"], data["page_table"], data["query_starts"], data["seq_lens"],
            data["new"])


def check(data: dict) -> float:
    """Relative error of the kernel against the reference on the first sequence's rows."""
    q, k_pages, v_pages, table, starts, lens, new = args_of(data)
    got = tk.paged_prefill_attention(q, k_pages, v_pages, table, starts, lens, new)[:new]
    one = torch.tensor([0, new], dtype=torch.int32, device=q.device)
    want = reference.paged_prefill_attention(q[:new], k_pages, v_pages, table[:1], one, lens[:1])
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def gathered_sdpa(data: dict) -> torch.Tensor:
    """The engine's previous prefill after cached tokens (per sequence gather, cat, repeat, SDPA), or, without
    cached tokens, its plain prefill (SDPA ``is_causal`` on repeated K/V)."""
    q, k_pages, v_pages, table, starts, lens, new = args_of(data)
    cached, group = data["cached"], q.shape[1] // k_pages.shape[2]
    out = torch.empty_like(q)
    for row, begin in enumerate(range(0, q.shape[0], new)):
        pages = table[row, :-(-(cached + new) // PAGE_SIZE)].long()
        kv = [pool[pages].flatten(0, 1)[:cached + new] for pool in (k_pages, v_pages)]  # [L, Hkv, D]
        if cached:  # the new K/V came from the layer's input, concatenated after the gathered prefix
            kv = [torch.cat([x[:cached], x[cached:].clone()]) for x in kv]
        ks, vs = [x.transpose(0, 1)[None].repeat_interleave(group, dim=1) for x in kv]  # [1, Hq, L, D]
        qs = q[begin:begin + new].transpose(0, 1)[None]
        if cached:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=causal_lower_right(new, cached + new))
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        out[begin:begin + new] = o[0].transpose(0, 1)
    return out


def time_ms(fn: Callable[[], object], reps: int) -> float:
    """Median CUDA-event milliseconds of ``fn`` over ``reps`` calls after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@contextlib.contextmanager
def constants(**values) -> Iterator[None]:
    """The kernel module's constants (``_BLOCK_M=64``, ...) set to these, restored after."""
    saved = {name: getattr(kernel, name) for name in values}
    for name, value in values.items():
        setattr(kernel, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(kernel, name, value)


def sweep_point(point: tuple[int, int, int], reps: int, sweep: bool = True) -> dict:
    data = point_data(*point)
    call = lambda: tk.paged_prefill_attention(*args_of(data))  # noqa: E731
    result = {"point": point, "rel_err": check(data), "baseline_ms": time_ms(lambda: gathered_sdpa(data), reps),
              "default_ms": time_ms(call, reps), "configs": []}
    if not sweep:
        return result
    for block_m, block_n, num_warps, num_stages in itertools.product(*GRID.values()):
        warps = {rows: num_warps for rows in kernel._NUM_WARPS}
        with constants(_BLOCK_M=block_m, _BLOCK_N=block_n, _NUM_WARPS=warps, _NUM_STAGES=num_stages):
            result["configs"].append({"block_m": block_m, "block_n": block_n, "num_warps": num_warps,
                                      "num_stages": num_stages, "ms": time_ms(call, reps)})
    for target in SPLIT_TARGETS:
        with constants(_SPLIT_PROGRAMS_PER_SM=target):
            result["configs"].append({"split_programs_per_sm": target, "ms": time_ms(call, reps)})
    return result


def markdown(results: list[dict], prov: dict) -> str:
    lines = ["# Paged prefill attention: the op against the reference and the gather + SDPA path it replaced", "",
             f"- command: `{prov.get('command', '?')}`", f"- commit: `{prov.get('commit', '?')}`",
             f"- GPU: {prov.get('machine', '?')}; date: {prov.get('date', '?')}", "",
             "Llama-3.1-8B attention (32 query / 8 KV heads, head_dim 128), bf16, page 16; CUDA-event ms per call, "
             "median; rel. err: against the float32 reference on the first sequence's rows.", "","| batch, cached, new | rel. err | before (gather + SDPA) ms | op, defaults ms | best config | best ms |",
             "|---|---|---|---|---|---|"]
    for r in results:
        best = min(r["configs"], key=lambda c: c["ms"]) if r["configs"] else {"ms": r["default_ms"]}
        name = ", ".join(f"{k}={v}" for k, v in best.items() if k != "ms") or "defaults (not swept)"
        lines.append(f"| {r['point']} | {r['rel_err']:.1e} | {r['baseline_ms']:.3f} | {r['default_ms']:.3f} | {name} "
                     f"| {best['ms']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--tag", default="h200")
    parser.add_argument("--reps", type=int, default=10, help="timed calls per measurement (default: 10)")
    parser.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True,
                        help="time every launch configuration of GRID and SPLIT_TARGETS (--no-sweep: the defaults only)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("prefill_sweep.py needs a CUDA GPU")
    prov, results = provenance("cuda"), []
    for point in POINTS:
        results.append(sweep_point(point, args.reps, args.sweep))
        print(markdown(results[-1:], prov).splitlines()[-1], flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"prefill-sweep-{args.tag}.json").write_text(json.dumps({"provenance": prov, "points": results},
                                                                            indent=1))
    (args.out_dir / f"prefill-sweep-{args.tag}.md").write_text(markdown(results, prov))
    print(markdown(results, prov))


if __name__ == "__main__":
    main()
