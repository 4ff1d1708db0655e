"""Helpers shared by the test packages (models, engine, server): tiny random models and the like.

Test files import it as ``from tests.helpers import ...`` (``python -m pytest`` from the repository root puts
the root on ``sys.path``; ``tests`` is a namespace package). Each section below belongs to the tests named in
its header; add a section rather than editing another's.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# ---------------------------------------------------------------------------------------------------------------
# Tiny random Llama-family models (tests/models, tests/engine, tests/server)
# ---------------------------------------------------------------------------------------------------------------

# family -> (transformers config class name, keyword arguments). Every family is small enough for a CPU test in
# fp32 (vocab ~100, hidden 64 or 128, 2-3 layers) and together they cover each flag of ModelSpec.
_TINY_COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, rms_norm_eps=1e-5,
                    max_position_embeddings=256)
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # llama3 rope; theta 1e4 and a pretraining length of 32 put frequencies in all three llama3 bands
    "llama3": ("LlamaConfig", dict(
        _TINY_COMMON, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    )),
    # linear rope scaling, GQA 4:1, tied embeddings
    "llama_linear": ("LlamaConfig", dict(
        _TINY_COMMON, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    )),
    # MHA, default rope, Llama's optional attention and MLP biases
    "llama_mha": ("LlamaConfig", dict(
        _TINY_COMMON, num_attention_heads=4, num_key_value_heads=4, attention_bias=True, mlp_bias=True,
        vocab_size=128, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )),
    # Mistral (full attention: no sliding window), head_dim 32 with 4 heads != hidden 64
    "mistral": ("MistralConfig", dict(
        _TINY_COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )),
    # Qwen2: QKV bias (no o_proj bias), GQA 7:1 (14 q / 2 KV heads), head_dim 64 with hidden 128, tied embeddings
    "qwen2": ("Qwen2Config", dict(
        _TINY_COMMON, hidden_size=128, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
        tie_word_embeddings=True, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )),
    # Qwen3: q/k RMSNorm per head, head_dim 32 with 4 heads != hidden 64, untied
    "qwen3": ("Qwen3Config", dict(
        _TINY_COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )),
}


def tiny_config(family: str, **overrides: Any):
    """A fresh transformers config of a tiny model of ``family`` (a key of :data:`TINY_CONFIGS`).

    ``overrides`` replace or add config keyword arguments (``num_hidden_layers=1``, ``tie_word_embeddings=...``).
    """
    import copy

    import transformers

    class_name, kwargs = TINY_CONFIGS[family]
    kwargs = copy.deepcopy(kwargs)
    kwargs.update(overrides)
    return getattr(transformers, class_name)(**kwargs)


@torch.no_grad()
def tiny_hf_model(config, seed: int = 0):
    """A transformers causal LM for ``config`` in fp32 eval mode (eager attention) with random weights that make
    every parameter matter: norm weights around 1, non-zero biases, and query/key projections large enough that
    attention is far from uniform."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen)
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.3 * noise)
        elif name.endswith("bias"):
            param.copy_(0.2 * noise)
        elif name.endswith(("q_proj.weight", "k_proj.weight")):
            param.copy_(0.2 * noise)
        elif name.endswith("embed_tokens.weight"):
            param.copy_(0.25 * noise)  # tied heads reuse it: logits of a few units
        else:
            param.copy_(0.1 * noise)
    return model.eval()


PAGE_SIZE = 4  # small pages: a prompt of ten-odd tokens spans several


