"""benchmarks/kernels_bench.py, the parts that run here: the key-code checks (Triton under the interpreter), the
'estimate from 2-bit codes' fields with a stand-in timer, and their table."""

import random

import pytest
import torch

pytest.importorskip("triton")

from benchmarks import kernels_bench  # noqa: E402
from questkv.ops import LayerPages, reference  # noqa: E402


def _data(gen, hq=4, hkv=2, d=32, batch=2, max_pages=3):
    page_size = kernels_bench.PAGE_SIZE
    num_pages = batch * max_pages
    k_pages = torch.randn(num_pages, page_size, hkv, d, generator=gen)
    table = torch.randperm(num_pages, generator=gen).view(batch, max_pages).int()
    lens = torch.tensor([page_size * max_pages, page_size + 5], dtype=torch.int32)
    q = torch.randn(batch, hq, d, generator=gen)
    return q, k_pages, k_pages.amin(1), k_pages.amax(1), table, lens


def test_key_codes_checks_pass_for_every_width_mode_and_rerank():
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    checks = kernels_bench.key_codes_checks(*_data(gen))
    names = [name for name, _, _ in checks]
    for bits in reference.KEY_CODE_BITS:
        assert f"encode_page_keys {bits}-bit (exact)" in names
        for mode in ("kv_head/sum", "kv_head/max", "q_head/sum"):
            for rerank in ("max", "mass"):
                assert f"page_scores_codes {bits}-bit {mode} {rerank}" in names
    failed = [(name, err, tol) for name, err, tol in checks if not err <= tol]
    assert not failed, failed


def test_codes_estimate_fields_time_both_reranks_and_fill_the_table():
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    q, k_pages, kmin, kmax, table, lens = _data(gen)
    layers = [LayerPages(k_pages, k_pages, kmin, kmax), LayerPages(k_pages * 2, k_pages, kmin * 2, kmax * 2)]
    micros = iter([random.uniform(5, 50), random.uniform(5, 50)])
    calls = []

    def timer(enqueue):
        enqueue(1)
        calls.append(1)
        return next(micros)

    fields = kernels_bench.time_codes_estimate(q, layers, table, lens, timer)
    assert len(calls) == 2
    assert set(fields) == {"estimate_codes2_us", "estimate_codes2_bytes", "estimate_codes2_tbps",
                           "estimate_codes2_mass_us", "estimate_codes2_mass_tbps"}
    for prefix in ("estimate_codes2", "estimate_codes2_mass"):
        want = fields["estimate_codes2_bytes"] / (fields[f"{prefix}_us"] * 1e-6) / 1e12
        assert fields[f"{prefix}_tbps"] == pytest.approx(want)
    point = {"model": "llama3.1-8b", "batch": 2, "context": 4096, "sparse": [{"estimate_us": 3.0}], **fields}
    old = {key: value for key, value in point.items() if "mass" not in key}  # a point measured before the mass mode
    lines = kernels_bench.codes_lines([point, old])
    assert "ranked by mass µs" in lines[0] and len(lines) == 4
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert f"| {fields['estimate_codes2_mass_us']:.1f} | {fields['estimate_codes2_mass_tbps']:.2f} |" in lines[2]
    assert "| - | - |" in lines[3]


def test_amortized_windows_run_every_step_of_every_layer_through_the_reuse_path():
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    q, k_pages, kmin, kmax, table, lens = _data(gen, max_pages=4)
    layers = [LayerPages(k_pages, k_pages, kmin, kmax), LayerPages(k_pages * 2, k_pages, kmin * 2, kmax * 2)]
    budget = 2 * kernels_bench.PAGE_SIZE
    windows = []

    def timer(enqueue, steps):
        for step in range(steps):
            for layer in range(len(layers)):
                enqueue(step, layer)
        windows.append(steps)
        return float(10 * steps)

    amortized = kernels_bench.time_amortized(budget, [1, 2, 5], q, layers, table, lens, timer)
    assert windows == [1, 2, 5] and amortized == {"1": 10.0, "2": 20.0, "5": 50.0}
    assert kernels_bench.amortized_target({"1": 30.0, "2": 19.0, "4": 12.0}, 20.0) == (2, 19.0, True)
    assert kernels_bench.amortized_target({"1": 30.0, "2": 25.0, "4": 22.0}, 20.0) == (4, 22.0, False)
    assert kernels_bench.amortized_target({}, 20.0) is None
