"""What one iteration of the decode attention's inner loop costs in sm_90 instructions, with no GPU.

The kernel (``questkv.ops.triton.decode_attention._decode_split_kernel``) is compiled for sm_90 as its launcher
would launch it for llama3.1-8b's shape (32 query heads over 8 KV heads, head_dim 128, page 16, one query, PDL on),
for each page dtype and grid kind asked, fp8 pages with either score dot (float16, keys converted in registers; e4m3,
the query split in two e4m3 parts, the launcher's choice); the SASS (Triton's bundled ``cuobjdump``) is cut at its longest backward
branch, the inner loop, whose instructions are counted by opcode. Instructions per key is a figure to lower where a
kernel is bound by its instructions; a memory-bound one must keep it low enough to hide under its loads (and the fp8
kernel on an H100 was bound by neither: its registers held it to two programs per SM, its warps waiting on latency,
``benchmarks/results/fp8-attention-ncu-h100.txt``).

    python benchmarks/sass_loop.py --out benchmarks/results/sass-decode-loop-cpu
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


def compile_case(query: str, pages: str, dense: bool, e4m3_dot: bool = False, keys: int | None = None,
                 stages: int | None = None):
    """The kernel compiled for sm_90 in the grid kind of :data:`PROGRAMS` (``triton.compile``; every pointer and
    stride 16-divisible, as a launch over the engine's buffers specializes them), or with ``keys`` per iteration and
    ``stages`` of pipelining instead of the kind's: the compiled kernel, its grid kind and its keys per iteration."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from questkv.ops.triton import decode_attention as attention

    kernel = attention._decode_split_kernel
    kind = attention.grid_kind(dense, PROGRAMS, pages == "fp8e4nv")
    pointers = {"q_ptr": query, "k_pages_ptr": pages, "v_pages_ptr": pages, "table_ptr": "i32", "lens_ptr": "i32",
                "sel_ptr": "i32", "budgets_ptr": "i32", "part_out_ptr": "fp32", "part_lse_ptr": "fp32", "counter_ptr": "i32",
                "out_ptr": query}
    constexprs = {"PAGE_SIZE": 16, "HEAD_DIM": 128, "BLOCK_D": 128, "GROUP": 4, "BLOCK_G": 16, "BLOCK_GM": 4,
                  "SEL_PER_KV": 1, "NUM_QUERIES": 1, "QUERY_BLOCK": 1,
                  "PAGES_PER_ITER": (keys or attention._CONFIG[kind][0]) // 16, "MERGE_CHUNK": attention._MERGE_CHUNK,
                  "DENSE": dense, "UPCAST": False, "IEEE": False, "USE_PDL": True,
                  "F16_DOT": pages == "fp8e4nv" and query == "bf16", "E4M3_DOT": e4m3_dot, "ROW_BUDGETS": False}
    signature = {name: "constexpr" if name in constexprs else "*" + pointers[name] if name in pointers
                 else "fp32" if name == "qk_scale" else "i32" for name in kernel.arg_names}
    divisible = [name for name in kernel.arg_names if name in pointers or name.startswith("stride_")]
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    options = {"num_warps": attention._WARPS_BY_ROWS[16], "num_stages": stages or attention._CONFIG[kind][2]}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    return compiled, kind, constexprs["PAGES_PER_ITER"] * 16


def registers(ptx: str) -> int:
    """Registers a thread of the kernel holds, from ``ptxas -v`` (Triton's bundled ptxas) on its sm_90 PTX: with
    the shared memory, what bounds its programs per SM."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "kernel.ptx")
        Path(source).write_text(ptx)
        result = subprocess.run([knobs.nvidia.ptxas.path, "-v", "--gpu-name", "sm_90a", source, "-o",
                                 os.path.join(tmp, "kernel.cubin")], capture_output=True, text=True, check=True)
    return int(re.search(r"Used (\d+) registers", result.stderr).group(1))


def inner_loop(cubin: bytes) -> collections.Counter:
    """Opcodes of the SASS between the longest backward branch's target and the branch."""
    from triton import knobs

    cuobjdump = os.path.join(os.path.dirname(knobs.nvidia.ptxas.path), "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    instructions = [(int(m.group(1), 16), m.group(3), line) for line in sass.splitlines()
                    if (m := _INSTRUCTION.match(line))]
    loops = [(int(b.group(1), 16), address) for address, _, line in instructions
             if (b := _BRANCH.search(line)) and int(b.group(1), 16) < address]
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    return collections.Counter(op for address, op, _ in instructions if start <= address <= end)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--keys", type=int, default=None, help="keys per iteration instead of the grid kind's")
    parser.add_argument("--stages", type=int, default=None, help="pipeline stages instead of the grid kind's")
    parser.add_argument("--out", default=None, help="output prefix (.json and .md); print only without it")
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
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
    lines = ["# The decode attention's inner loop in sm_90 instructions (no GPU)", "",
             f"`{record['provenance']['command']}` — commit {record['provenance']['commit']}, "
             f"{record['provenance']['date']}; llama3.1-8b's shape, batch 16, one query, PDL on", "",
             "| case | grid kind | keys / iteration | instructions | per key | shared memory | registers | top opcodes |",
             "|---|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        top = ", ".join(f"{op} {n}" for op, n in row["top"])
        lines.append(f"| {name} | {row['kind']} | {row['keys_per_iteration']} | {row['instructions']} | "
                     f"{row['per_key']:.2f} | {row['shared_memory_bytes'] // 1024} KiB | {row['registers']} | {top} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".json").write_text(json.dumps(record, indent=1))
        Path(args.out + ".md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
