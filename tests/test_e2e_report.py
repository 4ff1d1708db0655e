"""benchmarks/e2e_report.py on a tiny fake e2e JSON."""

import json

import pytest

pytest.importorskip("matplotlib")

from benchmarks import e2e_report  # noqa: E402


def _engine(ms, graph, attended):
    return {"ms_per_token": ms, "tokens_per_s": 1e3 / ms, "graph_replay_ms": graph,
            "mean_tokens_attended": attended, "spread_ms": [ms, ms], "weight_bytes": 16e9, "graphs": 1}


def _point(context, dense_ms, quest_ms, target):
    return {"model": "llama3.1-8b", "batch": 1, "context": context, "budget": 2048, "target": target,
            "engine_dense": _engine(dense_ms, dense_ms - 0.2, context), "engine_quest": _engine(quest_ms, quest_ms - 0.2, 2048),
            "floor_dense_ms": dense_ms * 0.8, "floor_quest_ms": quest_ms * 0.7,
            "ideal_speedup": dense_ms * 0.8 / (quest_ms * 0.7), "speedup": dense_ms / quest_ms}


def _render(tmp_path, stem: str, points: list, **record) -> str:
    """The markdown e2e_report writes for a record of ``points`` (and ``record``'s other keys)."""
    path = tmp_path / f"{stem}.json"
    path.write_text(json.dumps({"provenance": {}, "page_size": 16, "dense_layers": 2, "bandwidth_bytes_per_s": 4e12,
                                "points": points, **record}))
    e2e_report.main([str(path)])
    return (tmp_path / f"{stem}.md").read_text()


def test_report(tmp_path):
    base = _point(1024, 5.0, 5.1, None)
    long = _point(32768, 6.0, 5.0, 1.5)  # speedup 1.2 < 1.5: missed by 20 %
    long["hf_eager"] = {"ms_per_token": 30.0, "tokens_per_s": 33.3, "prefill_s": 4.0}
    long["hf_static"] = {"ms_per_token": 900.0, "tokens_per_s": 1.1, "prefill_s": 1.5}
    long["prefill_s"] = 1.3
    record = {"provenance": {"command": "e2e_bench.py", "commit": "abc", "machine": "FakeGPU", "date": "today",
                             "torch": "t", "transformers": "x"},
              "page_size": 16, "dense_layers": 2, "dtype": "bfloat16", "warmup_steps": 6, "timed_steps": 32,
              "bandwidth_bytes_per_s": 4e12, "points": [base, long],
              "check_fp32": {"dense": {"identical": True, "tokens_match": 72, "tokens": 72}},
              "check_8b_bf16": {"dense": {"agreeing_prefix": 3, "tokens": 16}}}
    path = tmp_path / "e2e-fake.json"
    path.write_text(json.dumps(record))
    e2e_report.main([str(path)])
    md = (tmp_path / "e2e-fake.md").read_text()
    assert "## Targets" in md and "| llama3.1-8b | 1 | 32k | 2048 |" in md and "| llama3.1-8b | 1 | 1k | 2048 |" in md
    assert "NO (missed by 20.0 %)" in md
    assert "invalid (recompiled per call" in md and "not evaluated" in md
    assert "Quest ≥ 12× faster than HF eager" in md and "6.00× (30.00 / 5.00 ms) | NO (missed by 50.0 %)" in md
    assert "3 of 16" in md and "FakeGPU" in md
    assert (tmp_path / "e2e-fake.png").stat().st_size > 1000
    assert "## Host overlap" not in md  # no point carries both scheduling modes


def test_report_of_both_scheduling_modes_and_kernel_counts(tmp_path):
    point = _point(32768, 6.0, 5.0, 1.5)
    for kind, sync_ms, count in (("engine_dense", 6.4, 430), ("engine_quest", 5.5, 490)):
        run = point[kind]
        run["graph_replay_ms"] = run["ms_per_token"] - 0.05
        run["sync"] = {"ms_per_token": sync_ms}
        run["kernels"] = {"count": count, "us": 5000.0, "top": [{"name": "nvjet_gemv", "count": 224, "us": 3900.0}]}
    record = {"provenance": {}, "page_size": 16, "dense_layers": 2, "bandwidth_bytes_per_s": 4e12, "points": [point]}
    path = tmp_path / "e2e-modes.json"
    path.write_text(json.dumps(record))
    e2e_report.main([str(path)])
    md = (tmp_path / "e2e-modes.md").read_text()
    # sync 6.40 / 5.50, async 6.00 / 5.00, graph 5.95 / 4.95: host 0.45 / 0.55 sync, 0.05 / 0.05 async
    assert ("| llama3.1-8b | 1 | 32k | 2048 | 6.40 / 5.50 | 6.00 / 5.00 | 5.95 / 4.95 | 0.45 / 0.55 | 0.05 / 0.05 | "
            "yes | 430 / 490 | 13.4 / 15.3 |") in md
    assert "`nvjet_gemv` 3900 (224)" in md


