"""Which layers an fp8 KV cache should keep in the model dtype (issue 43): the key-bias threshold, measured.

``LlamaForCausalLM.fp8_fragile_layers`` keeps a layer's K/V in the model dtype when some KV head's key bias is more
than ``FP8_FRAGILE_RATIO`` times its keys' token-dependent part (:meth:`LlamaAttention.key_bias_ratios`). For each
threshold ``2**b`` here, the layers it keeps, and how far transformers' model (bf16) moves when every other layer's
cached K/V are rounded to e4m3 (saturating, scale 1; transformers caches rotated keys, as the engine's pages do):
teacher-forced over windows of the agreement tasks' book and code text, the mean KL divergence of its next-token
distribution from the unrounded model's and the share of positions whose argmax agrees, over each window's last
``--positions`` positions. Also every layer rounded (no threshold).

    python benchmarks/fp8_fragile_layers.py --model qwen2.5-coder-1.5b --out-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a file: the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from questkv.engine.llm import LLM  # noqa: E402
from questkv.eval import agreement  # noqa: E402
from questkv.eval.provenance import provenance  # noqa: E402
from questkv.models.loader import resolve_model_path  # noqa: E402

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
TEXTS = {"book": "agreement_book", "code": "agreement_code"}


def rounding_cache(keep: set[int], config):
    """A transformers ``DynamicCache`` that stores (and hands attention) e4m3-rounded K/V in every layer not in
    ``keep``."""
    import transformers

    class RoundingCache(transformers.DynamicCache):
        def update(self, keys, values, layer_idx, *args, **kwargs):
            if layer_idx not in keep:
                keys = keys.clamp(-FP8_MAX, FP8_MAX).to(FP8).to(keys.dtype)
                values = values.clamp(-FP8_MAX, FP8_MAX).to(FP8).to(values.dtype)
            return super().update(keys, values, layer_idx, *args, **kwargs)

    return RoundingCache(config=config)


def measure(args) -> dict:
    import transformers

    engine = LLM(args.model, device="cpu", dtype="float32", max_model_len=64)
    layers = engine.engine.runner.model.model.layers
    ratios = [float(layer.self_attn.key_bias_ratios(layer.input_layernorm.weight).max()) for layer in layers]
    engine.close()
    variants = {"every layer fp8": set()}
    for bits in args.bits:
        variants[f"threshold 2^{bits}"] = {i for i, ratio in enumerate(ratios) if ratio > 2.0**bits}
    path = resolve_model_path(args.model)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    rows = []
    for text, task in TEXTS.items():
        ids = tokenizer(agreement.load_text(task)[0])["input_ids"]
        stride = (len(ids) - args.length) // max(1, args.windows - 1)
        windows = [torch.tensor([ids[i * stride:i * stride + args.length]]) for i in range(args.windows)]
        with torch.no_grad():
            exact = [torch.log_softmax(model(w).logits[0, -args.positions:].float(), -1) for w in windows]
            for name, keep in variants.items():
                kl, agree = [], []
                for window, want in zip(windows, exact):
                    cache = rounding_cache(keep, model.config)
                    got = torch.log_softmax(model(window, past_key_values=cache, use_cache=True)
                                            .logits[0, -args.positions:].float(), -1)
                    kl.append(float((want.exp() * (want - got)).sum(-1).mean()))
                    agree.append(float((got.argmax(-1) == want.argmax(-1)).float().mean()))
                rows.append({"text": text, "variant": name, "kept": sorted(keep), "kl": statistics.mean(kl),
                             "agreement": statistics.mean(agree)})
                print(f"{text} {name} (kept {sorted(keep)}): KL {rows[-1]['kl']:.5f}, "
                      f"agreement {rows[-1]['agreement']:.4f}", flush=True)
    return {"model": args.model, "length": args.length, "windows": args.windows, "positions": args.positions,
            "key_bias_ratios": ratios, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="an alias or HF folder")
    parser.add_argument("--bits", type=int, nargs="+", default=[4, 3, 2, 1], help="thresholds 2**b to try")
    parser.add_argument("--length", type=int, default=1024, help="window length (tokens)")
    parser.add_argument("--windows", type=int, default=4, help="windows per text")
    parser.add_argument("--positions", type=int, default=512, help="scored positions at each window's end")
    parser.add_argument("--out-dir", type=Path, required=True, help="where the JSON and the markdown table go")
    args = parser.parse_args()
    record = {"provenance": provenance("cpu"), **measure(args)}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"fp8-fragile-layers-{args.model}-cpu"
    stem.with_name(stem.name + ".json").write_text(json.dumps(record, indent=1))
    head = record["provenance"]
    lines = [f"# FP8 KV cache: which layers to keep in the model dtype ({args.model})", "",
             f"`{head['command']}` — commit {head['commit']}, {head['machine']}, {head['date']}", "",
             f"transformers' model in bf16, teacher-forced over {args.windows} windows of {args.length} tokens per "
             f"text; the last {args.positions} positions of each scored. KL: mean KL divergence of the next-token "
             "distribution with the other layers' K/V rounded to e4m3 from the unrounded one; agreement: their "
             "argmax agree.", "",
             "| text | layers kept in bf16 | kept | KL | agreement |", "|---|---|---|---|---|"]
    lines += [f"| {r['text']} | {r['variant']} | {r['kept']} | {r['kl']:.5f} | {r['agreement']:.2%} |"
              for r in record["rows"]]
    lines += ["", "Largest key bias / token-dependent key norm per layer: "
              + ", ".join(f"{r:.1f}" for r in record["key_bias_ratios"])]
    stem.with_name(stem.name + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
