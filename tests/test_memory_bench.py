"""benchmarks/memory_bench.py's table: every row's weights and KV tokens, and its KV tokens against bf16's at the same
max_num_seqs (the GPU run itself is the benchmark's; here the figures are random)."""

import random

from benchmarks import memory_bench


def test_the_table_has_a_row_per_engine_and_the_kv_ratio_to_bf16_at_the_same_batch():
    rows = [{"config": name, "max_num_seqs": seqs, "weight_bytes": random.randint(1, 10**10),
             "kv_cache_bytes": random.randint(1, 10**11),
             "kv_tokens": random.randint(1000, 10**6)} for seqs in (1, 16) for name in memory_bench.CONFIGS]
    record = {"provenance": {"command": "memory_bench.py"}, "model": "llama3.1-8b", "max_model_len": 4096,
              "gpu_memory_utilization": 0.9, "rows": rows}
    lines = memory_bench.render(record).splitlines()
    table = [line for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert len(table) == len(rows)
    for line, row in zip(table, rows):
        base = next(r for r in rows if r["config"] == "bf16" and r["max_num_seqs"] == row["max_num_seqs"])
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[:2] == [row["config"], str(row["max_num_seqs"])]
        assert cells[2] == f"{row['weight_bytes'] / 1e9:.2f}" and cells[5] == f"{row['kv_tokens']:,}"
        assert cells[6] == f"{row['kv_tokens'] / base['kv_tokens']:.2f}×"