@torch.no_grad()
def engine_greedy(model, prompts, steps: int, quest=None, dtype=torch.float32, page_size: int = PAGE_SIZE):
    """Run a ``questkv.models.llama.LlamaForCausalLM`` on the CPU over a fresh page pool: prefill all
    ``prompts`` (``[n_i]`` int64 each) in one step, then ``steps`` batched greedy decode steps.

    Returns ``(prefill_logits, decode_logits, tokens)``: per sequence ``[len(prompt), vocab]``, per step
    ``[batch, vocab]``, and ``[batch, steps + 1]`` greedy tokens (the last one never fed back).
    """
    from questkv.cache.paged import PagedKVCache
    from questkv.config import QuestConfig
    from questkv.decode.context import StepContext
    from questkv.decode.step import QuestDecodeStep
    from questkv.layers.attention import bind_cache

    spec = model.spec
    lens = [len(p) for p in prompts]
    cache = PagedKVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, num_pages=32, page_size=page_size,
                         dtype=dtype)
    bind_cache(model, cache)
    seq_ids = [cache.add_sequence() for _ in prompts]
    ctx = StepContext.for_prefill(cache, seq_ids, lens)
    positions = torch.cat([torch.arange(n) for n in lens])
    hidden = model(torch.cat(prompts), positions, ctx)  # [T, hidden]
    prefill_logits = list(model.compute_logits(hidden).split(lens))
    tokens = [torch.stack([logits[-1].argmax() for logits in prefill_logits])]  # [B]
    max_pages = math.ceil((max(lens) + steps) / page_size)
    step = QuestDecodeStep(quest or QuestConfig(page_size=page_size), len(prompts), spec.num_q_heads,
                           spec.num_kv_heads, spec.head_dim, max_pages, dtype, "cpu")
    positions = torch.tensor(lens)
    decode_logits = []
    for _ in range(steps):
        ctx = StepContext.for_decode(cache, seq_ids, step)
        logits = model.compute_logits(model(tokens[-1], positions, ctx))  # [B, vocab]
        decode_logits.append(logits)
        tokens.append(logits.argmax(-1))
        positions = positions + 1
    return prefill_logits, decode_logits, torch.stack(tokens, dim=1)


# ---------------------------------------------------------------------------------------------------------------
# Paged caches of known keys, word tokenizers and tiny Llamas (tests/ops, tests/policies, tests/eval, tests/test_*)
# ---------------------------------------------------------------------------------------------------------------


