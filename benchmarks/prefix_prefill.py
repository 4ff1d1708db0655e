"""Prefill after a prefix-cache hit on a GPU: the time to first token of a batch of requests whose prompts start
with cached documents, engine dense vs Quest, and where that step's time goes.

The multi-turn serving load (``serve_load.py --workload multi-turn``) spends its turns >= 2 on exactly this: 16
requests, each a cached 32k document plus a tail of new tokens (dense caches the earlier answers too, so its tail is
the new question; Quest's pages written by sparse decode are not shared, so its tail holds the last answer as
well). Per engine: the documents are prefilled once (their pages cached), then for each tail length a batch of
``--requests`` fresh prompts (document ``i % docs`` + random tail) is generated for one token: wall time (median of
``--repeats``), the tokens the prefix cache covered, and a torch-profiler table of that step's host and GPU time by
kernel (one more batch, profiled); and a fresh prompt of a document's length alone (no hit), prefilled in the
engine's default chunks, timed and profiled the same way (against the one-step prefill ``e2e_bench.py`` times). Random ("dummy") weights at a real shape, bf16, page 16::

    python benchmarks/prefix_prefill.py --out benchmarks/results/prefix-prefill-h200

``--smoke`` runs a tiny model on the CPU (what the test runs). Results: ``<out>.json`` (with provenance) and
``<out>.md``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

if __name__ == "__main__":  # run as a file: the checkout importable (questkv, benchmarks.*)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from questkv.config import QuestConfig  # noqa: E402
from questkv.engine.llm import LLM  # noqa: E402
from questkv.engine.sampling_params import SamplingParams  # noqa: E402
from questkv.eval.provenance import provenance  # noqa: E402
from questkv.models.shapes import dummy_config  # noqa: E402

FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _batch(docs: list[list[int]], requests: int, tail: int, vocab: int, gen: torch.Generator) -> list[list[int]]:
    return [docs[i % len(docs)] + torch.randint(0, vocab, (tail,), generator=gen).tolist() for i in range(requests)]


def _profile(llm: LLM, prompts: list[list[int]], device: str, top: int) -> dict:
    """Host wall time and the profiler's kernels (device time, or CPU op time on the CPU) of one batch."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        llm.generate(prompts, FIRST_TOKEN, use_tqdm=False)
        _sync(device)
        wall = time.perf_counter() - start
    attr = "device_time_total" if device == "cuda" else "self_cpu_time_total"
    rows = [e for e in prof.key_averages() if getattr(e, attr) > 0 and (device != "cuda" or e.device_type.name == "CUDA")]
    rows.sort(key=lambda e: getattr(e, attr), reverse=True)
    total = sum(getattr(e, attr) for e in rows)
    return {"wall_ms": wall * 1e3, "device_ms" if device == "cuda" else "cpu_op_ms": total / 1e3,
            "top": [{"name": e.key[:120], "count": e.count, "ms": getattr(e, attr) / 1e3} for e in rows[:top]]}


def measure(cfg, quest, args, gen: torch.Generator) -> dict:
    llm = LLM(cfg, quest=quest, load_format="dummy", device=args.device, dtype=args.dtype,
              max_num_seqs=max(args.requests, args.docs), max_model_len=args.doc_tokens + max(args.tails) + 64,
              seed=0)
    docs = [torch.randint(0, cfg.vocab_size, (args.doc_tokens,), generator=gen).tolist() for _ in range(args.docs)]
    start = time.perf_counter()
    llm.generate(docs, FIRST_TOKEN, use_tqdm=False)
    _sync(args.device)
    out = {"docs_prefill_s": time.perf_counter() - start, "tails": {}}
    walls = []
    for _ in range(args.repeats + 1):  # a fresh prompt: no hit, chunked by the engine's default policy
        prompt = torch.randint(0, cfg.vocab_size, (args.doc_tokens,), generator=gen).tolist()
        _sync(args.device)
        start = time.perf_counter()
        llm.generate([prompt], FIRST_TOKEN, use_tqdm=False)
        _sync(args.device)
        walls.append(time.perf_counter() - start)
    fresh = [torch.randint(0, cfg.vocab_size, (args.doc_tokens,), generator=gen).tolist()]
    out["fresh_prompt"] = {"wall_ms_median": statistics.median(walls[1:]) * 1e3, "wall_ms": [w * 1e3 for w in walls[1:]],
                           "chunk_tokens": llm.engine.scheduler.max_num_batched_tokens,
                           "profile": _profile(llm, fresh, args.device, args.top)}
    print(f"  fresh prompt of {args.doc_tokens}: {out['fresh_prompt']['wall_ms_median']:.1f} ms", flush=True)
    for tail in args.tails:
        walls, cached = [], None
        for _ in range(args.repeats + 1):  # the first warms up (graphs, allocator)
            prompts = _batch(docs, args.requests, tail, cfg.vocab_size, gen)
            _sync(args.device)
            start = time.perf_counter()
            outs = llm.generate(prompts, FIRST_TOKEN, use_tqdm=False)
            _sync(args.device)
            walls.append(time.perf_counter() - start)
            cached = [o.metrics.num_cached_tokens for o in outs]
        row = {"wall_ms_median": statistics.median(walls[1:]) * 1e3, "wall_ms": [w * 1e3 for w in walls[1:]],
               "mean_cached_tokens": statistics.mean(cached), "prompt_tokens": args.doc_tokens + tail,
               "profile": _profile(llm, _batch(docs, args.requests, tail, cfg.vocab_size, gen), args.device, args.top)}
        out["tails"][str(tail)] = row
        print(f"  tail {tail}: {row['wall_ms_median']:.1f} ms for {args.requests} requests, cached "
              f"{row['mean_cached_tokens']:.0f} of {row['prompt_tokens']}", flush=True)
    del llm
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


