"""benchmarks/lossless_bench.py and its engine-step profile (benchmarks/e2e_bench.py's profile_steps) on the CPU: what
a GPU run would record, on a tiny random model, so that a fault shows here rather than on the GPU's clock."""

import random

import pytest
from transformers import LlamaConfig

from benchmarks import lossless_bench
from benchmarks.e2e_bench import profile_steps
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


def test_profile_steps_times_the_engines_phases_and_leaves_the_engine_as_it_was():
    llm = _engine(speculative_config=lossless_bench.lossless_config(3, False), async_scheduling=True)
    engine = llm.engine
    for _ in range(4):
        engine.step()
    verifies = engine.scheduler.step_tokens["verify"]
    record = profile_steps(engine, 8)
    assert engine.scheduler.step_tokens["verify"] > verifies  # the profiled steps ran a round
    assert record["steps"] == 8 and record["gpu_busy_ms"] is None and record["gpu_kernels"] == []
    assert set(record["phases_ms"]) == {"schedule", "launch", "process"}
    assert all(ms > 0 for ms in record["phases_ms"].values())
    assert sum(record["phases_ms"].values()) <= record["host_wall_ms"] * 1.01
    assert record["host_ops"] and all(op["us"] >= 0 for op in record["host_ops"])
    for owner, name in ((engine.scheduler, "schedule"), (engine.runner, "execute"), (engine, "_process")):
        assert name not in vars(owner)  # the labelled wrappers are gone
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("kernels", [True, False])
def test_the_shapes_table_shows_rounds_graphs_and_profiles(kernels):
    profile = {"steps": 10, "wall_ms": 6.0, "gpu_busy_ms": 5.0, "gpu_idle_ms": 1.0, "host_wall_ms": 5.5,
               "phases_ms": {"schedule": 0.2, "launch": 0.7, "process": 3.6},
               "host_ops": [{"name": "cudaEventSynchronize", "us": 3000.0}]}
    if kernels:  # (a run before the device-only pass has none)
        profile["gpu_kernels"] = [{"name": "_decode_split_kernel", "us": 2061.0}]
    point = {"model": "llama2-7b", "batch": 1, "context": 32768, "budget": 2048, "quantization": "int4", "k": 4,
             "draft_selection": "quest", "dense_ms": 7.7, "round_ms": 25.5,
             "implied": [{"acceptance": 0.929, "tokens_per_round": 4.43, "speedup": 1.34}],
             "dense_graph_ms": 7.7, "draft_graph_ms": 3.2, "verify_graph_ms": 10.2,
             "verify_kernels": {"top": [{"name": "_decode_split_kernel", "count": 32, "us": 6329.0}]},
             "dense_profile": profile, "round_profile": profile}
    record = {"provenance": {"command": "lossless_bench.py shapes", "commit": "abc", "machine": "GPU", "date": "today"},
              "results": {"points": [point]}}
    text = lossless_bench.table("shapes", record)
    assert "| llama2-7b int4 B=1 32k/2048 | 7.70 | 25.50 (k=4) | 1.34× (0.929) |" in text
    assert "| llama2-7b B=1 32k | lossless k=4 | 6.00 | 5.00 | 1.00 |" in text
    assert ("_decode_split_kernel 2061" in text) == kernels
    assert "0.20 / 0.70 / 3.60" in text and "cudaEventSynchronize 3000" in text
