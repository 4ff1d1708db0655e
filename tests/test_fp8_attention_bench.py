"""The fp8 attention benchmark's CPU-checkable parts: the cast pools (``kernels_bench.cast_layer``, shared with
kernel_sweep.py) and the report (the timing needs a GPU)."""

import random

import torch

from benchmarks import fp8_attention_bench as bench
from benchmarks.kernels_bench import cast_layer
from questkv.ops import LayerPages


def test_a_cast_layer_keeps_the_values_as_e4m3_and_bounds_the_cast_keys():
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    k, v = (torch.randn(5, 16, 2, 8, generator=gen).to(torch.bfloat16) for _ in range(2))
    cast = cast_layer(LayerPages(k, v, k.amin(1), k.amax(1)), bench.E4M3)
    assert cast.k_pages.dtype == cast.v_pages.dtype == cast.kmin.dtype == bench.E4M3
    assert torch.equal(cast.k_pages.float(), k.to(bench.E4M3).float())
    assert torch.equal(cast.kmin.float(), cast.k_pages.float().amin(1))
    assert torch.equal(cast.kmax.float(), cast.k_pages.float().amax(1))


def _row(us: float, ok: bool = True) -> dict:
    return {"us": us, "rel_err": 1e-3, "ok": ok, "tbps": 1.0, "floor_us": us / 2}


def test_the_report_shows_both_kernels_their_ratio_and_why_flashinfer_did_not_run():
    ran = {"batch": 8, "context": 32768, "n_layers": 4, "pages": {
        "bf16": {"kv_bytes": 2, "questkv": _row(300.0), "flashinfer": {**_row(250.0), "mode": "tc"}},
        "fp8": {"kv_bytes": 1, "questkv": _row(200.0), "flashinfer": {**_row(125.0, ok=False), "mode": "no_tc"}}}}
    refused = {"batch": 4, "context": 131072, "n_layers": 2, "pages": {
        name: {"kv_bytes": 1, "questkv": _row(100.0), "flashinfer": {"error": "unavailable: ImportError"}}
        for name in ("bf16", "fp8")}}
    text = bench.table({"provenance": {"command": "c", "commit": "x", "machine": "m", "date": "d"},
                        "copy_tbps": 3.0, "points": [ran, refused]})
    assert "| 8 | 32k | bf16 | 300.0 | 250.0 (tc) | 150.0 | 1.20 |" in text
    assert "| 8 | 32k | fp8 | 200.0 | 125.0 (no_tc) | 100.0 | 1.60 |" in text and "| **no** |" in text
    assert "| 8 | 32k | 1.50× | 2.00× |" in text  # bf16 time / fp8 time, each kernel
    assert "| 4 | 128k | 1.00× | – |" in text
    assert "FlashInfer did not run: unavailable: ImportError" in text