def test_report_of_selection_reuse(tmp_path):
    point = _point(131072, 9.0, 6.0, 1.6)
    point["engine_quest_reuse"] = {"4": _engine(5.0, 4.8, 4100)}
    point["speedup_reuse"] = {"4": 9.0 / 5.0}
    plain = _point(32768, 6.0, 5.0, None)  # timed without reuse: not in the section
    md = _render(tmp_path, "e2e-reuse", [point, plain], selection_intervals=[4])
    assert "## Selection reuse" in md
    assert "| llama3.1-8b | 1 | 128k | 2048 | 1 | 9.00 | 6.00 (5.80) | 1.50× | 1.60× | NO (missed by 6.3 %) |" in md
    assert "| llama3.1-8b | 1 | 128k | 2048 | 4 | 9.00 | 5.00 (4.80) | 1.80× | 1.60× | yes |" in md
    assert "| llama3.1-8b | 1 | 32k | 2048 | 1 |" not in md


def test_report_of_the_dense_engine_with_gemv_and_with_cublas(tmp_path):
    point = _point(32768, 5.6, 5.0, None)  # floor 4.48 ms
    point["engine_dense_cublas"] = _engine(5.8, 5.75, 32768)
    for run, count in ((point["engine_dense"], 308), (point["engine_dense_cublas"], 372)):
        run["kernels"] = {"count": count, "us": 5000.0, "top": [{"name": "nvjet_tst", "count": 32, "us": 1800.0}]}
    plain = _point(1024, 5.0, 5.1, None)  # timed one way only: not in the section
    md = _render(tmp_path, "e2e-linear", [point, plain])
    assert "## Float linears at one row: GEMV vs cuBLAS" in md
    assert "| llama3.1-8b | 1 | 32k | 5.60 (5.40) | 5.80 (5.75) | 1.036 | 4.48 | 1.250 | 1.295 | 308 / 372 |" in md
    assert "| llama3.1-8b | 1 | 1k | 5.00" not in md
    assert "`nvjet_tst` 1800 (32)" in md


def test_report_of_a_checks_only_run(tmp_path):
    record = {"provenance": {}, "page_size": 16, "dense_layers": 2, "bandwidth_bytes_per_s": 4e12, "points": [],
              "check_chunked_prefix_fp32": {"quest-256": {"identical": False, "tokens_match": 70, "tokens": 72,
                                                          "cached_tokens": [0, 1024, 1024]}},
              "check_mixed_steps_fp32": {"dense": {"identical": True, "tokens_match": 120, "tokens": 120,
                                                   "mixed_steps": 31}},
              "check_fp32": {"quest-256-reuse-4": {"identical": True, "tokens_match": 72, "tokens": 72,
                                                   "selection_rates": {"cuda-graphs": [0.25, 0.5],
                                                                       "eager-reference": [0.25, 0.5]}}},
              "check_int4_fp32": {"dense-batch-1": {"identical": True, "tokens_match": 24, "tokens": 24}}}
    path = tmp_path / "e2e-checks.json"
    path.write_text(json.dumps(record))
    e2e_report.main([str(path)])
    md = (tmp_path / "e2e-checks.md").read_text()
    assert "- quest-256: identical False (70/72 tokens match); cached tokens per prompt [0, 1024, 1024]" in md
    assert "selection rates cuda-graphs 0.250 / 0.500, eager-reference 0.250 / 0.500" in md
    assert "- dense: identical True (120/120 tokens match); 31 mixed steps" in md
    assert "quantized to int4 at load, one prompt and three" in md and "- dense-batch-1: identical True (24/24 tokens match)" in md
    assert "## Targets" not in md and not (tmp_path / "e2e-checks.png").exists()
