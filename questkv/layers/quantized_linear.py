"""Weight-only quantized linear layers and the swap of a model's ``nn.Linear`` s for them.

Owns :class:`QuantizedLinear` (codes, scales and zero points as buffers; ``forward`` through
:func:`questkv.ops.int4_matmul` or :func:`questkv.ops.quant_matmul`), :class:`QuantizedMergedLinear` (the same,
keeping a fused QKV or gate/up projection's shards and ``split``; packed checkpoint shards load into its rows) and
:func:`quantize_linears` (round-to-nearest, in place, after the weights are loaded). The formats and the torch
reference live in :mod:`questkv.ops.quant_reference`; which kernel multiplies how many rows is the ops' business
(:mod:`questkv.ops.triton.quant_ops` on CUDA); which models get quantized, and when, is the engine's; reading packed
checkpoints is :mod:`questkv.models.gguf_native`'s and :mod:`questkv.models.quantized_checkpoints`'.

Embeddings always stay in the model dtype. The LM head stays too by default (``skip=("lm_head",)``): its error
lands directly on the logits (the layer most sensitive to rounding, kept in 16 bits by GPTQ and AWQ as well), a
tied head shares the embedding's weight, and at batch 1 it is ~6% of an 8B model's linear time in bf16.
``skip=()`` quantizes it too (a tied head then gets its own quantized copy; the embedding is untouched).
"""

from __future__ import annotations

from typing import Callable, Iterable, NamedTuple, Optional, Sequence

import torch
from torch import nn

from questkv import ops
from questkv.config import BACKENDS
from questkv.layers.linear import MergedLinear, copy_param, shard_offsets
from questkv.ops import quant_reference
from questkv.ops.quant_reference import (
    ALL_METHODS,
    DEFAULT_GROUP_SIZE,
    METHODS,
    QuantizedWeight,
    check_method,
    dequantize,
    quantize_weight,
)
from questkv.validation import check_choice, check_int

__all__ = [
    "METHODS",
    "QuantLayout",
    "QuantizedLinear",
    "QuantizedMergedLinear",
    "check_quantizable",
    "model_weight_bytes",
    "quantize_linears",
]


class QuantLayout(NamedTuple):
    """How one checkpoint weight ``[out_features, in_features]`` is stored: a format of
    :data:`questkv.ops.quant_reference.ALL_METHODS` and its group size (ignored by ``int8``)."""

    method: str
    group_size: int
    shape: tuple[int, int]


