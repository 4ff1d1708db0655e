"""Weight-only quantized linear layers and the swap of a model's ``nn.Linear`` s for them.

Owns :class:`QuantizedLinear` (packed weight, scales and zero points as buffers; ``forward`` through
:func:`quant_matmul`), :class:`QuantizedMergedLinear` (the same, keeping a fused QKV or gate/up projection's
shards and ``split``; packed checkpoint shards load into its rows), :func:`quantize_linears` (round-to-nearest,
in place, after the weights are loaded) and the backend choice of :func:`quant_matmul`. The formats and the torch
reference live in :mod:`questkv.ops.quant_reference`, the CUDA kernels in :mod:`questkv.ops.triton.quant_matmul`;
which models get quantized, and when, is the engine's business; reading packed checkpoints is
:mod:`questkv.models.gguf_native`'s and :mod:`questkv.models.quantized_checkpoints`'.

Embeddings always stay in the model dtype. The LM head stays too by default (``skip=("lm_head",)``): its error
lands directly on the logits (the layer most sensitive to rounding, kept in 16 bits by GPTQ and AWQ as well), a
tied head shares the embedding's weight, and at batch 1 it is ~6% of an 8B model's linear time in bf16.
``skip=()`` quantizes it too (a tied head then gets its own quantized copy; the embedding is untouched).
"""

from __future__ import annotations

from typing import Callable, Iterable, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

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
    "BACKENDS",
    "METHODS",
    "QuantLayout",
    "QuantizedLinear",
    "QuantizedMergedLinear",
    "check_quantizable",
    "model_weight_bytes",
    "quant_matmul",
    "quantize_linears",
]

# ``auto`` on CUDA, by rows M (all linears of one llama3.1-8b token on an H200, LM head bf16;
# benchmarks/results/linear-h200-words-final.md, and -words-plan2.md for 3 to 16 rows at the retuned plan): an int4
# layer holds one copy of its codes, the K-major words, and takes questkv's GEMV over them for one and two rows
# (1.94 ms at M = 1 against 2.43 for torch's tinygemm; 3.19 at M = 2 against 4.13 on tensor cores), tinygemm (bf16
# only, its own copy, made where the model batches) for 2 to 4 rows (2.56 / 3.30 ms at M = 2 / 4), tensor cores over
# the words up to 64 rows (``int4_words_matmul``: 3.89 / 3.91 / 4.01 / 4.20 ms at M = 3 / 4 / 8 / 16, against 4.02 /
# 4.75 for the GEMV at 3 / 4 and 4.61 / 4.63 for the Triton kernel over the checkpoint layout at 8 / 16; 5.73 / 7.18
# at M = 32 / 64 against 5.86 / 8.05), and above that (prefill) the float weight written from the words for one
# GEMM, whose cost is shared by the prompt's rows (linear-h200-words-dequant.md: 10.8 / 48.9 ms at M = 256 / 2048
# against 14.7 / 51.7 from the checkpoint layout). int8 and int8_grouped (imported GGUF Q8_0 / Q6_K layers) take
# the Triton kernel up to 64 rows and the float weight above.
AUTO_GEMV_MAX_M = 2
TINYGEMM_MAX_M = 4
TRITON_MAX_M = 64

