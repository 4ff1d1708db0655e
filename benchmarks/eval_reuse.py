#!/usr/bin/env python3
"""Issues 26 and 20 on the H200: accuracy through the engine, selection reuse (C = 1, 2, 4, 8), fidelity over real
text, and the model on its own 4-bit GGUF bits against its dequantized bf16 run.

Every sweep is a ``questkv eval sweep`` on Qwen2.5-Coder-1.5B (bf16, page 16, 2 dense layers, seed 0), the
``full`` and ``quest`` settings on the engine (``--eval-backend auto``); :data:`SWEEPS` holds them, by results
file, in the order they run, most wanted first (a file's later invocations resume it):

(a) ``eval-reuse-qwen2.5-coder-1.5b-16k``, first invocation: C = 1 on the engine against the committed HF
    cells (20 samples, seed 0): passkey and niah_multikey at 1024 (``eval-qwen2.5-coder-1.5b-16k-h200`` and
    ``-16k-targets-h200``), vt at 2048 (``-16k-agg-targets-h200``); the other budget of each (which (b) needs
    anyway) comes with them, so that one engine serves the three tasks;
(b) the same file's second invocation and ``eval-reuse-qwen2.5-coder-1.5b-32k``: passkey, niah_single,
    niah_multikey, passkey_essay, vt and fwe at 1/16 and 1/8 of 16k and 32k, full, quest and
    quest:selection_interval=2,4,8, 20 samples. "32k" is 32640 tokens: the engine does not run past the model's
    32768 positions and the niah answers take up to 128 tokens (the HF path's 32k cells ran 32768 + the answer);
(c) ``eval-agreement-qwen2.5-coder-1.5b-16k``: teacher-forced top-1 agreement with dense and the perplexity of
    dense's 128 greedy tokens, 4 windows of 16k of the book and of questkv's source, the same settings;
(d) ``eval-reuse-ppl-qwen2.5-coder-1.5b-32k``: perplexity of the book's last 256 tokens of 4 windows of 32k at
    1/8 (4096), the committed HF file's settings (``eval-qwen2.5-coder-1.5b-32k-ppl-h200``: 9.29 full, 9.65 quest).

(e) ``eval-lowbit-qwen2.5-coder-1.5b-16k`` and ``eval-lowbit-ppl-qwen2.5-coder-1.5b-32k`` (issue 20): the same
    settings with ``--quantization gguf``, the alias's Q4_K_M file on its own packed bits (Q4_K as int4 groups of 32,
    Q6_K as int8 groups of 16) instead of dequantized to bf16: passkey and niah_single at 16k, full and Quest 1/16
    (their bf16 pairs are (a)/(b)'s cells), and the 32k perplexity at 1/16 and 1/8 (bf16's 1/16 cell is (d)'s second
    invocation).

(f) (removed: adaptive reuse's sweeps, ``eval-adaptive-*``; their committed files stay as results.)
(g) ``eval-selection-agreement-qwen2.5-coder-1.5b-16k`` and ``eval-selection-qwen2.5-coder-1.5b-16k``: the
    page-selection defaults, ``kv_head`` with ``sum`` (the default),
    ``kv_head`` with ``max`` and ``q_head``, on the same tasks and budgets.
(h) (removed with (f).)

They run in the order (e), (a), (b) at 16k, (d), (c), (f), (g), (b) at 32k, (h) (finished files are skipped when
resumed). Measured H200 time (the cells' ``seconds``, commit c552545): (a) and (b) at 16k 484 s for 54 cells (the
first engine's load and compilation inside its first cell), (c) 27 s, (d) 45 s; at about 6 s per 16k retrieval
cell (20 samples) and 1 s per agreement cell, (f) is about 8 minutes and (g) about 4; the model's staging (23
``stage`` calls) and ``finish`` take about 4 minutes more. At commit 4d34b2b, one warm machine: 23 ``stage`` calls
in about 100 s, ``finish`` and (b) at 32k in one 289 s call, (g)'s retrieval in 118 s, (h) in 200 s.

Here::

    .venv/bin/python benchmarks/eval_reuse.py commands --commit SHA   # the device calls, after gpu_eval.py stage/finish
    .venv/bin/python benchmarks/eval_reuse.py smoke                   # every sweep on the CPU, tiny model and lengths

There, once the model is staged (``benchmarks/gpu_eval.py``: prepare here, stage and finish there), as often as
needed (each call resumes where the last stopped and copies every results file to ``$OUT``)::

    python3 benchmarks/eval_reuse.py run --commit SHA --seconds 560 [--resume-from benchmarks/results] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
ALIAS = "qwen2.5-coder-1.5b"
POLICIES = "full,quest,quest:selection_interval=2,quest:selection_interval=4,quest:selection_interval=8"
TASKS = "passkey,niah_single,niah_multikey,passkey_essay,vt,fwe"
# Adaptive reuse against fixed C at equal selection rate: one engine serves both (a fixed-C request passes T = -1).
# The page-selection defaults (kv_head with sum, the default; kv_head with max; q_head), re-decided on the 1.5B.
SELECTION_POLICIES = "full,quest,quest:group_reduction=max,quest:selection=q_head"
AGREEMENT = ["--tasks", "agreement_book,agreement_code", "--lengths", "16384", "--samples", "4", "--budgets", "1024,2048",
             "--agreement-tokens", "128"]
RETRIEVAL_16K = ["--tasks", "passkey,niah_multikey,passkey_essay,vt,fwe", "--lengths", "16384", "--samples", "20",
                 "--budgets", "1024,2048"]
COMMON = ["--device", "cuda", "--no-plot", "--seed", "0"]


def sweeps(alias: str = ALIAS) -> dict[str, list[list[str]]]:
    """Results file name -> its ``questkv eval sweep`` arguments (besides ``--model``, ``--json`` and
    :data:`COMMON`), one list per invocation, in order, for the staged model ``alias``."""
    return {
        f"eval-lowbit-{alias}-16k": [
            ["--tasks", "passkey,niah_single", "--lengths", "16384", "--samples", "20", "--budgets", "1024",
             "--policies", "full,quest", "--quantization", "gguf"],
        ],
        f"eval-lowbit-ppl-{alias}-32k": [
            ["--tasks", "ppl", "--lengths", "32768", "--samples", "4", "--budgets", "2048,4096", "--score-tokens", "256",
             "--text-file", "book:newton-opticks", "--policies", "full,quest", "--quantization", "gguf"],
        ],
        f"eval-reuse-{alias}-16k": [
            ["--tasks", "passkey,niah_multikey,vt", "--lengths", "16384", "--samples", "20", "--budgets", "1024,2048",
             "--policies", "full,quest"],
            ["--tasks", TASKS, "--lengths", "16384", "--samples", "20", "--budgets", "1024,2048", "--policies", POLICIES],
        ],
        f"eval-reuse-ppl-{alias}-32k": [
            ["--tasks", "ppl", "--lengths", "32768", "--samples", "4", "--budgets", "4096", "--score-tokens", "256",
             "--text-file", "book:newton-opticks", "--policies", POLICIES],
            ["--tasks", "ppl", "--lengths", "32768", "--samples", "4", "--budgets", "2048", "--score-tokens", "256",
             "--text-file", "book:newton-opticks", "--policies", "full,quest"],
        ],
        f"eval-agreement-{alias}-16k": [
            ["--tasks", "agreement_book,agreement_code", "--lengths", "16384", "--samples", "4", "--budgets", "1024,2048",
             "--agreement-tokens", "128", "--policies", POLICIES],
        ],
        f"eval-selection-agreement-{alias}-16k": [[*AGREEMENT, "--policies", SELECTION_POLICIES]],
        f"eval-selection-{alias}-16k": [[*RETRIEVAL_16K, "--policies", SELECTION_POLICIES]],
        f"eval-reuse-{alias}-32k": [
            ["--tasks", TASKS, "--lengths", "32640", "--samples", "20", "--budgets", "2048,4096", "--policies", POLICIES],
        ],
    }


SWEEPS = sweeps()
"""The sweeps of :data:`ALIAS`."""

# The CPU smoke run: tiny lengths (every task fits them), budgets of 4 and 8 pages of 4, 1 sample, few tokens.
SMOKE_VALUES = {"--lengths": {"16384": "192", "32640": "256", "32768": "256"},
                "--budgets": {"1024": "16", "2048": "32", "4096": "32"},
                "--samples": {"20": "1", "4": "1"}, "--agreement-tokens": {"128": "8"}, "--score-tokens": {"256": "8"},
                "--quantization": {"gguf": "int8"}}  # the tiny model is an HF folder (hidden 32): rounded at load instead
SMOKE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--page-size", "4", "--kv-cache-memory", "64MiB", "--no-plot",
               "--seed", "0"]


def sweep_args(name: str, args: list[str], model: str, json_path: str) -> list[str]:
    """``questkv eval sweep`` arguments of one invocation of sweep ``name``."""
    return ["eval", "sweep", "--model", model, "--json", json_path, *COMMON, *args]


def commands(commit: str, alias: str = ALIAS) -> list[str]:
    """The device calls (command | carry), in order: each runs one invocation through ``gpu_eval.py sweep``."""
    return [f"python3 benchmarks/gpu_eval.py sweep {alias} {name} --commit {commit} -- "
            f"{shlex.join([*COMMON, *args])} | []" for name, runs in sweeps(alias).items() for args in runs]


def _gpu_eval():
    spec = importlib.util.spec_from_file_location("gpu_eval", REPO / "benchmarks" / "gpu_eval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(commit: str, seconds: int, resume_from: str = "", alias: str = ALIAS,
        only: Optional[list[str]] = None) -> int:
    """There: every invocation in order through ``gpu_eval.sweep`` (resumable) until ``seconds`` are spent; a
    results file the machine lacks starts from ``resume_from/NAME.json`` when the tree has it (a machine
    started afresh). ``only``: these results files' invocations alone (names of :data:`SWEEPS`), still in order.

    Raises:
        ValueError: a name of ``only`` is not a results file of the sweeps (before anything runs).
    """
    chosen = sweeps(alias)
    unknown = [name for name in only or [] if name not in chosen]
    if unknown:
        raise ValueError(f"--only: {', '.join(unknown)} not among the results files: {', '.join(chosen)}")
    gpu_eval = _gpu_eval()
    end = time.monotonic() + seconds
    for name, runs in chosen.items():
        if only and name not in only:
            continue
        resume = f"{resume_from}/{name}.json" if resume_from and (REPO / resume_from / f"{name}.json").is_file() else ""
        for args in runs:
            done = gpu_eval.WORK / "results" / f"{name}.json"
            if is_complete(done if done.is_file() else REPO / resume if resume else None, args):
                continue  # starting the sweep only to find every cell would cost a process and its imports
            left = int(end - time.monotonic())
            if left < 30:
                print("time is up: run the same call again to resume", flush=True)
                return 0
            code = gpu_eval.sweep(alias, name, commit, left, resume, [*COMMON, *args])
            if code:
                return code
    return 0


def expected_cells(args: list[str]) -> set[tuple]:
    """The ``(task, length, policy, budget)`` cells that an invocation's sweep ``args`` produce: ``full`` once per
    task and length (budget ``None``), every other policy once per budget."""
    flags = dict(zip(args[::2], args[1::2]))
    budgets = [int(b) for b in flags["--budgets"].split(",")]
    return {(task, int(length), policy, None if policy == "full" else budget)
            for task in flags["--tasks"].split(",") for length in flags["--lengths"].split(",")
            for policy in flags["--policies"].split(",") for budget in ([None] if policy == "full" else budgets)}


def is_complete(path: Optional[Path], args: list[str]) -> bool:
    """Whether the results JSON at ``path`` (``None``: none yet) holds every cell of the invocation ``args``."""
    if path is None:
        return False
    cells = json.loads(path.read_text())["cells"]
    return expected_cells(args) <= {(c["task"], c["length"], c["policy"], c["budget"]) for c in cells}


def smoke_args(args: list[str]) -> list[str]:
    """An invocation's arguments for the CPU smoke run (:data:`SMOKE_VALUES`, :data:`SMOKE_FLAGS`)."""
    out, flags = [], dict(zip(args[::2], args[1::2]))
    for flag, value in flags.items():
        if flag in SMOKE_VALUES:
            value = ",".join(SMOKE_VALUES[flag].get(v, v) for v in value.split(","))
        out += [flag, value]
    return out + SMOKE_FLAGS


