"""benchmarks/lossless_bench.py and its engine-step profile and host timing (benchmarks/e2e_bench.py's profile_steps,
time_host) on the CPU: what
a GPU run would record, on a tiny random model, so that a fault shows here rather than on the GPU's clock."""

import json
import random

import pytest
from transformers import LlamaConfig

from benchmarks import lossless_bench
from benchmarks.e2e_bench import idle_gaps, profile_steps, time_host
from questkv import LLM, QuestConfig, SamplingParams

CFG = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048)


def _engine(**kwargs):
    """A tiny engine holding two requests whose prompts already pass the dense-context threshold (so that their
    first decode steps draft)."""
    quest = QuestConfig(token_budget=64, page_size=16, dense_layers=0)
    llm = LLM(CFG, load_format="dummy", dtype="float32", device="cpu", max_num_seqs=2, kv_cache_memory=16 << 20,
              seed=1, quest=quest, **kwargs)
    dense_context = int(quest.dense_context_ratio * quest.token_budget)
    for _ in range(2):
        prompt = [random.randrange(256) for _ in range(random.randint(dense_context + 1, dense_context + 60))]
        llm.engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    return llm


def _measured_round(measure):
    """``measure(engine, 8)`` over 8 steps of a warmed-up lossless engine (rounds of 3 drafts: a verify among them);
    returns the record and the engine, whose requests the caller finishes."""
    engine = _engine(speculative_config=lossless_bench.lossless_config(3, False), async_scheduling=True).engine
    for _ in range(4):
        engine.step()
    verifies = engine.scheduler.step_tokens["verify"]
    record = measure(engine, 8)
    assert engine.scheduler.step_tokens["verify"] > verifies  # the measured steps ran a round
    return record, engine


def test_profile_steps_times_the_engines_phases_and_leaves_the_engine_as_it_was():
    record, engine = _measured_round(profile_steps)
    assert record["steps"] == 8 and record["gpu_busy_ms"] is None and record["gpu_kernels"] == []
    assert set(record["phases_ms"]) == {"schedule", "launch", "process"}
    assert all(ms > 0 for ms in record["phases_ms"].values())
    assert sum(record["phases_ms"].values()) <= record["host_wall_ms"] * 1.01
    assert record["host_ops"] and all(op["us"] >= 0 for op in record["host_ops"])
    for owner, name in ((engine.scheduler, "schedule"), (engine.runner, "execute"), (engine, "_process")):
        assert name not in vars(owner)  # the labelled wrappers are gone
    while engine.has_unfinished_requests():
        engine.step()


def test_profile_steps_writes_its_timeline_as_a_gzipped_chrome_trace(tmp_path):
    import gzip
    import json

    trace = tmp_path / "trace.json.gz"
    record, engine = _measured_round(lambda engine, steps: profile_steps(engine, steps, trace=trace))
    events = json.load(gzip.open(trace))["traceEvents"]
    names = {event.get("name") for event in events}
    assert {"questkv::schedule", "questkv::launch", "questkv::process"} <= names  # the engine's phases on the timeline
    assert record["steps"] == 8
    while engine.has_unfinished_requests():
        engine.step()


