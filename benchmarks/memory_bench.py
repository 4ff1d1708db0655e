"""What an engine holds and what it fits, on one GPU: weights (counted once and held) and tokens of KV cache, for
bf16 and weight-only quantized linears, at batch 1 (``max_num_seqs=1``) and batched (``max_num_seqs=16``): an int4
layer holds one copy of its codes at any batch (engines before ``int4_mma`` added tinygemm's for 2 to 4 rows).

Each configuration builds ``LLM`` with random weights at the model's real shapes and the engine's own memory plan
(``gpu_memory_utilization``, as a user would run it), reads :attr:`~questkv.engine.llm.LLM.cache_spec` and
:func:`~questkv.layers.quantized_linear.model_weight_bytes`, and closes the engine before the next one.

Usage (GPU)::

    python benchmarks/memory_bench.py --model llama3.1-8b --out benchmarks/results/memory-h200

writes ``<out>.json`` and ``<out>.md`` with provenance.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

if __name__ == "__main__":  # run as a file: the checkout importable (questkv, benchmarks.*)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from questkv.engine.llm import LLM  # noqa: E402
from questkv.eval.provenance import provenance  # noqa: E402
from questkv.layers.quantized_linear import model_weight_bytes  # noqa: E402
from questkv.models.shapes import DUMMY_SHAPES, dummy_config  # noqa: E402

CONFIGS = {  # name: (quantization, quantize_lm_head)
    "bf16": (None, False),
    "int8": ("int8", False),
    "int4": ("int4", False),
    "int4, LM head int4": ("int4", True),
}


def measure(model: str, name: str, max_num_seqs: int, max_model_len: int, utilization: float) -> dict:
    """One engine's weights and KV capacity (closed before returning)."""
    quantization, head = CONFIGS[name]
    llm = LLM(dummy_config(model, max_position_embeddings=max_model_len), load_format="dummy", dtype="bfloat16",
              device="cuda", quantization=quantization, quantize_lm_head=head, max_num_seqs=max_num_seqs,
              max_model_len=max_model_len, gpu_memory_utilization=utilization, enforce_eager=True)
    spec = llm.cache_spec
    row = {"config": name, "max_num_seqs": max_num_seqs, "weight_bytes": model_weight_bytes(llm.engine.runner.model),
           "kv_tokens": spec.kv_tokens, "kv_cache_bytes": spec.num_pages * spec.page_bytes,
           "describe": spec.describe()}
    llm.close()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return row


def render(record: dict) -> str:
    prov = record["provenance"]
    lines = [f"# Weights held and KV tokens that fit: {record['model']}", "",
             f"- command: `{prov.get('command', '?')}`", f"- commit: `{prov.get('commit', '?')}`",
             f"- GPU: {prov.get('machine', '?')}; date: {prov.get('date', '?')}",
             f"- gpu_memory_utilization {record['gpu_memory_utilization']}, max_model_len {record['max_model_len']}, "
             "bf16 activations and KV; weights = every parameter and buffer the model holds", "",
             "| config | max_num_seqs | weights GB | GiB | KV cache GiB | KV tokens | vs bf16 |",
             "|---|---|---|---|---|---|---|"]
    base = {r["max_num_seqs"]: r["kv_tokens"] for r in record["rows"] if r["config"] == "bf16"}
    for r in record["rows"]:
        ref = base.get(r["max_num_seqs"])
        ratio = f"{r['kv_tokens'] / ref:.2f}×" if ref else "–"
        lines.append(f"| {r['config']} | {r['max_num_seqs']} | {r['weight_bytes'] / 1e9:.2f} | "
                     f"{r['weight_bytes'] / 2**30:.2f} | "
                     f"{r['kv_cache_bytes'] / 2**30:.2f} | {r['kv_tokens']:,} | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3.1-8b", choices=list(DUMMY_SHAPES), help="dummy model shape")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                        help="weight configurations (default: all)")
    parser.add_argument("--max-num-seqs", type=int, nargs="+", default=[1, 16], help="engines' max_num_seqs")
    parser.add_argument("--max-model-len", type=int, default=32768, help="engines' max_model_len")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="engines' memory share")
    parser.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    args = parser.parse_args()
    record = {"provenance": provenance("cuda"), "model": args.model, "max_model_len": args.max_model_len,
              "gpu_memory_utilization": args.gpu_memory_utilization, "rows": []}
    for seqs in args.max_num_seqs:
        for name in args.configs:
            row = measure(args.model, name, seqs, args.max_model_len, args.gpu_memory_utilization)
            record["rows"].append(row)
            print(f"{name}, max_num_seqs={seqs}: {row['describe']}; weights {row['weight_bytes'] / 1e9:.2f} GB",
                  flush=True)
            args.out.with_suffix(".json").write_text(json.dumps(record, indent=1))
            args.out.with_suffix(".md").write_text(render(record))


if __name__ == "__main__":
    main()
