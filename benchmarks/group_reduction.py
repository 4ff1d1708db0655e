"""Which ``kv_head`` group reduction, ``sum`` or ``max``, keeps more attention mass?

On the passkey prompts of ``questkv passkey`` (same keys and depths), the context is prefilled
densely and the question tail decoded densely, one token at a time. At every decode step and
sparse layer (index >= dense_layers) this measures, for each budget, the fraction of the true dense
attention probability that falls in the pages Quest would select, averaged over query heads:

* ``kv_head/sum``, ``kv_head/max``: one page set per KV head, the query group's page scores
  combined by sum or max (``QuestConfig.group_reduction``);
* ``q_head``: one page set per query head (the paper's setting), for reference;
* ``oracle``: the best possible pages per query head (the budget's top pages by true mass).

Every selection is measured on the same (dense) trajectory, so the comparison is paired.

    python benchmarks/group_reduction.py --lengths 2048,4096 --trials 3 \\
        --json benchmarks/results/group_reduction-smollm2-135m.json --md benchmarks/results/group_reduction-smollm2-135m.md
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from questkv import ops
from questkv.config import QuestConfig
from questkv.eval import harness, passkey
from questkv.integrations.hf import QuestCache, enable
from questkv.models import DEFAULT_MODEL, load_model

MODES = ("kv_head/sum", "kv_head/max", "q_head", "oracle")


class CoverageProbe(QuestCache):
    """A QuestCache that, on every decode step of a sparse layer, scores the pages each selection
    mode would pick against the true dense attention probabilities.

    ``totals[(budget, mode)]`` accumulates ``[sum of coverage, samples]``; a sample is one
    (decode step, sparse layer), its coverage the mean over query heads.
    """

    def __init__(self, model_config, page_size: int, budgets: list[int], sparse_from: int) -> None:
        super().__init__(model_config, page_size)
        self.budgets = budgets
        self.sparse_from = sparse_from
        self.totals: dict[tuple[int, str], list[float]] = defaultdict(lambda: [0.0, 0])

    def attend(self, layer_idx: int, query: torch.Tensor, scaling) -> torch.Tensor:
        if layer_idx >= self.sparse_from:
            self._measure(layer_idx, query, scaling)
        return super().attend(layer_idx, query, scaling)

    def _measure(self, layer_idx: int, query: torch.Tensor, scaling) -> None:
        layer, page_table, seq_lens = self.decode_view(layer_idx)
        if query.shape[0] != 1:
            raise ValueError("CoverageProbe measures batch size 1")
        num_q_heads, head_dim = query.shape[1:]
        num_kv_heads, page_size = layer.kmin.shape[1], self.page_size
        group = num_q_heads // num_kv_heads
        length = int(seq_lens[0])
        position = torch.arange(length, device=query.device)
        slots = page_table[0, position // page_size].long() * page_size + position % page_size
        keys = layer.k_pages.view(-1, num_kv_heads, head_dim)[slots].float()  # [L, Hkv, D]
        q = query[0].float().view(num_kv_heads, group, head_dim)
        scale = scaling if scaling is not None else head_dim**-0.5
        probs = torch.softmax(torch.einsum("hgd,lhd->hgl", q, keys) * scale, dim=-1)  # [Hkv, G, L]
        pad = -length % page_size
        page_mass = torch.nn.functional.pad(probs, (0, pad)).view(num_kv_heads, group, -1, page_size).sum(-1)
        page_mass = page_mass.reshape(num_q_heads, -1)  # [Hq, P]
        scores = {
            "kv_head/sum": ops.page_scores(query, layer.kmin, layer.kmax, page_table, seq_lens, page_size, "kv_head", "sum"),
            "kv_head/max": ops.page_scores(query, layer.kmin, layer.kmax, page_table, seq_lens, page_size, "kv_head", "max"),
            "q_head": ops.page_scores(query, layer.kmin, layer.kmax, page_table, seq_lens, page_size, "q_head"),
        }
        for budget in self.budgets:
            pages = budget // page_size
            for mode, score in scores.items():
                selected = ops.select_pages(score, seq_lens, page_size, pages)[0].long()  # [Hs, K]
                if selected.shape[0] != num_q_heads:
                    selected = selected.repeat_interleave(group, dim=0)
                covered = (page_mass.gather(1, selected.clamp(min=0)) * (selected >= 0)).sum(1)
                self._add(budget, mode, covered.mean().item())
            oracle = page_mass.topk(min(pages, page_mass.shape[1]), dim=1).values.sum(1)
            self._add(budget, "oracle", oracle.mean().item())

    def _add(self, budget: int, mode: str, value: float) -> None:
        total = self.totals[(budget, mode)]
        total[0] += value
        total[1] += 1


def measure(args) -> dict:
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    enable(model, QuestConfig(token_budget=None, page_size=args.page_size, dense_layers=args.dense_layers))
    totals: dict[tuple[int, int, str], list[float]] = defaultdict(lambda: [0.0, 0])
    depths = passkey.trial_depths(args.trials)
    jobs = [(length, trial) for length in args.lengths for trial in range(args.trials)]
    for length, trial in tqdm(jobs, desc="group_reduction", unit="trial"):
        key = passkey.trial_key(args.seed, length, trial)
        text = passkey.build_prompt(tokenizer, length, depths[trial], key)
        context_ids, tail_ids = passkey.split_tail(tokenizer, text)
        probe = CoverageProbe(model.config, args.page_size, args.budgets, args.dense_layers)
        _, next_positions = harness.prefill(model, [context_ids], args.page_size, cache=probe)
        harness.decode_greedy(model, probe, next_positions, [tail_ids], [0], tokenizer.eos_token_id)
        for (budget, mode), (total, count) in probe.totals.items():
            totals[(length, budget, mode)][0] += total
            totals[(length, budget, mode)][1] += count
    results = [
        {"length": length, "budget": budget, "mode": mode, "coverage": total / count, "samples": count}
        for (length, budget, mode), (total, count) in sorted(totals.items())
    ]
    config = {k: getattr(args, k) for k in ("lengths", "budgets", "trials", "page_size", "dense_layers", "dtype", "seed")}
    return {"model": args.model, "config": config, "results": results}


def format_table(results: list[dict]) -> str:
    cells = {(r["length"], r["budget"], r["mode"]): r["coverage"] for r in results}
    keys = sorted({(r["length"], r["budget"]) for r in results})
    lines = ["| length | budget | " + " | ".join(MODES) + " | sum − max |", "|" + "---|" * (len(MODES) + 3)]
    for length, budget in keys:
        row = [f"{cells[(length, budget, mode)]:.4f}" for mode in MODES]
        diff = cells[(length, budget, "kv_head/sum")] - cells[(length, budget, "kv_head/max")]
        lines.append(f"| {length} | {budget} | " + " | ".join(row) + f" | {diff:+.4f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 4096])
    parser.add_argument("--budgets", type=lambda s: [int(x) for x in s.split(",")], default=[64, 128, 256, 512])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dense-layers", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    parser.add_argument("--md", type=Path, help="write the table as markdown here")
    args = parser.parse_args()
    for budget in args.budgets:
        QuestConfig(token_budget=budget, page_size=args.page_size)  # validates the budget
    document = measure(args)
    table = format_table(document["results"])
    if args.json:
        args.json.write_text(json.dumps(document, indent=1))
    if args.md:
        args.md.write_text(
            f"# kv_head group reduction: attention mass covered ({document['model']})\n\n"
            "Mean fraction of the true dense attention probability inside the selected pages, over query heads, "
            f"sparse layers (>= {args.dense_layers}) and the decode steps of the passkey question tail "
            f"({args.trials} trials per length, page {args.page_size}). Produced by `benchmarks/group_reduction.py`.\n\n"
            + table + "\n"
        )
    print(table)


if __name__ == "__main__":
    main()
