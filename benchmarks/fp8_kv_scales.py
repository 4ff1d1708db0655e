"""Which scales an fp8 (e4m3) KV cache needs (issue 43): attention's error under each scale scheme, on real K/V.

The engine (fp32, CPU) prefills a window of the agreement tasks' book and code text (:mod:`questkv.eval.agreement`);
every layer's queries, rotated keys and values are captured, and causal attention over the K/V stored in e4m3 under
each scheme is compared with attention over the exact K/V (relative Frobenius error of the output, per layer):

- ``none``: scale 1 (the pool stores k and v as they are);
- ``data-free`` (the engine's scales, :meth:`~questkv.layers.attention.Attention.fit_kv_scales`): per layer and KV
  head, the smallest power of two >= 1 that keeps the weights' bound of |k| and |v|
  (:meth:`~questkv.models.llama.LlamaAttention.kv_bounds`) within 448;
- ``data-free, any power of two``: the same bound brought to 448 whichever way (scales below 1 too);
- ``calibrated``: per layer and KV head, this very window's max |k| and |v| brought to 448 (calibration on the test
  text: the best a calibration set could do);
- ``per token``: every token and head its own max brought to 448 (finer than any per-page scale could be);
- ``engine``: what the engine stores: ``data-free``, and in bf16 the layers whose key bias outweighs their keys
  (:meth:`~questkv.models.llama.LlamaForCausalLM.fp8_fragile_layers`).

Also the share of values that saturate (past 448 before the cast) and that fall below e4m3's smallest normal (2**-6,
where it keeps fewer than 3 bits), and bf16 K/V's error beside them.

    python benchmarks/fp8_kv_scales.py --models smollm2-135m qwen2.5-coder-1.5b --out-dir benchmarks/results
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
import torch.nn.functional as F  # noqa: E402

from questkv.engine.llm import LLM  # noqa: E402
from questkv.engine.sampling_params import SamplingParams  # noqa: E402
from questkv.eval import agreement  # noqa: E402
from questkv.eval.provenance import provenance  # noqa: E402
from questkv.layers.attention import Attention  # noqa: E402
from questkv.ops import reference  # noqa: E402

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
SMALLEST_NORMAL = 2.0**-6
TEXTS = {"book": "agreement_book", "code": "agreement_code"}
SCHEMES = ("none", "data-free", "data-free, any power of two", "calibrated", "per token", "engine")


def capture(llm: LLM, tokens: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Prefill ``tokens`` and return each layer's ``(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D])``, q and k rotated."""
    layers: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def keep(module, args):
        q, k, v, cos, sin = (t.detach().float() for t in args[:5])
        layers[module.layer_idx] = (reference.rotate(q, cos, sin), reference.rotate(k, cos, sin), v.clone())

    hooks = [m.register_forward_pre_hook(keep) for m in llm.engine.runner.model.modules() if isinstance(m, Attention)]
    try:
        llm.generate([tokens], SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
    finally:
        for hook in hooks:
            hook.remove()
    return layers


def scales(scheme: str, x: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Scheme ``scheme``'s scales for ``x`` ``[T, H, D]`` (weights' bound ``[H]``), broadcastable to ``x``."""
    if scheme == "none":
        return torch.ones(1, x.shape[1], 1)
    if scheme in ("data-free", "engine"):
        return torch.exp2(torch.ceil(torch.log2(bound / FP8_MAX)).clamp(min=0))[None, :, None]
    if scheme == "data-free, any power of two":
        return torch.exp2(torch.ceil(torch.log2(bound / FP8_MAX)))[None, :, None]
    if scheme == "calibrated":
        return (x.abs().amax(dim=(0, 2)) / FP8_MAX)[None, :, None]
    return x.abs().amax(dim=2, keepdim=True).clamp(min=1e-30) / FP8_MAX  # per token


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         is_causal=True, enable_gqa=True)
    return out[0]


def stored(x: torch.Tensor, scale: torch.Tensor, wide: bool = False) -> tuple[torch.Tensor, float, float]:
    """``x`` as an e4m3 pool under ``scale`` holds it (saturating), dequantized; the shares saturated and subnormal
    (``wide``: as a bf16 layer holds it)."""
    if wide:
        return x.bfloat16().float(), 0.0, 0.0
    scaled = x / scale
    saturated = float((scaled.abs() > FP8_MAX).float().mean())
    subnormal = float(((scaled != 0) & (scaled.abs() < SMALLEST_NORMAL)).float().mean())
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale, saturated, subnormal


def measure_model(name: str, length: int) -> dict:
    llm = LLM(name, device="cpu", dtype="float32", max_model_len=length + 8, max_num_seqs=1)
    model = llm.engine.runner.model
    bounds = [layer.self_attn.kv_bounds(layer.input_layernorm.weight) for layer in model.model.layers]  # [2, Hkv]
    fragile = model.fp8_fragile_layers()
    ratios = [float(layer.self_attn.key_bias_ratios(layer.input_layernorm.weight).max()) for layer in model.model.layers]
    rows = []
    for text, task in TEXTS.items():
        tokens = llm.tokenizer(agreement.load_text(task)[0])["input_ids"][:length]
        per_layer = {scheme: [] for scheme in (*SCHEMES, "bf16")}
        share = {scheme: [0.0, 0.0] for scheme in SCHEMES}
        peak = 0.0
        for index, (q, k, v) in sorted(capture(llm, tokens).items()):
            exact = attend(q, k, v)
            peak = max(peak, float(k.abs().max() / bounds[index][0].max()), float(v.abs().max() / bounds[index][1].max()))
            for scheme in SCHEMES:
                wide = scheme == "engine" and index in fragile
                k8, k_sat, k_sub = stored(k, scales(scheme, k, bounds[index][0]), wide)
                v8, v_sat, v_sub = stored(v, scales(scheme, v, bounds[index][1]), wide)
                per_layer[scheme].append(float((attend(q, k8, v8) - exact).norm() / exact.norm()))
                share[scheme][0] += (k_sat + v_sat) / 2 / len(bounds)
                share[scheme][1] += (k_sub + v_sub) / 2 / len(bounds)
            bf16 = attend(q, k.bfloat16().float(), v.bfloat16().float())
            per_layer["bf16"].append(float((bf16 - exact).norm() / exact.norm()))
        for scheme, errors in per_layer.items():
            rows.append({"model": name, "text": text, "tokens": len(tokens), "scheme": scheme,
                         "mean_error": statistics.mean(errors), "max_error": max(errors),
                         "worst_layer": errors.index(max(errors)),
                         "saturated": share[scheme][0] if scheme in share else 0.0,
                         "subnormal": share[scheme][1] if scheme in share else None,
                         "peak_of_bound": peak})
            print(f"{name} {text} {scheme}: mean error {rows[-1]['mean_error']:.4f}, max {rows[-1]['max_error']:.4f}",
                  flush=True)
    llm.close()
    return {"model": name, "rows": rows,
            "max_bound": {"k": max(float(b[0].max()) for b in bounds), "v": max(float(b[1].max()) for b in bounds)},
            "scaled_layers": [i for i, b in enumerate(bounds) if bool((b > FP8_MAX).any()) and i not in fragile],
            "fragile_layers": fragile,
            "key_bias_ratios": ratios}


def table(record: dict) -> list[str]:
    head = record["provenance"]
    lines = ["# FP8 (e4m3) KV cache: attention's error under each scale scheme", "",
             f"`{head['command']}` — commit {head['commit']}, {head['machine']}, {head['date']}", "",
             f"One {record['length']}-token window per text; per layer, the relative error of causal attention's output "
             "over the K/V as an e4m3 pool stores them (dequantized) against the exact fp32 K/V; mean and worst "
             "layer. *saturated*: share of values past 448 before the cast; *subnormal*: share below 2^-6 after "
             "scaling (under 3 bits kept).", "",
             "| model | text | scheme | mean error | worst layer | saturated | subnormal |", "|---|---|---|---|---|---|---|"]
    for model in record["models"]:
        for r in model["rows"]:
            subnormal = "" if r["subnormal"] is None else f"{r['subnormal']:.2%}"
            saturated = "" if r["scheme"] == "bf16" else f"{r['saturated']:.3%}"
            lines.append(f"| {r['model']} | {r['text']} | {r['scheme']} | {r['mean_error']:.2%} | "
                         f"{r['max_error']:.2%} (layer {r['worst_layer']}) | {saturated} | {subnormal} |")
    lines += ["", "Weights' bounds (`LlamaAttention.kv_bounds`), the layers the data-free rule scales and those kept in the "
              "model dtype (`LlamaForCausalLM.fp8_fragile_layers`):", ""]
    lines += [f"- {m['model']}: largest bound of |k| {m['max_bound']['k']:.1f}, of |v| {m['max_bound']['v']:.1f}; "
              f"largest |k| or |v| seen / its layer's bound {max(r['peak_of_bound'] for r in m['rows']):.3f}; "
              f"layers scaled: {m['scaled_layers'] or 'none'}; kept in the model dtype: {m['fragile_layers'] or 'none'}; "
              f"largest key bias / token-dependent key norm per layer: "
              f"{', '.join(f'{r:.1f}' for r in m['key_bias_ratios'])}" for m in record["models"]]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m"], help="aliases, HF folders or .gguf files")
    parser.add_argument("--length", type=int, default=1024, help="window length (tokens)")
    parser.add_argument("--out-dir", type=Path, required=True, help="where the JSON and the markdown table go")
    parser.add_argument("--tag", default="cpu", help="the files' suffix")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    record = {"provenance": provenance("cpu"), "length": args.length,
              "models": [measure_model(name, args.length) for name in args.models]}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"fp8-kv-scales-{args.tag}"
    stem.with_name(stem.name + ".json").write_text(json.dumps(record, indent=1))
    lines = table(record)
    stem.with_name(stem.name + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