BACKENDS: tuple[str, ...] = ("auto", "torch", "triton", "dequant", "tinygemm", "gemv")
"""How a quantized layer multiplies. ``auto``: on CUDA by rows (the table above), int4 from its K-major words
through ``int4_gemv`` up to :data:`AUTO_GEMV_MAX_M` rows, tinygemm's copy (if the layer made one) for 2 to
:data:`TINYGEMM_MAX_M`, ``int4_words_matmul`` up to :data:`TRITON_MAX_M` and the float weight written from the words
above; every other format through ``triton`` up to :data:`TRITON_MAX_M` and ``dequant`` above; ``torch`` off CUDA.
``torch``: the reference (dequantize to float32, float32 matmul); ``triton``:
:func:`questkv.ops.triton.quant_matmul.quant_matmul`;
``dequant``: dequantize to ``x``'s dtype (on CUDA in one Triton launch,
:func:`questkv.ops.triton.quant_matmul.dequantize`; torch ops elsewhere), then ``F.linear`` (prefill's);
``tinygemm``: ``torch.ops.aten._weight_int4pack_mm`` (``int4``, CUDA, bf16); ``gemv``: the K-major words alone,
:func:`~questkv.ops.triton.quant_matmul.int4_gemv` for up to 4 rows and
:func:`~questkv.ops.triton.quant_matmul.int4_words_matmul` for more (``int4``, CUDA). The last two, and ``auto``'s
int4 on CUDA, use copies the layer makes in :meth:`QuantizedLinear.set_backend` (non-persistent buffers)."""


class QuantLayout(NamedTuple):
    """How one checkpoint weight ``[out_features, in_features]`` is stored: a format of
    :data:`questkv.ops.quant_reference.ALL_METHODS` and its group size (ignored by ``int8``)."""

    method: str
    group_size: int
    shape: tuple[int, int]


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                 method: str, group_size: int = DEFAULT_GROUP_SIZE, bias: Optional[torch.Tensor] = None,
                 backend: str = "auto") -> torch.Tensor:
    """``y = x @ w.T + bias`` for a quantized weight, on the backend chosen by ``backend``.

    Args:
        x: ``[M, K]`` float. qweight, scales, zeros, method, group_size: the weight
            (:mod:`questkv.ops.quant_reference`). bias: ``[N]`` or ``None``.
        backend: one of :data:`BACKENDS` except ``tinygemm`` and ``gemv``.

    Returns:
        ``[M, N]`` in ``x.dtype``.
    """
    check_choice("quant_matmul backend", backend, BACKENDS[:-2])
    if backend == "auto":
        backend = ("triton" if x.shape[0] <= TRITON_MAX_M else "dequant") if x.is_cuda else "torch"
    if backend == "torch":
        return quant_reference.quant_matmul(x, qweight, scales, zeros, method, group_size, bias)
    if backend == "dequant":
        quant_reference.check_quant_args(x, qweight, scales, zeros, method, group_size)
        unpack = dequantize
        if x.is_cuda:
            from questkv.ops.triton.quant_matmul import dequantize as unpack  # the same values in one launch
        return F.linear(x, unpack(qweight, scales, zeros, method, group_size, dtype=x.dtype), bias)
    from questkv.ops.triton import quant_matmul as kernels  # needs triton; CPU-only installs never get here

    return kernels.quant_matmul(x, qweight, scales, zeros, method, group_size, bias)


