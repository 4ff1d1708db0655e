"""Check `questkv eval` sweeps against the accuracy issue's targets; writes JSON + markdown.

Targets (higher accuracy is better, lower perplexity is better), for the selector under test
(``--selector``, default plain ``quest``):

1. retrieval (passkey, niah_single, their essay variants, niah_multikey, niah_uuid): within 1 sample of
   full attention at a budget of 1/16 of the context;
2. aggregation (vt, cwe, fwe): within 10 points of full attention at 1/8 of the context;
3. perplexity at 1/8 of the context within 1 % of full attention's;
4. plain Quest >= every eviction policy (streaming, h2o, tova) at every budget <= 1/8 of the context;
5. quest-topp (any options) reaches fixed-K Quest's score with a mean budget <= K/2.

Cells where full attention itself scores <= 10 % carry no signal (the model cannot do the task); they
are listed apart and not counted. A target cell whose inputs were not run is listed as missing.
A cell found in two inputs counts once if its scores are the same in both (a repeat run) and stops
the check if not. Every cell of the inputs, with the fraction of the full KV bytes it read per decode step, is tabled last.

``--page-policies-from PATH`` takes the page-selection policies' cells (quest, quest-topp, oracle and
their variants) only from PATH (e.g. a sweep at another page size) and everything else (full attention,
the eviction policies, which do not depend on the page size) from the main JSONs: same prompts, other pages.

    python benchmarks/eval_targets.py benchmarks/results/eval-qwen2.5-coder-0.5b-16k-h200.json \
        benchmarks/results/eval-qwen2.5-coder-0.5b-16k-agg-h200.json --out benchmarks/results/eval-targets-qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EVICTION = ("streaming", "h2o", "tova")
RETRIEVAL = ("passkey", "passkey_essay", "niah_single", "niah_single_essay", "niah_multikey", "niah_uuid")
AGGREGATION = ("vt", "cwe", "fwe")
NO_SIGNAL = 0.10
RETRIEVAL_SAMPLES_BEHIND = 1
AGGREGATION_POINTS_BEHIND = 10.0
PPL_RELATIVE = 0.01
PAGE_POLICIES = ("quest", "quest-topp", "quest-rerank", "oracle")


def better_or_equal(metric: str, a: float, b: float) -> bool:
    return a <= b if metric == "ppl" else a >= b


def base_policy(policy: str) -> str:
    """``quest-topp:min_budget=256:top_p=0.9`` -> ``quest-topp``."""
    return policy.split(":", 1)[0]


def check(cells: list[dict], selector: str = "quest") -> dict:
    """Every target's rows (``met`` each) and a summary; see the module docstring."""
    index = {(c["task"], c["length"], c["policy"], c["budget"]): c for c in cells}
    groups = sorted({(c["task"], c["length"]) for c in cells})
    rows = {name: [] for name in ("retrieval_vs_full", "aggregation_vs_full", "ppl_vs_full", "quest_vs_eviction",
                                  "topp_half_budget", "no_signal", "missing")}
    for task, length in groups:
        full = index.get((task, length, "full", None))
        if full is None:
            rows["missing"].append({"task": task, "length": length, "cell": "full"})
            continue
        metric = full["metric"]
        if metric == "accuracy" and full["value"] <= NO_SIGNAL:
            rows["no_signal"].append({"task": task, "length": length, "full": full["value"]})
            continue
        for name, tasks, fraction in (("retrieval_vs_full", RETRIEVAL, 16), ("aggregation_vs_full", AGGREGATION, 8),
                                      ("ppl_vs_full", ("ppl",), 8)):
            if task not in tasks:
                continue
            budget = length // fraction
            cell = index.get((task, length, selector, budget))
            if cell is None:
                rows["missing"].append({"task": task, "length": length, "cell": f"{selector}@{budget}"})
                continue
            row = {"task": task, "length": length, "budget": budget, "selector": cell["value"], "full": full["value"]}
            if name == "retrieval_vs_full":
                row["behind"] = round((full["value"] - cell["value"]) * full["samples"], 3)
                row["met"] = row["behind"] <= RETRIEVAL_SAMPLES_BEHIND + 1e-9
            elif name == "aggregation_vs_full":
                row["behind"] = round((full["value"] - cell["value"]) * 100, 3)
                row["met"] = row["behind"] <= AGGREGATION_POINTS_BEHIND + 1e-9
            else:
                row["behind"] = round(cell["value"] / full["value"] - 1, 5)
                row["met"] = row["behind"] <= PPL_RELATIVE
            rows[name].append(row)
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
            topp_run = [c for c in cells if (c["task"], c["length"], base_policy(c["policy"])) == (task, length, "quest-topp")]
            if not topp_run:
                rows["missing"].append({"task": task, "length": length, "cell": f"quest-topp (vs quest@{budget})"})
                continue
            topp = [c for c in topp_run if c["mean_tokens_attended"] is not None and c["mean_tokens_attended"] <= budget / 2]
            best = None
            for c in topp:
                if best is None or better_or_equal(metric, c["value"], best["value"]):
                    best = c
            rows["topp_half_budget"].append({
                "task": task, "length": length, "quest_budget": budget, "quest": q["value"],
                "topp_best_within_half": None if best is None else best["value"],
                "topp_policy": None if best is None else best["policy"],
                "topp_cap": None if best is None else best["budget"],
                "topp_mean_budget": None if best is None else round(best["mean_tokens_attended"], 1),
                "met": best is not None and better_or_equal(metric, best["value"], q["value"]),
            })
    summary = {name: {"met": sum(r["met"] for r in items), "total": len(items)}
               for name, items in rows.items() if name not in ("no_signal", "missing")}
    summary["quest_vs_eviction"]["met_with_both_zero"] = sum(
        r["met"] and r["quest"] == 0 and r["other"] == 0 for r in rows["quest_vs_eviction"]
    )
    return {"selector": selector, "summary": summary, **rows}