def test_time_host_splits_the_steps_wall_time_and_leaves_the_engine_as_it_was():
    from questkv.engine.step_data import SampledTokens

    methods = {attr: getattr(SampledTokens, attr) for attr in ("token_ids", "logprobs_by_row")}
    record, engine = _measured_round(time_host)
    assert record["steps"] == 8
    assert 0 < record["schedule"] and 0 < record["sample"] < record["launch"] and record["replay"] == 0  # (no graphs)
    assert record["wait"] <= record["process"]
    assert record["schedule"] + record["launch"] + record["process"] <= record["wall"] * 1.01
    assert record["busy"] == pytest.approx(record["wall"] - record["wait"])
    kinds = record["kinds"]  # a round of 3 drafts and its verify: the steps that launched each kind apart
    assert set(kinds) == {"decode", "verify"} and kinds["decode"]["steps"] + kinds["verify"]["steps"] == 8
    assert kinds["verify"]["steps"] == 2
    for name in ("schedule", "launch", "process", "wait", "wall"):
        total = sum(kind[name] * kind["steps"] for kind in kinds.values())
        assert total == pytest.approx(record[name] * 8, rel=0.05 if name == "wall" else 1e-9)
    for owner, name in ((engine.scheduler, "schedule"), (engine.runner, "execute"), (engine.runner.graphs, "replay"),
                        (engine.runner.tokens, "sample"), (engine, "_process")):
        assert name not in vars(owner)  # the timing wrappers are gone
    assert all(getattr(SampledTokens, attr) is method for attr, method in methods.items())
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("kernels", [True, False])
def test_the_shapes_table_shows_rounds_graphs_and_profiles(kernels):
    profile = {"steps": 10, "wall_ms": 6.0, "gpu_busy_ms": 5.0, "gpu_idle_ms": 1.0, "host_wall_ms": 5.5,
               "phases_ms": {"schedule": 0.2, "launch": 0.7, "process": 3.6},
               "host_ops": [{"name": "cudaEventSynchronize", "us": 3000.0}]}
    if kernels:  # (a run before the device-only pass has none)
        profile["gpu_kernels"] = [{"name": "_decode_split_kernel", "us": 2061.0}]
        profile["gpu_gaps"] = [{"after": "argmax", "before": "_rms_norm_kernel", "us": 120.0, "count": 0.2}]
    point = {"model": "llama2-7b", "batch": 1, "context": 32768, "budget": 2048, "quantization": "int4", "k": 4,
             "dense_ms": 7.7, "round_ms": 25.5,
             "implied": [{"acceptance": 0.929, "tokens_per_round": 4.43, "speedup": 1.34}],
             "dense_graph_ms": 7.7, "draft_graph_ms": 3.2, "verify_graph_ms": 10.2,
             "verify_kernels": {"top": [{"name": "_decode_split_kernel", "count": 32, "us": 6329.0}]},
             "dense_profile": profile, "round_profile": profile}
    host = {"wall": 6.0, "busy": 4.5, "wait": 1.5, "schedule": 1.0, "launch": 2.0, "replay": 0.25, "sample": 0.5,
            "process": 2.75, "steps": 20}
    kinds = {"decode": {**host, "steps": 16}, "verify": {**host, "wall": 9.0, "steps": 4}}  # a round's steps apart
    point.update(dense_host=host, quest_host=host, round_host={**host, "kinds": kinds}, quest_ms=3.5)
    record = {"provenance": {"command": "lossless_bench.py shapes", "commit": "abc", "machine": "GPU", "date": "today"},
              "results": {"points": [point]}}
    text = lossless_bench.table("shapes", record)
    assert "| llama2-7b int4 B=1 32k/2048 | 7.70 | 3.50 | 25.50 (k=4) | 1.34× (0.929) |" in text
    assert "| llama2-7b B=1 32k | lossy Quest | 6.00 | 4.50 | 1.50 | 1.00 | 2.00 (0.25, 0.50) | 2.75 |" in text
    assert "| llama2-7b B=1 32k | lossless k=4 | 6.00 | 5.00 | 1.00 |" in text
    assert "| llama2-7b B=1 32k | lossless k=4: 16 steps launching no verify | 6.00 |" in text
    assert "| llama2-7b B=1 32k | lossless k=4: 4 steps launching a verify | 9.00 |" in text
    assert "dense, on the lossless engine" not in text  # (a run before it was timed)
    with_dense = {**point, "lossless_dense_host": {**host, "wall": 6.4},
                  "dense_kernels": {"count": 300, "us": 1900.0, "top": []},
                  "lossless_dense_kernels": {"count": 312, "us": 1990.0, "top": []},
                  "draft_kernels": {"count": 308, "us": 2000.0, "top": []},
                  "verify_kernels": {"count": 303, "us": 6300.0, "top": []}}
    dense_text = lossless_bench.table("shapes", {**record, "results": {"points": [with_dense]}})
    assert "| llama2-7b B=1 32k | dense, on the lossless engine | 6.40 | 4.50 | 1.50 |" in dense_text
    assert "| llama2-7b B=1 32k | dense, on the lossless engine | 312 | 1990 |" in dense_text
    assert "| llama2-7b B=1 32k | 7.70 | 3.20 | 10.20 | 23.00 | 2.50 |" in text  # a round's graphs, the rest
    assert ("_decode_split_kernel 2061" in text) == kernels
    assert ("| llama2-7b B=1 32k | argmax | _rms_norm_kernel | 120 | 0.2 |" in text) == kernels
    assert "0.20 / 0.70 / 3.60" in text and "cudaEventSynchronize 3000" in text
    record["results"]["points"].append({**point, "draft_dense_layers": 0})  # drafts sparse in every layer
    text = lossless_bench.table("shapes", record)
    assert "| llama2-7b int4 B=1 32k/2048-dense0 | 7.70 |" in text
    assert "| llama2-7b B=1 32k-dense0 | lossless k=4 | 6.00 | 5.00 | 1.00 |" in text


