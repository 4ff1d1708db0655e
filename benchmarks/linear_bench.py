"""Every linear layer of a decode step, bf16 against weight-only int4 / int8 / int8_grouped, on one GPU, in one run.

For each model (llama3.1-8b, llama2-7b), each projection shape (qkv, o, gate_up, down, lm_head) and each number of
rows ``M`` (tokens in the step: 1, 2, 4, 8, 16, 32, 64), after checking every backend against the torch reference
(float32 math on the dequantized weight), this script times under CUDA graphs (median GPU time per call over graph
replays; each replay cycles over enough copies of the weight that no call finds it in L2):

* ``bf16``: ``torch.nn.functional.linear`` on the float weight (cuBLAS), and at one row ``bf16-gemv``, questkv's
  GEMV (:mod:`questkv.ops.triton.gemv`; back to back in a graph, each call's first weight tile overlaps the call
  before it through programmatic dependent launch, which in a decode step only a kernel before it that triggers
  early allows: ``benchmarks/e2e_bench.py`` is the arbiter);
* ``int4`` (group 128) through each kernel over the K-major words a layer holds: ``gemv`` (``int4_gemv``,
  :mod:`questkv.ops.triton.int4_gemv`, ``M <= 2``), ``words`` (``int4_words_matmul``: tensor cores, ``M >= 2``)
  ``mma`` (``int4_mma``, :mod:`questkv.ops.cuda.int4_mma`: CUDA C++ on tensor cores, ``M <= 16``), ``words-dequant``
  (``dequantize_k_major`` + one GEMM, ``M >= --dequant-min-m``) and ``dispatch`` (``questkv.ops.int4_matmul``, the
  kernel ``INT4_KERNELS`` picks: what a layer runs); and ``tinygemm`` (``torch.ops.aten._weight_int4pack_mm`` on
  its own copy of the codes, ``benchmarks/torch_int4_baseline.py``: the baseline), and, where gemlite imports,
  ``gemlite`` (``GemLiteLinearTriton`` on its own packing of the codes, ``benchmarks/gemlite_baseline.py``: a
  maintained library's Triton kernels, at every ``M``);
* ``int8`` (per row) through ``triton`` (:mod:`questkv.ops.triton.quant_matmul`, the launcher's plan, at every
  ``M``) and ``dequant`` (dequantize + ``F.linear``, ``M >= --dequant-min-m``);
* ``int8g16`` / ``int8g32``: ``int8_grouped`` in GGUF ``Q6_K``'s groups of 16 and ``Q8_0``'s of 32 (codes and
  scales rounded to nearest here), through ``triton`` and ``dequant`` (``M >= --dequant-min-m``);
* ``--methods`` picks the quantized formats (default: all; none: bf16 alone; ``bf16`` is always timed, the
  baseline);
* with ``--sweep`` (default on for llama3.1-8b), alternative tilings of the Triton kernel (``int8g16``,
  ``int8g32`` and, for the GEMV rows, ``int8``; the ``--sweep-ms`` rows), up to 2 rows of ``int4_gemv``, 2 rows
  and more of ``int4_words_matmul`` and at one row of the bf16 ``gemv`` (``--sweep-kernels``
  picks them): the best one and its config tell how to retune ``plan_quant_matmul`` / ``plan_int4_gemv`` /
  ``plan_int4_words_matmul`` / ``plan_gemv``.

Every timed call is first checked against the reference: its relative error stands beside its time. Each time
stands beside its bytes floor (weight + scales + x + out, at the bandwidth of a device-to-device copy
measured in the same run). The sum over all linears of one token (layers x 4 shapes + the LM head) is reported per
``M`` and backend, with the LM head in bf16 (the default of ``quantize_linears``) and quantized. Writes
``<out>.json`` and ``<out>.md`` with provenance.

Usage (GPU)::

    python benchmarks/linear_bench.py --out benchmarks/results/linear-h200

Only ``int8_grouped`` at llama3.1-8b's shapes (under a minute)::

    python benchmarks/linear_bench.py --models llama3.1-8b --ms 1 4 16 64 --methods int8g16 int8g32 --no-sweep \
        --out benchmarks/results/linear-int8g-h200

On a CPU, ``--smoke`` runs tiny shapes through the reference, ``dequant`` and the Triton interpreter (and the sweep
on one shape), timed by the wall clock, to check the script end to end (~40 s). The full GPU run compiles ~50
kernel variants for the sweep and takes several minutes: ``--models llama3.1-8b`` or ``--no-sweep`` shorten it;
``<out>.json`` is rewritten after every shape, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

if __name__ == "__main__":  # run as a file: the checkout importable (questkv, benchmarks.*)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.graph_timing import graph_replay_us  # noqa: E402
from questkv.ops import quant_reference as ref  # noqa: E402
from questkv.ops.cuda import int4_gemv as cuda_gemv  # noqa: E402
from questkv.ops.cuda import int4_mma as mma  # noqa: E402
from questkv.ops.cuda.int4_mma import MMA_MAX_M  # noqa: E402

GROUP = 128  # int4's
QUANT = {"int4": ("int4", GROUP), "int8": ("int8", GROUP), "int8g16": ("int8_grouped", 16),
         "int8g32": ("int8_grouped", 32)}  # name: (method, group size)
MODELS = {  # name: (layers, {shape: (in_features, out_features)})
    "llama3.1-8b": (32, {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
                         "lm_head": (4096, 128256)}),
    "llama2-7b": (32, {"qkv": (4096, 12288), "o": (4096, 4096), "gate_up": (4096, 22016), "down": (11008, 4096),
                       "lm_head": (4096, 32000)}),
}
SMOKE_MODELS = {"tiny": (2, {"qkv": (128, 96), "o": (128, 128), "gate_up": (128, 192), "down": (256, 128),
                             "lm_head": (128, 101)})}
ROTATE_BYTES = 384 * 2**20  # weight bytes one graph replay reads at least (about 7x the H200's L2)
MAX_COPIES = 32
MIN_CALLS_PER_REPLAY = 8
TARGETS = {"int4_m1_ms": 1.57, "int8_speedup_m1": 1.6}  # the targets (llama3.1-8b, all linears of a token)
SWEEP_KERNELS = ("triton", "bf16-gemv", "int4-gemv", "int4-words", "int4-mma", "int4-gemv-cuda")
CHECK_TOL = 2e-2  # relative (norm) error vs the float32 reference on the dequantized weight; bf16 output ~4e-3


# ----------------------------------------------------------------------------------------------------------------
# timing


def time_cuda(fns: list[Callable[[], object]], reps: int, warmup: int) -> float:
    """Median GPU microseconds per call of the ``fns`` (one per weight copy), captured in one CUDA graph cycling
    over them (at least :data:`MIN_CALLS_PER_REPLAY` calls per replay) and replayed ``reps`` times."""
    return graph_replay_us(fns, reps, warmup, cycles=-(-MIN_CALLS_PER_REPLAY // len(fns)))


def time_cpu(fns: list[Callable[[], object]], reps: int, warmup: int) -> float:
    """Median wall-clock microseconds per call (the smoke run)."""
    for fn in fns[:1] * warmup:
        fn()
    samples = []
    for i in range(reps):
        t0 = time.perf_counter()
        fns[i % len(fns)]()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def copy_bandwidth(device: torch.device, reps: int = 30) -> float:
    """Device-to-device copy bandwidth in TB/s (bytes read plus written; 2 GiB on a GPU, 64 MiB on a CPU)."""
    numel = 2**30 if device.type == "cuda" else 2**25
    src = torch.randn(numel, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(5):
        dst.copy_(src)
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) * 1e-3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            samples.append(time.perf_counter() - t0)
    return 2 * numel * 2 / statistics.median(samples) / 1e12


# ----------------------------------------------------------------------------------------------------------------
# one shape


def weight_bytes(name: str, k: int, n: int) -> int:
    """Bytes of one weight ``[n, k]`` in ``name`` (``bf16`` or a :data:`QUANT` name) with bf16 scales (int4: byte zero
    points)."""
    if name == "bf16":
        return 2 * n * k
    method, group = QUANT[name]
    if method == "int8":
        return n * k + 2 * n
    if method == "int8_grouped":
        return n * k + 2 * (k // group) * n
    return n * k // 2 + (2 + 1) * (k // group) * n  # packed values + bf16 scales and byte zero points


def quantize(w: torch.Tensor, name: str) -> ref.QuantizedWeight:
    """``w`` ``[n, k]`` in the :data:`QUANT` format ``name``; ``int8_grouped`` (a checkpoint format that
    :func:`~questkv.ops.quant_reference.quantize_weight` does not make) rounded to nearest per group here."""
    method, group = QUANT[name]
    if method == "int4":  # the integer zero points in bytes, as a QuantizedLinear holds them
        qweight, scales, zeros = ref.quantize_weight(w, method, group)
        return ref.QuantizedWeight(qweight, scales, zeros.to(torch.uint8))
    if method != "int8_grouped":
        return ref.quantize_weight(w, method, group)
    n, k = w.shape
    groups = w.float().view(n, k // group, group)  # [N, G, g]
    scale = (groups.abs().amax(dim=2) / 127).clamp(min=1e-8).to(w.dtype)  # [N, G], as stored
    q = torch.clamp(torch.round(groups / scale.float()[:, :, None]), -127, 127).to(torch.int8).view(n, k)
    return ref.QuantizedWeight(q, scale.t().contiguous(), None)


def reference(x: torch.Tensor, name: str, q: tuple) -> torch.Tensor:
    """The float32 reference of ``x @ w.T`` for ``q`` ``(qweight, scales, zeros)`` in ``name``, as float64
    ``[M, N]``."""
    method, group = QUANT[name]
    qweight, scales, zeros = q
    zeros = None if zeros is None else zeros.float()
    return ref.quant_matmul(x.float(), qweight, scales.float(), zeros, method, group).double()


def _rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    out = out.double()
    if not torch.isfinite(out).all():
        return float("nan")
    return ((out - want).norm() / want.norm()).item()


class Shape:
    """The weights of one projection ``[n, k]``: bf16, the :data:`QUANT` formats ``names`` and (with ``int4``)
    tinygemm's int4, each in enough copies."""

    def __init__(self, k: int, n: int, device: torch.device, dtype: torch.dtype, gen: torch.Generator,
                 names: list[str]) -> None:
        self.k, self.n, self.device, self.dtype = k, n, device, dtype
        w = (torch.randn((n, k), generator=gen, device=device) * 0.02).to(dtype)
        self.copies = {}  # bf16 or a QUANT name -> number of copies
        self.w = self._rotate("bf16", w)
        self.q = {name: self._rotate(name, *quantize(w, name)) for name in names}
        # the K-major words of each int4 copy (what a layer holds; the checkpoint layout stays for the reference
        # and tinygemm's packer)
        self.gemv = [ref.pack_int4_k_major(q[0], GROUP) for q in self.q["int4"]] if "int4" in self.q else []
        self.tinygemm = None
        self.tinygemm_order: Optional[str] = None
        self.gemlite: list = []

    def _rotate(self, name: str, *tensors):
        if self.device.type != "cuda":
            self.copies[name] = 1
            return [tensors if len(tensors) > 1 else tensors[0]]
        copies = max(1, min(MAX_COPIES, math.ceil(ROTATE_BYTES / weight_bytes(name, self.k, self.n))))
        self.copies[name] = copies
        out = [tensors if len(tensors) > 1 else tensors[0]]
        for _ in range(copies - 1):
            cloned = tuple(None if t is None else t.clone() for t in tensors)
            out.append(cloned if len(cloned) > 1 else cloned[0])
        return out

    def prepare_tinygemm(self, x: torch.Tensor) -> dict:
        """Convert the int4 weight for tinygemm, in whichever nibble order its packer wants (checked on ``x``)."""
        from benchmarks import torch_int4_baseline as tg

        qweight, scales, zeros = self.q["int4"][0]
        want = reference(x, "int4", self.q["int4"][0])
        errors = {}
        for order, high in (("high nibble first", True), ("low nibble first", False)):
            try:
                packed, sz = tg.tinygemm_pack(qweight, scales, zeros, GROUP, high_nibble_first=high)
                errors[order] = _rel_err(tg.tinygemm_matmul(x, packed, sz, GROUP), want)
            except Exception as error:  # noqa: BLE001 - a packer that refuses this shape is a result too
                errors[order] = f"{type(error).__name__}: {error}"
                continue
            if errors[order] < CHECK_TOL:
                self.tinygemm_order = order
                self.tinygemm = [(packed, sz)] + [(packed.clone(), sz.clone())
                                                  for _ in range(self.copies["int4"] - 1)]
                break
        return errors

    def prepare_gemlite(self, x: torch.Tensor) -> str:
        """Pack each int4 copy for gemlite (where it imports) and check it on ``x``: the relative error, or why
        there is none."""
        from benchmarks import gemlite_baseline

        if not gemlite_baseline.available():
            return "gemlite does not import here"
        try:
            configs = gemlite_baseline.tuned_configs()
            layers = [gemlite_baseline.gemlite_layer(*q, GROUP) for q in self.q["int4"]]
            err = _rel_err(layers[0](x), reference(x, "int4", self.q["int4"][0]))
        except Exception as error:  # noqa: BLE001 - a library that refuses this shape is a result too
            return f"{type(error).__name__}: {error}"
        if err < CHECK_TOL:
            self.gemlite = layers
        return f"{err:.1e} ({configs})"