def render(record: dict) -> str:
    prov, a = record["provenance"], record["args"]
    lines = ["# Prefill after a prefix-cache hit: engine dense vs Quest", "",
             f"- command: `{prov.get('command', '?')}`", f"- commit: `{prov.get('commit', '?')}`",
             f"- machine: {prov.get('machine', '?')}; date: {prov.get('date', '?')}", "",
             f"{a['model']} (random weights), {a['dtype']}, page 16; {a['docs']} documents of {a['doc_tokens']} tokens "
             f"prefilled once, then batches of {a['requests']} requests (document i % {a['docs']} + a random tail) "
             f"generating one token; wall = median of {a['repeats']} batches after one warm-up.", "",
             "| engine | tail tokens | cached tokens (mean) | batch wall ms | profiled wall ms | kernel ms |",
             "|---|---|---|---|---|---|"]
    for name, run in record["engines"].items():
        for tail, row in run["tails"].items():
            prof = row["profile"]
            kernel = prof.get("device_ms", prof.get("cpu_op_ms"))
            lines.append(f"| {name} | {tail} | {row['mean_cached_tokens']:.0f} | {row['wall_ms_median']:.1f} | "
                         f"{prof['wall_ms']:.1f} | {kernel:.1f} |")
    lines += ["", f"A fresh prompt of {a['doc_tokens']} tokens alone (no hit), prefilled in the engine's chunks:", "",
              "| engine | chunk tokens | wall ms | profiled wall ms | kernel ms |", "|---|---|---|---|---|"]
    for name, run in record["engines"].items():
        fresh = run["fresh_prompt"]
        kernel = fresh["profile"].get("device_ms", fresh["profile"].get("cpu_op_ms"))
        lines.append(f"| {name} | {fresh['chunk_tokens']} | {fresh['wall_ms_median']:.1f} | "
                     f"{fresh['profile']['wall_ms']:.1f} | {kernel:.1f} |")
    for name, run in record["engines"].items():
        fresh = run["fresh_prompt"]["profile"]["top"]
        lines += ["", f"## {name}, fresh prompt: top kernels", "", "| kernel | calls | ms |", "|---|---|---|"]
        lines += [f"| `{k['name']}` | {k['count']} | {k['ms']:.2f} |" for k in fresh]
        for tail, row in run["tails"].items():
            lines += ["", f"## {name}, tail {tail}: top kernels of the profiled batch", "", "| kernel | calls | ms |",
                      "|---|---|---|"]
            lines += [f"| `{k['name']}` | {k['count']} | {k['ms']:.2f} |" for k in row["profile"]["top"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3.1-8b", help="a questkv.models.shapes name (default: llama3.1-8b)")
    parser.add_argument("--docs", type=int, default=4, help="distinct cached documents (default: 4)")
    parser.add_argument("--doc-tokens", type=int, default=32768, help="tokens per document (default: 32768)")
    parser.add_argument("--requests", type=int, default=16, help="requests per batch (default: 16)")
    parser.add_argument("--tails", default="48,544", help="comma list of new tokens after the document (default: "
                        "48,544: dense's and Quest's tails in the multi-turn load)")
    parser.add_argument("--budget", type=int, default=2048, help="the Quest engine's token budget (default: 2048)")
    parser.add_argument("--repeats", type=int, default=3, help="timed batches per tail (default: 3)")
    parser.add_argument("--top", type=int, default=12, help="kernels listed per profile (default: 12)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="default: cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="default: bfloat16")
    parser.add_argument("--smoke", action="store_true", help="a tiny random model on the CPU, short documents")
    parser.add_argument("--out", type=Path, required=True, help="write <out>.json and <out>.md")
    args = parser.parse_args(argv)
    if args.smoke:
        args.device, args.dtype, args.docs, args.doc_tokens, args.requests, args.repeats = "cpu", "float32", 2, 96, 3, 1
        args.tails, args.budget, args.model = "8,24", 32, "tiny random Llama (smoke)"
    try:
        args.tails = [int(t) for t in args.tails.split(",")]
    except ValueError:
        parser.error(f"--tails takes comma-separated ints, got {args.tails!r}")
    for name in ("docs", "doc_tokens", "requests", "repeats", "budget"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(t < 1 for t in args.tails):
        parser.error(f"--tails must be >= 1 each, got {args.tails}")
    if args.smoke:
        from transformers import LlamaConfig
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    else:
        cfg = dummy_config(args.model, max_position_embeddings=args.doc_tokens + max(args.tails) + 64)
    record = {"provenance": provenance(args.device), "args": {**vars(args), "out": str(args.out)}, "engines": {}}
    gen = torch.Generator().manual_seed(0)
    for name, quest in (("dense", None), ("quest", QuestConfig(token_budget=args.budget, page_size=16))):
        print(f"[{name}]", flush=True)
        record["engines"][name] = measure(cfg, quest, args, gen)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    args.out.with_suffix(".md").write_text(render(record))
    print(render(record).split("\n## ")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