class QuantizedLinear(nn.Module):
    """``y = x @ w.T + bias`` with ``w`` stored quantized (``int4`` groups or ``int8`` rows).

    Buffers (format: :mod:`questkv.ops.quant_reference`): ``qweight`` (``int4``: ``[N, K // 2]`` uint8; ``int8``,
    ``int8_grouped``: ``[N, K]`` int8), ``scales`` (``int4``, ``int8_grouped``: ``[K // group_size, N]``; ``int8``:
    ``[N]``), ``zeros`` (``int4``: ``[K // group_size, N]``; else ``None``), all in the state dict; ``bias`` ``[N]``
    is a frozen parameter. Zero points are held as uint8 while they are all integers in ``0..255`` (round to
    nearest, AWQ, GPTQ, GGUF ``Q4_0``: a byte per group where the scales' dtype takes two); a load that brings any
    other value (GGUF ``Q4_1`` / ``Q4_K`` offsets) first widens them to the scales' dtype, so no value is rounded.
    Built empty (then :meth:`load_packed` or fill the buffers), by :meth:`empty_like` or by :meth:`from_float`.

    Args:
        in_features (``K``), out_features (``N``): as ``nn.Linear``.
        method: one of :data:`questkv.ops.quant_reference.ALL_METHODS`. bias: whether there is a bias.
        group_size: ``int4`` / ``int8_grouped`` group (``GROUP_SIZES`` / ``INT8_GROUP_SIZES`` of
            :mod:`questkv.ops.quant_reference`, dividing ``in_features``).
        dtype: dtype of scales, zero points, bias and output (default: torch's default dtype). device: where.
        backend: one of :data:`BACKENDS` (:meth:`set_backend`).
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
            self.register_buffer("qweight", torch.zeros((n, k // 2), dtype=torch.uint8, device=device))
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
        copied. The ``torch`` backend by default: the small-batch copies of a still-empty weight would be packed for
        nothing (call :meth:`set_backend` once the weight is filled)."""
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
                   backend: str = "auto", row_absmax: Optional[torch.Tensor] = None,
                   small_batches: bool = True) -> "QuantizedLinear":
        """A quantized copy of ``linear`` (round to nearest; a :class:`~questkv.layers.linear.MergedLinear` gives a
        :class:`QuantizedMergedLinear` with the same shards) on its device, scales in its weight's dtype
        (``row_absmax``: see :func:`~questkv.ops.quant_reference.quantize_weight`; ``small_batches``: see
        :meth:`set_backend`)."""
        check_choice("quantization", method, METHODS)
        layer = cls.empty_like(linear, method, group_size)
        quantized = quantize_weight(linear.weight, method, group_size, row_absmax=row_absmax)
        layer.load_packed("weight", quantized)
        layer.set_backend(backend, small_batches)
        return layer

    @torch.no_grad()
    def load_packed(self, name: str, loaded: QuantizedWeight, rows: Optional[slice] = None) -> None:
        """Copy a packed weight in this layer's format into output rows ``rows`` (all by default), after checking
        every shape; scales are cast to the layer's dtype, zero points held as the class docstring says (``name``,
        the checkpoint name, only serves the error message). A layer that holds only the GEMV's words
        (:meth:`set_backend`) packs the codes into them.

        Args:
            loaded: ``qweight``, ``scales``, ``zeros`` as :mod:`questkv.ops.quant_reference` stores them for
                ``rows.stop - rows.start`` output features, on any device.
        """
        rows = slice(0, self.out_features) if rows is None else rows
        codes = self.qweight
        if codes is None:  # a same-shaped stand-in to check against; the codes go into the words below
            codes = torch.empty((self.out_features, self.in_features // 2), dtype=torch.uint8, device="meta")
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
            if part == "qweight" and self.qweight is None:
                words = quant_reference.pack_int4_k_major(tensor.to(self.gemv_words.device), self.group_size)
                self.gemv_words[:, rows] = words
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

    def set_backend(self, backend: str, small_batches: bool = True) -> None:
        """Choose how :meth:`forward` multiplies (one of :data:`BACKENDS`); copies of the codes the new backend
        does not use are dropped. Call it outside CUDA graph capture: it may convert the weight.

        On CUDA, ``auto`` and ``gemv`` keep an int4 layer's codes as one copy, the K-major words that
        :func:`~questkv.ops.triton.quant_matmul.int4_gemv` and
        :func:`~questkv.ops.triton.quant_matmul.int4_words_matmul` read: the ``qweight`` buffer is then ``None``,
        the state dict still holds it (rebuilt from the words), and the other backends rebuild it.
        ``small_batches`` (``auto``, bf16): also make ``tinygemm``'s copy for 2 to :data:`TINYGEMM_MAX_M` rows, a
        second copy of the codes that is faster there (all linears of a llama3.1-8b token at M = 2 / 4: 2.56 / 3.30
        ms against 3.19 / 3.91 from the words); an engine makes it when it batches sequences."""
        check_choice(f"{type(self).__name__}.backend", backend, BACKENDS)
        if self.qweight is None:  # only the words were kept: the checkpoint layout comes back first
            self.register_buffer("qweight", quant_reference.unpack_int4_k_major(self.gemv_words, self.group_size))
        if backend == "tinygemm" and not self._tinygemm_fits():
            raise ValueError(f"{type(self).__name__}.backend 'tinygemm' needs int4 bf16 weights on CUDA, got "
                             f"{self.method} {self.scales.dtype} on {self.qweight.device.type}")
        if backend == "gemv" and not self._gemv_fits():
            raise ValueError(f"{type(self).__name__}.backend 'gemv' needs int4 weights on CUDA, got {self.method} "
                             f"on {self.qweight.device.type}")
        auto = backend == "auto"
        if backend == "tinygemm" or (auto and small_batches and self._tinygemm_fits()):
            from questkv.ops.triton.quant_matmul import tinygemm_pack

            packed, scales_and_zeros = tinygemm_pack(self.qweight, self.scales, self.zeros, self.group_size)
            self.register_buffer("tinygemm_packed", packed, persistent=False)
            self.register_buffer("tinygemm_scales_and_zeros", scales_and_zeros, persistent=False)
        else:
            for name in ("tinygemm_packed", "tinygemm_scales_and_zeros"):
                self._buffers.pop(name, None)
        if backend == "gemv" or (auto and self._gemv_fits()):
            words = quant_reference.pack_int4_k_major(self.qweight, self.group_size)
            self.register_buffer("gemv_words", words, persistent=False)
            self.register_buffer("qweight", None)
        else:
            self._buffers.pop("gemv_words", None)
        self.backend = backend

    def _gemv_fits(self) -> bool:
        return self.method == "int4" and self.scales.device.type == "cuda"

    def _tinygemm_fits(self) -> bool:
        return self._gemv_fits() and self.scales.dtype == torch.bfloat16

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight ``[out_features, in_features]`` this layer multiplies by (a new tensor)."""
        if self.qweight is None:
            return quant_reference.dequantize_k_major(self.gemv_words, self.scales, self.zeros, self.group_size,
                                                      dtype).t()
        return dequantize(self.qweight, self.scales, self.zeros, self.method, self.group_size, dtype)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.qweight is None:  # the state dict keeps the checkpoint layout whatever copy the layer holds
            destination[prefix + "qweight"] = quant_reference.unpack_int4_k_major(self.gemv_words, self.group_size)

    def _load_from_state_dict(self, state_dict, prefix, *args) -> None:
        zeros = state_dict.get(prefix + "zeros")
        if self.zeros is not None and isinstance(zeros, torch.Tensor) and zeros.shape == self.zeros.shape:
            self._hold_zeros(zeros)  # a shape error is torch's to raise, with the zero points unchanged
        key = prefix + "qweight"
        if self.qweight is not None or key not in state_dict:
            return super()._load_from_state_dict(state_dict, prefix, *args)
        codes = state_dict.pop(key)  # load_state_dict hands each module its own copy of the dict
        super()._load_from_state_dict(state_dict, prefix, *args)
        self.load_packed(key, QuantizedWeight(codes, self.scales, self.zeros))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in_features]`` (usually ``[T, in_features]``) → ``[..., out_features]`` in ``x.dtype``."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [T, K]
        m = x2.shape[0]
        if self.backend == "tinygemm" or (self.backend == "auto" and "tinygemm_packed" in self._buffers
                                          and 1 < m <= TINYGEMM_MAX_M):
            from questkv.ops.triton.quant_matmul import tinygemm_matmul

            y = tinygemm_matmul(x2, self.tinygemm_packed, self.tinygemm_scales_and_zeros, self.group_size, self.bias)
        elif self.qweight is None:
            y = self._words_matmul(x2)
        else:
            y = quant_matmul(x2, self.qweight, self.scales, self.zeros, self.method, self.group_size, self.bias,
                             self.backend)
        return y.reshape(*lead, self.out_features)  # [..., N]

    def _words_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[M, K]`` times the int4 weight held as the K-major words alone (:meth:`set_backend`): the GEMV
        for up to :data:`AUTO_GEMV_MAX_M` rows (``gemv``: ``GEMV_MAX_M``), tensor cores up to :data:`TRITON_MAX_M`
        (``gemv``: any), the float weight written from the words above."""
        from questkv.ops.triton.quant_matmul import GEMV_MAX_M, int4_gemv, int4_words_matmul

        m = x.shape[0]
        gemv = self.backend == "gemv"
        if 0 < m <= (GEMV_MAX_M if gemv else AUTO_GEMV_MAX_M):
            return int4_gemv(x, self.gemv_words, self.scales, self.zeros, self.group_size, self.bias)
        if m <= TRITON_MAX_M or gemv:
            return int4_words_matmul(x, self.gemv_words, self.scales, self.zeros, self.group_size, self.bias)
        return self._dequantized_words_matmul(x, self.gemv_words)

    def _dequantized_words_matmul(self, x: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        """``x`` ``[M, K]`` times the float weight written from the GEMV's words (the reference off CUDA)."""
        unpack = quant_reference.dequantize_k_major
        if words.is_cuda:
            from questkv.ops.triton.quant_matmul import dequantize_k_major as unpack  # the same values in one launch
        wt = unpack(words, self.scales, self.zeros, self.group_size, dtype=x.dtype)  # [K, N]
        return x @ wt if self.bias is None else torch.addmm(self.bias, x, wt)

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


def model_weight_bytes(model: nn.Module) -> tuple[int, int]:
    """``(counted_once, held)`` bytes of ``model``'s weights: every parameter and persistent buffer, with one copy
    of each quantized layer's codes (the checkpoint layout, or the GEMV's words where they are the only copy: the
    same bytes), and everything it holds (plus the copies for other row counts). RoPE tables, non-persistent
    float buffers named ``*_cache``, are in neither."""
    held = [*model.parameters(), *(b for name, b in model.named_buffers() if not name.endswith("_cache"))]
    copies = {id(b) for m in model.modules() if isinstance(m, QuantizedLinear)
              for name, b in m.named_buffers(recurse=False)
              if name.startswith("tinygemm_") or (name == "gemv_words" and m.qweight is not None)}
    nbytes = [(t.numel() * t.element_size(), id(t) in copies) for t in held]
    return sum(n for n, copy in nbytes if not copy), sum(n for n, _ in nbytes)


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
                     row_absmax: Optional[Callable[[nn.Linear], Optional[torch.Tensor]]] = None,
                     small_batches: bool = True) -> list[str]:
    """Swap every ``nn.Linear`` of ``model`` (``MergedLinear`` included) for a :class:`QuantizedLinear`, in place.

    Call it after the float weights are loaded; embeddings and norms are untouched. Every layer is checked before
    any is swapped, so a ``ValueError`` leaves ``model`` as it was.

    Args:
        model: any module. method: one of :data:`METHODS` (``ValueError`` naming ``quantization`` otherwise).
        skip: module names (or their last dotted parts) left in float; ``("lm_head",)`` by default (module docstring).
        group_size: ``int4`` group; it must divide every quantized layer's ``in_features``.
        backend: one of :data:`BACKENDS` for every new layer.
        row_absmax: for ``int8``, each layer's whole rows' largest magnitudes when it holds part of them
            (:func:`questkv.layers.parallel.row_absmax`, tensor parallelism), or ``None`` for its own; called for
            every layer in ``named_modules`` order.
        small_batches: as :meth:`QuantizedLinear.set_backend`'s, for every new layer.

    Returns:
        The dotted names of the swapped modules, in ``named_modules`` order.
    """
    check_choice("quantize_linears backend", backend, BACKENDS)
    targets = check_quantizable(model, method, skip, group_size)
    done: dict[int, QuantizedLinear] = {}  # a module reachable under two names is quantized once
    for parent, attr, _, linear in targets:
        if id(linear) not in done:
            absmax = None if row_absmax is None or method != "int8" else row_absmax(linear)
            done[id(linear)] = QuantizedLinear.from_float(linear, method, group_size, backend, absmax, small_batches)
        setattr(parent, attr, done[id(linear)])
    return [name for _, _, name, _ in targets]
