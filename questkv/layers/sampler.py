"""Token sampling on the device: greedy, temperature, top-k, top-p and a per-request seed.

Every row is sampled from its own logits and parameters only, so a request's tokens do not depend on what
else shares the batch. The randomness is a counter-based integer hash of ``(seed, step, vocab index)``
computed with torch integer ops: no ``torch.Generator``, no host synchronisation, the same code on CPU and
CUDA, capturable in a CUDA graph. The same seed, step, logits and parameters give the same token on the same
device and dtype (floating-point softmax and sort may round differently on another device).

Which seed and step a request uses is the engine's choice; passing the request's number of generated
tokens as ``step`` makes a preempted and recomputed request draw exactly as it would have.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

__all__ = ["Sampler", "uniform_noise"]

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # 2**32 / golden ratio, odd: multiplying by it permutes the 32-bit integers


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """``x * constant mod 2**32`` for int64 ``x`` in ``[0, 2**32)``, without int64 overflow: a constant
    above ``2**31`` is used as ``constant - 2**32`` (the same modulo ``2**32``), so the product's magnitude
    stays below ``2**63``; ``& (2**32 - 1)`` of the two's-complement result is the low 32 bits."""
    return (x * (constant - 2**32 if constant >= 2**31 else constant)) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' ``lowbias32`` integer hash, a bijection of ``[0, 2**32)`` (int64 in and out)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform numbers in ``(0, 1)`` from a hash of ``(seeds[b], steps[b], v)``.

    Args:
        seeds: ``[B]`` int64 in ``[0, 2**63)``.
        steps: ``[B]`` int64 in ``[0, 2**32)`` (higher bits are ignored).
        vocab_size: ``V``.

    Returns:
        ``[B, V]`` float32, odd multiples of ``2**-24`` (never 0 or 1); within a row the values come from
        distinct hash outputs.
    """
    seeds, steps = seeds.to(torch.int64), steps.to(torch.int64)
    high = _mul32(((seeds >> 32) & _MASK32) ^ _GOLDEN, 0x85EBCA6B)  # [B]
    key = _hash32(_hash32((seeds & _MASK32) ^ high) ^ (steps & _MASK32))  # [B], one key per (seed, step)
    vocab = _mul32(torch.arange(vocab_size, device=seeds.device, dtype=torch.int64), _GOLDEN)  # [V]
    bits = _hash32(key[:, None] ^ vocab[None, :])  # [B, V] in [0, 2**32), a bijection of v within a row
    return ((bits >> 8) | 1).to(torch.float32) * (2.0**-24)


class Sampler(nn.Module):
    """One token per row of logits, with per-row temperature, top-k, top-p, seed and step.

    Greedy rows (temperature 0) take the argmax of their logits (the first maximal index). Other rows
    divide the logits by the temperature, keep the ``top_k`` most likely tokens (0: all), then the smallest
    prefix of those, most likely first, whose probability (renormalised over the top-k) reaches ``top_p``
    (at least one token), and sample from what is left by the Gumbel-max trick with the noise of
    :func:`uniform_noise`. Equal logits are ordered by vocab index (a stable sort), so the kept set is
    deterministic when ties straddle its edge.
    """

    def forward(
        self,
        logits: torch.Tensor,
        temperatures: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        seeds: torch.Tensor,
        steps: torch.Tensor,
        *,
        all_greedy: bool = False,
        apply_top_k_top_p: bool = True,
    ) -> torch.Tensor:
        """Sample one token per row.

        Args:
            logits: ``[B, V]`` float (computed in float32).
            temperatures: ``[B]`` float32 >= 0; 0 is greedy.
            top_k: ``[B]`` int32 or int64; 0 keeps all, values above ``V`` keep all.
            top_p: ``[B]`` float32 in ``(0, 1]``; 1 keeps all.
            seeds: ``[B]`` int64 in ``[0, 2**63)``, the request's seed.
            steps: ``[B]`` int64 in ``[0, 2**32)``, the request's draw counter (its number of generated tokens).
            all_greedy: a host-side promise that every row is greedy: only the argmax is computed.
            apply_top_k_top_p: ``False`` is a host-side promise that no row restricts top-k or top-p (every
                ``top_k`` 0 and ``top_p`` 1): the sort is skipped, with the same result.

        Returns:
            ``[B]`` int64 token ids on the logits' device.
        """
        logits = logits.float()
        greedy_tokens = logits.argmax(dim=-1)
        if all_greedy:
            return greedy_tokens
        greedy = temperatures <= 0
        scaled = logits / torch.where(greedy, torch.ones_like(temperatures), temperatures).float()[:, None]
        mask: Optional[torch.Tensor] = _top_k_top_p_mask(scaled, top_k, top_p) if apply_top_k_top_p else None
        # Gumbel-max: argmax(logit + g), g = -log(-log(u)), samples softmax(logit) exactly.
        scores = scaled - torch.log(-torch.log(uniform_noise(seeds, steps, logits.shape[-1])))  # [B, V]
        if mask is not None:
            scores = scores.masked_fill(mask, float("-inf"))
        return torch.where(greedy, greedy_tokens, scores.argmax(dim=-1))


def _top_k_top_p_mask(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` bool, ``True`` where a token is cut by top-k or top-p (never the most likely one)."""
    vocab_size = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)  # [B, V]
    rank = torch.arange(vocab_size, device=scaled.device)
    top_k = top_k.to(torch.int64)
    k = torch.where((top_k <= 0) | (top_k > vocab_size), vocab_size, top_k)  # [B]
    cut = rank[None, :] >= k[:, None]  # [B, V] in sorted order
    probs = sorted_logits.masked_fill(cut, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the more likely tokens
    top_p = top_p.float()[:, None]
    cut = cut | ((mass_before >= top_p) & (top_p < 1))
    cut[:, 0] = False
    return torch.empty_like(cut).scatter_(-1, order, cut)