def fmt(value, metric_is_ppl: bool) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if metric_is_ppl else f"{value:.0%}"


def cells_table(cells: list[dict]) -> list[str]:
    """Every cell: task, length, policy, budget, score, KV bytes read per step as a fraction of full."""
    lines = ["| task | length | policy | budget | score | KV bytes / full | mean tokens attended |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for c in sorted(cells, key=lambda c: (c["task"], c["length"], c["budget"] or 0, c["policy"])):
        ppl = c["metric"] == "ppl"
        attended = "-" if c.get("mean_tokens_attended") is None else f"{c['mean_tokens_attended']:.0f}"
        kv = "-" if c.get("kv_bytes_fraction") is None else f"{c['kv_bytes_fraction']:.1%}"  # older sweeps lack it
        lines.append(f"| {c['task']} | {c['length']} | {c['policy']} | {c['budget'] or '-'} | {fmt(c['value'], ppl)} | "
                     f"{kv} | {attended} |")
    return lines


def markdown(result: dict, command: str, cells: list[dict]) -> str:
    s = result["summary"]
    sel = result["selector"]
    lines = ["# Evaluation targets", "", f"- command: `{command}`", f"- selector under test: `{sel}`", "",
             "| target | met | cells |", "|---|---:|---:|",
             f"| {sel} within {RETRIEVAL_SAMPLES_BEHIND} sample of full on retrieval at 1/16 context "
             f"| {s['retrieval_vs_full']['met']} | {s['retrieval_vs_full']['total']} |",
             f"| {sel} within {AGGREGATION_POINTS_BEHIND:g} points of full on vt/cwe/fwe at 1/8 context "
             f"| {s['aggregation_vs_full']['met']} | {s['aggregation_vs_full']['total']} |",
             f"| {sel} perplexity within {PPL_RELATIVE:.0%} of full at 1/8 context "
             f"| {s['ppl_vs_full']['met']} | {s['ppl_vs_full']['total']} |",
             f"| Quest >= every eviction policy at budget <= 1/8 context (of the met: both at 0 %: "
             f"{s['quest_vs_eviction']['met_with_both_zero']}) | {s['quest_vs_eviction']['met']} | "
             f"{s['quest_vs_eviction']['total']} |",
             f"| quest-topp >= Quest@K with mean budget <= K/2 | {s['topp_half_budget']['met']} | "
             f"{s['topp_half_budget']['total']} |",
             "",
             "Without signal (full attention <= 10 %, not counted): "
             + (", ".join(f"{r['task']}@{r['length']} (full {r['full']:.0%})" for r in result["no_signal"]) or "none"),
             "",
             "Target cells not run: "
             + (", ".join(f"{r['task']}@{r['length']} {r['cell']}" for r in result["missing"]) or "none"),
             ""]
    for name, title, unit in (("retrieval_vs_full", "Retrieval at 1/16 context", "samples behind"),
                              ("aggregation_vs_full", "Aggregation at 1/8 context", "points behind"),
                              ("ppl_vs_full", "Perplexity at 1/8 context", "relative increase")):
        lines += [f"## {title}", "", f"| task | length | budget | {sel} | full | {unit} | met |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for r in result[name]:
            ppl = r["task"] == "ppl"
            lines.append(f"| {r['task']} | {r['length']} | {r['budget']} | {fmt(r['selector'], ppl)} | "
                         f"{fmt(r['full'], ppl)} | {r['behind']:g} | {'yes' if r['met'] else 'no'} |")
        lines.append("")
    lines += ["## Quest vs eviction (budget <= 1/8 context)", "",
              "| task | length | budget | policy | quest | other | met |", "|---|---:|---:|---|---:|---:|---|"]
    for r in result["quest_vs_eviction"]:
        ppl = r["task"] == "ppl"
        lines.append(f"| {r['task']} | {r['length']} | {r['budget']} | {r['policy']} | {fmt(r['quest'], ppl)} | "
                     f"{fmt(r['other'], ppl)} | {'yes' if r['met'] else 'no'} |")
    lines += ["", "## quest-topp at half the budget", "",
              "| task | length | Quest K | Quest | best quest-topp with mean budget <= K/2 | its policy, cap | "
              "its mean budget | met |",
              "|---|---:|---:|---:|---:|---|---:|---|"]
    for r in result["topp_half_budget"]:
        ppl = r["task"] == "ppl"
        policy = "-" if r["topp_policy"] is None else f"{r['topp_policy']} @ {r['topp_cap']}"
        lines.append(f"| {r['task']} | {r['length']} | {r['quest_budget']} | {fmt(r['quest'], ppl)} | "
                     f"{fmt(r['topp_best_within_half'], ppl)} | {policy} | {r['topp_mean_budget'] or '-'} | "
                     f"{'yes' if r['met'] else 'no'} |")
    lines += ["", "## Every cell", ""] + cells_table(cells)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json", nargs="+", help="result JSONs of `questkv eval` (their cells are pooled)")
    parser.add_argument("--out", required=True, help="output path without suffix (writes .json and .md)")
    parser.add_argument("--selector", default="quest",
                        help="the policy string whose cells the first three targets check (default: quest)")
    parser.add_argument("--page-policies-from", metavar="PATH",
                        help="take the page policies' cells only from this JSON (see the module docstring)")
    args = parser.parse_args(argv)
    cells, seen = [], {}
    sources = [(path, False) for path in args.json] + ([(args.page_policies_from, True)] if args.page_policies_from else [])
    for path, page_policies in sources:
        with open(path) as handle:
            for cell in json.load(handle)["cells"]:
                if args.page_policies_from and (base_policy(cell["policy"]) in PAGE_POLICIES) != page_policies:
                    continue
                key = (cell["task"], cell["length"], cell["policy"], cell["budget"])
                if key in seen:
                    first_path, first = seen[key]
                    if first["scores"] != cell["scores"]:
                        raise SystemExit(f"cell {key} is in both {first_path} and {path} with other scores")
                    continue  # the same cell run again (same prompts, same result): counted once
                seen[key] = (path, cell)
                cells.append(cell)
    result = check(cells, args.selector)
    command = "python benchmarks/eval_targets.py " + " ".join(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    # the stem may hold dots (qwen2.5-...), so the suffix is appended, never substituted
    Path(f"{out}.json").write_text(json.dumps({"command": command, "sources": [path for path, _ in sources], **result}, indent=1))
    text = markdown(result, command, cells)
    Path(f"{out}.md").write_text(text)
    print(text.split("## Retrieval")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
