"""questkv's own Llama-family causal LM: Llama 2/3/3.1, Mistral, Qwen2/2.5 and Qwen3 in one module.

The families differ only by flags of :class:`ModelSpec` (QKV bias, q/k RMSNorm, rope type, tied embeddings),
read once from a transformers config and the family's entry of :mod:`questkv.models.families`. Owns the decoder
stack, the fused projections' layout, the mapping of HF safetensors names onto it
(:meth:`LlamaForCausalLM.load_weights`) and which linears hold a checkpoint's packed weights as they are stored
(:meth:`LlamaForCausalLM.use_packed_linears`). Attention itself, and so the KV cache, is
``questkv.layers.attention.Attention``'s: the model passes it post-RoPE queries, keys and values and the step's
``StepContext``, and never touches the cache.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Union

import torch
from torch import nn

from questkv.config import QuestConfig
from questkv.distributed.group import TensorParallel
from questkv.layers.activation import SiluAndMul
from questkv.layers.attention import Attention
from questkv.layers.linear import Linear, MergedLinear, copy_param
from questkv.layers.norm import RMSNorm
from questkv.layers.parallel import (
    ParallelLMHead,
    VocabParallelEmbedding,
    mark_column_parallel,
    mark_row_parallel,
    row_parallel_bias,
    shard_of,
    shard_tensor,
)
from questkv.layers.quantized_linear import QuantizedLinear, QuantLayout
from questkv.layers.rotary import ROPE_TYPES, RopeScaling, RotaryEmbedding
from questkv.models.families import MODEL_TYPES, model_family
from questkv.ops.quant_reference import ALL_METHODS, QuantizedWeight, check_method
from questkv.validation import check_bool, check_choice, check_float, check_int

if TYPE_CHECKING:  # transformers takes seconds to import; only from_hf_config reads a config
    from transformers import PretrainedConfig

    from questkv.decode.context import StepContext

__all__ = ["LlamaForCausalLM", "ModelSpec"]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The shape and flags of one Llama-family model: all :class:`LlamaForCausalLM` needs to be built.

    Attributes:
        model_type: one of :data:`~questkv.models.families.MODEL_TYPES` (kept for messages; behaviour follows the
            flags below).
        head_dim: per-head size, independent of ``hidden_size`` (Qwen3 uses ``head_dim * num_q_heads !=
            hidden_size``).
        rope_scaling: ``None`` for the ``default`` rope, else how ``linear`` or ``llama3`` rope stretches it.
        attention_bias: the q/k/v projections have a bias (Qwen2 always; the others when configured).
        o_proj_bias: the output projection has a bias (Qwen2 never; the others with ``attention_bias``).
        mlp_bias: the gate/up/down projections have a bias (Llama's ``mlp_bias``).
        qk_norm: RMSNorm over ``head_dim`` of every query and key head before RoPE (Qwen3).
        tie_word_embeddings: the LM head shares the input embedding's weight.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[RopeScaling]
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self) -> None:
        check_choice("ModelSpec.model_type", self.model_type, MODEL_TYPES)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_q_heads", "num_kv_heads",
                     "max_position_embeddings"):
            check_int(f"ModelSpec.{name}", getattr(self, name), minimum=1)
        check_int("ModelSpec.head_dim", self.head_dim, minimum=2)
        if self.head_dim % 2:
            raise ValueError(f"ModelSpec.head_dim must be even (rope rotates pairs), got {self.head_dim}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelSpec.num_q_heads must be a multiple of num_kv_heads={self.num_kv_heads}, "
                f"got {self.num_q_heads}"
            )
        check_float("ModelSpec.rms_norm_eps", self.rms_norm_eps, low=0.0, low_open=True)
        check_float("ModelSpec.rope_theta", self.rope_theta, low=0.0, low_open=True)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"ModelSpec.rope_scaling must be None or a RopeScaling, got {self.rope_scaling!r}")
        for name in ("tie_word_embeddings", "attention_bias", "o_proj_bias", "mlp_bias", "qk_norm"):
            check_bool(f"ModelSpec.{name}", getattr(self, name))

    @classmethod
    def from_hf_config(cls, config: "PretrainedConfig") -> "ModelSpec":
        """Read a transformers config of a supported family (:data:`~questkv.models.families.FAMILIES`: the
        family's flags from there, the rest from the config).

        Raises:
            ValueError: for another architecture, a rope type other than ``default``, ``linear`` and
                ``llama3``, partial rotary, sliding-window attention, or an activation other than SiLU, naming
                the value and what is supported.
        """
        family = model_family(getattr(config, "model_type", None))
        check_choice("config.hidden_act", getattr(config, "hidden_act", "silu"), ("silu",))
        _check_no_sliding_window(config)
        num_q_heads = config.num_attention_heads
        rope_theta, rope_scaling = _rope_from_config(config)
        config_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            model_type=family.model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_q_heads=num_q_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_q_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_q_heads,
            rms_norm_eps=float(config.rms_norm_eps),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=config_bias if family.qkv_bias is None else family.qkv_bias,
            o_proj_bias=config_bias if family.o_proj_bias is None else family.o_proj_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=family.qk_norm,
        )


def _check_no_sliding_window(config: Any) -> None:
    window = getattr(config, "sliding_window", None)
    if window is None or window >= config.max_position_embeddings:
        return  # a window covering every position is full attention
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return  # Qwen2/Qwen3 keep a window size but use it on no layer
    raise ValueError(
        f"config.sliding_window={window} (< max_position_embeddings={config.max_position_embeddings}) is not "
        "supported: questkv models attend the full context; supported: sliding_window None or >= "
        "max_position_embeddings"
    )


def _rope_from_config(config: Any) -> tuple[float, Optional[RopeScaling]]:
    """``(rope_theta, rope_scaling)`` from transformers 5's ``rope_parameters`` (or the older ``rope_scaling`` +
    ``rope_theta`` attributes)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if "rope_type" not in params and "type" not in params and any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"config.rope_parameters per layer type ({sorted(params)}) is not supported; supported: "
                         "one rope for all layers")
    check_choice("config.rope_parameters['rope_type']", rope_type, ROPE_TYPES)
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"config.partial_rotary_factor={partial!r} is not supported; supported: 1.0 (rope on every "
                         "dimension)")
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    return theta, RopeScaling(
        "llama3",
        float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", config.max_position_embeddings)
        ),
    )


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class LlamaAttention(nn.Module):
    """Fused QKV projection, optional q/k norm, RoPE, ``Attention`` and the output projection.

    With tensor parallelism (``tp``) the layer holds ``1 / tp.size`` of the query and KV heads (QKV
    column-parallel, the output projection row-parallel and all-reduced): each rank attends, and selects Quest
    pages, for its own KV heads only.
    """

    def __init__(self, spec: ModelSpec, layer_idx: int, quest: Optional[QuestConfig],
                 tp: Optional[TensorParallel] = None) -> None:
        super().__init__()
        heads, kv_heads = spec.num_q_heads, spec.num_kv_heads
        if tp is not None:
            heads, kv_heads = tp.split("num_attention_heads", heads), tp.split("num_key_value_heads", kv_heads)
        self.num_q_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, spec.head_dim
        q_size, kv_size = heads * spec.head_dim, kv_heads * spec.head_dim
        self.qkv_proj = MergedLinear(spec.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, spec.attention_bias)
        self.o_proj = Linear(q_size, spec.hidden_size, bias=spec.o_proj_bias)
        self.reduce = _identity if tp is None else tp.all_reduce  # chosen once: one rank runs no collective
        if tp is not None:
            full = spec.head_dim * spec.num_kv_heads
            mark_column_parallel(self.qkv_proj, (spec.head_dim * spec.num_q_heads, full, full), tp)
            mark_row_parallel(self.o_proj, tp)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.attn = Attention(
            layer_idx, heads, kv_heads, spec.head_dim, sm_scale=spec.head_dim**-0.5, quest=quest
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: "StepContext"
    ) -> torch.Tensor:
        """``x`` ``[T, hidden_size]``, ``cos``/``sin`` ``[T, head_dim // 2]`` → ``[T, hidden_size]``."""
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(-1, self.num_q_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        o = self.attn(q, k, v, cos, sin, ctx)  # rotates q and k (RoPE) as it stores k and v; [T, Hq, D]
        return self.reduce(self.o_proj(o.reshape(o.shape[0], -1)))  # [T, hidden]

    @torch.no_grad()
    def kv_bounds(self, input_norm: torch.Tensor) -> torch.Tensor:
        """Bounds ``[2, num_kv_heads]`` float32 of ``|k|`` (after the k norm and RoPE) and ``|v|`` over every input,
        from the weights alone. The projection's input is ``input_norm * x / rms(x)`` (``input_norm``: the layer's
        RMSNorm weight ``[hidden_size]``), and ``x / rms(x)`` has norm at most ``sqrt(hidden_size)``, so output row
        ``w`` (bias ``b``) stays within ``||w * input_norm|| * sqrt(hidden_size) + |b|`` (Cauchy-Schwarz; attained
        by ``x`` along ``w * input_norm``); a k norm bounds key element ``j`` by ``|k_norm.weight[j]| *
        sqrt(head_dim)`` instead; RoPE mixes element ``j`` with ``j +- head_dim / 2``, within the two bounds' norm.
        """
        proj = self.qkv_proj
        weight = proj.dequantized_weight() if isinstance(proj, QuantizedLinear) else proj.weight.float()
        rows = (weight * input_norm.float()).norm(dim=1) * weight.shape[1] ** 0.5
        if proj.bias is not None:
            rows = rows + proj.bias.float().abs()
        k, v = (rows[proj.shard_offsets[s] : proj.shard_offsets[s] + proj.shard_sizes[s]].view(self.num_kv_heads, -1)
                for s in ("k", "v"))
        if self.qk_norm:
            k = self.k_norm.weight.float().abs().expand_as(k) * self.head_dim**0.5
        half = self.head_dim // 2
        rotated = torch.hypot(k[:, :half], k[:, half:])  # either element of a RoPE pair
        return torch.stack([rotated.amax(dim=1), v.amax(dim=1)])

    @torch.no_grad()
    def key_bias_ratios(self, input_norm: torch.Tensor) -> torch.Tensor:
        """Per KV head (``[num_kv_heads]`` float32): the norm of the key bias over the norm of the key's
        token-dependent part for an input of unit RMS in every direction, ``||W_h diag(input_norm)||_F`` (``W_h``: the
        head's key rows); 0 without a bias."""
        proj = self.qkv_proj
        if proj.bias is None:
            return torch.zeros(self.num_kv_heads)
        weight = proj.dequantized_weight() if isinstance(proj, QuantizedLinear) else proj.weight.float()
        rows = slice(proj.shard_offsets["k"], proj.shard_offsets["k"] + proj.shard_sizes["k"])
        part = (weight[rows] * input_norm.float()).view(self.num_kv_heads, -1).norm(dim=1)
        return proj.bias[rows].float().view(self.num_kv_heads, -1).norm(dim=1) / part


class LlamaMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up in one GEMM (with ``tp``: each rank's share of the
    intermediate features, gate/up column-parallel, down row-parallel and all-reduced)."""

    def __init__(self, spec: ModelSpec, tp: Optional[TensorParallel] = None) -> None:
        super().__init__()
        size = spec.intermediate_size if tp is None else tp.split("intermediate_size", spec.intermediate_size)
        self.gate_up_proj = MergedLinear(spec.hidden_size, {"gate": size, "up": size}, spec.mlp_bias)
        self.act_fn = SiluAndMul()
        self.down_proj = Linear(size, spec.hidden_size, bias=spec.mlp_bias)
        self.reduce = _identity if tp is None else tp.all_reduce
        if tp is not None:
            mark_column_parallel(self.gate_up_proj, (spec.intermediate_size,) * 2, tp)
            mark_row_parallel(self.down_proj, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden_size]`` → ``[T, hidden_size]``."""
        return self.reduce(self.down_proj(self.act_fn(self.gate_up_proj(x))))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks; the residual add is fused into the next norm."""

    def __init__(self, spec: ModelSpec, layer_idx: int, quest: Optional[QuestConfig],
                 tp: Optional[TensorParallel] = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = LlamaAttention(spec, layer_idx, quest, tp)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = LlamaMLP(spec, tp)

    def forward(
        self,
        x: torch.Tensor,
        residual: Optional[torch.Tensor],
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: "StepContext",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[T, hidden_size]`` (this layer's input is ``x + residual``; ``residual`` None in layer 0)
        → ``(mlp_out, residual)``, each ``[T, hidden_size]``, with the same convention for the next layer."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, ctx)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm (HF's ``model.`` prefix)."""

    def __init__(self, spec: ModelSpec, quest: Optional[QuestConfig], tp: Optional[TensorParallel] = None) -> None:
        super().__init__()
        if tp is None:
            self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, tp)
        self.rotary_emb = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings, spec.rope_theta,
                                          spec.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(spec, i, quest, tp) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: "StepContext") -> torch.Tensor:
        h = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary_emb.cos_sin(positions, h.dtype)  # [T, D/2] each, shared by every layer
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, cos, sin, ctx)
        h, _ = self.norm(h, residual)
        return h


