"""gemlite's int4 kernels as a baseline of ``linear_bench.py``: issue 44 names gemlite among the maintained kernels
still to try against bf16 at 1-256 rows (written against gemlite 0.6.0.post2, which needs triton >= 3.6, the GPU
image's).

``gemlite.GemLiteLinearTriton`` (Triton: a GEMV at up to 4 rows, a split-K GEMM below 64, a GEMM from 64, launch
configurations tuned per GPU and shipped with the package, e.g. ``configs/h100.json``; autotuned on a GPU it has none
for) holds its own packing of the codes, so a layer's ``int4`` weight (:mod:`questkv.ops.quant_reference` format) is
repacked into it: a second copy, fine for a baseline, not a layer's format. Its ``fma_mode=False`` computes
``w = (q - z) * s``, ours.

gemlite reads the CUDA device's capability when imported, so it imports only on a GPU; the GPU image lacks it, and
``benchmarks/gpu_runs.sh int4`` puts the pure-Python package that ``.gpu/site`` holds on ``PYTHONPATH`` (its header
says how to fill it here).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from questkv.ops.quant_reference import unpack_int4

__all__ = ["available", "gemlite_layer", "tuned_configs"]

def available() -> bool:
    """Whether gemlite imports here (a CUDA device and the package)."""
    if not torch.cuda.is_available():
        return False
    try:
        importlib.import_module("gemlite")
    except ImportError:
        return False
    return True


def tuned_configs() -> str:
    """The launch configurations gemlite uses on this GPU: the file it loaded for the device's name when imported,
    else, on another sm_90 device (an H200: gemlite ships none), its H100 file, loaded here (the same SMs; its
    Triton autotuning of each shape and row count instead would take minutes). Returns ``"gemlite <version>,
    <file>"`` (the file's name, or ``autotuned``)."""
    import gemlite
    from gemlite.core import get_default_cache_config

    bundled = get_default_cache_config()
    h100 = Path(gemlite.__file__).parent / "configs" / "h100.json"
    if bundled is not None:
        used = Path(bundled).name
    elif torch.cuda.get_device_capability() == (9, 0) and gemlite.load_config(str(h100)):
        used = h100.name
    else:
        used = "autotuned"
    return f"gemlite {gemlite.__version__}, {used}"


def gemlite_layer(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  group_size: int = 128) -> torch.nn.Module:
    """An ``int4`` weight — ``qweight`` ``[N, K // 2]`` uint8, ``scales`` and ``zeros`` ``[K // group_size, N]``
    (zero points in ``scales``' dtype or uint8), on a CUDA device — as a ``GemLiteLinearTriton`` of ``scales``'
    dtype (bf16 or fp16): ``layer(x)`` is ``x @ w.T`` for ``x`` ``[M, K]``."""
    if scales.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"gemlite_layer: scales must be torch.bfloat16 or torch.float16, got {scales.dtype}")
    from gemlite import DType, GemLiteLinearTriton

    dtype = DType.BF16 if scales.dtype == torch.bfloat16 else DType.FP16
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    layer = GemLiteLinearTriton(W_nbits=4, group_size=group_size, in_features=k, out_features=n, input_dtype=dtype,
                                output_dtype=dtype)
    layer.pack(unpack_int4(qweight), scales.t().contiguous(), zeros.to(scales.dtype).t().contiguous(), bias=None,
               fma_mode=False)
    return layer
