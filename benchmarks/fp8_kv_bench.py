"""FP8 KV cache on a GPU (issue 43): the engine's decode step with float8 e4m3 K/V beside the model-dtype K/V, same
run, random weights at real shapes, synthetic contexts (``e2e_bench``'s), plus the KV tokens each fits.

Per point, in one run: a dense engine and a Quest engine, each with ``kv_cache_dtype="auto"`` and ``"fp8"``, timed
in alternation (rounds of asynchronous decode steps, the order swapped every round; median ms per step and the
median of the per-round ratios; where the two engines do not fit on the GPU together, one after the other, marked), and a correctness check first: on a small fp32 model with sharpened attention the
fp8 engine's CUDA path (graphs, Triton kernels) gives the tokens of its eager torch-reference path, and with a budget
covering the context fp8 Quest gives fp8 dense's tokens. ``--fp8-scores f16`` times the attention on fp8 pages as
it was before its scores moved to e4m3 tensor-core dots (float16 dots, at that kernel's measured launch), for a
comparison in the same session.

    python benchmarks/fp8_kv_bench.py --out-dir $OUT --tag h200
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from pathlib import Path

import torch

if __name__ == "__main__":  # run as a file: the checkout importable (questkv, benchmarks.*)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.e2e_bench import (  # noqa: E402
    context_config, kv_bytes_per_token, profile_replay, synthetic_prefill, time_rounds)
from questkv.config import QuestConfig  # noqa: E402
from questkv.engine.llm import LLM  # noqa: E402
from questkv.engine.sampling_params import SamplingParams  # noqa: E402
from questkv.eval.provenance import provenance  # noqa: E402
from questkv.models.shapes import dummy_config  # noqa: E402

PAGE, DENSE_LAYERS = 16, 2
# The float16-dot kernel's launch on fp8 pages, dense and sparse: 128 keys per iteration, 3 programs per SM, 2 stages
# (its best at B=8/32k in benchmarks/results/kernel-sweep-h100-fp8.md).
F16_DOT_LAUNCH = (128, 3, 2)
POINTS = [  # (model, batch, context, budget); the targets: dense B=16/32k and B=4/128k >= 1.6x, Quest B=16/32k
    ("llama3.1-8b", 16, 32 * 1024, 2048),  # >= 1.15x
    ("llama3.1-8b", 4, 128 * 1024, 4096),
    ("llama3.1-8b", 1, 32 * 1024, 2048),
    ("llama3.1-8b", 1, 128 * 1024, 4096),
]
KV_DTYPES = ("auto", "fp8")


def check(device: str = "cuda") -> dict:
    """fp8 engine: CUDA path (graphs, Triton kernels) == eager reference path, the norms unfused so that the maths is
    the same (beside the same comparison on model-dtype pages, the baseline that tells an fp32 near tie from a fault);
    the tokens of the default CUDA path, whose fused RMSNorm kernel rounds float32 differently from torch's ops (on
    fp8 pages a key near an e4m3 rounding midpoint then lands on the other e4m3 value, 1/16 apart, so its tokens part
    from the reference's sooner than on float32 pages); fp8 Quest with a covering budget == fp8 dense."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (700, 1500, 333)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def tokens(quest, kv_cache_dtype="fp8", **kwargs):
        llm = LLM(cfg, quest=quest, load_format="dummy", dtype="float32", device=device, max_num_seqs=4,
                  kv_cache_memory=256 << 20, seed=5, kv_cache_dtype=kv_cache_dtype, **kwargs)
        with torch.no_grad():
            for layer in llm.engine.runner.model.model.layers:
                layer.self_attn.qkv_proj.weight.mul_(8.0)
        if kwargs.get("enforce_eager"):
            llm.engine.cache.backend = "torch"
            for module in llm.engine.runner.model.modules():
                if hasattr(module, "backend"):
                    module.backend = "torch"
        out = [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.close()
        return out

    quest = QuestConfig(token_budget=256, page_size=PAGE, dense_layers=1, dense_context_ratio=1.0)
    full = QuestConfig(token_budget=2048, page_size=PAGE, dense_layers=1)
    results = {}
    for name, config in (("dense", None), ("quest-256", quest)):
        results[name] = {}
        for kv in KV_DTYPES:
            want = tokens(config, kv, enforce_eager=True)
            got, fused = tokens(config, kv, compile_elementwise=False), tokens(config, kv)
            results[name][f"graphs_equal_reference_{kv}"] = got == want
            for label, out in (("tokens_matching", got), ("fused_norms_tokens_matching", fused)):
                matching = sum(a == b for x, y in zip(out, want) for a, b in zip(x, y))
                results[name][f"{label}_{kv}"] = f"{matching}/{sum(map(len, want))}"
    results["quest-full-equals-dense"] = tokens(full) == tokens(None)
    results["append_bytes_equal_reference"] = append_check(device)
    return results


def append_check(device: str = "cuda") -> dict:
    """Whether the Triton append into fp8 pages (the kernel rounds to e4m3 itself), alone and with RoPE folded in,
    writes the torch reference's bytes (torch's cast on the device, saturated at ±448) into pages and bounds, every
    finite bfloat16 value a key."""
    from questkv.ops import reference
    from questkv.ops import triton as tk

    gen = torch.Generator().manual_seed(7)
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    every = every[torch.isfinite(every)]
    every = every[torch.randperm(len(every), generator=gen)]
    heads, group, dim = 8, 4, 128
    tokens = len(every) // (heads * dim)
    keys = every[:tokens * heads * dim].view(tokens, heads, dim).to(device)
    q = torch.randn(tokens, heads * group, dim, generator=gen).to(device, torch.bfloat16)
    angles = torch.rand(tokens, dim // 2, generator=gen) * 100.0
    cos, sin = angles.cos().to(device, torch.bfloat16), angles.sin().to(device, torch.bfloat16)
    shape = (-(-(tokens + 3) // PAGE) + 1, PAGE, heads, dim)
    pools = [torch.zeros(shape, device=device).to(torch.float8_e4m3fn) for _ in range(2)]
    pools += [torch.randn(shape[0], heads, dim, device=device).to(torch.float8_e4m3fn) for _ in range(2)]
    slots = torch.arange(PAGE + 3, PAGE + 3 + tokens, device=device)  # (a first page joined mid-way)
    equal = {}
    for name, rope in (("append", False), ("rope_append", True)):
        want, got = [t.clone() for t in pools], [t.clone() for t in pools]
        for module, pool in ((reference, want), (tk, got)):
            if rope:
                module.rope_append_kv(*pool, slots, q.clone(), keys.clone(), keys.flip(0), cos, sin)
            else:
                module.append_kv(*pool, slots, keys, keys.flip(0))
        equal[name] = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want))
    return equal


def _kv_memory(cfg, batch, context, kv_cache_dtype, steps) -> int:
    element = 1 if kv_cache_dtype == "fp8" else 2
    need = batch * (context + steps + 4 * PAGE) * kv_bytes_per_token(cfg) * element // 2 * (PAGE + 2) // PAGE
    return int(need * 1.1) + (256 << 20)


def _engine(cfg, quest, batch, context, kv_cache_dtype, steps) -> LLM:
    llm = LLM(cfg, quest=quest, load_format="dummy", dtype="bfloat16", device="cuda", max_num_seqs=batch,
              max_model_len=context + PAGE, kv_cache_memory=_kv_memory(cfg, batch, context, kv_cache_dtype, steps),
              enable_chunked_prefill=False, async_scheduling=True, kv_cache_dtype=kv_cache_dtype)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for _ in range(batch):
        llm.engine.add_request(torch.randint(0, cfg.vocab_size, (context - steps - 2,), generator=gen).tolist(), params)
    synthetic_prefill(llm.engine)
    for _ in range(6):
        llm.engine.step()
    return llm


def _close(llm: LLM) -> None:
    llm.close()
    gc.collect()
    torch.cuda.empty_cache()


def point(model: str, batch: int, context: int, budget: int, rounds: int = 6, steps_per_round: int = 8) -> dict:
    """Both KV dtypes timed in alternation when their engines fit on the GPU together, else one after the other
    (``record[name]["alternated"]``: the ratio then compares rounds of separate engines)."""
    cfg = context_config(model, context)
    steps = 6 + 2 * rounds * steps_per_round
    record = {"model": model, "batch": batch, "context": context, "budget": budget}
    for name, quest in (("dense", None), ("quest", QuestConfig(token_budget=budget, page_size=PAGE,
                                                                 dense_layers=DENSE_LAYERS))):
        engines = {"auto": _engine(cfg, quest, batch, context, "auto", steps)}
        weights = sum(p.numel() * p.element_size() for p in engines["auto"].engine.runner.model.parameters())
        together = torch.cuda.mem_get_info()[0] > 1.05 * (weights + _kv_memory(cfg, batch, context, "fp8", steps)) + (
            4 << 30)  # activations, graphs
        kv_tokens = {"auto": engines["auto"].engine.runner.cache_spec.kv_tokens}
        if together:
            engines["fp8"] = _engine(cfg, quest, batch, context, "fp8", steps)
            kv_tokens["fp8"] = engines["fp8"].engine.runner.cache_spec.kv_tokens
            ms = time_rounds(engines, rounds, steps_per_round)[0]
            for llm in engines.values():
                _close(llm)
        else:
            ms = time_rounds(engines, rounds, steps_per_round)[0]
            _close(engines.pop("auto"))
            engines["fp8"] = _engine(cfg, quest, batch, context, "fp8", steps)
            kv_tokens["fp8"] = engines["fp8"].engine.runner.cache_spec.kv_tokens
            ms.update(time_rounds(engines, rounds, steps_per_round)[0])
            _close(engines.pop("fp8"))
        del engines
        record[name] = {dtype: statistics.median(ms[dtype]) for dtype in KV_DTYPES}
        record[name]["speedup"] = statistics.median(a / b for a, b in zip(ms["auto"], ms["fp8"]))
        record[name]["kv_tokens"] = kv_tokens
        record[name]["alternated"] = together
        print(f"{model} B={batch} {context}: {name} bf16-KV {record[name]['auto']:.2f} ms, fp8-KV "
              f"{record[name]['fp8']:.2f} ms ({record[name]['speedup']:.2f}x"
              f"{'' if together else ', engines one after the other'})", flush=True)
    return record


def profile(model: str, batch: int, context: int, budget: int) -> dict:
    """The kernels of one decode-graph replay (:func:`~benchmarks.e2e_bench.profile_replay`) of the dense and the
    Quest engine at each KV dtype, one engine at a time: where the fp8 step's time goes."""
    cfg = context_config(model, context)
    record = {"model": model, "batch": batch, "context": context, "budget": budget}
    for name, quest in (("dense", None), ("quest", QuestConfig(token_budget=budget, page_size=PAGE,
                                                                 dense_layers=DENSE_LAYERS))):
        for dtype in KV_DTYPES:
            llm = _engine(cfg, quest, batch, context, dtype, 16)
            record[f"{name}/{dtype}"] = profile_replay(llm.engine.runner, top=8)
            _close(llm)
            print(f"{name} {dtype}: {json.dumps(record[f'{name}/{dtype}'])}", flush=True)
    return record


def profile_table(record: dict) -> str:
    """The markdown of a ``--profile`` record: per engine and KV dtype, the kernels and GPU µs of one decode step
    and its top kernels."""
    head, prof = record["provenance"], record["profile"]
    lines = [f"# FP8 KV cache: the kernels of one decode step ({prof['model']} B={prof['batch']} "
             f"{prof['context'] // 1024}k, Quest budget {prof['budget']})", "",
             f"`{head['command']}` — commit {head['commit']}, {head['machine']}, {head['date']}", "",
             "One replay of the decode step's CUDA graph under the torch profiler (CUDA activity).", "",
             "| engine / KV | kernels | GPU µs | top kernels (count, µs) |", "|---|---|---|---|"]
    for key, entry in prof.items():
        if isinstance(entry, dict):
            top = "; ".join(f"{t['name'][:60]} ({t['count']}, {t['us']:.0f})" for t in entry["top"][:6])
            lines.append(f"| {key} | {entry['count']} | {entry['us']:.0f} | {top} |")
    return "\n".join(lines) + "\n"


def capacity(model: str = "llama3.1-8b", memory: int = 40 << 30) -> dict:
    """KV tokens ``memory`` bytes of KV cache hold at each KV dtype at ``model``'s shape (bf16 weights): the engine's
    own planner (``questkv.engine.kv_pool.plan_cache``, what ``CacheSpec.kv_tokens`` reports), no weights built."""
    from questkv.engine.engine_config import EngineConfig
    from questkv.engine.kv_pool import plan_cache
    from questkv.models.llama import ModelSpec

    cfg = dummy_config(model)
    spec = ModelSpec.from_hf_config(cfg)
    tokens = {}
    for dtype in KV_DTYPES:
        config = EngineConfig(model=cfg, load_format="dummy", dtype="bfloat16", device="cpu", kv_cache_memory=memory,
                              kv_cache_dtype=dtype)
        tokens[dtype] = plan_cache(config, spec, 8192, torch.device("cpu")).kv_tokens
    return {"model": model, "memory_bytes": memory, "kv_tokens": tokens, "ratio": tokens["fp8"] / tokens["auto"]}


def table(record: dict) -> str:
    head = record["provenance"]
    lines = ["# FP8 KV cache: decode step, bf16 KV vs fp8 KV", "",
             f"`{head['command']}` — commit {head['commit']}, {head['machine']}, {head['date']}", "",
             "fp8 pages scored in " + {"e4m3": "e4m3 tensor-core dots",
                                       "f16": "float16 dots (the kernel before e4m3 scores)"}[record["fp8_scores"]], "",
             f"Checks: {json.dumps(record['check'])}", "",
             f"KV tokens in {record['capacity']['memory_bytes'] / 2**30:.0f} GiB ({record['capacity']['model']}): "
             f"{record['capacity']['kv_tokens']} — {record['capacity']['ratio']:.3f}×", "",
             "| point | dense bf16-KV ms | dense fp8-KV ms | dense speedup | Quest bf16-KV ms | Quest fp8-KV ms | Quest speedup |",
             "|---|---|---|---|---|---|---|"]
    for p in record["points"]:
        d, q = p["dense"], p["quest"]
        mark = {name: "" if p[name].get("alternated", True) else " (apart)" for name in ("dense", "quest")}
        lines.append(f"| {p['model']} B={p['batch']} {p['context'] // 1024}k/{p['budget']} | {d['auto']:.2f} | "
                     f"{d['fp8']:.2f} | {d['speedup']:.2f}×{mark['dense']} | {q['auto']:.2f} | {q['fp8']:.2f} | "
                     f"{q['speedup']:.2f}×{mark['quest']} |")
    lines += ["", "(apart): the two engines did not fit on the GPU together and were timed one after the other."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, required=True, help="where the JSON and the markdown table go")
    parser.add_argument("--tag", default="h200", help="the files' suffix: fp8-kv-TAG.{json,md}")
    parser.add_argument("--points", default=None,
                        help="model:batch:context:budget,... (default: the issue's four points)")
    parser.add_argument("--capacity-only", action="store_true",
                        help="only the KV tokens per memory (the planner's arithmetic: runs on a CPU)")
    parser.add_argument("--profile", action="store_true",
                        help="instead of timing: the kernels of one decode step at the first point, per KV dtype")
    parser.add_argument("--fp8-scores", default="e4m3", choices=("e4m3", "f16"),
                        help="fp8 pages: scores in e4m3 tensor-core dots (the kernel's default) or float16 dots at "
                        "their own launch (the kernel before e4m3 scores)")
    args = parser.parse_args()
    if args.fp8_scores == "f16":
        from questkv.ops.triton import decode_attention

        decode_attention.E4M3_DOTS = False
        decode_attention._CONFIG.update({"dense-fp8": F16_DOT_LAUNCH, "sparse-fp8": F16_DOT_LAUNCH})
    points = POINTS if args.points is None else [
        (m, int(b), int(c), int(k)) for m, b, c, k in (p.split(":") for p in args.points.split(","))]
    if args.profile:
        record = {"provenance": provenance("cuda"), "profile": profile(*points[0])}
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / f"fp8-kv-profile-{args.tag}.json").write_text(json.dumps(record, indent=1))
        (args.out_dir / f"fp8-kv-profile-{args.tag}.md").write_text(profile_table(record))
        print(profile_table(record))
        return
    if args.capacity_only:
        record = {"provenance": provenance("cpu"), "capacity": capacity()}
        stem = args.out_dir / f"fp8-kv-capacity-{args.tag}"
        args.out_dir.mkdir(parents=True, exist_ok=True)
        stem.with_name(stem.name + ".json").write_text(json.dumps(record, indent=1))
        cap, head = record["capacity"], record["provenance"]
        text = (f"# FP8 KV cache: KV tokens per memory\n\n`{head['command']}` — commit {head['commit']}, "
                f"{head['machine']}, {head['date']}\n\n| model | KV cache | bf16 KV tokens | fp8 KV tokens | ratio |\n"
                f"|---|---|---|---|---|\n| {cap['model']} | {cap['memory_bytes'] / 2**30:.0f} GiB | "
                f"{cap['kv_tokens']['auto']:,} | {cap['kv_tokens']['fp8']:,} | {cap['ratio']:.3f}× |\n")
        stem.with_name(stem.name + ".md").write_text(text)
        print(text)
        return
    record = {"provenance": provenance("cuda"), "fp8_scores": args.fp8_scores, "check": check(),
              "capacity": capacity(), "points": []}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"fp8-kv-{args.tag}"
    for p in points:  # saved after every point: a run stopped by a time limit keeps what it measured
        record["points"].append(point(*p))
        stem.with_name(stem.name + ".json").write_text(json.dumps(record, indent=1))
        stem.with_name(stem.name + ".md").write_text(table(record))
    print(table(record))


if __name__ == "__main__":
    main()
