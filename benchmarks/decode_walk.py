"""Which package files one engine decode step enters, and how often (issue 45: "a decode step from `LLM.generate` to
the kernel launch crosses <= 10 package files, each entered once").

Runs a tiny random Llama on the CPU (the eager path, reference ops), takes one decode-only ``engine.step()`` of one
Quest request and records, with ``sys.setprofile``, every call into a ``questkv`` file made from another file: the
files in the order first entered and the number of entries of each (every file the step touches, a property read
included). Also the call chains that reach the ops backend (``ops/reference.py`` here; ``ops/triton/`` on CUDA, where
the graph's capture takes the same chain): the package files on the stack at each op, and any file entered twice
on one chain. ``LLM.generate`` (``engine/llm.py``) calls ``engine.step()`` above every chain. Prints a table, or JSON
with ``--json``.

    python benchmarks/decode_walk.py [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":  # run as a file: the checkout importable (questkv, tests.*)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from questkv import LLM, QuestConfig  # noqa: E402
from questkv.engine.sampling_params import SamplingParams  # noqa: E402

PACKAGE = Path(__file__).resolve().parents[1] / "questkv"


BACKENDS = ("questkv/ops/reference.py", "questkv/ops/triton/")


def walk_one_decode_step() -> tuple[list[tuple[str, int]], list[tuple[str, ...]]]:
    """``(file relative to the checkout, entries from other files)`` of one decode step, in first-entry order; and
    the distinct call chains into the ops backend, each the package files on the stack, outermost first (a file
    repeats where the chain left it and came back)."""
    from tests.helpers import save_tiny_model

    with tempfile.TemporaryDirectory() as folder:
        model = save_tiny_model(Path(folder), 96, seed=1)
        quest = QuestConfig(token_budget=16, page_size=4, dense_layers=1, dense_context_ratio=1.0)
        llm = LLM(str(model), quest=quest, device="cpu", dtype="float32", max_model_len=128, kv_cache_memory=1 << 21)
    engine = llm.engine
    engine.add_request(list(range(2, 60)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()  # the prefill
    engine.step()  # a first decode step: lazy work done
    root = str(PACKAGE)
    entries: collections.Counter[str] = collections.Counter()
    chains: dict[tuple[str, ...], None] = {}  # (ordered, distinct)

    def relative(path: str) -> str:
        return str(Path(path).relative_to(PACKAGE.parent))

    def record(frame, event, arg) -> None:
        path = frame.f_code.co_filename
        if event == "call" and path.startswith(root) and (frame.f_back is None or frame.f_back.f_code.co_filename != path):
            entries[relative(path)] += 1  # insertion order: first entry
            if relative(path).startswith(BACKENDS) and not relative(frame.f_back.f_code.co_filename).startswith(BACKENDS):
                chain, caller = [], frame
                while caller is not None:
                    if caller.f_code.co_filename.startswith(root) and (not chain or chain[-1] != relative(caller.f_code.co_filename)):
                        chain.append(relative(caller.f_code.co_filename))
                    caller = caller.f_back
                chains[tuple(reversed(chain))] = None

    sys.setprofile(record)
    try:
        engine.step()
    finally:
        sys.setprofile(None)
    llm.close()
    return list(entries.items()), list(chains)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    files, chains = walk_one_decode_step()
    longest = max(len(set(chain)) for chain in chains)
    reentered = sorted({path for chain in chains for path in chain if chain.count(path) > 1})
    if args.json:
        print(json.dumps({"files": len(files), "entries": dict(files), "chain_files": longest,
                          "chains": [list(chain) for chain in chains], "reentered": reentered}, indent=1))
        return 0
    print(f"{len(files)} package files entered by one decode step ({sum(n for _, n in files)} entries)")
    print("| file | entries |\n|---|---|")
    for path, count in files:
        print(f"| {path} | {count} |")
    print(f"\n{len(chains)} call chains into the ops backend, at most {longest} package files each (engine/llm.py's "
          f"LLM.generate above them); files entered twice on one chain: {', '.join(reentered) or 'none'}")
    for chain in chains:
        print(" -> ".join(path.removeprefix("questkv/") for path in chain))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
