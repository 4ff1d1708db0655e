"""Teacher-forced agreement of an engine with another one's dense greedy tokens (issue 43: fp8 K/V against bf16 K/V).

For each text (the agreement tasks' book and code, :mod:`questkv.eval.agreement`) and length, ``--samples`` windows:
the reference engine (``--reference-kv-cache-dtype``, default ``auto``) prefills each window's context and greedily
decodes ``--tokens + 1`` tokens; the tested engine (``--kv-cache-dtype``, default ``fp8``) decodes the same tokens
fed back (``SamplingParams.forced_token_ids``) and is scored where its decode steps predict (:func:`agreement.score`):
the share of positions where its argmax is the reference's token, and the perplexity of the reference's tokens under
it. Both engines dense (no Quest), alive one after the other.

    python benchmarks/kv_agreement.py --model qwen2.5-coder-1.5b --device cuda --lengths 16384 --out-dir $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a file: the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from questkv.engine.llm import LLM  # noqa: E402
from questkv.engine.sampling_params import SamplingParams  # noqa: E402
from questkv.eval import agreement  # noqa: E402
from questkv.eval.provenance import provenance  # noqa: E402

TEXTS = {"book": "agreement_book", "code": "agreement_code"}


def measure(args) -> dict:
    results = []
    for length in args.lengths:
        common = dict(device=args.device, dtype=args.dtype, max_model_len=length + 8, max_num_seqs=args.samples)
        reference = LLM(args.model, kv_cache_dtype=args.reference_kv_cache_dtype, **common)
        contexts = {name: agreement.contexts(reference.tokenizer, agreement.load_text(task)[0], length, args.samples,
                                             args.tokens) for name, task in TEXTS.items()}
        greedy = SamplingParams(temperature=0, max_tokens=args.tokens + 1, ignore_eos=True, detokenize=False)
        wanted = {name: [list(out.token_ids) for out in reference.generate(prompts, greedy, use_tqdm=False)]
                  for name, prompts in contexts.items()}
        reference.close()
        tested = LLM(args.model, kv_cache_dtype=args.kv_cache_dtype, **common)
        for name, prompts in contexts.items():
            params = [SamplingParams(temperature=0, max_tokens=len(want), ignore_eos=True, detokenize=False,
                                     forced_token_ids=want) for want in wanted[name]]
            outs = tested.generate(prompts, params, use_tqdm=False)
            scores = [agreement.score(out.forced_choices, out.forced_logprobs, want)
                      for out, want in zip(outs, wanted[name])]
            nll = [value for _, window in scores for value in window]
            results.append({"text": name, "length": length, "windows": len(scores),
                            "agreement": statistics.mean(a for a, _ in scores),
                            "perplexity": agreement.perplexity(nll)})
            print(f"{name} {length}: agreement {results[-1]['agreement']:.4f}, ppl {results[-1]['perplexity']:.3f}",
                  flush=True)
        tested.close()
    return {"model": args.model, "reference_kv_cache_dtype": args.reference_kv_cache_dtype,
            "kv_cache_dtype": args.kv_cache_dtype, "tokens": args.tokens, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="an alias, HF folder or .gguf")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048], help="window lengths (tokens)")
    parser.add_argument("--samples", type=int, default=4, help="windows per text and length")
    parser.add_argument("--tokens", type=int, default=128, help="scored positions per window")
    parser.add_argument("--kv-cache-dtype", default="fp8", choices=("auto", "fp8"), help="the tested engine's K/V")
    parser.add_argument("--reference-kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                        help="the reference engine's K/V")
    parser.add_argument("--out-dir", type=Path, required=True, help="where the JSON and the markdown table go")
    parser.add_argument("--tag", default="cpu", help="the files' suffix")
    args = parser.parse_args()
    record = {"provenance": provenance(args.device), **measure(args)}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"kv-agreement-{args.kv_cache_dtype}-vs-{args.reference_kv_cache_dtype}-{args.tag}"
    stem.with_name(stem.name + ".json").write_text(json.dumps(record, indent=1))
    head = record["provenance"]
    lines = [f"# Teacher-forced agreement: {args.kv_cache_dtype} K/V against {args.reference_kv_cache_dtype} K/V's "
             f"greedy tokens ({args.model})", "",
             f"`{head['command']}` — commit {head['commit']}, {head['machine']}, {head['date']}", "",
             "| text | length | windows | agreement | perplexity of the reference's tokens |", "|---|---|---|---|---|"]
    lines += [f"| {r['text']} | {r['length']} | {r['windows']} | {r['agreement']:.1%} | {r['perplexity']:.3f} |"
              for r in record["results"]]
    stem.with_name(stem.name + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