class QuantizedLinear(nn.Module):
    """``y = x @ w.T + bias`` with ``w`` stored quantized (``int4`` groups or ``int8`` rows).

    Buffers (format: :mod:`questkv.ops.quant_reference`): ``int4``: ``words`` ``[K // 8, N]`` int32, the codes in
    :func:`~questkv.ops.quant_reference.pack_int4_k_major`'s layout, the one copy every row count reads (the state
    dict holds them as ``qweight`` ``[N, K // 2]`` uint8, the checkpoint layout, converted on save and load);
    ``int8``, ``int8_grouped``: ``qweight`` ``[N, K]`` int8. ``scales`` (``int4``, ``int8_grouped``: ``[K //
    group_size, N]``; ``int8``: ``[N]``), ``zeros`` (``int4``: ``[K // group_size, N]``; else ``None``), in the
    state dict; ``bias`` ``[N]`` is a frozen parameter. Zero points are held as uint8 while they are all integers in
    ``0..255`` (round to nearest, AWQ, GPTQ, GGUF ``Q4_0``: a byte per group where the scales' dtype takes two); a
    load that brings any other value (GGUF ``Q4_1`` / ``Q4_K`` offsets) first widens them to the scales' dtype, so
    no value is rounded. Built empty (then :meth:`load_packed` or fill the buffers), by :meth:`empty_like` or by
    :meth:`from_float`.

    Args:
        in_features (``K``), out_features (``N``): as ``nn.Linear``.
        method: one of :data:`questkv.ops.quant_reference.ALL_METHODS`. bias: whether there is a bias.
        group_size: ``int4`` / ``int8_grouped`` group (``GROUP_SIZES`` / ``INT8_GROUP_SIZES`` of
            :mod:`questkv.ops.quant_reference`, dividing ``in_features``).
        dtype: dtype of scales, zero points, bias and output (default: torch's default dtype). device: where.
        backend: the ops' backend, one of :data:`questkv.config.BACKENDS` (:meth:`set_backend`).
    """

    def __init__(self, in_features: int, out_features: int, method: str = "int4", bias: bool = False,
                 group_size: int = DEFAULT_GROUP_SIZE, dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device | str] = None, backend: str = "auto") -> None:
        check_int(f"{type(self).__name__}.in_features", in_features, minimum=1)
        check_int(f"{type(self).__name__}.out_features", out_features, minimum=1)
        check_method(method, group_size, in_features, owner=type(self).__name__, methods=ALL_METHODS)
        if method == "int8" and in_features % 4:
            raise ValueError(f"{type(self).__name__}.in_features must be a multiple of 4 for int8 (int32 words), "
                             f"got {in_features}")
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.method, self.group_size = method, group_size
        dtype = dtype or torch.get_default_dtype()
        n, k = out_features, in_features
        if method == "int4":
            self.register_buffer("words", torch.zeros((k // 8, n), dtype=torch.int32, device=device),
                                 persistent=False)
            self.register_buffer("scales", torch.ones((k // group_size, n), dtype=dtype, device=device))
            self.register_buffer("zeros", torch.zeros((k // group_size, n), dtype=torch.uint8, device=device))
        else:
            scale_shape = (n,) if method == "int8" else (k // group_size, n)
            self.register_buffer("qweight", torch.zeros((n, k), dtype=torch.int8, device=device))
            self.register_buffer("scales", torch.ones(scale_shape, dtype=dtype, device=device))
            self.register_buffer("zeros", None)
        if bias:
            self.bias = nn.Parameter(torch.zeros(n, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self.backend = "auto"
        self.set_backend(backend)

    @classmethod
    @torch.no_grad()
    def empty_like(cls, linear: nn.Linear, method: str, group_size: int = DEFAULT_GROUP_SIZE,
                   backend: str = "torch") -> "QuantizedLinear":
        """An empty quantized layer of ``linear``'s shape (a :class:`~questkv.layers.linear.MergedLinear` gives a
        :class:`QuantizedMergedLinear` with the same shards) on its device, scales in its weight's dtype, its bias
        copied. The ``torch`` backend by default (call :meth:`set_backend` once the weight is filled)."""
        weight = linear.weight
        kwargs = dict(method=method, bias=linear.bias is not None, group_size=group_size, dtype=weight.dtype,
                      device=weight.device, backend=backend)
        if isinstance(linear, MergedLinear):
            layer = QuantizedMergedLinear(linear.in_features, linear.shard_sizes, **kwargs)
        else:
            layer = QuantizedLinear(linear.in_features, linear.out_features, **kwargs)
        if linear.bias is not None:
            layer.bias.copy_(linear.bias)
        return layer

    @classmethod
    @torch.no_grad()
    def from_float(cls, linear: nn.Linear, method: str, group_size: int = DEFAULT_GROUP_SIZE,
                   backend: str = "auto", row_absmax: Optional[torch.Tensor] = None) -> "QuantizedLinear":
        """A quantized copy of ``linear`` (round to nearest; a :class:`~questkv.layers.linear.MergedLinear` gives a
        :class:`QuantizedMergedLinear` with the same shards) on its device, scales in its weight's dtype
        (``row_absmax``: see :func:`~questkv.ops.quant_reference.quantize_weight`)."""
        check_choice("quantization", method, METHODS)
        layer = cls.empty_like(linear, method, group_size)
        quantized = quantize_weight(linear.weight, method, group_size, row_absmax=row_absmax)
        layer.load_packed("weight", quantized)
        layer.set_backend(backend)
        return layer

    @torch.no_grad()
    def load_packed(self, name: str, loaded: QuantizedWeight, rows: Optional[slice] = None) -> None:
        """Copy a packed weight in this layer's format into output rows ``rows`` (all by default), after checking
        every shape; ``int4`` codes are packed into the words, scales cast to the layer's dtype, zero points held
        as the class docstring says (``name``, the checkpoint name, only serves the error message).

        Args:
            loaded: ``qweight``, ``scales``, ``zeros`` as :mod:`questkv.ops.quant_reference` stores them for
                ``rows.stop - rows.start`` output features, on any device.
        """
        rows = slice(0, self.out_features) if rows is None else rows
        if self.method == "int4":  # a same-shaped stand-in to check against; the codes go into the words below
            codes = torch.empty((self.out_features, self.in_features // 2), dtype=torch.uint8, device="meta")
        else:
            codes = self.qweight
        targets = {"qweight": codes[rows], "scales": self.scales[..., rows],
                   "zeros": None if self.zeros is None else self.zeros[:, rows]}
        for part, target in targets.items():
            tensor = getattr(loaded, part)
            if (tensor is None) != (target is None):
                raise ValueError(f"weight {name!r}: {part} must be {'given' if target is not None else 'None'} for "
                                 f"{self.method}")
            if target is None:
                continue
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"weight {name!r}: {part} has shape {tuple(tensor.shape)}, the {self.method} layer "
                                 f"expects {tuple(target.shape)}")
            if part == "qweight" and tensor.dtype != target.dtype:
                raise ValueError(f"weight {name!r}: qweight must be {target.dtype}, got {tensor.dtype}")
        if loaded.zeros is not None:
            self._hold_zeros(loaded.zeros)
            targets["zeros"] = self.zeros[:, rows]
        for part, target in targets.items():
            tensor = getattr(loaded, part)
            if part == "qweight" and self.method == "int4":
                self.words[:, rows] = quant_reference.pack_int4_k_major(tensor.to(self.words.device), self.group_size)
            elif target is not None:
                target.copy_(tensor)

    def _hold_zeros(self, zeros: torch.Tensor) -> None:
        """Widen uint8 zero points to the scales' dtype unless every value of ``zeros`` is an integer in
        ``0..255`` (the uint8 ones are exact in it)."""
        if self.zeros.dtype != torch.uint8 or zeros.dtype == torch.uint8:
            return
        z = zeros.float()
        if not bool(torch.all((z == z.round()) & (z >= 0) & (z <= 255))):
            self.register_buffer("zeros", self.zeros.to(self.scales.dtype))

    def set_backend(self, backend: str) -> None:
        """Choose the ops' backend :meth:`forward` passes (one of :data:`questkv.config.BACKENDS`: ``auto`` picks
        the kernels for CUDA tensors and the reference otherwise). Call it outside CUDA graph capture: an ``int4``
        layer on CUDA makes sure its kernels are built (:func:`questkv.ops.prepare_int4_matmul`)."""
        check_choice(f"{type(self).__name__}.backend", backend, BACKENDS)
        if self.method == "int4" and backend != "torch":
            ops.prepare_int4_matmul(self.words.device)
        self.backend = backend

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight ``[out_features, in_features]`` this layer multiplies by (a new tensor)."""
        if self.method == "int4":
            codes = quant_reference.unpack_int4_k_major(self.words, self.group_size)
            return dequantize(codes, self.scales, self.zeros, "int4", self.group_size, dtype)
        return dequantize(self.qweight, self.scales, self.zeros, self.method, self.group_size, dtype)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.method == "int4":  # the state dict keeps the checkpoint layout
            destination[prefix + "qweight"] = quant_reference.unpack_int4_k_major(self.words, self.group_size)

    def _load_from_state_dict(self, state_dict, prefix, *args) -> None:
        zeros = state_dict.get(prefix + "zeros")
        if self.zeros is not None and isinstance(zeros, torch.Tensor) and zeros.shape == self.zeros.shape:
            self._hold_zeros(zeros)  # a shape error is torch's to raise, with the zero points unchanged
        key = prefix + "qweight"
        if self.method != "int4" or key not in state_dict:
            return super()._load_from_state_dict(state_dict, prefix, *args)
        codes = state_dict.pop(key)  # load_state_dict hands each module its own copy of the dict
        super()._load_from_state_dict(state_dict, prefix, *args)
        self.load_packed(key, QuantizedWeight(codes, self.scales, self.zeros))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in_features]`` (usually ``[T, in_features]``) → ``[..., out_features]`` in ``x.dtype``."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [T, K]
        if self.method == "int4":
            y = ops.int4_matmul(x2, self.words, self.scales, self.zeros, self.group_size, self.bias,
                                backend=self.backend)
        else:
            y = ops.quant_matmul(x2, self.qweight, self.scales, self.zeros, self.method, self.group_size, self.bias,
                                 backend=self.backend)
        return y.reshape(*lead, self.out_features)  # [..., N]

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.method != "int8" else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"method={self.method}{group}, backend={self.backend}")


class QuantizedMergedLinear(QuantizedLinear):
    """A :class:`QuantizedLinear` whose output features are named shards back to back, as
    :class:`~questkv.layers.linear.MergedLinear` (``shard_sizes``, ``shard_offsets``, :meth:`split`). Packed
    checkpoint shards and float bias shards load into it (:meth:`load_shard`); a float weight cannot (quantize
    after loading)."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], **kwargs) -> None:
        offsets = shard_offsets("QuantizedMergedLinear", shard_sizes)
        super().__init__(in_features, sum(shard_sizes.values()), **kwargs)
        self.shard_sizes = dict(shard_sizes)
        self.shard_offsets = offsets

    def load_shard(self, name: str, shard: str, param_name: str, loaded) -> None:
        """Copy checkpoint shard ``loaded`` into the rows of ``shard``: a :class:`QuantizedWeight` in this layer's
        format for ``"weight"``, a ``[shard_size]`` tensor for ``"bias"`` (a float ``"weight"`` is a
        ``RuntimeError``: load the float weights into a float layer, then quantize)."""
        check_choice("QuantizedMergedLinear.load_shard shard", shard, tuple(self.shard_sizes))
        params = ("weight", "bias") if self.bias is not None else ("weight",)
        check_choice("QuantizedMergedLinear.load_shard param_name", param_name, params)
        start = self.shard_offsets[shard]
        rows = slice(start, start + self.shard_sizes[shard])
        if param_name == "bias":
            copy_param(name, self.bias[rows], loaded)
        elif isinstance(loaded, QuantizedWeight):
            self.load_packed(name, loaded, rows)
        else:
            raise RuntimeError(f"cannot load {name!r} into a quantized layer: load the float weights, then quantize")

    def split(self, out: torch.Tensor) -> Sequence[torch.Tensor]:
        """Split ``out`` ``[T, out_features]`` (this layer's output) into one ``[T, size]`` view per shard."""
        return out.split(tuple(self.shard_sizes.values()), dim=-1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, shards={self.shard_sizes}"


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s weights: every parameter and buffer (an ``int4`` layer's one copy of its codes, the
    words, included). RoPE tables, non-persistent float buffers named ``*_cache``, are not counted."""
    held = [*model.parameters(), *(b for name, b in model.named_buffers() if not name.endswith("_cache"))]
    return sum(t.numel() * t.element_size() for t in held)


def _skipped(name: str, skip: Iterable[str]) -> bool:
    return any(name == s or name.endswith("." + s) for s in skip)


def check_quantizable(model: nn.Module, method: str, skip: Sequence[str] = ("lm_head",),
                      group_size: int = DEFAULT_GROUP_SIZE) -> list[tuple[nn.Module, str, str, nn.Linear]]:
    """Every check of :func:`quantize_linears` (same arguments), changing nothing; returns its targets,
    ``(parent, attribute, dotted name, linear)`` in ``named_modules`` order.

    Raises:
        ValueError: ``method`` is not one of :data:`METHODS`, or a layer's ``in_features`` (a tensor-parallel
            shard's own) does not hold whole groups, naming the layer.
    """
    check_choice("quantization", method, METHODS)
    targets = []  # (parent, attribute, full name, linear)
    for parent_name, parent in model.named_modules():
        for attr, child in parent.named_children():
            name = f"{parent_name}.{attr}" if parent_name else attr
            if isinstance(child, nn.Linear) and not _skipped(name, skip):
                targets.append((parent, attr, name, child))
    for _, _, name, linear in targets:
        try:
            check_method(method, group_size, linear.in_features, owner="quantize_linears")
        except ValueError as error:
            raise ValueError(f"{error} (layer {name})") from None
        if method == "int8" and linear.in_features % 4:
            raise ValueError(f"quantize_linears: int8 needs in_features divisible by 4, layer {name} has "
                             f"{linear.in_features}")
    return targets


@torch.no_grad()
def quantize_linears(model: nn.Module, method: str, skip: Sequence[str] = ("lm_head",),
                     group_size: int = DEFAULT_GROUP_SIZE, backend: str = "auto",
                     row_absmax: Optional[Callable[[nn.Linear], Optional[torch.Tensor]]] = None) -> list[str]:
    """Swap every ``nn.Linear`` of ``model`` (``MergedLinear`` included) for a :class:`QuantizedLinear`, in place.

    Call it after the float weights are loaded; embeddings and norms are untouched. Every layer is checked before
    any is swapped, so a ``ValueError`` leaves ``model`` as it was.

    Args:
        model: any module. method: one of :data:`METHODS` (``ValueError`` naming ``quantization`` otherwise).
        skip: module names (or their last dotted parts) left in float; ``("lm_head",)`` by default (module docstring).
        group_size: ``int4`` group; it must divide every quantized layer's ``in_features``.
        backend: the ops' backend of every new layer, one of :data:`questkv.config.BACKENDS`.
        row_absmax: for ``int8``, each layer's whole rows' largest magnitudes when it holds part of them
            (:func:`questkv.layers.parallel.row_absmax`, tensor parallelism), or ``None`` for its own; called for
            every layer in ``named_modules`` order.

    Returns:
        The dotted names of the swapped modules, in ``named_modules`` order.
    """
    check_choice("quantize_linears backend", backend, BACKENDS)
    targets = check_quantizable(model, method, skip, group_size)
    done: dict[int, QuantizedLinear] = {}  # a module reachable under two names is quantized once
    for parent, attr, _, linear in targets:
        if id(linear) not in done:
            absmax = None if row_absmax is None or method != "int8" else row_absmax(linear)
            done[id(linear)] = QuantizedLinear.from_float(linear, method, group_size, backend, absmax)
        setattr(parent, attr, done[id(linear)])
    return [name for _, _, name, _ in targets]