def tiny_model(path: Path) -> Path:
    """A tiny random Llama with a word tokenizer (the passkey prompt's words, digits apart) saved at ``path``."""
    import re

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from questkv.eval import passkey

    words = sorted(set(re.findall(r"\w+|[^\w\s]", " ".join([passkey.HEADER, passkey.FILLER, passkey.KEY_LINE,
                                                              passkey.QUESTION]))) | set("0123456789"))
    vocab = {"<unk>": 0, "<eos>": 1, **{word: i + 2 for i, word in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                     pre_tokenizers.Digits(individual_digits=True)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def smoke(out_dir: Path) -> list[Path]:
    """Here: every invocation of :data:`SWEEPS` on the CPU, on a tiny random model with tiny lengths, through
    ``questkv.cli.main``; returns the results files."""
    from questkv import cli

    model = tiny_model(out_dir / "tiny-model")
    paths = []
    for name, runs in SWEEPS.items():
        path = out_dir / f"{name}.json"
        for args in runs:
            argv = ["eval", "sweep", "--model", str(model), "--json", str(path), *smoke_args(args)]
            if cli.main(argv) != 0:
                raise SystemExit(f"smoke: questkv {shlex.join(argv)} failed")
        paths.append(path)
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands_ = parser.add_subparsers(dest="command", required=True)
    sub = commands_.add_parser("commands", help="here: print the device calls")
    sub.add_argument("--commit", required=True)
    sub.add_argument("--model", default=ALIAS, help=f"the staged alias (default: {ALIAS})")
    sub = commands_.add_parser("run", help="there: run the sweeps in order for at most --seconds (resumable)")
    sub.add_argument("--commit", required=True)
    sub.add_argument("--model", default=ALIAS, help=f"the staged alias (default: {ALIAS})")
    sub.add_argument("--seconds", type=int, default=560)
    sub.add_argument("--resume-from", default="", help="a folder of the tree with results files to continue "
                     "(e.g. benchmarks/results) when the machine has none")
    sub.add_argument("--only", nargs="+", default=None, metavar="NAME",
                     help="run only these results files' sweeps (names without .json; default: all, in order)")
    sub = commands_.add_parser("smoke", help="here: every sweep on the CPU, tiny model and lengths")
    sub.add_argument("--out-dir", default=None, help="where the results go (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.command == "commands":
        print("\n".join(commands(args.commit, args.model)))
        return 0
    if args.command == "run":
        try:
            return run(args.commit, args.seconds, args.resume_from, args.model, args.only)
        except ValueError as error:
            parser.error(str(error))
    if args.out_dir is None:
        with tempfile.TemporaryDirectory() as tmp:
            print("\n".join(map(str, smoke(Path(tmp)))))
    else:
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
        print("\n".join(map(str, smoke(Path(args.out_dir)))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
