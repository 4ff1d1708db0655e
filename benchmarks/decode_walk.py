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
from typing import Optional

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

    def package_file(path: Optional[str]) -> str:
        """``path`` relative to the checkout if it is a package file, else ``""``."""
        return str(Path(path).relative_to(PACKAGE.parent)) if path and path.startswith(root) else ""

    def chain_of(frame) -> tuple[str, ...]:
        """The package files on ``frame``'s stack, outermost first (a run of frames in one file counts once)."""
        chain = []
        while frame is not None:
            path = package_file(frame.f_code.co_filename)
            if path and (not chain or chain[-1] != path):
                chain.append(path)
            frame = frame.f_back
        return tuple(reversed(chain))

    def record(frame, event, arg) -> None:
        path = package_file(frame.f_code.co_filename)
        caller = package_file(frame.f_back.f_code.co_filename if frame.f_back is not None else None)
        if event != "call" or not path or caller == path:
            return
        entries[path] += 1  # insertion order: first entry
        if path.startswith(BACKENDS) and not caller.startswith(BACKENDS):
            chains[chain_of(frame)] = None

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
