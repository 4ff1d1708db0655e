"""What one iteration of a kernel's inner loop costs in sm_90 instructions, with no GPU: the decode attention's, or
the int4 tensor-core kernel's.

The kernel (``questkv.ops.triton.decode_attention._decode_split_kernel``) is compiled for sm_90 as its launcher
would launch it for llama3.1-8b's shape (32 query heads over 8 KV heads, head_dim 128, page 16, one query, PDL on),
for each page dtype and grid kind asked, fp8 pages with either score dot (float16, keys converted in registers; e4m3,
the query split in two e4m3 parts, the launcher's choice); the SASS (Triton's bundled ``cuobjdump``) is cut at its longest backward
branch, the inner loop, whose instructions are counted by opcode. Instructions per key is a figure to lower where a
kernel is bound by its instructions; a memory-bound one must keep it low enough to hide under its loads (and the fp8
kernel on an H100 was bound by neither: its registers held it to two programs per SM, its warps waiting on latency,
``benchmarks/results/fp8-attention-ncu-h100.txt``).

    python benchmarks/sass_loop.py --out benchmarks/results/sass-decode-loop-cpu

``--int4-mma SOURCE ...`` counts instead the loop over groups of each instantiation of the CUDA C++ int4 kernel
(``questkv/ops/cuda/int4_mma.cu``, or another version of it: ``git show REV:questkv/ops/cuda/int4_mma.cu``),
compiled by nvcc for sm_90 with ``-O3`` as its extension is built: per 16-bit type, zero-point type and column
tiles of 8 rows, the instructions of one group of 128 features for a warp's 64 outputs, its registers and spills::

    python benchmarks/sass_loop.py --int4-mma questkv/ops/cuda/int4_mma.cu --out benchmarks/results/sass-int4-mma-cpu

``--verify`` compiles the verify step's multi-query tile (9 queries of a group of 4: 36 rows, padded to 64) under
each launch ``benchmarks/verify_attention.py --sweep`` tries, with the registers, shared memory and programs per SM
each allows::

    python benchmarks/sass_loop.py --verify --out benchmarks/results/sass-verify-cpu

``--int4-gemv`` counts the loop over groups of the Triton int4 GEMV (``questkv.ops.triton.int4_gemv``) for each
launch :func:`~questkv.ops.triton.int4_gemv.plan_int4_gemv` makes at llama3.1-8b's shapes, at one and two rows of
``x``. Both int4 reports give a loop's warp instructions per weight (one group of 128 features over the outputs of
a warp): the GEMV at one row multiplies each weight by one ``x`` value, so where a GPU issues fewer warp
instructions a second than this figure times the weights its bandwidth delivers, the kernel is bound by its
instructions, not its loads. ``--maxnreg N`` caps its registers a thread and reports what spills::

    python benchmarks/sass_loop.py --int4-gemv --out benchmarks/results/sass-int4-gemv-cpu
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":  # run as a file: the checkout importable (questkv, benchmarks.*)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = {  # name: (query dtype, page dtype, dense, fp8 pages scored in e4m3 dots)
    "bf16 dense": ("bf16", "bf16", True),
    "fp8 dense, float16 dots": ("bf16", "fp8e4nv", True),
    "fp8 dense, e4m3 scores": ("bf16", "fp8e4nv", True, True),
    "bf16 sparse": ("bf16", "bf16", False),
    "fp8 sparse, float16 dots": ("bf16", "fp8e4nv", False),
    "fp8 sparse, e4m3 scores": ("bf16", "fp8e4nv", False, True),
}
PROGRAMS = 16 * 8  # (sequence, KV head) pairs of the grid: batch 16 of llama3.1-8b's 8 KV heads
_INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)")
_BRANCH = re.compile(r"BRA\s.*?(0x[0-9a-f]+)")
# int4_mma_kernel<T, Z, NT>'s mangled template arguments: x's type, the zero points' type, the column tiles
_INT4_MMA = re.compile(r"int4_mma_kernelI(13__nv_bfloat16|6__half)(S1_|h)Li(\d+)E")
_INT4_TYPES = {"13__nv_bfloat16": "bf16", "6__half": "fp16", "S1_": "x's type", "h": "uint8"}


def compile_sm90(kernel, pointers: dict[str, str], constexprs: dict, options: dict, floats: tuple = (),
                 divisible: tuple = ()):
    """``kernel`` compiled by ``triton.compile`` for sm_90: ``pointers`` (argument -> element type) and every stride
    and ``divisible`` integer 16-divisible, as a launch over the engine's buffers specializes them; ``floats`` the
    float32 scalars, other arguments int32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: "constexpr" if name in constexprs else "*" + pointers[name] if name in pointers
                 else "fp32" if name in floats else "i32" for name in kernel.arg_names}
    aligned = [name for name in kernel.arg_names
               if name in pointers or name.startswith("stride_") or name in divisible]
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    return triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def compile_case(query: str, pages: str, dense: bool, e4m3_dot: bool = False, keys: int | None = None,
                 stages: int | None = None, queries: int = 1, block: int = 1, rows: int = 16):
    """The kernel compiled for sm_90 in the grid kind of :data:`PROGRAMS` (``triton.compile``; every pointer and
    stride 16-divisible, as a launch over the engine's buffers specializes them), or with ``keys`` per iteration and
    ``stages`` of pipelining instead of the kind's; ``queries`` per sequence, ``block`` of them a program over a
    tile of ``rows`` (llama3.1-8b's group of 4 query heads): the compiled kernel, its grid kind and its keys per
    iteration."""
    from questkv.ops.triton import decode_attention as attention

    kernel = attention._decode_split_kernel
    kind = attention.grid_kind(dense, PROGRAMS, pages == "fp8e4nv", rows if queries > 1 else None)
    pointers = {"q_ptr": query, "k_pages_ptr": pages, "v_pages_ptr": pages, "table_ptr": "i32", "lens_ptr": "i32",
                "sel_ptr": "i32", "budgets_ptr": "i32", "part_out_ptr": "fp32", "part_lse_ptr": "fp32", "counter_ptr": "i32",
                "out_ptr": query}
    constexprs = {"PAGE_SIZE": 16, "HEAD_DIM": 128, "BLOCK_D": 128, "GROUP": 4, "BLOCK_G": rows, "BLOCK_GM": 4,
                  "SEL_PER_KV": 1, "NUM_QUERIES": queries, "QUERY_BLOCK": block,
                  "PAGES_PER_ITER": (keys or attention._CONFIG[kind][0]) // 16, "MERGE_CHUNK": attention._MERGE_CHUNK,
                  "DENSE": dense, "UPCAST": False, "IEEE": False, "USE_PDL": True,
                  "F16_DOT": pages == "fp8e4nv" and query == "bf16", "E4M3_DOT": e4m3_dot, "ROW_BUDGETS": False}
    options = {"num_warps": attention._WARPS_BY_ROWS.get(rows, 2 * attention._NUM_WARPS),
               "num_stages": stages or attention._CONFIG[kind][2]}
    compiled = compile_sm90(kernel, pointers, constexprs, options, floats=("qk_scale",))
    return compiled, kind, constexprs["PAGES_PER_ITER"] * 16


