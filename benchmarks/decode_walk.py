"""Which package files one engine decode step enters, and how often (issue 45: "a decode step from `LLM.generate` to
the kernel launch crosses <= 10 package files, each entered once").

Runs a tiny random Llama on the CPU (the eager path, reference ops), takes one decode-only ``engine.step()`` of one
Quest request and records, with ``sys.setprofile``, every call into a ``questkv`` file made from another file: the
files in the order first entered and the number of entries of each. Prints a table, or JSON with ``--json``.

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


def walk_one_decode_step() -> list[tuple[str, int]]:
    """``(file relative to the checkout, entries from other files)`` of one decode step, in first-entry order."""
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

    def record(frame, event, arg) -> None:
        path = frame.f_code.co_filename
        if event == "call" and path.startswith(root) and (frame.f_back is None or frame.f_back.f_code.co_filename != path):
            entries[str(Path(path).relative_to(PACKAGE.parent))] += 1  # insertion order: first entry

    sys.setprofile(record)
    try:
        engine.step()
    finally:
        sys.setprofile(None)
    llm.close()
    return list(entries.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    files = walk_one_decode_step()
    if args.json:
        print(json.dumps({"files": len(files), "entries": dict(files)}, indent=1))
        return 0
    print(f"{len(files)} package files entered by one decode step ({sum(n for _, n in files)} entries)")
    print("| file | entries |\n|---|---|")
    for path, count in files:
        print(f"| {path} | {count} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
