"""benchmarks/serve_load.py: its summaries on hand-made request timings, and its ``--smoke`` run (dense and Quest CPU
servers of a tiny random model, single-turn and multi-turn loads) end to end."""

import json
import os

import pytest

from benchmarks import serve_load


def request(sent, times, completion_tokens, cached_tokens=0, prompt_tokens=10):
    return {"sent": sent, "times": times, "token_ids": [], "error": None, "quest": None,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "prompt_tokens_details": {"cached_tokens": cached_tokens}}}


def test_the_gaps_while_prompts_arrive_are_those_overlapping_another_requests_wait_for_its_first_token():
    early = request(0.0, [1.0, 2.0, 3.0, 4.0], 4)
    late = request(2.5, [3.5, 5.0], 2)  # waits from 2.5 to 3.5: overlaps early's gaps (2, 3] and (3, 4]
    assert sorted(serve_load.itl_while_prompts_arrive([early, late])) == [1.0, 1.0]
    assert serve_load.itl_while_prompts_arrive([early]) == []


def test_turns_are_summarised_each_and_turns_from_the_second_on_together():
    turn1 = [request(0.0, [4.0, 5.0], 2), request(0.0, [8.0, 9.0], 2)]
    turn2 = [request(10.0, [10.5, 11.0], 2, cached_tokens=8), request(10.0, [11.0, 12.0], 2, cached_tokens=8)]
    turn3 = [request(12.0, [12.5, 13.0], 2, cached_tokens=12), request(12.0, [12.5, 14.0], 2, cached_tokens=12)]
    summary = serve_load.summarise_turns([(turn1, 10.0), (turn2, 2.0), (turn3, 2.0)])
    assert [turn["ttft_s"]["p50"] for turn in summary["turns"]] == [6.0, 0.75, 0.5]
    assert [turn["mean_cached_tokens"] for turn in summary["turns"]] == [0, 8, 12]
    assert summary["output_tokens_per_s"] == 12 / 14 and summary["output_tokens_per_s_turns_2_on"] == 8 / 4
    assert summary["ttft_p50_turns_2_on_over_turn_1"] == pytest.approx(0.5 / 6.0)
    assert summary["failed"] == 0 and summary["requests"] == 6


def test_a_turns_lossless_requests_that_verified_are_counted_with_their_mean_acceptance_and_tokens_a_verify():
    drafting = [request(0.0, [1.0, 2.0], 2), request(0.0, [1.0, 3.0], 2), request(0.0, [1.0, 2.0], 2)]
    drafting[0]["quest"] = {"mean_tokens_attended": 50.0, "acceptance_rate": 0.5, "mean_tokens_per_verify": 3.0}
    drafting[1]["quest"] = {"mean_tokens_attended": 60.0, "acceptance_rate": 1.0, "mean_tokens_per_verify": 5.0}
    drafting[2]["quest"] = {"mean_tokens_attended": 70.0}  # a lossless request that only decoded densely
    dense = [request(4.0, [5.0, 6.0], 2)]
    turns = serve_load.summarise_turns([(drafting, 4.0), (dense, 2.0)])["turns"]
    assert (turns[0]["verified_requests"], turns[0]["mean_acceptance_rate"], turns[0]["mean_tokens_per_verify"]) == (
        2, 0.75, 4.0)
    assert (turns[1]["verified_requests"], turns[1]["mean_acceptance_rate"], turns[1]["mean_tokens_per_verify"]) == (
        0, None, None)


def test_a_servers_kernels_compiled_since_a_moment_are_its_cache_groups_written_after_it(tmp_path):
    server = serve_load.Server.__new__(serve_load.Server)  # the cache only: no process
    server.triton_cache = str(tmp_path)
    for folder, kernel, mtime in [("a1", "append_kernel", 100.0), ("b2", "verify_kernel", 300.0),
                                  ("c3", "verify_kernel", 400.0), ("d4", "select_kernel", 250.0)]:
        (tmp_path / folder).mkdir()
        group = tmp_path / folder / f"__grp__{kernel}.json"
        group.write_text("{}")
        (tmp_path / folder / f"{kernel}.cubin").write_text("")
        os.utime(group, (mtime, mtime))
    assert server.compiled_since(200.0) == ["select_kernel", "verify_kernel", "verify_kernel"]
    assert server.compiled_since(500.0) == []


def test_the_smoke_run_serves_every_load_dense_and_quest_and_writes_its_report(tmp_path, monkeypatch):
    caches, mkdtemp = [], serve_load.tempfile.mkdtemp

    def recorded(*args, **kwargs):
        folder = mkdtemp(*args, **kwargs)
        if "triton" in kwargs.get("prefix", ""):
            caches.append(folder)
        return folder

    monkeypatch.setattr(serve_load.tempfile, "mkdtemp", recorded)
    result = serve_load.main(["--smoke", "--out", str(tmp_path / "serve")])
    # each server compiled into a Triton cache of its own, removed when it stopped
    assert len(caches) == len(set(caches)) == 2 and not any(os.path.exists(cache) for cache in caches)
    runs = {(run["name"], run["workload"]): run for run in result["runs"]}
    assert sorted(runs) == [("dense", "multi-turn"), ("dense", "single"), ("quest", "multi-turn"), ("quest", "single")]
    for run in runs.values():
        assert run["load"]["failed"] == 0 and run["exit_code"] == 0
        assert isinstance(run["load"]["kernels_compiled"], list) and "timed_from" not in run["load"]
        assert run["load"]["itl_s"]["count"] > 0
    for name in ("dense", "quest"):
        turns = runs[name, "multi-turn"]["load"]["turns"]
        assert len(turns) == 3
        # Turn 1: two clients per document, the second hits the first's pages; later turns hit the conversation too.
        assert turns[0]["mean_cached_tokens"] == 96 / 2
        assert all(turn["mean_cached_tokens"] >= 96 + 8 for turn in turns[1:])
    assert [c.get("workload", "single") for c in result["quest_vs_dense"]] == ["single", "multi-turn"]
    saved = json.loads((tmp_path / "serve.json").read_text())
    assert saved["provenance"]["command"] and saved["settings"]["turns"] == 3
    report = (tmp_path / "serve.md").read_text()
    assert "## Multi-turn: quest" in report and "over turns >= 2" in report and "ITL while prompts arrive" in report
    assert "## Triton kernels compiled inside the timed loads" in report
