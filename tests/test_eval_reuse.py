"""benchmarks/eval_reuse.py: the GPU sweeps of issue 26 run end to end on the CPU (a tiny random model, tiny
lengths, through ``questkv eval sweep``), and the device calls it prints."""

import json
import random
from pathlib import Path

import pytest

from benchmarks import eval_reuse


def test_every_sweep_runs_on_a_tiny_model_on_the_cpu(tmp_path):
    paths = eval_reuse.smoke(tmp_path)
    assert [p.stem for p in paths] == list(eval_reuse.SWEEPS)
    documents = {p.stem: json.loads(p.read_text()) for p in paths}
    reuse = documents["eval-reuse-qwen2.5-coder-1.5b-16k"]
    policies = eval_reuse.POLICIES.split(",")
    budgets = {"full": [None]} | {p: [16, 32] for p in policies[1:]}
    expected = {(task, p, b) for task in eval_reuse.TASKS.split(",") for p in policies for b in budgets[p]}
    assert {(c["task"], c["policy"], c["budget"]) for c in reuse["cells"]} == expected
    assert [c["run"] for c in reuse["cells"]].count(0) == 3 * 3  # (a): 3 tasks x full, quest@16, quest@32
    for document in documents.values():
        assert all(c["backend"] == "engine" and c["preemptions"] == 0 for c in document["cells"])
    agreement = documents["eval-agreement-qwen2.5-coder-1.5b-16k"]
    assert {c["metric"] for c in agreement["cells"]} == {"agreement"} and len(agreement["cells"]) == 2 * 9
    assert set(agreement["agreement_texts"]) == {"agreement_book", "agreement_code"}
    assert {c["metric"] for c in documents["eval-reuse-ppl-qwen2.5-coder-1.5b-32k"]["cells"]} == {"ppl"}
    assert {c["length"] for c in documents["eval-reuse-qwen2.5-coder-1.5b-32k"]["cells"]} == {256}
    policies = set(eval_reuse.SELECTION_POLICIES.split(","))
    cells = documents["eval-selection-agreement-qwen2.5-coder-1.5b-16k"]["cells"]
    assert {c["policy"] for c in cells} == policies and {c["metric"] for c in cells} == {"agreement"}
    cells = documents["eval-selection-qwen2.5-coder-1.5b-16k"]["cells"]
    assert {c["policy"] for c in cells} == policies and len({c["task"] for c in cells}) == 5
    reusing = [c for c in documents["eval-reuse-ppl-qwen2.5-coder-1.5b-32k"]["cells"]
               if "selection_interval" in c["policy"]]  # 8 scored tokens: 8 decode steps, selecting every C
    assert reusing and all(0 < c["selection_rate"] < 1 for c in reusing)
    for name in ("eval-lowbit-qwen2.5-coder-1.5b-16k", "eval-lowbit-ppl-qwen2.5-coder-1.5b-32k"):  # rounded at load
        assert documents[name]["spec"]["quantization"] == "int8" and documents[name]["cells"]
    # A resumed run skips an invocation only when its file holds every cell the invocation makes.
    paths = {p.stem: p for p in paths}
    for name, runs in eval_reuse.SWEEPS.items():
        assert all(eval_reuse.is_complete(paths[name], eval_reuse.smoke_args(args)) for args in runs)
    document = documents["eval-selection-qwen2.5-coder-1.5b-16k"]
    document["cells"].pop(random.randrange(len(document["cells"])))
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps(document))
    (args,) = eval_reuse.SWEEPS["eval-selection-qwen2.5-coder-1.5b-16k"]
    assert not eval_reuse.is_complete(partial, eval_reuse.smoke_args(args))
    assert not eval_reuse.is_complete(None, args)


def test_the_device_calls_run_each_sweep_through_gpu_eval():
    calls = eval_reuse.commands("abc123")
    assert len(calls) == sum(len(runs) for runs in eval_reuse.SWEEPS.values())
    assert calls[0].startswith("python3 benchmarks/gpu_eval.py sweep qwen2.5-coder-1.5b "
                               "eval-lowbit-qwen2.5-coder-1.5b-16k --commit abc123 -- --device cuda")
    assert "--quantization gguf" in calls[0]
    assert all(call.endswith(" | []") for call in calls)
    assert eval_reuse.smoke_args(["--lengths", "16384", "--budgets", "1024,2048"])[:4] == [
        "--lengths", "192", "--budgets", "16,32"]


def test_run_takes_only_the_named_results_files_and_rejects_unknown_names(monkeypatch):
    ran = []

    class FakeGpuEval:
        WORK = Path("/nonexistent")

        @staticmethod
        def sweep(alias, name, commit, left, resume, args):
            ran.append((name, resume))
            return 0

    monkeypatch.setattr(eval_reuse, "_gpu_eval", lambda: FakeGpuEval)
    name = "eval-reuse-qwen2.5-coder-1.5b-32k"
    assert eval_reuse.run("abc123", 600, resume_from="", only=[name]) == 0
    assert ran == [(name, "")] * len(eval_reuse.SWEEPS[name])
    with pytest.raises(ValueError, match="--only: eval-nothing not among the results files: eval-lowbit-qwen2.5"):
        eval_reuse.run("abc123", 600, only=["eval-nothing", name])
    assert len(ran) == len(eval_reuse.SWEEPS[name])  # nothing ran for the bad call