# HF safetensors name -> (module path inside LlamaForCausalLM, parameter, shard of a MergedLinear or None)
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)_proj\.(weight|bias)$")
_SHARDS = {"q": "qkv_proj", "k": "qkv_proj", "v": "qkv_proj", "gate": "gate_up_proj", "up": "gate_up_proj"}
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")  # stored by some older checkpoints, recomputed here
logger = logging.getLogger(__name__)

FP8_FRAGILE_RATIO = 4.0
"""A layer whose key bias is more than this many times its keys' token-dependent part in some KV head keeps its K/V
in the model dtype in an fp8 pool (:meth:`LlamaForCausalLM.fp8_fragile_layers`; the knee of
benchmarks/fp8_fragile_layers.py on Qwen2.5-Coder-1.5B: 16 keeps 2 layers, 4 keeps 4 and a third less KL, 2 no better)."""
_KV_SCALE = re.compile(r"model\.layers\.(\d+)\.self_attn\.([kv])_scale$")  # optional: an fp8 KV cache's scales
_UNFUSED = ("o", "down")
# (block, module, checkpoint projections) of each linear of a decoder layer
_LINEARS = (("self_attn", "qkv_proj", ("q", "k", "v")), ("self_attn", "o_proj", ("o",)),
            ("mlp", "gate_up_proj", ("gate", "up")), ("mlp", "down_proj", ("down",)))


