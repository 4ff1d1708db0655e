"""The int4 linears of one decode step, each launched once after a warm-up pass: a run for Nsight Compute.

Each projection of ``--model`` (qkv, o, gate_up, down) holds one copy of random int4 codes as K-major words with
bfloat16 scales and byte zero points, as a ``QuantizedLinear`` holds them (the codes' values do not change a
kernel's work), and is multiplied by ``--m`` random bfloat16 rows through ``questkv.ops.int4_matmul``: the kernel
its dispatch table (``INT4_KERNELS``) picks for that many rows (``--kernel gemv-cuda``: the CUDA C++ GEMV instead).
A first pass over the shapes compiles and warms every launch; the second is the one to profile (skip the first
pass's launches); then each output is compared with the float32 reference on the dequantized weight and the
relative error printed.

Usage (GPU; llama3.1-8b's four projections at one row, the second pass profiled, cold caches as ncu leaves them)::

    ncu --clock-control none -k regex:int4 --launch-skip 4 --launch-count 4 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \\
        --section WarpStateStats --section SchedulerStats \\
        python benchmarks/linear_ncu.py --model llama3.1-8b --m 1

``--smoke`` runs tiny shapes on the CPU (Triton through the interpreter) to check the script end to end.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROJECTIONS = ("qkv", "o", "gate_up", "down")


def main(argv=None) -> dict[str, float]:
    """Run the two passes; returns each projection's relative error against the reference."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama3.1-8b", choices=("llama3.1-8b", "llama2-7b"),
                        help="whose projection shapes")
    parser.add_argument("--m", type=int, default=1, help="rows of x (tokens in the step; default 1)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton through the interpreter)")
    parser.add_argument("--kernel", default="dispatch", choices=("dispatch", "gemv-cuda"),
                        help="what multiplies: the dispatch table's pick (default) or the CUDA C++ GEMV (one row)")
    args = parser.parse_args(argv)
    if args.m < 1:
        parser.error(f"--m must be at least 1, got {args.m}")
    if args.kernel == "gemv-cuda" and (args.m != 1 or args.smoke):
        parser.error(f"--kernel gemv-cuda takes one row on a GPU, got --m {args.m}{' --smoke' if args.smoke else ''}")
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import torch

    from benchmarks.linear_bench import GROUP, MODELS, SMOKE_MODELS
    from questkv import ops
    from questkv.ops import quant_reference as ref

    if not args.smoke and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --smoke)")
    device = torch.device("cpu" if args.smoke else "cuda")
    shapes = (SMOKE_MODELS["tiny"] if args.smoke else MODELS[args.model])[1]
    gen = torch.Generator(device=device).manual_seed(0)
    layers = []
    for name in PROJECTIONS:
        k, n = shapes[name]
        w = (torch.randn((n, k), generator=gen, device=device) * 0.02).to(torch.bfloat16)
        qweight, scales, zeros = ref.quantize_weight(w, "int4", GROUP)
        x = torch.randn((args.m, k), generator=gen, device=device).to(torch.bfloat16)
        layers.append((name, x, ref.pack_int4_k_major(qweight, GROUP), scales, zeros.to(torch.uint8), qweight))
    backend = "triton" if args.smoke else "auto"  # (auto on a CPU: the reference)
    if args.kernel == "gemv-cuda":
        from questkv.ops.cuda.int4_gemv import int4_gemv_cuda as multiply
    else:
        def multiply(x, words, scales, zeros, group):
            return ops.int4_matmul(x, words, scales, zeros, group, backend=backend)
    for _ in range(2):  # the warm-up pass, then the one to profile
        outs = [multiply(x, words, scales, zeros, GROUP) for _, x, words, scales, zeros, _ in layers]
    if device.type == "cuda":
        torch.cuda.synchronize()
    errors = {}
    for (name, x, _, scales, zeros, qweight), out in zip(layers, outs):
        weight = ref.dequantize(qweight, scales, zeros, "int4", GROUP).float()  # [N, K]
        want = x.float() @ weight.t()
        err = errors[name] = (out.float() - want).norm().item() / want.norm().item()
        k, n = shapes[name]
        print(f"{name:8s} K={k:6d} N={n:6d} M={args.m}: relative error {err:.1e} against the float32 reference")
    return errors


if __name__ == "__main__":
    main()
