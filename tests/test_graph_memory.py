"""benchmarks/graph_memory.py's table: a row per engine, GiB from the measured bytes (the GPU run itself is the
benchmark's; here the figures are random)."""

import random

from benchmarks import graph_memory


def test_the_table_has_a_row_per_engine_in_gib():
    engines = [{"engine": name, "graphs": random.randint(10, 200), "decode_graphs": random.randint(1, 9),
                "verify_graphs": random.randint(0, 9), "reserved_bytes": random.randint(1, 10**10),
                "allocated_bytes": random.randint(1, 10**10), "logits_rows": random.randint(1, 10**4),
                "one_output_each_bytes": random.randint(1, 10**11), "capture_s": random.uniform(0, 100)} for name in graph_memory.ENGINES]
    record = {"provenance": {"command": "graph_memory.py", "commit": "c", "machine": "m", "date": "d"},
              "results": {"model": "qwen2.5-1.5b", "max_num_seqs": 64, "max_model_len": 32768, "engines": engines}}
    rows = [line for line in graph_memory.table(record).splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + len(engines)
    for line, p in zip(rows[1:], engines):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells == [p["engine"], f"{p['graphs']} ({p['decode_graphs']} + {p['verify_graphs']})",
                         f"{p['capture_s']:.1f}",
                         f"{p['reserved_bytes'] / 2**30:.2f}", f"{p['allocated_bytes'] / 2**30:.2f}",
                         str(p["logits_rows"]), f"{p['one_output_each_bytes'] / 2**30:.2f}"]

