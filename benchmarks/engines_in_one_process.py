"""Several engines in one process: build, use and drop an engine of each model family, dense and Quest, one
after another, and check that each gives the tokens of the same engine built alone in a fresh process.

Random bf16 weights (``load_format="dummy"``, seed 0) at small shapes of five families: Llama 3 (llama3 RoPE,
GQA), Llama 2 (default RoPE, MHA), Mistral, Qwen2 (QKV bias), Qwen3 (q/k norm). On CUDA every engine captures
its decode graphs and compiles its elementwise kernels (where a Qwen3 engine after another family's used to hit
torch.compile's recompile limit), sizes its KV pool from ``gpu_memory_utilization`` (where an engine after a
dropped one used to find the memory still held), and is dropped with ``del`` only (no ``gc.collect()``).

    python benchmarks/engines_in_one_process.py --out benchmarks/results/engines-in-one-process-h200
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

if __name__ == "__main__":  # run as a file: the checkout importable (questkv, benchmarks.*)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from questkv.config import QuestConfig  # noqa: E402
from questkv.engine.llm import LLM  # noqa: E402
from questkv.engine.sampling_params import SamplingParams  # noqa: E402
from questkv.eval.provenance import provenance  # noqa: E402

COMMON = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=6,
              num_attention_heads=16, max_position_embeddings=16384)
FAMILIES = {
    "llama3": ("LlamaConfig", dict(num_key_value_heads=4, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "llama2": ("LlamaConfig", dict(num_key_value_heads=16)),
    "mistral": ("MistralConfig", dict(num_key_value_heads=8, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=8, head_dim=128)),
}
MODES = {"dense": None, "quest": QuestConfig(token_budget=256, page_size=16, dense_layers=2)}
PROMPT_LENGTHS = (2000, 900, 1500)
MAX_TOKENS = 24


def config(family: str):
    import transformers

    class_name, extra = FAMILIES[family]
    return getattr(transformers, class_name)(**COMMON, **extra)


def tokens_of(family: str, mode: str, device: str) -> dict:
    """Greedy tokens of the family's engine in ``mode``, the pages its pool got, and the device memory held
    after ``del`` (CUDA)."""
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, COMMON["vocab_size"], (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    kwargs = {"gpu_memory_utilization": 0.5} if device == "cuda" else {"kv_cache_memory": 1 << 28}
    llm = LLM(config(family), quest=MODES[mode], load_format="dummy", dtype="bfloat16", device=device,
              max_model_len=4096, max_num_seqs=4, seed=0, **kwargs)
    pages = llm.engine.cache.num_pages
    tokens = [list(out.token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]
    del llm  # reference counting alone must free it
    held = torch.cuda.memory_allocated() if device == "cuda" else None
    return {"tokens": tokens, "kv_pages": pages, "bytes_allocated_after_del": held}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="path prefix of the .json and .md results")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="where the engines run")
    parser.add_argument("--alone", metavar="FAMILY", help="(internal) run one family's engines and print JSON")
    args = parser.parse_args()
    if args.alone:
        print(json.dumps({mode: tokens_of(args.alone, mode, args.device)["tokens"] for mode in MODES}))
        return
    baseline = torch.cuda.memory_allocated() if args.device == "cuda" else None
    together = {(family, mode): tokens_of(family, mode, args.device) for family in FAMILIES for mode in MODES}
    rows = []
    for family in FAMILIES:
        alone = json.loads(subprocess.run(
            [sys.executable, __file__, "--alone", family, "--device", args.device],
            check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        for mode in MODES:
            run = together[(family, mode)]
            rows.append({"family": family, "mode": mode, "equal_to_alone": run["tokens"] == alone[mode],
                         "kv_pages": run["kv_pages"], "bytes_allocated_after_del": run["bytes_allocated_after_del"]})
    record = {"provenance": provenance(args.device), "baseline_bytes_allocated": baseline,
              "families": {f: {"class": c, **COMMON, **e} for f, (c, e) in FAMILIES.items()},
              "prompt_lengths": PROMPT_LENGTHS, "max_tokens": MAX_TOKENS, "rows": rows,
              "all_equal": all(r["equal_to_alone"] for r in rows)}
    prov = record["provenance"]
    lines = ["# Five engines in one process, built and dropped one after another", "",
             f"- command: `{prov['command']}`", f"- commit: `{prov['commit']}`",
             f"- machine: {prov['machine']}; date: {prov['date']}; torch {prov['torch']}", "",
             "Each engine: random bf16 weights (seed 0), 6 layers, hidden 1024; greedy, 3 prompts of "
             f"{', '.join(map(str, PROMPT_LENGTHS))} tokens, {MAX_TOKENS} tokens each; Quest budget 256, page 16, "
             "2 dense layers. Dropped with `del` only. Alone = the same engines in a fresh process.", "",
             f"Device memory allocated before the first engine: {baseline} bytes.", "",
             "| family | mode | tokens equal to alone | KV pages | bytes allocated after `del` |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['family']} | {r['mode']} | {r['equal_to_alone']} | {r['kv_pages']} | "
              f"{r['bytes_allocated_after_del']} |" for r in rows]
    print("\n".join(lines[-len(rows) - 2:]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(record, indent=1))
        args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    if not record["all_equal"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