class OneLayerCache:
    """A one-layer :class:`~questkv.PagedKVCache` holding given per-sequence keys and values.

    The tokens are appended round-robin in chunks of ``page_size + 1`` (they straddle pages), so the
    sequences' physical pages interleave.

    Args:
        keys, values: per sequence ``[len, num_kv_heads, head_dim]``.
        page_size: tokens per page. extra_tokens: room per sequence for later :meth:`append_token` s.
        dtype: the cache's dtype; :attr:`keys` / :attr:`values` hold what it stores, as float32.

    Attributes:
        cache: the cache. ids: its sequence ids, one per sequence.
        keys, values: per sequence ``[len, num_kv_heads, head_dim]`` float32, every token appended so far.
    """

    def __init__(self, keys, values, page_size: int, extra_tokens: int = 0, dtype: torch.dtype = torch.float32):
        import math

        from questkv import PagedKVCache

        num_kv_heads, head_dim = keys[0].shape[1:]
        num_pages = sum(math.ceil((k.shape[0] + extra_tokens) / page_size) for k in keys) + 2
        self.cache = PagedKVCache(1, num_kv_heads, head_dim, num_pages, page_size, max_seqs=len(keys), dtype=dtype)
        self.ids = [self.cache.add_sequence() for _ in keys]
        self.keys = [k.to(dtype=dtype, copy=True).float() for k in keys]
        self.values = [v.to(dtype=dtype, copy=True).float() for v in values]
        written, chunk = [0] * len(keys), page_size + 1
        while any(w < k.shape[0] for w, k in zip(written, keys)):
            ids, counts, ks, vs = [], [], [], []
            for i, k in enumerate(self.keys):
                n = min(chunk, k.shape[0] - written[i])
                if n > 0:
                    ids.append(self.ids[i]), counts.append(n)
                    ks.append(k[written[i] : written[i] + n]), vs.append(self.values[i][written[i] : written[i] + n])
                    written[i] += n
            self.cache.append(ids, counts, torch.cat(ks)[None].to(dtype), torch.cat(vs)[None].to(dtype))

    def append_token(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append one token per sequence: ``keys`` / ``values`` ``[batch, num_kv_heads, head_dim]``."""
        dtype = self.cache.dtype
        self.cache.append(self.ids, [1] * len(self.ids), keys[None].to(dtype), values[None].to(dtype))
        for i in range(len(self.ids)):
            self.keys[i] = torch.cat([self.keys[i], keys[i : i + 1].to(dtype).float()])
            self.values[i] = torch.cat([self.values[i], values[i : i + 1].to(dtype).float()])

    def step_inputs(self):
        """``(layer, page_table, seq_lens)`` of a decode step over every sequence."""
        page_table, seq_lens = self.cache.batch(self.ids)
        return self.cache.layer(0), page_table, seq_lens


def random_cache(lens, num_kv_heads: int = 2, head_dim: int = 8, page_size: int = 4, extra_tokens: int = 0,
                 dtype: torch.dtype = torch.float32) -> OneLayerCache:
    """A :class:`OneLayerCache` of sequences of ``lens`` tokens: random values and random keys of
    mixed signs around shared per-dim offsets (so page bounds are of mixed, not centred, signs)."""
    offset = torch.randn(head_dim)
    keys = [torch.randn(n, num_kv_heads, head_dim) * 2 + offset for n in lens]
    values = [torch.randn(n, num_kv_heads, head_dim) for n in lens]
    return OneLayerCache(keys, values, page_size, extra_tokens, dtype)


def dense_probs(q: torch.Tensor, keys: torch.Tensor, sm_scale=None) -> torch.Tensor:
    """Softmax probabilities ``[num_q_heads, len]`` float64 of one sequence's query ``[num_q_heads, head_dim]``
    over its keys ``[len, num_kv_heads, head_dim]``, brute force."""
    group = q.shape[0] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).double()  # [len, Hq, D]
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    return torch.softmax(torch.einsum("hd,thd->ht", q.double(), k) * scale, dim=-1)


def word_tokenizer(words, split_digits: bool = False):
    """A word-level ``PreTrainedTokenizerFast`` (offline, instant): ``<unk>`` 0, ``<eos>`` 1, then
    ``words`` sorted, one token per word (and per digit with ``split_digits``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1}
    for word in sorted(set(words)):
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    splits = [pre_tokenizers.Whitespace()] + ([pre_tokenizers.Digits(individual_digits=True)] if split_digits else [])
    backend.pre_tokenizer = pre_tokenizers.Sequence(splits)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")


def tiny_llama(vocab_size: int, seed: int = 0, **overrides: Any):
    """A transformers ``LlamaForCausalLM`` in eval mode, random weights (seeded), fast on a CPU: hidden
    32, 3 layers, 4 query and 2 KV heads (GQA). ``overrides`` replace ``LlamaConfig`` arguments."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    kwargs = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return LlamaForCausalLM(LlamaConfig(**{**kwargs, **overrides})).eval()


# ---------------------------------------------------------------------------------------------------------------
# Engine: a tiny model folder (weights + word tokenizer) and greedy requests
# ---------------------------------------------------------------------------------------------------------------


def save_tiny_model(path, vocab_size: int, seed: int, family: str = "llama3"):
    """Save a tiny random ``family`` model and a word tokenizer (token ``i >= 2`` is the word ``x{i:02d}``) to
    ``path``, an HF folder the engine loads; returns ``path``."""
    tiny_hf_model(tiny_config(family, vocab_size=vocab_size), seed=seed).save_pretrained(path)
    word_tokenizer([f"x{i:02d}" for i in range(2, vocab_size)]).save_pretrained(path)
    return path


def greedy_params(max_tokens: int, **kwargs):
    """Greedy ``SamplingParams`` that run exactly ``max_tokens`` tokens (EOS ignored)."""
    from questkv.engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Kernels against their torch reference under the Triton interpreter (tests/ops)
# ---------------------------------------------------------------------------------------------------------------

INTERPRETER_TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
"""Relative error a kernel may show against its reference under the interpreter, by dtype: the interpreter truncates
float32 → bf16 / fp16 casts where a GPU rounds to nearest (a couple of units in their last place)."""


def fresh_generator() -> torch.Generator:
    """A CPU generator seeded afresh from torch's global seed (every test draws new random inputs)."""
    return torch.Generator().manual_seed(torch.seed() % 2**31)


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    """``|out - want| / |want|`` (Frobenius norms, in float64); fails on a NaN in ``out``."""
    assert not torch.isnan(out).any()
    return ((out.double() - want.double()).norm() / want.double().norm()).item()


def int4_words_weight(n: int, k: int, dtype: torch.dtype, zeros_u8: bool, device) -> tuple:
    """A random int4 weight ``[n, k]`` (group 128) as the CUDA int4 kernels read it: ``(words, scales in dtype, zero
    points in uint8 or dtype, qweight)``."""
    from questkv.ops import quant_reference as ref

    w = torch.randn((n, k), device=device) * 0.05
    qweight, scales, zeros = ref.quantize_weight(w, "int4", 128, dtype=dtype)
    words = ref.pack_int4_k_major(qweight, 128)
    return words, scales, zeros.to(torch.uint8) if zeros_u8 else zeros.to(dtype), qweight
