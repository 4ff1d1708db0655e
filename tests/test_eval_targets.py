"""benchmarks/eval_targets.py on hand-made cells: each target's verdict, no-signal and missing cells."""

import json
import random

import pytest

from benchmarks import eval_targets

L = 16384


def _cell(task, policy, budget, value, attended=None, metric="accuracy"):
    return {"task": task, "length": L, "policy": policy, "budget": budget, "value": value, "metric": metric,
            "samples": 20, "mean_tokens_attended": attended if attended is not None else budget,
            "kv_bytes_fraction": random.random()}


def test_retrieval_within_one_sample_and_no_signal_tasks_apart():
    cells = [_cell("passkey", "full", None, 1.0), _cell("passkey", "quest", L // 16, 0.95),
             _cell("niah_multikey", "full", None, 0.7), _cell("niah_multikey", "quest", L // 16, 0.6),
             _cell("niah_uuid", "full", None, 0.05), _cell("niah_uuid", "quest", L // 16, 0.0)]
    result = eval_targets.check(cells)
    verdicts = {r["task"]: (r["behind"], r["met"]) for r in result["retrieval_vs_full"]}
    assert verdicts == {"passkey": (1.0, True), "niah_multikey": (2.0, False)}
    assert [r["task"] for r in result["no_signal"]] == ["niah_uuid"]


def test_aggregation_ten_points_and_perplexity_one_percent():
    cells = [_cell("vt", "full", None, 0.81), _cell("vt", "quest", L // 8, 0.71),
             _cell("cwe", "full", None, 0.44), _cell("cwe", "quest", L // 8, 0.11),
             _cell("ppl", "full", None, 10.0, metric="ppl"), _cell("ppl", "quest", L // 8, 10.2, metric="ppl")]
    result = eval_targets.check(cells)
    assert {r["task"]: r["met"] for r in result["aggregation_vs_full"]} == {"vt": True, "cwe": False}
    assert [(r["behind"], r["met"]) for r in result["ppl_vs_full"]] == [(0.02, False)]


def test_selector_option_checks_another_policy_string():
    cells = [_cell("cwe", "full", None, 0.44), _cell("cwe", "quest", L // 8, 0.11),
             _cell("cwe", "quest:selection=q_head", L // 8, 0.40)]
    assert [r["met"] for r in eval_targets.check(cells, "quest:selection=q_head")["aggregation_vs_full"]] == [True]


def test_eviction_and_topp_with_options_and_missing_cells():
    cells = [_cell("vt", "full", None, 0.8), _cell("vt", "quest", 2048, 0.7), _cell("vt", "tova", 2048, 0.85),
             _cell("vt", "streaming", 2048, 0.0),
             _cell("vt", "quest-topp:min_budget=256:top_p=0.9", 2048, 0.7, attended=900.0),
             _cell("fwe", "full", None, 0.7), _cell("fwe", "quest", 2048, 0.6)]
    result = eval_targets.check(cells)
    assert {(r["policy"], r["met"]) for r in result["quest_vs_eviction"] if r["task"] == "vt"} == {
        ("tova", False), ("streaming", True)}
    (topp,) = result["topp_half_budget"]
    assert topp["met"] and topp["topp_policy"].startswith("quest-topp:")
    assert {"task": "fwe", "length": L, "cell": "quest-topp (vs quest@2048)"} in result["missing"]


def test_main_counts_a_repeated_cell_once_and_rejects_one_with_other_scores(tmp_path):
    full = dict(_cell("vt", "full", None, 0.8), scores=[1.0, 0.6])
    quest = dict(_cell("vt", "quest", 2048, 0.75), scores=[1.0, 0.5])
    for name, cells in (("a", [full, quest]), ("b", [dict(full)])):
        (tmp_path / f"{name}.json").write_text(json.dumps({"cells": cells}))
    eval_targets.main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path / "t")])
    assert json.loads((tmp_path / "t.json").read_text())["summary"]["aggregation_vs_full"] == {"met": 1, "total": 1}
    other = dict(full, scores=[1.0 - s for s in full["scores"]])
    (tmp_path / "b.json").write_text(json.dumps({"cells": [other]}))
    with pytest.raises(SystemExit, match="in both .* other scores"):
        eval_targets.main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path / "t")])


def test_main_writes_json_and_markdown(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"cells": [_cell("vt", "full", None, 0.8),
                                                           _cell("vt", "quest", 2048, 0.75)]}))
    eval_targets.main([str(tmp_path / "a.json"), "--out", str(tmp_path / "t-0.5b")])
    assert json.loads((tmp_path / "t-0.5b.json").read_text())["summary"]["aggregation_vs_full"] == {"met": 1, "total": 1}
    assert "| vt | 16384 | quest | 2048 | 75% |" in (tmp_path / "t-0.5b.md").read_text()
