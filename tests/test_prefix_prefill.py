"""benchmarks/prefix_prefill.py ``--smoke``: a tiny random Llama on the CPU, dense and Quest, end to end."""

import json

from benchmarks import prefix_prefill


def test_smoke_run_reports_every_tail_of_both_engines_with_the_documents_cached(tmp_path):
    assert prefix_prefill.main(["--smoke", "--out", str(tmp_path / "pp")]) == 0
    record = json.loads((tmp_path / "pp.json").read_text())
    assert set(record["engines"]) == {"dense", "quest"}
    for run in record["engines"].values():
        assert set(run["tails"]) == {"8", "24"}
        for tail, row in run["tails"].items():
            # the 96-token documents are 6 whole pages, all cached; the tail is computed
            assert row["mean_cached_tokens"] == 96 and row["prompt_tokens"] == 96 + int(tail)
            assert row["wall_ms_median"] > 0 and row["profile"]["top"]
        assert run["fresh_prompt"]["wall_ms_median"] > 0 and run["fresh_prompt"]["profile"]["top"]
    md = (tmp_path / "pp.md").read_text()
    assert "| quest | 24 | 96 |" in md and "## dense, tail 8: top kernels" in md
