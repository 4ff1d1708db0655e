"""Where a lossless round's draft pages come from, measured by acceptance on real text (issue 42, item 5).

A lossless engine (``speculative_config``, fixed rounds of ``--k`` drafts) continues windows of the book and of code
(:mod:`questkv.eval.agreement`'s texts, ``--samples`` of each, one batch) greedily for ``--tokens`` tokens, once per
draft-page source (``SpeculativeConfig.draft_selection``): ``quest``, the round's first draft's Quest estimate and
top-K, reused by its later drafts; ``verify``, the top pages by the attention mass of the verify step before the
round. Per source and budget: acceptance (draft tokens kept over draft tokens), tokens per verify step, the share of
(draft step, sparse layer, head) that estimated and selected, and whether every output equals the dense engine's
(it must: only the speed depends on the drafts). Acceptance is what the source changes; the speed it buys is
measured on a GPU (``benchmarks/lossless_bench.py real``).

    python benchmarks/draft_selection.py --model qwen2.5-coder-1.5b --device cpu --dtype float32 --length 2048 \\
        --out-dir benchmarks/results --tag qwen2.5-coder-1.5b-2k-cpu
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a file: the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from questkv.config import QuestConfig  # noqa: E402
from questkv.engine.llm import LLM  # noqa: E402
from questkv.engine.sampling_params import SamplingParams  # noqa: E402
from questkv.eval import agreement  # noqa: E402
from questkv.eval.provenance import provenance  # noqa: E402

PAGE, DENSE_LAYERS = 16, 2
SOURCES = ("quest", "verify")


def measure(args) -> dict:
    common = dict(device=args.device, dtype=args.dtype, max_model_len=args.length + args.tokens + 4 * PAGE,
                  max_num_seqs=2 * args.samples)
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, detokenize=False)
    dense = LLM(args.model, **common)
    prompts = [prompt for task in ("agreement_book", "agreement_code")
               for prompt in agreement.contexts(dense.tokenizer, agreement.load_text(task)[0], args.length + 1,
                                                args.samples, args.tokens)]
    want = [list(out.token_ids) for out in dense.generate(prompts, greedy, use_tqdm=False)]
    dense.close()
    rows = []
    for fraction in args.fractions:
        budget = args.length // fraction
        for source in SOURCES:
            config = {"method": "quest", "num_speculative_tokens": args.k, "adaptive": False,
                      "draft_selection": source}
            llm = LLM(args.model, quest=QuestConfig(token_budget=budget, page_size=PAGE, dense_layers=DENSE_LAYERS),
                      speculative_config=config, **common)
            outs = llm.generate(prompts, greedy, use_tqdm=False)
            llm.close()
            metrics = [out.metrics for out in outs]
            per_text = {}
            for text, group in (("book", metrics[:args.samples]), ("code", metrics[args.samples:])):
                per_text[text] = statistics.mean(m.acceptance_rate for m in group)
            rows.append({
                "budget": f"1/{fraction}", "budget_tokens": budget, "source": source,
                "acceptance": statistics.mean(m.acceptance_rate for m in metrics),
                "acceptance_book": per_text["book"], "acceptance_code": per_text["code"],
                "tokens_per_verify": statistics.mean(m.mean_tokens_per_verify for m in metrics),
                "selection_rate": statistics.mean(m.selection_rate for m in metrics),
                "identical_to_dense": sum(list(out.token_ids) == w for out, w in zip(outs, want)),
                "rows": len(want),
            })
            print(json.dumps(rows[-1]), flush=True)
    return {"model": args.model, "length": args.length, "tokens": args.tokens, "k": args.k,
            "samples_per_text": args.samples, "dense_layers": DENSE_LAYERS, "page_size": PAGE, "rows": rows}


def table(record: dict) -> list[str]:
    lines = ["| budget | draft pages from | acceptance (book / code) | tokens per verify | selecting draft steps "
             "| outputs equal to dense |", "|---|---|---|---|---|---|"]
    for row in record["rows"]:
        lines.append(f"| {row['budget']} ({row['budget_tokens']} tokens) | {row['source']} | {row['acceptance']:.3f} "
                     f"({row['acceptance_book']:.3f} / {row['acceptance_code']:.3f}) | {row['tokens_per_verify']:.2f} "
                     f"| {row['selection_rate']:.3f} | {row['identical_to_dense']} of {row['rows']} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="an alias, HF folder or .gguf")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--length", type=int, default=2048, help="context tokens per window")
    parser.add_argument("--samples", type=int, default=2, help="windows per text (book, code)")
    parser.add_argument("--tokens", type=int, default=64, help="generated tokens per window")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per round (fixed)")
    parser.add_argument("--fractions", type=int, nargs="+", default=[16, 8], help="budgets: 1/F of the context")
    parser.add_argument("--out-dir", type=Path, required=True, help="where the JSON and the markdown table go")
    parser.add_argument("--tag", default="cpu", help="the files' suffix")
    args = parser.parse_args()
    record = {"provenance": provenance(args.device), **measure(args)}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"draft-selection-{args.tag}"
    stem.with_name(stem.name + ".json").write_text(json.dumps(record, indent=1))
    head = record["provenance"]
    lines = [f"# Lossless draft pages: Quest's selection against the verify step's attention ({args.model})", "",
             f"- command: `{head['command']}`", f"- commit: {head['commit']}",
             f"- machine: {head['machine']}; date: {head['date']}",
             f"- {2 * args.samples} windows ({args.samples} book, {args.samples} code) of {args.length} context tokens, "
             f"{args.tokens} greedy tokens each, one batch; fixed rounds of k = {args.k}; {args.dtype}; page "
             f"{PAGE}, {DENSE_LAYERS} dense layers", "", *table(record), ""]
    stem.with_name(stem.name + ".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
