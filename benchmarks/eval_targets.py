"""Check a `questkv eval` sweep against the evaluation issue's targets; writes JSON + markdown.

Targets (higher accuracy is better, lower perplexity is better):
1. Quest >= every eviction policy (streaming, h2o, tova) at every budget <= 1/8 of the context.
2. Quest within 1 sample of full attention on the NIAH tasks at a budget of 1/16 of the context.
3. quest-topp reaches fixed-K Quest's score with <= 1/2 of K as its mean budget: for every Quest cell
   at budget K, some quest-topp cell of the same task and length with mean budget used <= K/2 scores
   at least as well.
Cells where full attention itself scores <= 10 % carry no signal (the model cannot do the task); they
are listed apart and not counted.

``--page-policies-from PATH`` takes the page-selection policies' cells (quest, quest-topp, oracle) only
from PATH (e.g. a sweep at another page size) and everything else (full attention, the eviction
policies, which do not depend on the page size) from the main JSONs: same prompts, other pages.

    python benchmarks/eval_targets.py benchmarks/results/eval-accuracy-smollm2-135m.json \
        benchmarks/results/eval-ppl-smollm2-135m.json --out benchmarks/results/eval-targets-smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EVICTION = ("streaming", "h2o", "tova")
NIAH = ("niah_single", "niah_single_essay", "niah_multikey", "niah_uuid")
NO_SIGNAL = 0.10
PAGE_POLICIES = ("quest", "quest-topp", "oracle")


def better_or_equal(metric: str, a: float, b: float) -> bool:
    return a <= b if metric == "ppl" else a >= b


def check(cells: list[dict]) -> dict:
    index = {(c["task"], c["length"], c["policy"], c["budget"]): c for c in cells}
    groups = sorted({(c["task"], c["length"]) for c in cells}, key=lambda g: (g[0], g[1]))
    rows = {"quest_vs_eviction": [], "quest_vs_full_niah": [], "topp_half_budget": [], "no_signal": []}
    for task, length in groups:
        full = index.get((task, length, "full", None))
        metric = full["metric"] if full else "accuracy"
        if full is not None and metric == "accuracy" and full["value"] <= NO_SIGNAL:
            rows["no_signal"].append({"task": task, "length": length, "full": full["value"]})
            continue
        quest = {c["budget"]: c for c in cells if (c["task"], c["length"], c["policy"]) == (task, length, "quest")}
        for budget, q in sorted(quest.items()):
            if budget <= length // 8:
                for policy in EVICTION:
                    other = index.get((task, length, policy, budget))
                    if other is not None:
                        rows["quest_vs_eviction"].append({
                            "task": task, "length": length, "budget": budget, "policy": policy,
                            "quest": q["value"], "other": other["value"],
                            "met": better_or_equal(metric, q["value"], other["value"]),
                        })
            if task in NIAH and budget == length // 16 and full is not None:
                gap = (full["value"] - q["value"]) * full["samples"]
                rows["quest_vs_full_niah"].append({
                    "task": task, "length": length, "budget": budget, "quest": q["value"], "full": full["value"],
                    "samples_behind": round(gap, 3), "met": gap <= 1 + 1e-9,
                })
            topp = [
                c for c in cells
                if (c["task"], c["length"], c["policy"]) == (task, length, "quest-topp")
                and c["mean_tokens_attended"] is not None and c["mean_tokens_attended"] <= budget / 2
            ]
            best = None
            for c in topp:
                if best is None or better_or_equal(metric, c["value"], best["value"]):
                    best = c
            rows["topp_half_budget"].append({
                "task": task, "length": length, "quest_budget": budget, "quest": q["value"],
                "topp_best_within_half": None if best is None else best["value"],
                "topp_cap": None if best is None else best["budget"],
                "topp_mean_budget": None if best is None else round(best["mean_tokens_attended"], 1),
                "met": best is not None and better_or_equal(metric, best["value"], q["value"]),
            })
    summary = {name: {"met": sum(r["met"] for r in items), "total": len(items)}
               for name, items in rows.items() if name != "no_signal"}
    summary["quest_vs_eviction"]["met_with_both_zero"] = sum(
        r["met"] and r["quest"] == 0 and r["other"] == 0 for r in rows["quest_vs_eviction"]
    )
    return {"summary": summary, **rows}


def fmt(value, metric_is_ppl: bool) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if metric_is_ppl else f"{value:.0%}"


def markdown(result: dict, command: str) -> str:
    lines = ["# Evaluation targets", "", f"- command: `{command}`", ""]
    s = result["summary"]
    lines += [
        "| target | met | cells |", "|---|---:|---:|",
        f"| Quest >= every eviction policy at budget <= 1/8 context (of the met: both at 0 %: "
        f"{s['quest_vs_eviction']['met_with_both_zero']}) | {s['quest_vs_eviction']['met']} | {s['quest_vs_eviction']['total']} |",
        f"| Quest within 1 sample of full on NIAH at 1/16 context | {s['quest_vs_full_niah']['met']} | {s['quest_vs_full_niah']['total']} |",
        f"| quest-topp >= Quest@K with mean budget <= K/2 | {s['topp_half_budget']['met']} | {s['topp_half_budget']['total']} |",
        "",
        "Without signal (full attention <= 10 %, not counted): "
        + (", ".join(f"{r['task']}@{r['length']} (full {r['full']:.0%})" for r in result["no_signal"]) or "none"),
        "",
        "## Quest vs eviction (budget <= 1/8 context)", "",
        "| task | length | budget | policy | quest | other | met |", "|---|---:|---:|---|---:|---:|---|",
    ]
    for r in result["quest_vs_eviction"]:
        ppl = r["task"] == "ppl"
        lines.append(f"| {r['task']} | {r['length']} | {r['budget']} | {r['policy']} | {fmt(r['quest'], ppl)} | "
                     f"{fmt(r['other'], ppl)} | {'yes' if r['met'] else 'no'} |")
    lines += ["", "## Quest vs full on NIAH at 1/16 context", "",
              "| task | length | budget | quest | full | samples behind | met |", "|---|---:|---:|---:|---:|---:|---|"]
    for r in result["quest_vs_full_niah"]:
        lines.append(f"| {r['task']} | {r['length']} | {r['budget']} | {r['quest']:.0%} | {r['full']:.0%} | "
                     f"{r['samples_behind']:g} | {'yes' if r['met'] else 'no'} |")
    lines += ["", "## quest-topp at half the budget", "",
              "| task | length | Quest K | Quest | best quest-topp with mean budget <= K/2 | its cap | its mean budget | met |",
              "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in result["topp_half_budget"]:
        ppl = r["task"] == "ppl"
        lines.append(f"| {r['task']} | {r['length']} | {r['quest_budget']} | {fmt(r['quest'], ppl)} | "
                     f"{fmt(r['topp_best_within_half'], ppl)} | {r['topp_cap'] or '-'} | {r['topp_mean_budget'] or '-'} | "
                     f"{'yes' if r['met'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json", nargs="+", help="result JSONs of `questkv eval`")
    parser.add_argument("--out", required=True, help="output path without suffix (writes .json and .md)")
    parser.add_argument("--page-policies-from", metavar="PATH",
                        help="take quest, quest-topp and oracle cells only from this JSON (see the module docstring)")
    args = parser.parse_args()
    cells = []
    for path in args.json:
        with open(path) as handle:
            cells += json.load(handle)["cells"]
    if args.page_policies_from:
        cells = [c for c in cells if c["policy"] not in PAGE_POLICIES]
        with open(args.page_policies_from) as handle:
            cells += [c for c in json.load(handle)["cells"] if c["policy"] in PAGE_POLICIES]
    result = check(cells)
    command = "python " + " ".join(sys.argv)
    out = Path(args.out)
    sources = args.json + ([args.page_policies_from] if args.page_policies_from else [])
    out.with_suffix(".json").write_text(json.dumps({"command": command, "sources": sources, **result}, indent=1))
    out.with_suffix(".md").write_text(markdown(result, command))
    print(markdown(result, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