def quant_call(x: torch.Tensor, q: tuple, method: str, group: int, kind: str, triton_ok: bool) -> torch.Tensor:
    """``x @ w.T`` for ``q`` ``(qweight, scales, zeros)`` in ``int8`` / ``int8_grouped`` (or, for ``torch``, any
    format) through ``kind``: ``torch`` (the reference), ``triton`` (the kernel) or ``dequant`` (the float weight,
    in one Triton launch where Triton runs, then ``F.linear``)."""
    if kind == "torch":
        return ref.quant_matmul(x, *q, method, group)
    if not triton_ok:
        return F.linear(x, ref.dequantize(*q, method, group, dtype=x.dtype))
    from questkv.ops.triton import quant_matmul as qm

    if kind == "triton":
        return qm.quant_matmul(x, *q, method, group)
    return F.linear(x, qm.dequantize(*q, method, group, dtype=x.dtype))


def backends(shape: Shape, m: int, args, interp: bool) -> tuple[dict[str, list[Callable]], torch.Tensor]:
    """``({name: one call per weight copy}, x)`` for a random ``x`` of ``m`` rows."""
    gen = torch.Generator(device=shape.device).manual_seed(m)
    x = torch.randn((m, shape.k), generator=gen, device=shape.device).to(shape.dtype)
    cuda = shape.device.type == "cuda"
    out: dict[str, list] = {"bf16": [lambda w=w: F.linear(x, w) for w in shape.w]}
    triton_ok = cuda or interp
    if m == 1 and triton_ok:
        from questkv.ops.triton.gemv import gemv

        out["bf16-gemv"] = [lambda w=w: gemv(x, w) for w in shape.w]
    for name, copies in shape.q.items():
        method, group = QUANT[name]
        kinds = [] if method == "int4" else (["triton"] if triton_ok else []) + (
            ["dequant"] if m >= args.dequant_min_m or not cuda else [])  # int4: over the words below
        for kind in kinds + ([] if cuda else ["torch"]):
            out[f"{name}-{kind}"] = [lambda q=q, method=method, group=group, kind=kind:
                                     quant_call(x, q, method, group, kind, triton_ok) for q in copies]
    if shape.gemv and triton_ok:
        from questkv.ops.triton.int4_gemv import GEMV_MAX_M, int4_gemv

        if m <= GEMV_MAX_M:
            out["int4-gemv"] = [lambda w=w, q=q: int4_gemv(x, w, q[1], q[2], GROUP)
                                for w, q in zip(shape.gemv, shape.q["int4"])]
        if m > 1:  # tensor cores over the same words
            from questkv.ops.triton.int4_words import int4_words_matmul

            out["int4-words"] = [lambda w=w, q=q: int4_words_matmul(x, w, q[1], q[2], GROUP)
                                 for w, q in zip(shape.gemv, shape.q["int4"])]
        if cuda and m <= MMA_MAX_M and mma.available(shape.device):  # the CUDA C++ kernels over the same words
            out["int4-mma"] = [lambda w=w, q=q: mma.int4_mma(x, w, q[1], q[2], GROUP)
                               for w, q in zip(shape.gemv, shape.q["int4"])]
            if m == 1 and cuda_gemv.fits(x, shape.gemv[0], *shape.q["int4"][0][1:3], GROUP):
                out["int4-gemv-cuda"] = [lambda w=w, q=q: cuda_gemv.int4_gemv_cuda(x, w, q[1], q[2], GROUP)
                                         for w, q in zip(shape.gemv, shape.q["int4"])]
        if cuda:
            from questkv import ops

            out["int4-dispatch"] = [lambda w=w, q=q: ops.int4_matmul(x, w, q[1], q[2], GROUP)
                                    for w, q in zip(shape.gemv, shape.q["int4"])]
        if m >= args.dequant_min_m:  # an int4 layer's prefill
            from questkv.ops.triton.int4_words import dequantize_k_major

            out["int4-words-dequant"] = [lambda w=w, q=q: x @ dequantize_k_major(w, q[1], q[2], GROUP, x.dtype)
                                         for w, q in zip(shape.gemv, shape.q["int4"])]
    if shape.tinygemm is not None:
        from benchmarks.torch_int4_baseline import tinygemm_matmul

        out["int4-tinygemm"] = [lambda p=p: tinygemm_matmul(x, p[0], p[1], GROUP) for p in shape.tinygemm]
    if shape.gemlite:
        out["int4-gemlite"] = [lambda layer=layer: layer(x) for layer in shape.gemlite]
    return out, x