def registers(ptx: str) -> int:
    """Registers a thread of the kernel holds, from ``ptxas -v`` (Triton's bundled ptxas) on its sm_90 PTX: with
    the shared memory, what bounds its programs per SM."""
    return ptxas_usage(ptx)[0]


def ptxas_usage(ptx: str) -> tuple[int, int]:
    """A kernel's registers a thread and spilled bytes (stores + loads) from ``ptxas -v`` on its sm_90 PTX."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "kernel.ptx")
        Path(source).write_text(ptx)
        result = subprocess.run([knobs.nvidia.ptxas.path, "-v", "--gpu-name", "sm_90a", source, "-o",
                                 os.path.join(tmp, "kernel.cubin")], capture_output=True, text=True, check=True)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", result.stderr)
    return (int(re.search(r"Used (\d+) registers", result.stderr).group(1)),
            int(spills.group(1)) + int(spills.group(2)))


def disassemble(cubin: bytes) -> str:
    """The SASS of ``cubin`` (Triton's bundled ``cuobjdump``)."""
    from triton import knobs

    cuobjdump = os.path.join(os.path.dirname(knobs.nvidia.ptxas.path), "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout


def inner_loop(cubin: bytes) -> collections.Counter:
    """Opcodes of the SASS between the longest backward branch's target and the branch."""
    return loop_opcodes(disassemble(cubin))


def loop_opcodes(sass: str) -> collections.Counter:
    """Opcodes of one function's SASS between its longest backward branch's target and the branch."""
    instructions = [(int(m.group(1), 16), m.group(3), line) for line in sass.splitlines()
                    if (m := _INSTRUCTION.match(line))]
    loops = [(int(b.group(1), 16), address) for address, _, line in instructions
             if (b := _BRANCH.search(line)) and int(b.group(1), 16) < address]
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    return collections.Counter(op for address, op, _ in instructions if start <= address <= end)


def _top(row: dict) -> str:
    return ", ".join(f"{op} {n}" for op, n in row["top"])


def write_report(record: dict, title: str, setting: str, header: list[str], rows: list[list], out: str | None) -> None:
    """Print the markdown table of ``rows`` under ``header`` (with ``record``'s command, commit and date) and, with
    ``out``, write it to ``out.md`` and ``record`` to ``out.json``."""
    provenance = record["provenance"]
    lines = [f"# {title}", "", f"`{provenance['command']}` — commit {provenance['commit']}, {provenance['date']}; "
             f"{setting}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out + ".json").write_text(json.dumps(record, indent=1))
        Path(out + ".md").write_text(text)


def int4_mma_loops(source: Path) -> dict[str, dict]:
    """Each instantiation of the int4 kernel in the CUDA C++ ``source``, compiled for sm_90 by nvcc: its registers,
    spilled bytes (stores + loads), loop instructions, MMAs and top opcodes, by ``"<x type>, <zeros type> zeros, up
    to <8 × column tiles> rows"``."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "int4_mma.cubin")
        headers = Path(__file__).resolve().parents[1] / "questkv" / "ops" / "cuda"  # int4_common.cuh for any version
        build = subprocess.run(["nvcc", "-O3", "-std=c++17", "-gencode", "arch=compute_90,code=sm_90", "-cubin",
                                "-Xptxas", "-v", "-I", str(headers), "-o", cubin, str(source)],
                               capture_output=True, text=True, check=True)
        sass = disassemble(Path(cubin).read_bytes())
    usage, name = {}, None
    for line in build.stderr.splitlines():  # ptxas -v: a function's properties, then its registers
        if (entry := re.search(r"Function properties for (\w+)", line)):
            name = entry.group(1)
        elif name and (spill := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)):
            usage[name] = {"spill_bytes": int(spill.group(1)) + int(spill.group(2))}
        elif name and (used := re.search(r"Used (\d+) registers", line)):
            usage[name]["registers"] = int(used.group(1))
    kernels = {}
    for function in re.split(r"\n\s*Function : ", sass)[1:]:
        mangled = function.split("\n", 1)[0].strip()
        args = _INT4_MMA.search(mangled)
        if args is None:
            continue
        x, zeros, tiles = args.groups()
        ops = loop_opcodes(function)
        kernels[f"{_INT4_TYPES[x]}, {_INT4_TYPES[zeros]} zeros, up to {8 * int(tiles)} rows"] = {
            **usage[mangled], "tiles": int(tiles), "instructions": sum(ops.values()),
            "per_weight": sum(ops.values()) / (128 * 64),
            "hmma": sum(n for op, n in ops.items() if op.startswith("HMMA")), "top": ops.most_common(8)}
    return dict(sorted(kernels.items(), key=lambda item: (item[0].split(' up to ')[0], item[1]['tiles'])))


GEMV_SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
"""llama3.1-8b's projections (in features, out features), whose GEMV launches ``--int4-gemv`` compiles."""


def int4_gemv_loops(maxnreg: int | None = None) -> dict[str, dict]:
    """The Triton int4 GEMV's loop over groups, compiled for sm_90 for each distinct launch
    :func:`~questkv.ops.triton.int4_gemv.plan_int4_gemv` makes at :data:`GEMV_SHAPES` (split over groups, bf16
    ``x`` and scales, byte zero points, PDL on), at one and two rows: its instructions, registers, spilled bytes,
    warp instructions per weight and top opcodes, by ``"<rows> row(s), <warps> warps (<shapes>)"``; every pointer,
    stride and ``N`` 16-divisible, as a launch specializes them. ``maxnreg`` caps the registers a thread (Triton's
    option; ``None``: as the launcher compiles it)."""
    from questkv.ops.triton import int4_gemv

    kernel = int4_gemv._int4_gemv_kernel
    launches: dict[tuple, list[str]] = {}
    for shape, (k, n) in GEMV_SHAPES.items():
        cfg = int4_gemv.plan_int4_gemv(n, k)
        launches.setdefault((cfg.block_n, cfg.num_warps, cfg.rows), []).append(shape)
    pointers = {"x_ptr": "bf16", "w_ptr": "i32", "s_ptr": "bf16", "z_ptr": "u8", "bias_ptr": "bf16",
                "part_ptr": "fp32", "counter_ptr": "i32", "out_ptr": "bf16"}
    kernels = {}
    for m in range(1, int4_gemv.GEMV_MAX_M + 1):
        for (block_n, warps, rows), shapes in launches.items():
            constexprs = {"GROUP": 128, "BLOCK_M": m, "BLOCK_N": block_n, "ROWS": rows, "SPLIT_K": True,
                          "REDUCE_CHUNK": 16, "EVEN_N": True, "HAS_BIAS": False, "ASM": True, "USE_PDL": True}
            options = {"num_warps": warps, **({} if maxnreg is None else {"maxnreg": maxnreg})}
            compiled = compile_sm90(kernel, pointers, constexprs, options, divisible=("N",))  # every shape's N
            ops = inner_loop(compiled.asm["cubin"])
            weights = 128 * block_n // warps  # a group's features times a warp's outputs
            used, spilled = ptxas_usage(compiled.asm["ptx"])
            kernels[f"{m} row{'s' if m > 1 else ''}, {warps} warps ({', '.join(shapes)})"] = {
                "rows": m, "warps": warps, "block_n": block_n, "instructions": sum(ops.values()),
                "weights": weights, "per_weight": sum(ops.values()) / weights, "registers": used,
                "spill_bytes": spilled, "top": ops.most_common(8)}
    return kernels


VERIFY_QUERIES = (2, 5, 9)
"""Queries per sequence (k + 1) whose verify tiles ``--verify`` compiles."""
SM_REGISTERS = 64 * 1024
SM_SHARED_BYTES = 228 * 1024  # an H100's or H200's shared memory an SM, 1 KiB of it reserved per program


def programs_per_sm(registers: int, shared_bytes: int, warps: int) -> tuple[int, int]:
    """Programs of ``warps`` warps that one sm_90 SM holds by their registers a thread (allocated in steps of 8)
    and by their shared memory, each bound alone."""
    by_registers = SM_REGISTERS // (-(-registers // 8) * 8 * 32 * warps)
    return by_registers, SM_SHARED_BYTES // (shared_bytes + 1024)


def verify_loops() -> dict[str, dict]:
    """The verify step's multi-query tile compiled for sm_90 (``_decode_split_kernel``, dense, bf16 pages, PDL on,
    llama3.1-8b's group of 4 query heads) under each launch of ``benchmarks/verify_attention.py``'s
    ``SWEEP_CONFIGS`` (its keys an iteration, stages and most rows a tile; the programs per SM it aims at change no
    code) at :data:`VERIFY_QUERIES`: the tile's rows, registers, spilled bytes, shared memory, the programs an SM
    holds by each (:func:`programs_per_sm`) and the loop's instructions a key, by ``"<queries> queries, <keys>
    keys, <stages> stages, tiles of at most <rows> rows"``."""
    from benchmarks.verify_attention import SWEEP_CONFIGS, multi_query_launch
    from questkv.ops.triton import decode_attention as attention

    group = 4
    launches = sorted({(keys, stages, most) for keys, _, stages, most in SWEEP_CONFIGS}, reverse=True)
    kernels = {}
    for queries in VERIFY_QUERIES:
        for keys, stages, most in launches:
            with multi_query_launch(keys, 2, stages, most):
                block = attention.query_block(queries, group)
                rows = attention._tile_rows(block, group)
            compiled, _, _ = compile_case("bf16", "bf16", True, keys=keys, stages=stages, queries=queries, block=block,
                                          rows=rows)
            warps = compiled.metadata.num_warps
            ops = inner_loop(compiled.asm["cubin"])
            used, spilled = ptxas_usage(compiled.asm["ptx"])
            by_registers, by_shared = programs_per_sm(used, compiled.metadata.shared, warps)
            kernels[f"{queries} queries, {keys} keys, {stages} stages, tiles of at most {most} rows"] = {
                "queries": queries, "keys_per_iteration": keys, "stages": stages, "max_rows": most,
                "tiles": -(-queries // block), "rows": rows, "warps": warps, "registers": used, "spill_bytes": spilled,
                "shared_memory_bytes": compiled.metadata.shared, "programs_by_registers": by_registers,
                "programs_by_shared_memory": by_shared, "instructions": sum(ops.values()),
                "per_key": sum(ops.values()) / keys, "top": ops.most_common(8)}
            print(f"{queries} queries, {keys} keys, {stages} stages, {most} rows: {used} registers", flush=True)
    return kernels


def verify_main(out: str | None) -> int:
    """``--verify``: :func:`verify_loops`."""
    from questkv.eval.provenance import provenance

    record = {"provenance": provenance("cpu"), "kernels": verify_loops()}
    rows = [[row["queries"], row["keys_per_iteration"], row["stages"], row["max_rows"],
             f"{row['tiles']} x {row['rows']}", row["registers"], row["spill_bytes"],
             f"{row['shared_memory_bytes'] // 1024} KiB",
             f"{min(row['programs_by_registers'], row['programs_by_shared_memory'])} "
             f"({row['programs_by_registers']} / {row['programs_by_shared_memory']})",
             f"{row['per_key']:.1f}", _top(row)] for row in record["kernels"].values()]
    write_report(record, "The verify step's multi-query tile in sm_90 instructions and registers (no GPU)",
                 "Triton for sm_90, llama3.1-8b's group of 4 query heads, dense, bf16 pages, PDL on; every launch of "
                 "`verify_attention.py --sweep`",
                 ["queries", "keys / iteration", "stages", "most rows a tile", "tiles x rows", "registers",
                  "spilled bytes", "shared memory", "programs an SM holds (by registers / by shared memory)",
                  "loop instructions a key", "top opcodes"], rows, out)
    return 0


def int4_gemv_main(out: str | None, maxnreg: int | None) -> int:
    """``--int4-gemv``: :func:`int4_gemv_loops`."""
    from questkv.eval.provenance import provenance

    record = {"provenance": provenance("cpu"), "maxnreg": maxnreg, "kernels": int4_gemv_loops(maxnreg)}
    rows = [[name, row["instructions"], row["weights"], f"{row['per_weight']:.4f}", row["registers"],
             row["spill_bytes"], _top(row)] for name, row in record["kernels"].items()]
    cap = "" if maxnreg is None else f", at most {maxnreg} registers a thread"
    write_report(record, "The int4 GEMV's loop over groups in sm_90 instructions (no GPU)",
                 "Triton for sm_90, one group of 128 features for a warp's outputs (4 a thread), "
                 f"its launches at llama3.1-8b's shapes{cap}",
                 ["launch", "instructions", "weights", "warp instructions per weight", "registers",
                  "spilled bytes", "top opcodes"], rows, out)
    return 0


def int4_mma_main(sources: list[str], out: str | None) -> int:
    """``--int4-mma``: :func:`int4_mma_loops` of each source side by side."""
    from questkv.eval.provenance import provenance

    record = {"provenance": provenance("cpu"), "sources": {src: int4_mma_loops(Path(src)) for src in sources}}
    rows = [[src, name, row["instructions"], f"{row['per_weight']:.4f}", row["hmma"], row["registers"],
             row["spill_bytes"], _top(row)]
            for src, kernels in record["sources"].items() for name, row in kernels.items()]
    write_report(record, "The int4 tensor-core kernel's loop over groups in sm_90 instructions (no GPU)",
                 "nvcc -O3 for sm_90, one group of 128 features for a warp's 64 outputs (8 rows a column tile)",
                 ["source", "kernel", "instructions", "warp instructions per weight", "HMMA", "registers",
                  "spilled bytes", "top opcodes"], rows, out)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--keys", type=int, default=None, help="keys per iteration instead of the grid kind's")
    parser.add_argument("--stages", type=int, default=None, help="pipeline stages instead of the grid kind's")
    parser.add_argument("--out", default=None, help="output prefix (.json and .md); print only without it")
    parser.add_argument("--int4-mma", nargs="+", default=None, metavar="SOURCE",
                        help="count the int4 tensor-core kernel's loop in these CUDA C++ sources instead (nvcc)")
    parser.add_argument("--int4-gemv", action="store_true",
                        help="count the Triton int4 GEMV's loop at llama3.1-8b's launches instead")
    parser.add_argument("--verify", action="store_true",
                        help="report the verify step's multi-query tile under each launch of verify_attention.py's "
                             "sweep instead")
    parser.add_argument("--maxnreg", type=int, default=None,
                        help="with --int4-gemv: cap the registers a thread (Triton's maxnreg) to see what spills")
    args = parser.parse_args()
    if args.int4_mma:
        return int4_mma_main(args.int4_mma, args.out)
    os.environ.pop("TRITON_INTERPRET", None)
    if args.maxnreg is not None and not (args.int4_gemv and 16 <= args.maxnreg <= 255):
        parser.error(f"--maxnreg takes 16 to 255 registers, with --int4-gemv; got {args.maxnreg}")
    if args.int4_gemv:
        return int4_gemv_main(args.out, args.maxnreg)
    if args.verify:
        return verify_main(args.out)
    from questkv.eval.provenance import provenance

    rows = {}
    for name in args.cases:
        compiled, kind, keys = compile_case(*CASES[name], keys=args.keys, stages=args.stages)
        ops = inner_loop(compiled.asm["cubin"])
        total = sum(ops.values())
        rows[name] = {"kind": kind, "keys_per_iteration": keys, "instructions": total,
                      "per_key": total / keys, "shared_memory_bytes": compiled.metadata.shared,
                      "registers": registers(compiled.asm["ptx"]),
                      "top": ops.most_common(8)}
        print(f"{name}: {total} instructions per {keys} keys ({total / keys:.2f} a key)", flush=True)
    record = {"provenance": provenance("cpu"), "cases": rows}
    table = [[name, row["kind"], row["keys_per_iteration"], row["instructions"], f"{row['per_key']:.2f}",
              f"{row['shared_memory_bytes'] // 1024} KiB", row["registers"], _top(row)] for name, row in rows.items()]
    write_report(record, "The decode attention's inner loop in sm_90 instructions (no GPU)",
                 "llama3.1-8b's shape, batch 16, one query, PDL on",
                 ["case", "grid kind", "keys / iteration", "instructions", "per key", "shared memory", "registers",
                  "top opcodes"], table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
