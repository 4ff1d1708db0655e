"""benchmarks/verify_attention.py on tiny CPU shapes (the kernels under the interpreter, graph timing replaced by one
call): its checks pass, a point runs every query count and the sweep, the sweep restores the kernel's settings, and
the tables name what they measured."""

import json

import pytest
import torch

pytest.importorskip("triton")

from benchmarks import verify_attention  # noqa: E402
from questkv.ops import LayerPages  # noqa: E402

TINY = {"tiny-gqa": (8, 2, 16)}


def test_the_small_checks_compare_both_kernels_with_the_reference():
    checks = verify_attention.check_small(torch.Generator().manual_seed(1), lengths=(37, 18), queries_list=(2, 5),
                                          models=TINY, device="cpu")
    assert len(checks) == 2 * 2 * 2  # pool dtypes x query counts x kernels
    assert all(c["ok"] for c in checks), checks


def test_a_point_runs_every_query_count_and_the_sweep_restores_the_kernels_settings(monkeypatch, tmp_path):
    calls = []

    def one_call(enqueue, n_layers, reps, warmup):
        calls.append(enqueue(0))
        return float(len(calls))

    def tiny_point(model, batch, context, min_budget, max_gb):
        hq, hkv, d = TINY[model]
        gen = torch.Generator().manual_seed(0)
        pages = batch * context // verify_attention.PAGE_SIZE
        k = torch.randn(pages, verify_attention.PAGE_SIZE, hkv, d, generator=gen).to(verify_attention.DTYPE)
        v = torch.randn_like(k)
        return {"layers": [LayerPages(k, v, k.amin(1), k.amax(1))], "n_layers": 1, "gen": gen,
                "table": torch.randperm(pages, generator=gen).view(batch, -1).int(),
                "lens": torch.full((batch,), context, dtype=torch.int32),
                "q": torch.randn(batch, hq, d, generator=gen).to(verify_attention.DTYPE),
                "npages": context // verify_attention.PAGE_SIZE, "kv_bytes": 2 * k.numel() * k.element_size()}

    monkeypatch.setattr(verify_attention, "DEVICE", "cpu")
    monkeypatch.setattr(verify_attention, "MODELS", TINY)
    monkeypatch.setattr(verify_attention, "point_data", tiny_point)
    monkeypatch.setattr(verify_attention, "time_graph", one_call)
    monkeypatch.setattr(verify_attention, "graph_equals_eager", lambda fn: fn() is not None)
    before = dict(verify_attention.attention._CONFIG)
    args = type("Args", (), {"reps": 1, "warmup": 0, "max_gb": 1.0, "queries": [2, 5, 9], "sweep": True})()
    point = verify_attention.run_point("tiny-gqa", 2, 64, args, floor_tbps=1.0)
    assert verify_attention.attention._CONFIG == before and verify_attention.attention._MAX_QUERY_ROWS == 64
    assert [r["queries"] for r in point["queries"]] == [2, 5, 9]  # 9: two tiles under the 32-row launches
    assert all(r["kernels_rel_err"] < 1e-2 and r["graph_equals_eager"] for r in point["queries"])
    assert all(len(r["sweep_us"]) == len(verify_attention.SWEEP_CONFIGS) for r in point["queries"])
    assert all(err < 1e-2 for r in point["queries"] for err in r["sweep_rel_err"].values())
    table = "\n".join(verify_attention.table_lines([point]) + verify_attention.sweep_lines([point]))
    assert "| tiny-gqa B=2/0k | 5 |" in table and "128 keys, 3/SM, 2 stages" in table and "**" in table
    assert "tiles of 32 rows" in table and "(wrong)" not in table
    info = {"gpu": "cpu", "command": "x", "commit": "c", "date": "d", "torch": "t", "triton": "tr", "dtype": "bf16",
            "copy_tbps": 1.0}
    verify_attention.write_results(tmp_path, "t", info, [], [point])
    written = (tmp_path / "verify-attention-t.md").read_text().splitlines()
    assert all(line in written for line in table.splitlines())
    assert json.loads((tmp_path / "verify-attention-t.json").read_text())["points"][0]["batch"] == 2