@pytest.mark.parametrize("batches", [[1], [1, 2]])
def test_the_real_run_measures_every_mode_on_a_tiny_model_and_the_lossless_ones_equal_dense(tmp_path, batches):
    """``real`` at batch 1 (a book and a code window each) and 2 (one of each in a batch) on the CPU: every mode
    timed, the lossless engines' outputs equal to the dense requests' (float32), their acceptance counted."""
    import argparse
    import collections

    from questkv.eval import agreement
    from tests.helpers import tiny_config, tiny_hf_model, word_tokenizer

    model = tmp_path / "tiny"  # positions for a 512-token context (budgets 32 and 64 at page 16)
    tiny_hf_model(tiny_config("llama3", vocab_size=96, max_position_embeddings=1024),
                  seed=random.randrange(1 << 16)).save_pretrained(model)
    words = collections.Counter(word for task in ("agreement_book", "agreement_code")
                                for word in agreement.load_text(task)[0].split())
    word_tokenizer([word for word, _ in words.most_common(94)]).save_pretrained(model)  # the texts' commonest words
    dense_layers = [lossless_bench.DENSE_LAYERS] + [0] * (len(batches) > 1)  # drafts sparse in every layer too
    host_steps = 3 * (len(batches) > 1)  # the host timed over 3 steps of each mode (after 10 warm-up ones)
    args = argparse.Namespace(model=str(model), contexts=[512], batches=batches, tokens=8 + 8 * bool(host_steps), k=3,
                              policies=["fixed"], device="cpu", dtype="float32", kv_cache_dtype="auto", memory=0.4,
                              kv_cache_gib=None, draft_dense_layers=dense_layers, host_steps=host_steps)
    saved = []
    results = lossless_bench.real(args, saved.append)
    assert saved and saved[-1] is results
    points = results["points"]
    assert [(p["batch"], p["corpus"]) for p in points] == [(1, "book"), (1, "code"), (2, "book+code")][:len(batches) + 1]
    for point in points:
        alone = {"dense-alone"} if point["batch"] > 1 else set()
        lossless = {f"lossless-{label}-fixed{suffix}" for label in ("1/16", "1/8")
                    for suffix in ("", "-dense0")[:len(dense_layers)]}
        assert set(point["modes"]) == {"dense", "quest-1/16"} | lossless | alone
        assert all(mode["tokens_per_s"] > 0 and mode["graphs_captured_timed"] == 0  # (no graphs on the CPU)
                   and mode["rows_tokens_per_s"] > 0 and mode["rows_speedup"] > 0
                   for name, mode in point["modes"].items() if name not in alone)
        assert point["modes"]["dense"]["rows_speedup"] == 1.0
        hosted = {name for name, mode in point["modes"].items() if "host" in mode}
        assert hosted == (set(point["modes"]) - alone if host_steps else set())
        assert all(point["modes"][name]["host"]["steps"] == host_steps and point["modes"][name]["host"]["wall"] > 0
                   for name in hosted)
        if alone:  # float32: a prompt decoded alone gives the batch's tokens
            assert point["modes"]["dense-alone"]["rows_identical"] == point["batch"]
        for name in lossless:
            mode = point["modes"][name]
            assert mode["rows_identical"] == mode["rows"] == point["batch"]
            assert 0 <= mode["acceptance"] <= 1 and 1 <= mode["tokens_per_verify"] <= args.k + 1
            seen = mode["policy"]  # what the policy timed in the timed run, per batch size of its steps
            assert set(seen) <= {str(b) for b in range(1, point["batch"] + 1)} and str(point["batch"]) in seen
            assert any(name.startswith("verify-") for view in seen.values() for name in view["steps"])
            assert all(count > 0 for view in seen.values() for count in view["steps"].values())
    text = lossless_bench.table("real", {"provenance": {"command": "c", "commit": "x", "machine": "m", "date": "d"},
                                         "results": results})
    assert f"| 512 | {batches[-1]} | " in text and "rows = dense" in text and "rows running" in text
    assert ("not timed" in text) == (batches[-1] > 1)
    assert ("| 512 | 2 | book+code | lossless-1/8-fixed-dense0 | " in text) == bool(host_steps)
    assert "The speculation policy after each timed run" in text
    assert f"| 512 | {batches[-1]} | {points[-1]['corpus']} | lossless-1/16-fixed | {batches[-1]} | " in text


def test_idle_gaps_are_summed_per_pair_of_intervals_around_them():
    """Overlapping intervals leave no gap; a gap is charged to the interval that ended last before it and the one
    after; gaps under the threshold are not counted; per step."""
    spans = [(0, 10, "a"), (2, 14, "b"), (30, 40, "c"), (41, 50, "a"), (80, 90, "b"), (100, 110, "c"), (5, 12, "d")]
    gaps = idle_gaps(spans, steps=2, least_us=5.0)
    assert gaps == [{"after": "a", "before": "b", "us": 15.0, "count": 0.5},   # 50 -> 80 (40 -> 41: too short)
                    {"after": "b", "before": "c", "us": 13.0, "count": 1.0}]   # 14 -> 30 and 90 -> 100


def test_render_rewrites_a_results_table_from_its_json(tmp_path):
    record = {"provenance": {"command": "lossless_bench.py check", "commit": "abc", "machine": "GPU", "date": "today"},
              "results": {"lossless-k4/greedy": {"identical": True, "tokens_match": 40, "tokens": 40,
                                                 "acceptance": [0.5]}}}
    path = tmp_path / "lossless-check-h100.json"
    path.write_text(json.dumps(record))
    lossless_bench.render([path])
    text = path.with_suffix(".md").read_text()
    assert text == lossless_bench.table("check", record) and "| lossless-k4/greedy | True | 40/40 | [0.5] |" in text
