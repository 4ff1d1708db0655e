"""benchmarks/mixed_step.py ``--smoke``: the whole sequence on a tiny random Llama on the CPU, and its report."""

import json

from benchmarks import mixed_step


def test_smoke_run_times_prompts_alone_decodes_and_mixed_steps_and_reports_them(tmp_path):
    assert mixed_step.main(["--smoke", "--out", str(tmp_path / "ms")]) == 0
    data = json.loads((tmp_path / "ms.json").read_text())
    chunks = -(-data["settings"]["prompt_tokens"] // data["settings"]["chunk"])
    assert [kind for kind, _ in data["alone"]][:chunks] == ["prefill"] * chunks
    assert [kind for kind, _ in data["decode"]] == ["decode"] * mixed_step.DECODE_STEPS
    assert [kind for kind, _ in data["mixed"]] == ["mixed"] * chunks
    assert data["decode_median_ms"] > 0 and all(ms > 0 for _, ms in data["mixed"])
    md = (tmp_path / "ms.md").read_text()
    assert f"| {chunks} |" in md and "Kernels of chunk 3's step, mixed" in md
    mixed_step.main(["--render", str(tmp_path / "ms.json")])
    assert (tmp_path / "ms.md").read_text() == md
