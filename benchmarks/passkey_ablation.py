"""Why does Quest miss the passkey on a small model? Page selectors and settings side by side.

Same prompts, keys and protocol as ``questkv eval passkey`` (dense prefill, question tail decoded one
token at a time, 10 greedy tokens), on the first ``--trials`` trials of its depth order, with
variants of the sparse layers' attention:

* ``quest``: Quest selection (``QuestConfig`` with the variant's page size / sink / recent pages);
* ``oracle``: the top pages by the true attention mass (``questkv.policies`` ``oracle``), the
  upper bound of any page selector at that budget.

Writes ``passkey-ablation-<model>-<length>.json`` + ``.md`` and prints the table last.

Usage::

    python benchmarks/passkey_ablation.py --length 4096 --trials 5
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm.auto import tqdm

if __name__ == "__main__":  # run as a file: the checkout importable (questkv, benchmarks.*)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import questkv  # noqa: E402
from questkv.eval import passkey  # noqa: E402
from questkv.eval import harness  # noqa: E402
from questkv.integrations.hf import enable  # noqa: E402
from questkv.policies import make_policy  # noqa: E402
from questkv.eval.provenance import provenance  # noqa: E402

# name: (selector, token_budget, QuestConfig options)
VARIANTS = {
    "quest 256": ("quest", 256, {}),
    "quest 512": ("quest", 512, {}),
    "quest 256, 1 sink + 1 recent page": ("quest", 256, {"sink_pages": 1, "recent_pages": 1}),
    "quest 256, page 8": ("quest", 256, {"page_size": 8}),
    "quest 256, page 4": ("quest", 256, {"page_size": 4}),
    "oracle 256": ("oracle", 256, {}),
    "oracle 512": ("oracle", 512, {}),
}


def run(model, tokenizer, length: int, trials: int, seed: int) -> dict:
    depths = passkey.trial_depths(10)
    hits: dict[str, list[bool]] = {name: [] for name in VARIANTS}
    records = []
    bar = tqdm(total=trials * len(VARIANTS), desc="ablation", unit="run")
    for trial in passkey.spread_order(10)[:trials]:
        key = passkey.trial_key(seed, length, trial)
        context, tail = passkey.split_tail(tokenizer, passkey.build_prompt(tokenizer, length, depths[trial], key))
        prefills = {}
        for name, (selector, budget, options) in VARIANTS.items():
            config = questkv.QuestConfig(token_budget=budget, **options)
            if config.page_size not in prefills:
                enable(model, config)
                prefills[config.page_size] = harness.prefill(model, [context], config.page_size)
            if selector == "oracle":
                enable(model, make_policy("oracle", budget, config.page_size), dense_layers=config.dense_layers)
            else:
                enable(model, config)
            cache, next_positions = prefills[config.page_size]
            answer = harness.decode_greedy(
                model, harness.snapshot(cache), next_positions, [tail], [passkey.ANSWER_TOKENS], tokenizer.eos_token_id
            )[0]
            output = tokenizer.decode(answer, skip_special_tokens=True)
            correct = passkey.is_correct(output, key)
            hits[name].append(correct)
            records.append({"variant": name, "trial": trial, "depth": depths[trial], "key": key,
                            "output": output, "correct": correct})
            bar.update(1)
    bar.close()
    results = [{"variant": name, "correct": sum(h), "trials": len(h)} for name, h in hits.items()]
    return {"results": results, "trials": records}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="model alias or path (default: smollm2-135m)")
    parser.add_argument("--length", type=int, default=4096, help="prompt tokens (default: 4096)")
    parser.add_argument("--trials", type=int, default=5, help="first trials of questkv eval passkey's 10 (default: 5)")
    parser.add_argument("--seed", type=int, default=0, help="passkey seed, as in questkv eval passkey (default: 0)")
    parser.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args()
    model, tokenizer = questkv.load_model(args.model, device="cpu", dtype="bfloat16")
    info = {
        **provenance("cpu", command="python " + " ".join(sys.argv)),
        "model": args.model,
        "length": args.length,
        "dense_layers": 2,
        "selection": "kv_head",
    }
    document = {**info, **run(model, tokenizer, args.length, args.trials, args.seed)}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"passkey-ablation-{args.model}-{args.length}"
    (out / f"{stem}.json").write_text(json.dumps(document, indent=2))
    lines = [
        f"# Passkey ablation: {args.model}, {args.length} tokens",
        "",
        f"- command: `{info['command']}`",
        f"- commit: `{info['commit']}`, date: {info['date']}, {info['machine']}",
        "- page 16, dense_layers 2, kv_head selection (group sum) unless the variant says otherwise; bf16",
        "",
        "| variant | correct |",
        "|---|---|",
        *[f"| {r['variant']} | {r['correct']}/{r['trials']} |" for r in document["results"]],
    ]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