class LlamaForCausalLM(nn.Module):
    """The causal LM: ``forward`` gives final hidden states, ``compute_logits`` the LM head's logits.

    Args:
        spec: the architecture (:meth:`ModelSpec.from_hf_config`).
        quest: passed to every layer's ``Attention`` (``None``: dense decoding).
        tp: this rank's tensor-parallel group, or ``None`` (one device): the model then holds this rank's shard
            (:mod:`questkv.layers.parallel`), :meth:`load_weights` slices full checkpoint tensors, and ``forward``
            runs the collectives (two all-reduces per layer, one for the embedding, an all-gather for the logits).

    Module names follow HF's (``model.layers.3.self_attn.o_proj``) except the fused
    ``self_attn.qkv_proj`` and ``mlp.gate_up_proj``; :meth:`load_weights` maps checkpoint names onto them.
    Parameters are created on the current default device and dtype: build inside ``with torch.device("cuda")``
    and ``torch.set_default_dtype`` to skip a host copy.
    """

    def __init__(self, spec: ModelSpec, quest: Optional[QuestConfig] = None,
                 tp: Optional[TensorParallel] = None) -> None:
        super().__init__()
        if not isinstance(spec, ModelSpec):
            raise ValueError(f"LlamaForCausalLM.spec must be a ModelSpec, got {type(spec).__name__}")
        if quest is not None and not isinstance(quest, QuestConfig):
            raise ValueError(f"LlamaForCausalLM.quest must be None or a QuestConfig, got {type(quest).__name__}")
        self.spec = spec
        self.tp = tp
        self.model = LlamaModel(spec, quest, tp)
        if tp is None:
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        else:
            self.lm_head = ParallelLMHead(spec.hidden_size, spec.vocab_size, tp)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: "StepContext") -> torch.Tensor:
        """Run every layer over the step's tokens.

        Args:
            input_ids: ``[T]`` int64, the new tokens of all sequences of the step back to back (prefill: each
                sequence's chunk; decode: one per sequence), in ``ctx``'s sequence order.
            positions: ``[T]`` int64, each token's position in its sequence (< ``max_position_embeddings``).
            ctx: the step's metadata, handed to every ``Attention``.

        Returns:
            ``[T, hidden_size]`` final hidden states (after the last norm), in the model dtype.
        """
        return self.model(input_ids, positions, ctx)

    def fp8_fragile_layers(self) -> list[int]:
        """The layers whose keys an e4m3 pool would round past use: some KV head's key bias more than
        :data:`FP8_FRAGILE_RATIO` times its keys' token-dependent part (:meth:`LlamaAttention.key_bias_ratios`), so that
        e4m3's rounding of the bias (4 significant bits, steps of 2**-4 of it) drowns much of what tells one token's key
        from another's (Qwen2.5's; benchmarks/fp8_fragile_layers.py and fp8_kv_scales.py measure it). An fp8 pool
        keeps them in the model dtype. With tensor parallelism, the layers fragile in any rank's heads (a
        collective)."""
        fragile = [bool((layer.self_attn.key_bias_ratios(layer.input_layernorm.weight) > FP8_FRAGILE_RATIO).any())
                   for layer in self.model.layers]
        if self.tp is not None:  # a layer fragile in any rank's heads, on every rank (one device's maths)
            fragile = self.tp.all_max(torch.tensor(fragile, dtype=torch.float32, device=self.lm_head.weight.device))
            fragile = [bool(flag) for flag in fragile.tolist()]
        return [i for i, flag in enumerate(fragile) if flag]

    def plan_fp8_kv(self, kv_max: float) -> tuple[int, ...]:
        """Ready the layers for an fp8 KV pool whose largest value is ``kv_max`` (after loading the weights): returns
        the layers it keeps in the model dtype (:meth:`fp8_fragile_layers`) and gives every other layer's attention
        data-free K/V scales where the checkpoint gave none (:meth:`~questkv.layers.attention.Attention.fit_kv_scales`
        from :meth:`LlamaAttention.kv_bounds`)."""
        fragile = self.fp8_fragile_layers()
        scaled = []
        for i, layer in enumerate(self.model.layers):
            if i not in fragile:
                attention = layer.self_attn
                attention.attn.fit_kv_scales(attention.kv_bounds(layer.input_layernorm.weight), kv_max)
                if bool((attention.attn.kv_scales != 1).any()):
                    scaled.append(i)
        if fragile or scaled:
            logger.info("fp8 KV cache: layers %s keep K/V in the model dtype (a key bias e4m3 would round past the "
                        "keys' token-dependent part); layers %s scale K/V by powers of two (their weights let them "
                        "pass %s)", fragile, scaled, kv_max)
        return tuple(fragile)

    def compute_logits(self, hidden: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``hidden`` ``[N, hidden_size]`` (the rows to sample from) → ``[N, vocab_size]`` float32 logits, written
        into ``out`` (``[N, vocab_size]`` float32: the engine's CUDA graphs share one output) when given."""
        logits = self.lm_head(hidden)
        return logits.float() if out is None else out.copy_(logits)

    def expected_weight_names(self) -> list[str]:
        """The HF safetensors names :meth:`load_weights` needs, in checkpoint order."""
        spec = self.spec
        names = ["model.embed_tokens.weight"]
        params = ("weight", "bias")
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            names.append(p + "input_layernorm.weight")
            for proj in ("q", "k", "v"):
                names += [f"{p}self_attn.{proj}_proj.{w}" for w in params[: 1 + spec.attention_bias]]
            names += [f"{p}self_attn.o_proj.{w}" for w in params[: 1 + spec.o_proj_bias]]
            if spec.qk_norm:
                names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
            names.append(p + "post_attention_layernorm.weight")
            for proj in ("gate", "up", "down"):
                names += [f"{p}mlp.{proj}_proj.{w}" for w in params[: 1 + spec.mlp_bias]]
        names.append("model.norm.weight")
        if not spec.tie_word_embeddings:
            names.append("lm_head.weight")
        return names

    def use_packed_linears(self, layouts: Mapping[str, QuantLayout]) -> frozenset[str]:
        """Swap the decoder's linears whose checkpoint weights are all stored packed, in one format, for empty
        :class:`~questkv.layers.quantized_linear.QuantizedLinear` s of that format, before :meth:`load_weights`.

        A fused projection is swapped only when every shard has the same method and group size (GGUF Q4_K_M files
        store ``attn_v`` as Q6_K beside Q4_K ``attn_q`` / ``attn_k``: that QKV stays float). The LM head always
        stays float (as :func:`~questkv.layers.quantized_linear.quantize_linears` leaves it), so do embeddings.
        Every shape is checked before anything is swapped.

        Args:
            layouts: HF weight name (``model.layers.0.self_attn.q_proj.weight``) -> how the checkpoint stores it,
                for the packed weights of a checkpoint.

        Returns:
            The names whose packed weights :meth:`load_weights` now takes as
            :class:`~questkv.ops.quant_reference.QuantizedWeight` s; every other weight is loaded as a float tensor.

        Raises:
            ValueError: a packed weight whose shape is not the model's, or a name the model does not have.
        """
        expected = set(self.expected_weight_names())
        for name, layout in layouts.items():
            if name == "lm_head.weight" and self.spec.tie_word_embeddings:
                continue  # load_weights skips it: the head is the embedding
            if name not in expected:
                raise ValueError(f"packed weight {name!r} is not a weight of this {self.spec.model_type} model")
            want = self._weight_shape(name)
            if tuple(layout.shape) != want:
                raise ValueError(f"packed weight {name!r} has shape {tuple(layout.shape)}, the model expects {want}")
            in_features, match = want[1], _LAYER_NAME.match(name)
            if self.tp is not None and match is not None and match.group(3) in _UNFUSED:
                in_features //= self.tp.size  # a row-parallel shard holds whole groups of its input features
            check_method(layout.method, layout.group_size, in_features, methods=ALL_METHODS,
                         owner=f"packed weight {name!r}" + (f" (its shard of tensor_parallel_size={self.tp.size})"
                                                            if self.tp is not None else ""))
        swaps = []  # (parent module, attribute, HF names, layout)
        for i, layer in enumerate(self.model.layers):
            for block, attr, projs in _LINEARS:
                names = [f"model.layers.{i}.{block}.{proj}_proj.weight" for proj in projs]
                found = {(layouts[n].method, layouts[n].group_size) if n in layouts else None for n in names}
                if len(found) == 1 and None not in found:
                    swaps.append((getattr(layer, block), attr, names, layouts[names[0]]))
        packed = set()
        for parent, attr, names, layout in swaps:
            linear = getattr(parent, attr)
            setattr(parent, attr, QuantizedLinear.empty_like(linear, layout.method, layout.group_size))
            packed.update(names)
        return frozenset(packed)

    def _weight_shape(self, name: str) -> tuple[int, ...]:
        """The shape of checkpoint weight ``name`` (a shard's own rows for a fused projection), unsharded."""
        match = _LAYER_NAME.match(name)
        if match is None:
            param = self.get_parameter(name)
            return tuple(getattr(param, "tp_full_shape", param.shape))
        layer, block, proj, _ = match.groups()
        module = self.model.layers[int(layer)].get_submodule(f"{block}.{_SHARDS.get(proj, proj + '_proj')}")
        size = 1 if self.tp is None else self.tp.size
        if proj in _SHARDS:
            return (module.shard_sizes[proj] * size, module.in_features)
        return (module.out_features, module.in_features * size)

    def load_weights(self, weights: Iterable[tuple[str, Union[torch.Tensor, QuantizedWeight]]]) -> None:
        """Copy checkpoint tensors, by HF safetensors name, into this model's (fused) parameters.

        Args:
            weights: ``(name, tensor)`` pairs such as ``load_safetensors_weights(folder)`` or
                ``hf_model.state_dict().items()``; any dtype and device (cast and moved on copy). With tied
                embeddings a ``lm_head.weight`` entry is skipped (it is the embedding); ``*.rotary_emb.inv_freq``
                entries of older checkpoints are skipped. The weight of a linear swapped by
                :meth:`use_packed_linears` comes as a :class:`~questkv.ops.quant_reference.QuantizedWeight`.
                Optional ``model.layers.N.self_attn.k_scale`` / ``v_scale`` (compressed-tensors' and vLLM's KV-cache
                scales, per tensor or per KV head) go to the layer's attention, used with an fp8 KV cache
                (:meth:`~questkv.layers.attention.Attention.set_kv_scale`).

        Raises:
            ValueError: a tensor of the wrong shape or kind (packed for a float layer, or the reverse) at once, or,
                once all are read, names this architecture does not have or expected names that never came (each
                listed).
        """
        expected = set(self.expected_weight_names())
        loaded: set[str] = set()
        unknown: list[str] = []
        for name, tensor in weights:
            if _IGNORED.match(name) or (name == "lm_head.weight" and self.spec.tie_word_embeddings):
                continue
            scale = _KV_SCALE.match(name)
            if scale is not None and int(scale.group(1)) < self.spec.num_layers:
                if self.tp is not None and tensor.numel() > 1:  # per KV head: this rank's heads
                    tensor = shard_tensor(name, tensor.reshape(-1), 0, self.tp)
                self.model.layers[int(scale.group(1))].self_attn.attn.set_kv_scale(scale.group(2), tensor, name)
                continue
            if name not in expected:
                unknown.append(name)
                continue
            self._load_one(name, tensor)
            loaded.add(name)
        missing = [n for n in self.expected_weight_names() if n not in loaded]
        if unknown or missing:
            parts = [f"unknown weights for {self.spec.model_type} ({len(unknown)}): {_listing(unknown)}",
                     f"missing weights ({len(missing)}): {_listing(missing)}"]
            listed = (part for part, names in zip(parts, (unknown, missing)) if names)
            raise ValueError("LlamaForCausalLM.load_weights: " + "; ".join(listed))

    def _load_one(self, name: str, tensor: Union[torch.Tensor, QuantizedWeight]) -> None:
        match = _LAYER_NAME.match(name)
        if match is None or match.group(3) not in (*_SHARDS, *_UNFUSED):
            param = self.get_parameter(name)
            copy_param(name, param, shard_of(param, tensor))
            return
        layer, block, proj, param = match.groups()
        if self.tp is not None:  # column-parallel rows, row-parallel input columns, a row-parallel bias on rank 0
            if proj in _SHARDS:
                tensor = shard_tensor(name, tensor, 0, self.tp)
            elif param == "weight":
                tensor = shard_tensor(name, tensor, 1, self.tp)
            else:
                tensor = row_parallel_bias(tensor, self.tp)
        module = self.model.layers[int(layer)].get_submodule(f"{block}.{_SHARDS.get(proj, proj + '_proj')}")
        if param == "weight" and isinstance(tensor, QuantizedWeight) != isinstance(module, QuantizedLinear):
            kind = "packed" if isinstance(tensor, QuantizedWeight) else "a float tensor"
            raise ValueError(f"weight {name!r} is {kind} but its layer is {type(module).__name__}")
        if proj in _SHARDS:
            module.load_shard(name, proj, param, tensor)
        elif param == "weight" and isinstance(tensor, QuantizedWeight):
            module.load_packed(name, tensor)
        else:
            copy_param(name, getattr(module, param), tensor)


def _listing(names: list[str], limit: int = 8) -> str:
    return ", ".join(map(repr, names[:limit])) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
