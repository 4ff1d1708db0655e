"""The demos: a passkey prompt answered by the engine dense and with Quest (``questkv demo``, ``make demo``), and
Quest vs dense decode attention on random tensors with planted relevant pages (``questkv demo-tensors``).

The passkey demo owns its prompt, runs and report; the engine (:class:`~questkv.engine.llm.LLM`) does the work and
:mod:`questkv.eval.passkey` builds and scores the prompt.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import sys
import textwrap
from typing import Callable, Optional, Sequence

import torch

from questkv.cache import PagedKVCache
from questkv.config import QuestConfig
from questkv.ops import reference
from questkv.decode import quest_decode


def build_cache(batch: int, context: int, num_kv_heads: int, head_dim: int, page_size: int, hot_pages: int, seed: int):
    """A one-layer cache of ``batch`` sequences of ``context`` random keys, in which ``hot_pages``
    random pages per sequence hold keys aligned with a random direction; returns the cache,
    its sequence ids and that direction ``[batch, num_kv_heads, head_dim]``."""
    generator = torch.Generator().manual_seed(seed)
    num_pages = batch * math.ceil(context / page_size)
    cache = PagedKVCache(1, num_kv_heads, head_dim, num_pages, page_size, max_seqs=batch)
    direction = torch.randn(batch, num_kv_heads, head_dim, generator=generator)
    direction = direction / direction.norm(dim=-1, keepdim=True)
    seq_ids = [cache.add_sequence() for _ in range(batch)]
    keys = torch.randn(batch, context, num_kv_heads, head_dim, generator=generator)
    values = torch.randn(batch, context, num_kv_heads, head_dim, generator=generator)
    for b in range(batch):
        pages = torch.randperm(context // page_size, generator=generator)[:hot_pages]
        for page in pages.tolist():
            keys[b, page * page_size : (page + 1) * page_size] += 8.0 * head_dim**0.25 * direction[b]
    cache.append(seq_ids, [context] * batch, keys.flatten(0, 1)[None], values.flatten(0, 1)[None])
    return cache, seq_ids, direction


def run_demo(
    budgets=(64, 256, 1024, None),
    batch: int = 2,
    context: int = 8192,
    num_q_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    page_size: int = 16,
    seed: int = 0,
) -> list[dict]:
    """Rows of (budget, fraction of KV read, attention mass kept, error vs dense) for each budget."""
    cache, seq_ids, direction = build_cache(batch, context, num_kv_heads, head_dim, page_size, 8, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    group = num_q_heads // num_kv_heads
    q = direction.repeat_interleave(group, dim=1) * head_dim**0.25
    q = q + 0.3 * torch.randn(batch, num_q_heads, head_dim, generator=generator)
    layer = cache.layer(0)
    page_table, seq_lens = cache.batch(seq_ids)
    dense = quest_decode(q, layer, page_table, seq_lens, QuestConfig())
    all_pages = page_table.shape[1]
    rows = []
    for budget in budgets:
        config = QuestConfig(token_budget=budget, page_size=page_size, dense_layers=0)
        out = quest_decode(q, layer, page_table, seq_lens, config)
        if budget is None:
            mass, pages_read = 1.0, all_pages
        else:
            scores = reference.page_scores(q, layer.kmin, layer.kmax, page_table, seq_lens, page_size)
            selected = reference.select_pages(scores, seq_lens, page_size, config.budget_pages)
            mass = _attention_mass(q, layer, page_table, seq_lens, selected, page_size)
            pages_read = config.budget_pages
        error = ((out - dense).norm() / dense.norm()).item()
        rows.append(
            {
                "budget": budget,
                "kv_read": pages_read / all_pages,
                "attention_mass": mass,
                "rel_error_vs_dense": error,
            }
        )
    return rows


def _attention_mass(q, layer, page_table, seq_lens, selected, page_size) -> float:
    """Mean over (sequence, query head) of the dense softmax mass on the selected pages."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = layer.k_pages.shape[2]
    keys = layer.k_pages[page_table.long()].flatten(1, 2)  # [B, T, Hkv, D]
    keys = keys.repeat_interleave(num_q_heads // num_kv_heads, dim=2)
    logits = torch.einsum("bhd,bthd->bht", q.float(), keys.float()) / math.sqrt(head_dim)
    positions = torch.arange(keys.shape[1])
    logits = logits.masked_fill(positions >= seq_lens[:, None, None], float("-inf"))
    probs = logits.softmax(-1).view(batch, num_q_heads, -1, page_size).sum(-1)  # [B, Hq, P]
    sel = selected.long().repeat_interleave(num_q_heads // selected.shape[1], dim=1)
    picked = torch.zeros_like(probs).scatter_(-1, sel.clamp(min=0), (sel >= 0).float())
    return (probs * picked).sum(-1).mean().item()


def format_table(rows: list[dict]) -> str:
    header = f"{'budget':>8} {'KV read':>8} {'attn mass':>10} {'rel err vs dense':>17}"
    lines = [header, "-" * len(header)]
    for row in rows:
        budget = "full" if row["budget"] is None else str(row["budget"])
        lines.append(
            f"{budget:>8} {row['kv_read']:>8.1%} {row['attention_mass']:>10.4f} "
            f"{row['rel_error_vs_dense']:>17.2e}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# The passkey demo on the engine
# ---------------------------------------------------------------------------------------------------------------

DEMO_LENGTH = 4000  # tokens: full attention finds the key at 50 % depth on smollm2-135m (checked by running it)
DEMO_DEPTH = 0.5
DEMO_BUDGETS = (256,)
DEMO_PAGE_SIZE = 8  # page 8 matched full attention on smollm2-135m's passkey prompts at 2k-4k, page 16 did not
DEMO_MAX_TOKENS = 10
PAGE_NOTE = (
    "Why page 8: on this 135M model, Quest with page 8 matched full attention on passkey prompts of 2k-4k tokens, "
    "page 16 did not (budget 256, with the question decoded through Quest too: page 8 found 9/10 keys at 2k and "
    "4k like full attention, page 16 5/10 and 0/10; benchmarks/results/passkey-smollm2-135m*.md). On the default "
    "prompt, `questkv demo --page-size 16` answers ' 338.' at budget 256."
)


@dataclasses.dataclass(frozen=True)
class PasskeyRun:
    """One engine's answer to the demo's prompt.

    Attributes:
        name: ``"dense"`` or ``"quest"``. token_budget: Quest's budget (``None``: dense).
        text: the answer. new_tokens: its tokens (the first from the prefill, each other from a decode step).
        found: its first integer is the key.
        decode_tokens_per_s: the request's decode speed (``None`` with fewer than two tokens).
        mean_tokens_attended: KV tokens a decode step read, averaged over steps, layers and heads.
        kv_fraction: ``mean_tokens_attended`` / the mean context of the decode steps
            (:func:`questkv.generate.kv_read`).
        prefill_seconds: time to the first token.
    """

    name: str
    token_budget: Optional[int]
    text: str
    new_tokens: int
    found: bool
    decode_tokens_per_s: Optional[float]
    mean_tokens_attended: Optional[float]
    kv_fraction: Optional[float]
    prefill_seconds: float


def run_passkey_demo(
    model: str = "smollm2-135m",
    length: int = DEMO_LENGTH,
    depth: float = DEMO_DEPTH,
    budgets: Sequence[Optional[int]] = DEMO_BUDGETS,
    page_size: int = DEMO_PAGE_SIZE,
    max_tokens: int = DEMO_MAX_TOKENS,
    seed: int = 0,
    log: Optional[Callable[[str], None]] = None,
    **engine_kwargs,
) -> dict:
    """Answer one passkey prompt of ``length`` tokens (key at ``depth``) greedily with a dense engine, then with a
    Quest engine per budget of ``budgets`` (``None`` entries are skipped: that is the dense run), one engine alive
    at a time.

    Args:
        model: what :func:`questkv.load_model` takes; it needs a tokenizer.
        page_size: Quest's page size; ``dense_layers`` is :class:`QuestConfig`'s default (2).
        seed: picks the key (:func:`questkv.eval.passkey.trial_key`).
        log: called with a line before each slow part (default: print to stderr).
        **engine_kwargs: other :class:`~questkv.engine.engine_config.EngineConfig` fields (``device``, ``dtype``, ...).

    Returns:
        ``{"model", "prompt_tokens", "depth", "key", "page_size", "dense_layers", "num_layers", "runs": [PasskeyRun
        as a dict, ...]}``, the dense run first.
    """
    from questkv.engine.llm import LLM
    from questkv.engine.sampling_params import SamplingParams
    from questkv.eval import passkey
    from questkv.generate import kv_read, mean_decode_context
    from questkv.validation import check_float, check_int

    check_int("length", length, minimum=64)
    check_float("depth", depth, low=0, high=1)
    check_int("max_tokens", max_tokens, minimum=1)
    quests = [QuestConfig(token_budget=b, page_size=page_size) for b in budgets if b is not None]  # validated first
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    key = passkey.trial_key(seed, length, 0)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    engine_kwargs = {"max_num_seqs": 1, "max_model_len": length + max_tokens + 64, **engine_kwargs}
    prompt_ids, runs, num_layers = None, [], None
    for quest in [None] + quests:
        name = "dense" if quest is None else f"quest (budget {quest.token_budget})"
        log(f"building the {name} engine ...")
        llm = LLM(model, quest=quest, **engine_kwargs)
        if prompt_ids is None:
            if llm.tokenizer is None:
                raise ValueError(f"the passkey demo needs a model with a tokenizer; {model!r} has none")
            text = passkey.build_prompt(llm.tokenizer, length, depth, key)
            prompt_ids = llm.tokenizer(text)["input_ids"]
        num_layers = llm.engine.spec.num_layers
        log(f"{name}: prefilling {len(prompt_ids)} tokens, then decoding {max_tokens} ...")
        (out,) = llm.generate([prompt_ids], params, use_tqdm=False)
        del llm
        gc.collect()
        metrics = out.metrics
        attended, fraction = kv_read(metrics.mean_tokens_attended, mean_decode_context(len(prompt_ids),
                                                                                       len(out.token_ids)))
        runs.append(PasskeyRun(
            name="dense" if quest is None else "quest",
            token_budget=None if quest is None else quest.token_budget,
            text=out.text,
            new_tokens=len(out.token_ids),
            found=passkey.is_correct(out.text, key),
            decode_tokens_per_s=metrics.decode_tokens_per_s,
            mean_tokens_attended=attended,
            kv_fraction=fraction,
            prefill_seconds=metrics.time_to_first_token,
        ))
    return {
        "model": str(model),
        "prompt_tokens": len(prompt_ids),
        "depth": depth,
        "key": key,
        "page_size": page_size,
        "dense_layers": QuestConfig().dense_layers,
        "num_layers": num_layers,
        "runs": [dataclasses.asdict(run) for run in runs],
    }


def format_passkey_demo(result: dict) -> str:
    """What ``questkv demo`` prints: the setting, one row per engine, and why these settings."""
    tokens, layers, dense_layers = result["prompt_tokens"], result["num_layers"], result["dense_layers"]
    intro = (
        f"A {tokens}-token prompt hides the pass key {result['key']} at {result['depth']:.0%} depth in filler text and "
        f"asks for it at the end ({result['model']}). Both engines prefill the prompt with full attention; the "
        "answer's first token comes from that prefill, every later one from a decode step, "
        f"which with Quest reads only the highest-scoring pages (page {result['page_size']}) of the KV cache in "
        f"layers >= {dense_layers}."
    )
    lines = textwrap.wrap(intro, 116) + [""]
    header = f"{'engine':<18} {'answer':<24} {'key found':<10} {'decode tok/s':>12}   KV cache read per decode step"
    lines += [header, "-" * len(header)]
    for run in result["runs"]:
        name = "dense" if run["token_budget"] is None else f"quest, budget {run['token_budget']}"
        speed = "n/a" if run["decode_tokens_per_s"] is None else f"{run['decode_tokens_per_s']:.1f}"
        if run["kv_fraction"] is None:
            read = "n/a (no decode step)"
        elif run["token_budget"] is None:
            read = f"{run['kv_fraction']:.1%} (all {run['mean_tokens_attended']:.0f} tokens)"
        else:
            context = run["mean_tokens_attended"] / run["kv_fraction"]
            read = (f"{run['kv_fraction']:.1%} ({run['mean_tokens_attended']:.0f} tokens of {context:.0f}: "
                    f"{run['token_budget']} in each of {layers - dense_layers} sparse layers, "
                    f"all in {dense_layers} dense)")
        lines.append(f"{name:<18} {run['text']!r:<24} {'yes' if run['found'] else 'no':<10} {speed:>12}   {read}")
    steps = sorted({run["new_tokens"] - 1 for run in result["runs"] if run["decode_tokens_per_s"] is not None})
    if steps:
        count = str(steps[0]) if len(steps) == 1 else f"{steps[0]} to {steps[-1]}"
        lines += [""] + textwrap.wrap(f"decode tok/s is timed over {count} decode steps per answer, too few to time "
                                      "steadily: noisy on a shared CPU, it varies from run to run.", 116)
    lines += [""] + textwrap.wrap(PAGE_NOTE, 116)
    return "\n".join(lines)
