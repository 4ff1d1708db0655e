"""benchmarks/linear_bench.py, the parts that run here: its ``--smoke`` runs (Triton under the interpreter) check every
backend against the reference before timing it and write the error beside the time (the ``int8_grouped`` formats,
the int4 GEMV, bf16 and its one-row GEMV); its round-to-nearest ``int8_grouped`` weights stay within half a step."""

import json

import pytest
import torch

from questkv.ops import quant_reference as ref

pytest.importorskip("triton")

from benchmarks import linear_bench  # noqa: E402


def test_smoke_run_checks_and_times_grouped_int8_beside_bf16(tmp_path):
    out = tmp_path / "linear"
    linear_bench.main(["--smoke", "--methods", "int8g16", "int8g32", "--no-sweep", "--out", str(out)])
    payload = json.loads(out.with_suffix(".json").read_text())
    backends = {t["backend"] for t in payload["times"]}
    assert {"bf16", "int8g16-triton", "int8g32-triton", "int8g16-dequant", "int8g32-torch"} <= backends
    assert not any(b.startswith(("int4", "int8-")) for b in backends)  # only the formats asked for
    assert payload["checks"] and all(c["ok"] for c in payload["checks"])
    assert all(t["rel_err"] < linear_bench.CHECK_TOL for t in payload["times"])
    assert "| rel err |" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize("name, group", [("int8g16", 16), ("int8g32", 32)])
def test_grouped_int8_rounding_stays_within_half_a_step(name, group):
    w = torch.randn((8, 96), generator=torch.Generator().manual_seed(group))
    q = linear_bench.quantize(w, name)
    assert q.qweight.dtype == torch.int8 and q.scales.shape == (96 // group, 8) and q.zeros is None
    back = ref.dequantize(*q, "int8_grouped", group)
    step = q.scales.t().repeat_interleave(group, dim=1)  # [N, K]
    assert torch.all((back - w).abs() <= step / 2 + 1e-6)


def test_smoke_run_times_the_one_row_int4_gemv_and_sweeps_its_launches(tmp_path):
    out = tmp_path / "linear"
    linear_bench.main(["--smoke", "--methods", "int4", "--out", str(out)])
    payload = json.loads(out.with_suffix(".json").read_text())
    gemv = [t for t in payload["times"] if t["backend"] == "int4-gemv"]
    assert {t["m"] for t in gemv} == {1} and len(gemv) == 5  # the GEMV serves 1-2 rows, every shape
    assert all(c["ok"] for c in payload["checks"])
    swept = [s for s in payload["sweep"] if s["method"] == "int4-gemv"]
    assert swept and swept[0]["planned"] and all(s["rel_err"] < linear_bench.CHECK_TOL for s in swept)
    sums = {(r["m"], r["backend"]) for r in payload["token_sums"]}
    assert {(1, "int4-gemv"), (1, "int4-gemv-swept")} <= sums


def test_smoke_run_with_no_quantized_format_times_bf16_beside_its_one_row_gemv(tmp_path):
    out = tmp_path / "linear"
    linear_bench.main(["--smoke", "--methods", "--out", str(out)])
    payload = json.loads(out.with_suffix(".json").read_text())
    backends = {(t["m"], t["backend"]) for t in payload["times"]}
    assert backends == {(1, "bf16"), (1, "bf16-gemv"), (3, "bf16")}  # the GEMV takes one row
    assert all(c["ok"] for c in payload["checks"])
    swept = [s for s in payload["sweep"] if s["method"] == "bf16-gemv"]
    assert swept and swept[0]["planned"] and all(s["rel_err"] < linear_bench.CHECK_TOL for s in swept)
    sums = {(r["m"], r["backend"]) for r in payload["token_sums"]}
    assert {(1, "bf16"), (1, "bf16-gemv"), (1, "bf16-gemv-swept")} <= sums


def test_the_gemlite_baseline_stands_aside_where_gemlite_cannot_import():
    """gemlite imports only on a GPU: here the shape records why it did not run and times no gemlite backend; a
    weight whose scales are neither bf16 nor fp16 is refused before gemlite is imported."""
    from benchmarks import gemlite_baseline

    gen = torch.Generator().manual_seed(3)
    shape = linear_bench.Shape(256, 96, torch.device("cpu"), torch.bfloat16, gen, ["int4"])
    x = torch.randn((2, 256), generator=gen).to(torch.bfloat16)
    assert not gemlite_baseline.available()
    assert shape.prepare_gemlite(x) == "gemlite does not import here" and shape.gemlite == []
    args = type("Args", (), {"dequant_min_m": 16})()
    assert not any("gemlite" in name for name in linear_bench.backends(shape, 2, args, interp=False)[0])
    qweight, scales, zeros = shape.q["int4"][0]
    with pytest.raises(ValueError, match="torch.float32"):
        gemlite_baseline.gemlite_layer(qweight, scales.float(), zeros)


def test_the_words_sweep_tries_tiles_of_128_rows_from_128_rows():
    """From 128 rows the sweep adds launches whose tile holds 128 rows (the words read and dequantized once for
    them), which the plan (at most 64 rows a tile) never takes; below 128 it adds none."""
    from questkv.ops.triton.int4_words import plan_int4_words_matmul

    cpu = torch.device("cpu")
    assert plan_int4_words_matmul(256, 28672, 4096, 128, cpu).block_m == 64
    assert not any(c.block_m == 128 for c in linear_bench.words_sweep_configs(64, 28672, 4096, cpu))
    tall = [c for c in linear_bench.words_sweep_configs(256, 28672, 4096, cpu) if c.block_m == 128]
    assert {(c.block_n, c.num_warps) for c in tall} == {(128, 8), (64, 4)} and all(c.swap_ab for c in tall)
