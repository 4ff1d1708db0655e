"""Quest vs dense decode attention on random tensors with planted relevant pages."""

from __future__ import annotations

import math

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
