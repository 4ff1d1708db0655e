"""A mixed step against its parts, on one GPU: what a chunk of a 32k prompt costs alone, with running decodes
riding in its step (chunked prefill's mixed steps), and what a decode-only step of those decodes costs.

Dense engine, dummy Llama-3.1-8B, bf16, chunks of ``--chunk`` tokens. In order, on one engine: a warm-up prompt of
``--prompt`` tokens alone; the same length alone, each chunk's step timed (CUDA synchronised around it), then a
third prompt with its third chunk's step under the torch profiler; ``--decodes`` requests of ``--decode-tokens``
admitted with random K/V (``e2e.synthetic_prefill``) and 12 decode-only steps timed (CUDA graphs); a prompt whose chunks ride
with those decodes (mixed steps), timed; another whose third mixed step is profiled. The first steps of a shape
include its kernels' compilation: they are reported, not hidden.

    python benchmarks/mixed_step.py --decodes 20 --out benchmarks/results/mixed-step-h200
    python benchmarks/mixed_step.py --render benchmarks/results/mixed-step-h200.json

``--smoke`` runs the same sequence on a tiny random Llama on the CPU (what the test runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

if __name__ == "__main__":  # run as a file: the checkout importable (questkv, benchmarks.*)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DECODE_STEPS = 12


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run(cfg, decodes: int, decode_tokens: int, prompt_tokens: int, chunk: int, max_model_len: int, device: str,
        dtype: str) -> dict:
    """The timed and profiled steps of the sequence in the module's docstring, on a dense engine of ``cfg``
    (random weights) on ``device``: ``decodes`` running requests of ``decode_tokens`` tokens, prompts of
    ``prompt_tokens`` in chunks of ``chunk``; a pool of ``decodes + 3`` sequences of ``max_model_len`` tokens."""
    from benchmarks.e2e_bench import kv_bytes_per_token, synthetic_prefill
    from torch.profiler import ProfilerActivity, profile

    from questkv import LLM, SamplingParams

    kv_bytes = kv_bytes_per_token(cfg) // 2 * getattr(torch, dtype).itemsize  # e2e's count is for 2-byte K/V
    llm = LLM(cfg, load_format="dummy", dtype=dtype, device=device, max_num_seqs=32, max_model_len=max_model_len,
              max_num_batched_tokens=chunk, kv_cache_memory=(decodes + 3) * max_model_len * kv_bytes)
    engine = llm.engine
    gen = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(2, cfg.vocab_size, (n,), generator=gen).tolist()

    def timed_steps(until) -> list[tuple[str, float]]:
        """(kind, ms) of each step until ``until()``; the kind by the scheduler's step counters."""
        out = []
        while not until():
            synchronize(device)
            start = time.perf_counter()
            before = engine.scheduler.step_counts.copy()
            engine.step()
            synchronize(device)
            kinds = [k for k, v in engine.scheduler.step_counts.items() if v != before[k]]
            out.append((kinds[0] if kinds else "none", round((time.perf_counter() - start) * 1e3, 2)))
        return out

    def profiled_step() -> dict:
        """One step under the torch profiler: GPU ms summed and the top kernels (name, count, ms)."""
        synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            engine.step()
            synchronize(device)
        rows: dict[str, list] = {}
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                row = rows.setdefault(event.name[:70], [0, 0.0])
                row[0] += 1
                row[1] += event.device_time
        top = sorted(rows.items(), key=lambda item: -item[1][1])[:12]
        return {"gpu_ms": round(sum(v[1] for v in rows.values()) / 1e3, 2),
                "top": [(name, n, round(us / 1e3, 2)) for name, (n, us) in top]}

    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    result: dict = {}
    engine.add_request(prompt(prompt_tokens), one)
    result["warmup"] = timed_steps(lambda: not engine.has_unfinished_requests())
    engine.add_request(prompt(prompt_tokens), one)
    result["alone"] = timed_steps(lambda: not engine.has_unfinished_requests())
    engine.add_request(prompt(prompt_tokens), one)
    timed_steps(lambda: engine.scheduler.step_tokens["prefill"] % prompt_tokens >= 2 * chunk)
    result["alone_profile_chunk3"] = profiled_step()
    while engine.has_unfinished_requests():
        engine.step()
    engine.scheduler.chunked_prefill = False  # the synthetic prefill admits every request in one step
    for _ in range(decodes):
        engine.add_request(prompt(decode_tokens), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    synthetic_prefill(engine)
    engine.scheduler.chunked_prefill = True
    result["decode"] = timed_steps(lambda: engine.scheduler.step_counts["decode"] >= DECODE_STEPS)
    engine.add_request(prompt(prompt_tokens), one)
    first = engine.scheduler.step_counts["mixed"]
    result["mixed"] = timed_steps(lambda: engine.scheduler.step_counts["mixed"] - first >= 4)
    engine.add_request(prompt(prompt_tokens), one)
    first = engine.scheduler.step_counts["mixed"]
    timed_steps(lambda: engine.scheduler.step_counts["mixed"] - first >= 2)
    result["mixed_profile_chunk3"] = profiled_step()
    result["decode_median_ms"] = statistics.median(ms for _, ms in result["decode"][2:])
    llm.close()
    return result


def report(data: dict) -> str:
    """Markdown of a run's JSON: every number from it."""
    prov, settings = data["provenance"], data["settings"]
    alone = [ms for kind, ms in data["alone"] if kind == "prefill"]
    mixed = [ms for kind, ms in data["mixed"] if kind == "mixed"]
    decode = data["decode_median_ms"]
    lines = [
        "# A mixed step against its parts (dense, dummy Llama-3.1-8B, bf16)",
        "",
        f"- command: `{prov['command']}`",
        f"- commit: `{prov['commit']}`; machine: {prov['machine']}; date: {prov['date']}",
        f"- torch {prov['torch']}, transformers {prov['transformers']}, python {prov['python']}",
        f"- a prompt of {settings['prompt_tokens']} tokens in chunks of {settings['chunk']}; "
        f"{settings['decodes']} running decodes at {settings['decode_tokens']} tokens (random K/V); ms per step, "
        "device synchronised "
        "around each step (host included)",
        "",
        f"Decode-only step of the {settings['decodes']} decodes (CUDA graph): median {decode:.2f} ms.",
        "",
        "| chunk | alone ms | with the decodes (mixed) ms | mixed − alone − decode-only ms |",
        "|---|---|---|---|",
    ]
    for i, (a, m) in enumerate(zip(alone, mixed)):
        lines.append(f"| {i + 1} | {a:.1f} | {m:.1f} | {m - a - decode:+.1f} |")
    lines += ["", f"Warm-up prompt alone (first use of each shape: compilation included): "
              f"{', '.join(f'{ms:.0f}' for _, ms in data['warmup'])} ms per step.", ""]
    for name in ("alone_profile_chunk3", "mixed_profile_chunk3"):
        prof = data[name]
        kind = name.split("_")[0]
        lines += [f"Kernels of chunk 3's step, {kind} (torch profiler): {prof['gpu_ms']:.1f} ms of GPU time",
                  "", "| kernel | count | ms |", "|---|---|---|"]
        lines += [f"| `{kernel}` | {n} | {ms:.2f} |" for kernel, n, ms in prof["top"]]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decodes", type=int, default=20, help="running decodes (default 20)")
    parser.add_argument("--decode-tokens", type=int, default=32000, help="tokens of each decode (default 32000)")
    parser.add_argument("--prompt", type=int, default=32000, help="tokens of the chunked prompts (default 32000)")
    parser.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens (default 8192)")
    parser.add_argument("--max-model-len", type=int, default=34816,
                        help="the engine's max_model_len; the pool holds decodes + 3 sequences of it (default 34816)")
    parser.add_argument("--smoke", action="store_true", help="a tiny random Llama on the CPU, short prompts")
    parser.add_argument("--out", help="write <out>.json and <out>.md")
    parser.add_argument("--render", help="a run's JSON: write its markdown next to it, nothing else")
    args = parser.parse_args(argv)
    if args.render:
        path = Path(args.render)
        path.with_suffix(".md").write_text(report(json.loads(path.read_text())) + "\n")
        return 0
    device, dtype = ("cpu", "float32") if args.smoke else ("cuda", "bfloat16")
    if args.smoke:
        args.decodes, args.decode_tokens, args.prompt, args.chunk, args.max_model_len = 3, 96, 100, 32, 320
    elif not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (the decode graphs and Triton kernels), or --smoke")
    if (not 1 <= args.decodes <= 28 or args.prompt < 3 * args.chunk
            or not 1 <= args.decode_tokens <= args.max_model_len - 200 or args.prompt >= args.max_model_len):
        parser.error(f"--decodes must be in [1, 28], --prompt at least 3 chunks and below --max-model-len, and "
                     f"--decode-tokens in [1, max_model_len - 200] (each decodes up to 200 tokens), got "
                     f"{args.decodes}, {args.prompt} (chunk {args.chunk}), {args.decode_tokens} and "
                     f"{args.max_model_len}")
    from questkv.eval.provenance import provenance

    if args.smoke:
        from transformers import LlamaConfig
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    else:
        from questkv.models.shapes import dummy_config
        cfg = dummy_config("llama3.1-8b")
    data = {"provenance": provenance(device),
            "settings": {"decodes": args.decodes, "decode_tokens": args.decode_tokens, "prompt_tokens": args.prompt,
                         "chunk": args.chunk, "max_model_len": args.max_model_len,
                         "model": "tiny random Llama (smoke)" if args.smoke else "llama3.1-8b"},
            **run(cfg, args.decodes, args.decode_tokens, args.prompt, args.chunk, args.max_model_len, device, dtype)}
    for key, value in data.items():
        print(key, json.dumps(value))
    if args.out:
        Path(args.out).with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
        Path(args.out).with_suffix(".md").write_text(report(data) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
