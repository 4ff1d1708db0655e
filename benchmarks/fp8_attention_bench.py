"""Dense decode attention on fp8 (e4m3) pages: questkv's Triton kernel against FlashInfer's, both also on bf16 pages.

Issue 43 asks the dense step on fp8 pages to be 1.6x faster than on bf16 ones; questkv's kernel gives 1.27x at
llama3.1-8b B=16/32k on an H200 (``fp8-kv-profile-h200-pairs.md``), bound by its conversion work. This measures
whether a maintained library does better on the same pages before any more hand-written kernel work: per point
(llama3.1-8b attention, page 16; ``kernels_bench.point_data``'s random pools, their pages cast to e4m3 for the fp8
rows), the GPU time per call under CUDA graphs (``kernels_bench.time_graph``: layers rotated so that each call reads
its pages from memory) of questkv's dense decode (``QuestDecodeStep.dense``) and of FlashInfer's
``BatchDecodeWithPagedKVCacheWrapper`` (``kv_data_type`` the pages' dtype, scale 1; the faster of its tensor-core and
CUDA-core modes), each output checked against the torch reference on the same pages; the bytes floor (K and V read
once at the copy bandwidth) beside every time.

FlashInfer is not in the GPU image: carry ``flashinfer-python==0.6.18.post1`` and ``apache-tvm-ffi==0.1.15.post2``
(cp312) installed with ``pip install --no-index --no-deps --target DIR``, run with ``PYTHONPATH=DIR``,
``FLASHINFER_CUDA_ARCH_LIST=9.0`` and a ``libcuda.so`` on ``LIBRARY_PATH`` (docs/kernels.md). Without it the
FlashInfer rows record why.

    python benchmarks/fp8_attention_bench.py --out-dir benchmarks/results --tag h200
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

if __name__ == "__main__":  # run as a file: the checkout importable (questkv, benchmarks.*)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernels_bench import (  # noqa: E402
    DEVICE, DTYPE, MODELS, PAGE_SIZE, _rel_err, cast_layer, copy_bandwidth, flashinfer_wrappers, point_data,
    time_graph,
)

from questkv.config import QuestConfig  # noqa: E402
from questkv.decode import QuestDecodeStep  # noqa: E402
from questkv.eval.provenance import provenance  # noqa: E402
from questkv.ops import reference  # noqa: E402

MODEL = "llama3.1-8b"
POINTS = [(1, 32768), (8, 32768), (16, 32768), (4, 131072)]  # (batch, context)
E4M3 = torch.float8_e4m3fn
TOLERANCE = 2e-2  # relative error against the torch reference on the same pages (bf16 output)


def measure_point(batch: int, context: int, args, flashinfer_error: str | None) -> dict:
    """Both kernels on bf16 and on fp8 pages at one point: ``{"pages": {dtype: {kernel: row}}}``, a row holding
    ``us``, ``rel_err``, ``ok``, ``tbps`` and ``floor_us`` (or ``error`` where the kernel could not run)."""
    hq, hkv, d = MODELS[MODEL]
    data = point_data(MODEL, batch, context, 2048, args.max_gb)
    table, lens, q, n_layers = data["table"], data["lens"], data["q"], data["n_layers"]
    point = {"batch": batch, "context": context, "n_layers": n_layers, "pages": {}}
    for name, dtype in (("bf16", DTYPE), ("fp8", E4M3)):
        layers = data["layers"] if dtype == DTYPE else [cast_layer(layer, dtype) for layer in data["layers"]]
        kv_bytes = batch * context * hkv * d * 2 * layers[0].k_pages.element_size()
        want = reference.paged_decode_attention(q, layers[0].k_pages, layers[0].v_pages, table, lens)
        rows = {}
        step = QuestDecodeStep(QuestConfig(backend="triton"), batch, hq, hkv, d, data["npages"], DTYPE, DEVICE,
                               kv_dtype=dtype)
        rows["questkv"] = _row(lambda i: step.dense(q, layers[i], table, lens), want, kv_bytes, n_layers, args)
        rows["flashinfer"] = _flashinfer(batch, table, q, layers, want, kv_bytes, n_layers, args, flashinfer_error)
        point["pages"][name] = {"kv_bytes": kv_bytes, **rows}
        print(json.dumps({"batch": batch, "context": context, "pages": name,
                          **{k: v.get("us", v.get("error")) for k, v in rows.items()}}), flush=True)
    torch.cuda.empty_cache()
    return point


def _flashinfer(batch, table, q, layers, want, kv_bytes, n_layers, args, unavailable) -> dict:
    """FlashInfer's faster mode (tensor cores or not, both tried: ``modes``) as a :func:`_row` with its ``mode``;
    ``{"error": ...}`` where it is unavailable or refuses every mode."""
    if unavailable is not None:
        return {"error": unavailable}
    hq, hkv, d = MODELS[MODEL]
    modes, out = {}, torch.empty_like(q)
    for tc in (True, False):
        name = "tc" if tc else "no_tc"
        try:
            wrapper = flashinfer_wrappers(batch, hq, hkv, d, table, (tc,), kv_dtype=layers[0].k_pages.dtype)[tc]
            modes[name] = _row(lambda i: wrapper.run(q, (layers[i].k_pages, layers[i].v_pages), out=out),
                               want, kv_bytes, n_layers, args)
        except Exception as error:  # noqa: BLE001 - a library's refusal is a result: recorded, not raised
            modes[name] = {"error": f"{type(error).__name__}: {error}"[:300]}
    ran = {name: row for name, row in modes.items() if "us" in row}
    if not ran:
        return {"error": "; ".join(f"{name}: {row['error']}" for name, row in modes.items()), "modes": modes}
    best = min(ran, key=lambda name: ran[name]["us"])
    return {**ran[best], "mode": best, "modes": modes}


def _row(call, want: torch.Tensor, kv_bytes: int, n_layers: int, args) -> dict:
    err = _rel_err(call(0), want)
    micros = time_graph(call, n_layers, args.reps, args.warmup)
    return {"us": micros, "rel_err": err, "ok": bool(err <= TOLERANCE), "tbps": kv_bytes / (micros * 1e-6) / 1e12,
            "floor_us": kv_bytes / (args.copy_tbps * 1e12) * 1e6}


def table(record: dict) -> str:
    """The markdown report of a run's JSON ``record``."""
    info = record["provenance"]
    lines = [f"# Dense decode attention on fp8 pages: questkv against FlashInfer ({info.get('machine', '?')})", "",
             f"`{info.get('command', '?')}` — commit {info.get('commit', '?')}, {info.get('date', '?')}; "
             f"{MODEL} attention, bf16 queries, page {PAGE_SIZE}; GPU µs per call under CUDA graphs (median); floor: "
             f"K and V read once at the copy bandwidth ({record['copy_tbps']:.2f} TB/s); ok: within "
             f"{TOLERANCE:g} of the torch reference on the same pages", "",
             "| B | context | pages | questkv µs | FlashInfer µs (mode) | floor µs | questkv / FlashInfer | "
             "questkv TB/s | FlashInfer TB/s | ok |", "|---|---|---|---|---|---|---|---|---|---|"]
    for p in record["points"]:
        for name, rows in p["pages"].items():
            ours, theirs = rows["questkv"], rows["flashinfer"]
            ran = "us" in theirs
            cells = [str(p["batch"]), f"{p['context'] // 1024}k", name, f"{ours['us']:.1f}",
                     f"{theirs['us']:.1f} ({theirs['mode']})" if ran else "–", f"{ours['floor_us']:.1f}",
                     f"{ours['us'] / theirs['us']:.2f}" if ran else "–", f"{ours['tbps']:.2f}",
                     f"{theirs['tbps']:.2f}" if ran else "–",
                     "yes" if ours["ok"] and theirs.get("ok", True) else "**no**"]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "bf16 time / fp8 time on the same kernel (the issue's ratio, attention alone):", "",
              "| B | context | questkv | FlashInfer |", "|---|---|---|---|"]
    for p in record["points"]:
        cells = []
        for kernel in ("questkv", "flashinfer"):
            bf16, fp8 = p["pages"]["bf16"][kernel], p["pages"]["fp8"][kernel]
            cells.append(f"{bf16['us'] / fp8['us']:.2f}×" if "us" in bf16 and "us" in fp8 else "–")
        lines.append(f"| {p['batch']} | {p['context'] // 1024}k | " + " | ".join(cells) + " |")
    errors = sorted({rows["flashinfer"]["error"] for p in record["points"] for rows in p["pages"].values()
                     if "error" in rows["flashinfer"]})
    if errors:
        lines += ["", "FlashInfer did not run: " + "; ".join(errors)]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, required=True, help="where fp8-attention-TAG.{json,md} go")
    parser.add_argument("--tag", default="h200", help="the files' suffix")
    parser.add_argument("--points", default=",".join(f"{b}:{c}" for b, c in POINTS),
                        help="batch:context,... (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=30, help="timed graph replays per measurement")
    parser.add_argument("--warmup", type=int, default=3, help="untimed graph replays first")
    parser.add_argument("--max-gb", type=float, default=40.0, help="GPU memory for one point's bf16 pools")
    args = parser.parse_args()
    points = [tuple(int(x) for x in p.split(":")) for p in args.points.split(",")]
    try:
        import flashinfer

        flashinfer_error = None
        version = flashinfer.__version__
    except Exception as error:  # noqa: BLE001 - the baseline is optional, its absence is recorded
        flashinfer_error = version = f"unavailable: {type(error).__name__}: {error}"[:300]
    args.copy_tbps = copy_bandwidth()
    record = {"provenance": {**provenance("cuda"), "flashinfer": version}, "copy_tbps": args.copy_tbps, "points": []}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for batch, context in points:  # saved after every point: a run stopped by a time limit keeps what it measured
        record["points"].append(measure_point(batch, context, args, flashinfer_error))
        (args.out_dir / f"fp8-attention-{args.tag}.json").write_text(json.dumps(record, indent=1))
        (args.out_dir / f"fp8-attention-{args.tag}.md").write_text(table(record))
    print(table(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