def sweep_configs(m: int, n: int, k: int, device: torch.device, name: str):
    """Alternative tilings of the Triton kernel for the :data:`QUANT` format ``name`` (``int8`` or an
    ``int8_grouped`` one) at ``m`` rows (the plan first; up to 8 rows the FMA loop's tilings, and for ``int8`` the
    dot loop's plan; for ``int8_grouped`` the dot loop's tilings and other input features per ``tl.dot``)."""
    from questkv.ops.triton.quant_matmul import plan_quant_matmul

    method, group = QUANT[name]
    plan = plan_quant_matmul(m, n, k, method, group, device)
    configs = [plan]
    fma = plan_quant_matmul(m, n, k, method, group, device, use_dot=False)
    dot = plan_quant_matmul(m, n, k, method, group, device, use_dot=True)
    per_128 = max(1, 128 // group)  # groups in 128 input features (int8: one chunk)
    if m <= 8:
        configs += [dataclasses.replace(fma, block_n=bn, groups_per_iter=g * per_128, num_warps=w)
                    for bn, g, w in ((16, 2, 4), (32, 2, 4), (64, 2, 4), (32, 4, 4), (32, 1, 4), (64, 4, 8))]
        configs += [dataclasses.replace(fma, split_k=max(1, fma.split_k * f)) for f in (2, 4)]
        configs += [dataclasses.replace(fma, split_k=max(1, fma.split_k // 2))]
    if method == "int8" and m <= 8:  # the dot loop where the plan takes the FMA loop
        configs += [dot, dataclasses.replace(dot, split_k=max(1, dot.split_k * 2)),
                    dataclasses.replace(dot, split_k=max(1, dot.split_k // 2))]
    if method != "int8":
        configs += [dataclasses.replace(dot, block_n=bn, swap_ab=s, num_stages=st)
                    for bn, s, st in ((64, True, 3), (128, True, 3), (64, False, 3), (64, True, 4), (128, False, 4))]
        configs += [dataclasses.replace(dot, split_k=max(1, dot.split_k * 2))]
    if method == "int8_grouped":  # 32 and 128 input features per dot (the plan: DOT_CHUNK)
        configs += [dataclasses.replace(dot, groups_per_iter=max(1, f // group)) for f in (32, 128)]
    unique = []
    for cfg in configs:
        if cfg not in unique:
            unique.append(cfg)
    return unique


def sweep_launches(results: dict, where: tuple, configs: list, want: torch.Tensor, launches, timer, reps: int,
                   warmup: int) -> None:
    """Check and time every launch configuration of one kernel at one shape (``where`` = model, shape, M,
    method; the first config is the launcher's plan): ``launches(cfg)`` gives one call per weight copy. A config
    whose output misses the check, or that fails to compile, is recorded with its error and no time."""
    model, name, m, method = where
    for i, cfg in enumerate(configs):
        fns = launches(cfg)
        try:
            err = _rel_err(fns[0](), want)
            us = timer(fns, reps, warmup) if err < CHECK_TOL else float("nan")
        except Exception as error:  # noqa: BLE001 - a launch that fails to compile is reported
            err, us = f"{type(error).__name__}: {error}"[:200], float("nan")
        results["sweep"].append({"model": model, "shape": name, "m": m, "method": method, "planned": i == 0,
                                 "config": dataclasses.asdict(cfg), "us": us, "rel_err": err})
        print(f"  sweep {method} {name} M={m} {cfg}: {us:.1f} us (err {err})", flush=True)


def bf16_gemv_sweep_configs(n: int, k: int, device: torch.device) -> list:
    """Alternative launches of the bf16 ``gemv`` (the plan first): outputs and input features per tile, warps, and
    half and twice the plan's split."""
    from questkv.ops.triton.gemv import GemvConfig, plan_gemv

    plan = plan_gemv(n, k, device)
    tiles = math.ceil(k / plan.block_k)
    configs = [plan]
    configs += [dataclasses.replace(plan_gemv(n, k, device), block_n=bn, block_k=bk, num_warps=w)
                for bn, bk, w in ((8, 512, 4), (32, 512, 4), (32, 512, 8), (16, 256, 4), (16, 1024, 8))]
    configs += [dataclasses.replace(plan, split=s) for s in (max(1, plan.split // 2), min(tiles, 2 * plan.split),
                                                             min(tiles, 4 * plan.split))]
    return [c for c in dict.fromkeys(configs) if isinstance(c, GemvConfig)]


def gemv_sweep_configs(n: int, k: int, device: torch.device) -> list:
    """Alternative launches of ``int4_gemv`` (the plan first): outputs per program, word rows per load, and half,
    twice and every group as the split."""
    from questkv.ops.triton.int4_gemv import Int4GemvConfig, plan_int4_gemv

    plan = plan_int4_gemv(n, k, GROUP, device)
    groups = k // GROUP
    configs = [plan]
    configs += [Int4GemvConfig(128 * w, w, rows, plan.split) for w in (1, 2, 4, 8) for rows in (8, 16)]
    configs += [dataclasses.replace(plan, split=s) for s in (max(1, plan.split // 2), min(groups, 2 * plan.split),
                                                             groups)]
    return list(dict.fromkeys(configs))


def words_sweep_configs(m: int, n: int, k: int, device: torch.device) -> list:
    """Alternative launches of ``int4_words_matmul`` for ``m`` rows (the plan first): outputs per program, warps,
    pipeline stages, one dot per nibble or per group, which operand the weight is, and other splits."""
    from questkv.ops.triton.int4_words import plan_int4_words_matmul

    plan = plan_int4_words_matmul(m, n, k, GROUP, device)
    groups = k // GROUP
    configs = [plan]
    configs += [dataclasses.replace(plan, block_n=bn, num_warps=w) for bn, w in ((32, 4), (128, 4), (128, 8), (256, 8))]
    configs += [dataclasses.replace(plan, slabs=sl, swap_ab=sw) for sl, sw in ((False, True), (True, False),
                                                                               (False, False))]
    configs += [dataclasses.replace(plan, num_stages=st) for st in (1, 3, 4)]
    configs += [dataclasses.replace(plan, split=s) for s in (max(1, plan.split // 2), min(groups, 2 * plan.split),
                                                             min(groups, 4 * plan.split))]
    if plan.block_m > 16:
        configs += [dataclasses.replace(plan, block_m=plan.block_m // 2)]
    if m >= 128:  # 128 rows a tile: the words read and dequantized once for them (sm_90 compiles hold it, no spill)
        configs += [dataclasses.replace(plan, block_m=128, block_n=128, num_warps=8, swap_ab=True, split=s)
                    for s in (plan.split, min(groups, 2 * plan.split))]
        configs += [dataclasses.replace(plan, block_m=128, block_n=64, num_warps=4, swap_ab=True)]
    return list(dict.fromkeys(configs))


def mma_sweep_configs(m: int, n: int, k: int, device: torch.device) -> list:
    """Alternative launches of the CUDA ``int4_mma`` (the plan first): warps per block and blocks per 64 outputs."""
    plan = mma.plan_int4_mma(m, n, k, device)
    groups = k // GROUP
    configs = [plan] + [mma.Int4MmaConfig(w, s) for w in (2, 4, 8) for s in (1, 2, 4, 8, 16)
                        if w <= mma.max_warps(m) and (s == 1 or groups // s >= w)]
    return list(dict.fromkeys(configs))


def cuda_gemv_sweep_configs(n: int, k: int, device: torch.device) -> list:
    """Alternative launches of the CUDA ``int4_gemv_cuda`` (the plan first): warps per block, blocks per 32 outputs
    and stages, every warp at least one group and the shared memory within bounds."""
    plan = cuda_gemv.plan_int4_gemv_cuda(n, k, device)
    groups = k // GROUP
    configs = [plan] + [cuda_gemv.CudaGemvConfig(w, s, st) for w in (4, 8, 16) for s in (1, 2, 4, 8)
                        for st in cuda_gemv.GEMV_STAGES
                        if (s == 1 or groups // s >= w)
                        and cuda_gemv.smem_bytes(-(-groups // s), w) <= cuda_gemv.GEMV_MAX_SMEM]
    return list(dict.fromkeys(configs))


# ----------------------------------------------------------------------------------------------------------------
# the run


def run(args) -> dict:
    device = torch.device("cpu" if args.smoke else "cuda")
    interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    models = SMOKE_MODELS if args.smoke else {name: MODELS[name] for name in args.models}
    ms = [1, 3] if args.smoke else args.ms
    timer = time_cpu if device.type == "cpu" else time_cuda
    reps, warmup = (2, 0) if args.smoke else (args.reps, 5)
    info = {"copy_tbps": copy_bandwidth(device)}
    print(f"device-to-device copy: {info['copy_tbps']:.3f} TB/s", flush=True)
    gen = torch.Generator(device=device).manual_seed(0)
    results = {"checks": [], "times": [], "sweep": [], "tinygemm": {}, "gemlite": {}}
    for model, (layers, shapes) in models.items():
        for name, (k, n) in shapes.items():
            shape = Shape(k, n, device, torch.bfloat16, gen, args.methods)
            if device.type == "cuda" and "int4" in args.methods:
                x1 = torch.randn((4, k), generator=gen, device=device).to(torch.bfloat16)
                results["tinygemm"][f"{model}/{name}"] = shape.prepare_tinygemm(x1)
                results["gemlite"][f"{model}/{name}"] = shape.prepare_gemlite(x1)
            for m in ms:
                calls, x = backends(shape, m, args, interp)
                for backend, fns in calls.items():
                    method = backend.split("-")[0]  # bf16 or a QUANT name
                    if method == "bf16":
                        want = x.double() @ shape.w[0].double().t()
                    else:
                        want = reference(x, method, shape.q[method][0])
                    err = _rel_err(fns[0](), want)
                    ok = err < CHECK_TOL
                    results["checks"].append({"model": model, "shape": name, "m": m, "backend": backend, "rel_err": err,
                                              "ok": ok})
                    if not ok:
                        print(f"CHECK FAILED {model} {name} M={m} {backend}: rel err {err}", flush=True)
                        continue
                    try:
                        us = timer(fns, reps, warmup)
                    except Exception as error:  # noqa: BLE001 - a baseline library's failure is its result
                        if backend != "int4-gemlite":
                            raise
                        results["gemlite"][f"{model}/{name}/M={m}"] = f"timing: {type(error).__name__}: {error}"
                        continue
                    nbytes = weight_bytes(method, k, n) + 2 * m * (k + n)
                    floor_us = nbytes / (info["copy_tbps"] * 1e12) * 1e6
                    results["times"].append({"model": model, "shape": name, "m": m, "backend": backend, "us": us,
                                             "floor_us": floor_us, "bytes": nbytes, "rel_err": err,
                                             "layers": 1 if name == "lm_head" else layers})
                    print(f"{model:12s} {name:8s} M={m:3d} {backend:16s} {us:9.1f} us  floor {floor_us:8.1f} us  "
                          f"rel err {err:.1e}", flush=True)
                sweep = model in args.sweep_models and m in args.sweep_ms and (not args.smoke or name == "o")
                kernels = set(args.sweep_kernels)
                if args.sweep and sweep and (device.type == "cuda" or interp):
                    from questkv.ops.triton.quant_matmul import quant_matmul as kernel

                    for qname in (nm for nm in args.methods if "triton" in kernels and QUANT[nm][0] != "int4"
                                  and (m <= 8 or QUANT[nm][0] != "int8")):
                        q = shape.q[qname]
                        want = reference(x, qname, q[0])
                        method, group = QUANT[qname]
                        sweep_launches(
                            results, (model, name, m, qname), sweep_configs(m, n, k, device, qname), want,
                            lambda cfg, method=method, group=group: [
                                lambda qq=qq: kernel(x, *qq, method, group, config=cfg) for qq in q],
                            timer, reps, warmup)
                    if m == 1 and "bf16-gemv" in kernels:
                        from questkv.ops.triton.gemv import gemv

                        sweep_launches(
                            results, (model, name, m, "bf16-gemv"), bf16_gemv_sweep_configs(n, k, device),
                            x.double() @ shape.w[0].double().t(),
                            lambda cfg: [lambda w=w: gemv(x, w, config=cfg) for w in shape.w], timer, reps, warmup)
                    from questkv.ops.triton.int4_gemv import GEMV_MAX_M, int4_gemv
                    from questkv.ops.triton.int4_words import int4_words_matmul

                    over_words = (  # the kernels that read the K-major words: (name, rows, configs, launcher)
                        ("int4-gemv", m <= GEMV_MAX_M, lambda: gemv_sweep_configs(n, k, device), int4_gemv),
                        ("int4-words", m > 1, lambda: words_sweep_configs(m, n, k, device), int4_words_matmul),
                        ("int4-mma", m <= MMA_MAX_M and mma.available(device),
                         lambda: mma_sweep_configs(m, n, k, device), mma.int4_mma),
                        ("int4-gemv-cuda", m == 1 and mma.available(device) and n % cuda_gemv.GEMV_OUTPUTS == 0,
                         lambda: cuda_gemv_sweep_configs(n, k, device), cuda_gemv.int4_gemv_cuda))
                    for kname, rows_ok, configs, launch in over_words:
                        if rows_ok and shape.gemv and kname in kernels:
                            sweep_launches(
                                results, (model, name, m, kname), configs(), reference(x, "int4", shape.q["int4"][0]),
                                lambda cfg, launch=launch: [
                                    lambda w=w, q=q: launch(x, w, q[1], q[2], GROUP, config=cfg)
                                    for w, q in zip(shape.gemv, shape.q["int4"])],
                                timer, reps, warmup)
            del shape
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if args.out:
                write(args, info, results, partial=True)
    return info, results


def token_sums(results: dict) -> list[dict]:
    """Per model, M and backend: microseconds of all linears of one token (layers x 4 shapes + LM head), with the
    LM head in bf16 and quantized (same backend); the sweep's best per shape as ``<method>-triton-swept`` (the
    Triton kernel), ``int4-gemv-swept`` and ``int4-words-swept``."""
    times = {(t["model"], t["shape"], t["m"], t["backend"]): t for t in results["times"]}
    best = {}
    for s in results["sweep"]:
        key = (s["model"], s["shape"], s["m"], s.get("method", "int4"))
        if isinstance(s["us"], float) and not math.isnan(s["us"]) and s["us"] < best.get(key, float("inf")):
            best[key] = s["us"]
    rows = []
    models = sorted({t["model"] for t in results["times"]})
    for model in models:
        shapes = sorted({t["shape"] for t in results["times"] if t["model"] == model})
        layers = next(t["layers"] for t in results["times"] if t["model"] == model and t["shape"] != "lm_head")
        for m in sorted({t["m"] for t in results["times"] if t["model"] == model}):
            backends = sorted({t["backend"] for t in results["times"] if t["model"] == model and t["m"] == m})
            # a swept method's best tiling per shape, against the planned launch of its backend
            # a QUANT name's sweep is its Triton kernel's; a kernel's own (int4-gemv, int4-words) keeps its name
            timed = {(f"{k[3]}-swept" if "-" in k[3] else f"{k[3]}-triton-swept"):
                     (k[3] if "-" in k[3] else f"{k[3]}-triton", k[3])
                     for k in best if k[0] == model and k[2] == m}
            for backend in backends + sorted(timed):
                def us(shape, b=backend):
                    if b in timed:
                        planned, meth = timed[b]
                        return min(best.get((model, shape, m, meth), float("inf")),
                                   times.get((model, shape, m, planned), {}).get("us", float("inf")))
                    return times.get((model, shape, m, b), {}).get("us", float("nan"))

                body = sum(us(s) * layers for s in shapes if s != "lm_head")
                method = backend.split("-")[0]
                floor = sum(_floor(times, model, s, m, method) * (1 if s == "lm_head" else layers) for s in shapes)
                rows.append({"model": model, "m": m, "backend": backend,
                             "ms_lm_head_bf16": (body + us("lm_head", "bf16")) / 1e3,
                             "ms_lm_head_quantized": (body + us("lm_head")) / 1e3,
                             "floor_ms_lm_head_quantized": floor / 1e3})
    return rows


def _floor(times: dict, model: str, shape: str, m: int, method: str) -> float:
    for (mo, sh, mm, b), t in times.items():
        if mo == model and sh == shape and mm == m and b.split("-")[0] == method:
            return t["floor_us"]
    return float("nan")


def write(args, info: dict, results: dict, partial: bool = False) -> None:
    from questkv.eval.provenance import provenance

    sums = token_sums(results) if results["times"] else []
    payload = {"provenance": provenance("cpu" if args.smoke else "cuda"), "partial": partial, "group_size": GROUP,
               "targets": TARGETS, **info, **results, "token_sums": sums}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(payload, indent=1))
    lines = [f"# Linear layers, bf16 vs weight-only int4 (group {GROUP}) / int8 (per row) / int8_grouped "
             f"(int8g16, int8g32: groups of 16, 32)", "",
             f"- provenance: `{json.dumps(payload['provenance'])}`",
             f"- device-to-device copy: {info['copy_tbps']:.3f} TB/s (read + write); floors use it",
             f"- targets (llama3.1-8b, one token, M=1): int4 <= {TARGETS['int4_m1_ms']} ms, int8 >= "
             f"{TARGETS['int8_speedup_m1']}x faster than bf16, every M <= 64 no slower than bf16", ""]
    bad = [c for c in results["checks"] if not c["ok"]]
    lines += [f"- correctness vs the float32 reference on the dequantized weight: {len(results['checks']) - len(bad)} "
              f"of {len(results['checks'])} within {CHECK_TOL} relative" + (f"; FAILED: {bad}" if bad else ""),
              f"- tinygemm packer check (relative error per nibble order): `{json.dumps(results['tinygemm'])}`",
              f"- gemlite check (relative error, or why it did not run): `{json.dumps(results.get('gemlite', {}))}`",
              ""]
    if sums:
        lines += ["## All linears of one token (ms; layers x 4 shapes + LM head)", "",
                  "| model | M | backend | LM head bf16 | LM head quantized | bytes floor (LM head quantized) |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['m']} | {r['backend']} | {r['ms_lm_head_bf16']:.3f} | "
                  f"{r['ms_lm_head_quantized']:.3f} | {r['floor_ms_lm_head_quantized']:.3f} |" for r in sums]
    lines += ["", "## Per shape (µs per call; bytes floor beside)", "",
              "| model | shape | M | backend | µs | floor µs | floor / time | rel err |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {t['model']} | {t['shape']} | {t['m']} | {t['backend']} | {t['us']:.1f} | {t['floor_us']:.1f} | "
              f"{t['floor_us'] / t['us']:.2f} | {t['rel_err']:.1e} |" for t in results["times"]]
    if results["sweep"]:
        lines += ["", "## Triton tilings (sweep; planned = the launcher's choice)", "",
                  "| model | shape | M | method | config | planned | µs |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {s['model']} | {s['shape']} | {s['m']} | {s.get('method', 'int4')} | `{s['config']}` | "
                  f"{s['planned']} | {s['us']:.1f} |" for s in results["sweep"]]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/linear", help="output prefix (.json and .md)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--methods", nargs="*", default=list(QUANT), choices=list(QUANT),
                        help="quantized formats to time (bf16 always is; none: bf16 and its GEMV alone)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--dequant-min-m", type=int, default=16, help="time 'dequant' from this many rows")
    parser.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--sweep-models", nargs="+", default=["llama3.1-8b"])
    parser.add_argument("--sweep-ms", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--sweep-kernels", nargs="+", default=list(SWEEP_KERNELS), choices=list(SWEEP_KERNELS),
                        help="the kernels whose tilings --sweep times")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton through the interpreter)")
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
        torch.set_num_threads(1)
        args.sweep_models, args.sweep_ms = ["tiny"], [1, 3]  # the sweep's code path, on one small shape
    elif not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --smoke)")
    info, results = run(args)
    write(args, info, results)
    for r in token_sums(results):
        print(f"{r['model']:12s} M={r['m']:3d} {r['backend']:18s} {r['ms_lm_head_bf16']:7.3f} ms "
              f"(LM head quantized {r['ms_lm_head_quantized']:7.3f}, floor {r['floor_ms_lm_head_quantized']:6.3f})")
    print(f"wrote {Path(args.out).with_suffix('.json')} and .md")


if __name__ == "__main__":
    main()
