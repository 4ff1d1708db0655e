"""The device memory an engine's CUDA graphs hold: every decode graph a server captures at start
(``graph_capture="startup"``), for a lossless engine with the verify graphs of every batch size, page-table width
and round length.

Random weights (``load_format="dummy"``) at a real shape, a small KV pool; per engine (dense, Quest, lossless Quest)
the graphs captured, the seconds their capture takes (a server's start; a kernel compiles on its first use in the
process, so an engine after another captures faster), the bytes the process reserves from the GPU across their
capture (``torch.cuda.memory_reserved``; a graph pool keeps its blocks) and the bytes still allocated after it, and the
logits outputs alone (``[rows, vocab]`` float32 per graph) as a reference: what the graphs would hold with one output
each. On the CPU (no graphs) it only checks that it runs.

    python benchmarks/graph_memory.py --model qwen2.5-1.5b --max-num-seqs 64 --out-dir $OUT --tag h200
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

if __name__ == "__main__":  # run as a file: the checkout importable (questkv, benchmarks.*)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.e2e_bench import context_config  # noqa: E402
from questkv.config import QuestConfig  # noqa: E402
from questkv.decode.route import StepRoute  # noqa: E402
from questkv.engine.llm import LLM  # noqa: E402
from questkv.eval.provenance import provenance  # noqa: E402

PAGE = 16
ENGINES = ("dense", "quest", "lossless")


def measure(engine: str, args) -> dict:
    """Build the ``engine`` kind at ``args``' shape with lazy capture, then capture what the startup capture
    captures (lossless: its verify and mixed graphs too) and measure what they hold."""
    cfg = context_config(args.model, args.max_model_len)
    quest = None if engine == "dense" else QuestConfig(token_budget=args.budget, page_size=PAGE, dense_layers=2)
    speculative = {"method": "quest", "num_speculative_tokens": args.k} if engine == "lossless" else None
    device = torch.device(args.device)
    llm = LLM(cfg, load_format="dummy", dtype="bfloat16", device=args.device, max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_model_len, kv_cache_memory=2 << 30, quest=quest,
              speculative_config=speculative)
    runner = llm.engine.runner
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    reserved, allocated = _memory(cuda)
    keys = runner.graphs.missing()  # what the startup capture captures; lossless: every round length's verify too
    began = time.perf_counter()
    runner.capture_decode_graphs()
    if cuda:
        torch.cuda.synchronize()
    capture_s = time.perf_counter() - began
    if len(runner.graphs) != len(keys):
        raise RuntimeError(f"captured {len(runner.graphs)} graphs, expected {len(keys)}")
    verify_keys = [key for key in keys if key[2] == StepRoute.VERIFY]  # (batch, width, route, q_len)
    rows = sum(key[0] * (key[3] if key[2] == StepRoute.VERIFY else 1) for key in keys)
    after_reserved, after_allocated = _memory(cuda)
    record = {"engine": engine, "graphs": len(runner.graphs), "decode_graphs": len(keys) - len(verify_keys),
              "verify_graphs": len(verify_keys), "reserved_bytes": after_reserved - reserved,
              "allocated_bytes": after_allocated - allocated, "logits_rows": rows,
              "one_output_each_bytes": rows * cfg.vocab_size * 4, "capture_s": capture_s}
    llm.close()
    del llm, runner
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return record


def _memory(cuda: bool) -> tuple[int, int]:
    return (torch.cuda.memory_reserved(), torch.cuda.memory_allocated()) if cuda else (0, 0)


def table(record: dict) -> str:
    head, res = record["provenance"], record["results"]
    lines = [f"# CUDA graph memory: {res['model']}, max_num_seqs {res['max_num_seqs']}, {res['max_model_len']} "
             f"tokens", "", f"`{head['command']}` — commit {head['commit']}, {head['machine']}, {head['date']}", "",
             "| engine | graphs (decode + verify) | capture s | GiB reserved across the captures | GiB allocated after "
             "| logits rows | GiB of logits at one output per graph |", "|---|---|---|---|---|---|---|"]
    for p in res["engines"]:
        lines.append(f"| {p['engine']} | {p['graphs']} ({p['decode_graphs']} + {p['verify_graphs']}) | "
                     f"{p['capture_s']:.1f} | {p['reserved_bytes'] / 2**30:.2f} | {p['allocated_bytes'] / 2**30:.2f} | "
                     f"{p['logits_rows']} | {p['one_output_each_bytes'] / 2**30:.2f} |")
    return "\n".join(lines + [""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-1.5b", help="a shape of questkv.models.shapes (random weights)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="the engines' max_num_seqs")
    parser.add_argument("--max-model-len", type=int, default=32768, help="the engines' max_model_len")
    parser.add_argument("--budget", type=int, default=2048, help="Quest's token budget")
    parser.add_argument("--k", type=int, default=4, help="the lossless engine's num_speculative_tokens")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES, help="the engines measured")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke run (no graphs)")
    parser.add_argument("--out-dir", type=Path, required=True, help="where the JSON and the markdown table go")
    parser.add_argument("--tag", default="h200", help="the files' suffix: graph-memory-TAG.{json,md}")
    args = parser.parse_args()
    results = {"model": args.model, "max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len,
               "budget": args.budget, "k": args.k, "engines": [measure(engine, args) for engine in args.engines]}
    record = {"provenance": provenance(args.device), "results": results}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"graph-memory-{args.tag}.json").write_text(json.dumps(record, indent=1))
    (args.out_dir / f"graph-memory-{args.tag}.md").write_text(table(record))
    print(table(record))


if __name__ == "__main__":
    main()
