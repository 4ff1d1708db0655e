"""The HF drop-in on a CUDA GPU: Triton kernels vs the torch reference through a whole model.

On a random-weight Llama-family model (GQA, sharpened queries so page selection matters) this checks,
with the GPU image's transformers:

* a budget covering the context: greedy tokens identical to the unpatched model, logits close;
* a small budget: the Triton path (``backend="triton"``) against the torch reference ops run on the
  same CUDA tensors (``backend="torch"``): greedy tokens and logits;
* a left-padded batch of two prompts equals each prompt generated alone.

Then it times greedy decoding (ms per token, CUDA-synchronised wall clock, eager PyTorch, no CUDA
graphs) dense vs Quest. Writes ``hf-gpu-check.json`` + ``.md`` and prints a table last.

Usage (on the GPU machine)::

    python benchmarks/hf_gpu_check.py --out-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

if __name__ == "__main__":  # run as a file: the checkout importable (questkv, benchmarks.*)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import questkv  # noqa: E402
from questkv.eval.provenance import git_commit  # noqa: E402

MODEL = dict(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=6,
             num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=65536)


def make_model(dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL, pad_token_id=0))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
    return model.to("cuda", dtype).eval()


def greedy(model, ids, new_tokens, **kwargs):
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0, **kwargs)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1).float()


def compare(name, tokens_a, logits_a, tokens_b, logits_b, logits_atol):
    same = torch.equal(tokens_a, tokens_b)
    diff = (logits_a - logits_b).abs().max().item()
    ok = same and diff <= logits_atol
    return {"check": name, "tokens_identical": same, "max_abs_logit_diff": diff, "atol": logits_atol, "pass": ok}


def correctness(context: int, new_tokens: int) -> list[dict]:
    """fp32 checks (bf16 greedy paths may legitimately split on near-tied logits)."""
    dtype, atol = torch.float32, 1e-3
    model = make_model(dtype)
    ids = torch.randint(1, MODEL["vocab_size"], (1, context), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    checks = []
    ref = greedy(model, ids, new_tokens)
    questkv.enable(model, questkv.QuestConfig(token_budget=-(-(context + new_tokens) // 16) * 16, dense_layers=1))
    full = greedy(model, ids, new_tokens)
    checks.append(compare("budget covers context == unpatched", *ref, *full, atol))
    small = dict(token_budget=128, dense_layers=1)
    for selection in ("kv_head", "q_head"):
        questkv.enable(model, questkv.QuestConfig(**small, selection=selection, backend="torch"))
        torch_path = greedy(model, ids, new_tokens)
        questkv.enable(model, questkv.QuestConfig(**small, selection=selection, backend="triton"))
        triton_path = greedy(model, ids, new_tokens)
        checks.append(compare(f"budget 128 {selection}, triton == torch reference", *torch_path, *triton_path, atol))
    short = ids[:, : context // 2]
    padded = torch.cat([torch.zeros_like(ids[:, : context - short.shape[1]]), short], dim=1)
    batch = torch.cat([ids, padded])
    mask = torch.cat([torch.ones_like(ids), torch.cat([torch.zeros_like(ids[:, : context - short.shape[1]]), torch.ones_like(short)], 1)])
    questkv.enable(model, questkv.QuestConfig(**small, backend="triton"))
    together = greedy(model, batch, new_tokens, attention_mask=mask)
    alone = [greedy(model, ids, new_tokens), greedy(model, short, new_tokens)]
    same = all(torch.equal(together[0][i], alone[i][0][0]) for i in range(2))
    checks.append({"check": "left-padded batch == each alone (budget 128)", "tokens_identical": same,
                   "max_abs_logit_diff": None, "atol": None, "pass": same})
    questkv.disable(model)
    return checks


def decode_ms_per_token(model, ids, new_tokens: int, reps: int) -> float:
    greedy(model, ids, 4)  # warm-up: compilation, allocator
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        prefill = time.perf_counter() - start
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens + 1, min_new_tokens=new_tokens + 1, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start - prefill) / new_tokens * 1e3)
    times.sort()
    return times[len(times) // 2]


def timing(contexts: list[int], budget: int, new_tokens: int, reps: int) -> list[dict]:
    model = make_model(torch.bfloat16)
    rows = []
    for context in contexts:
        ids = torch.randint(1, MODEL["vocab_size"], (1, context), device="cuda")
        questkv.disable(model)
        unpatched = decode_ms_per_token(model, ids, new_tokens, reps)
        questkv.enable(model, questkv.QuestConfig(dense_layers=1))
        paged_dense = decode_ms_per_token(model, ids, new_tokens, reps)
        questkv.enable(model, questkv.QuestConfig(token_budget=budget, dense_layers=1))
        quest = decode_ms_per_token(model, ids, new_tokens, reps)
        rows.append({"context": context, "budget": budget, "hf_sdpa_ms": unpatched,
                     "questkv_dense_ms": paged_dense, "questkv_quest_ms": quest})
    questkv.disable(model)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=700, help="prompt tokens for the correctness checks")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--timing-contexts", default="4096,32768")
    parser.add_argument("--budget", type=int, default=1024, help="token budget of the timing runs")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/hf_gpu_check.py needs a CUDA GPU", file=sys.stderr)
        return 2
    info = {
        "command": "python " + " ".join(sys.argv),
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": {**MODEL, "q_proj_scale": 4.0, "weights": "random"},
    }
    checks = correctness(args.context, args.new_tokens)
    contexts = [int(c) for c in args.timing_contexts.split(",")]
    rows = timing(contexts, args.budget, args.new_tokens, args.reps)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hf-gpu-check.json").write_text(json.dumps({**info, "checks": checks, "decode": rows}, indent=2))
    lines = [
        "# HF drop-in on the GPU: Triton path vs torch reference, decode latency",
        "",
        f"- command: `{info['command']}`",
        f"- commit: `{info['commit']}`, date: {info['date']}",
        f"- GPU: {info['gpu']}, torch {info['torch']}, transformers {info['transformers']}",
        f"- model: random-weight Llama, {MODEL['num_hidden_layers']} layers, {MODEL['num_attention_heads']} q / "
        f"{MODEL['num_key_value_heads']} KV heads, head_dim {MODEL['head_dim']}; dense_layers 1",
        "",
        "fp32 checks:",
        "",
        "| check | tokens identical | max abs logit diff | pass |",
        "|---|---|---|---|",
        *[f"| {c['check']} | {c['tokens_identical']} | "
          f"{'-' if c['max_abs_logit_diff'] is None else format(c['max_abs_logit_diff'], '.2e')} | {c['pass']} |"
          for c in checks],
        "",
        "Greedy decode, batch 1, bf16, eager (no CUDA graphs), median ms per generated token:",
        "",
        "| context | budget | HF SDPA (unpatched) | questkv dense paged | questkv Quest |",
        "|---|---|---|---|---|",
        *[f"| {r['context']} | {r['budget']} | {r['hf_sdpa_ms']:.2f} | {r['questkv_dense_ms']:.2f} | {r['questkv_quest_ms']:.2f} |"
          for r in rows],
    ]
    (out / "hf-gpu-check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(c["pass"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
