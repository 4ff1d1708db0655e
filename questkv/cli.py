"""The ``questkv`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence


def _budget_list(text: str) -> list[Optional[int]]:
    """Parse ``"64,256,full"`` into ``[64, 256, None]``."""
    budgets: list[Optional[int]] = []
    for item in text.split(","):
        item = item.strip()
        if item == "full":
            budgets.append(None)
        elif item.isdigit() and int(item) > 0:
            budgets.append(int(item))
        else:
            raise argparse.ArgumentTypeError(f"budget {item!r} is not a positive integer or 'full'")
    return budgets


def _add_demo(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="Quest vs dense decode attention on random tensors (no model needed)",
        description="Build a paged KV cache of random keys in which a few pages are relevant to the query, "
        "then compare Quest attention at several token budgets with dense attention.",
    )
    parser.add_argument("--budgets", type=_budget_list, default=[64, 256, 1024, None],
                        help="comma-separated token budgets; 'full' is dense attention (default: 64,256,1024,full)")
    parser.add_argument("--context", type=int, default=8192, help="tokens per sequence (default: 8192)")
    parser.add_argument("--batch", type=int, default=2, help="number of sequences (default: 2)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page, a power of two (default: 16)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    parser.set_defaults(func=_run_demo)


def _run_demo(args) -> int:
    from questkv.demo import format_table, run_demo

    rows = run_demo(budgets=args.budgets, batch=args.batch, context=args.context, page_size=args.page_size, seed=args.seed)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)
    print(format_table(rows))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="questkv", description="Query-aware KV-cache page sparsity (Quest) for long-context decoding.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_demo(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as error:
        parser.exit(2, f"questkv {args.command}: error: {error}\n")


if __name__ == "__main__":
    sys.exit(main())
