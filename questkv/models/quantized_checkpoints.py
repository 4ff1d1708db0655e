"""HF safetensors checkpoints stored quantized (AWQ, GPTQ, compressed-tensors), mapped exactly into ``int4``.

Owns detecting a folder's format from ``config.json``'s ``quantization_config`` (as vLLM does), checking it and
every packed tensor's shape before any weight is read (:class:`QuantizedCheckpoint`), and unpacking each
module's tensors into :mod:`questkv.ops.quant_reference`'s ``int4`` layout (``w = (q - zero) * scale``, ``q`` in
``0..15``): the codes bit-exact, zero points exact, scales as stored, rounded once to the model dtype (each weight
is then off by at most ``u * |w|``: ``u`` = 2**-8 in bf16, 0 in fp16 / float32 for fp16 scales). Which linears
hold them is ``LlamaForCausalLM.use_packed_linears``'s business.

The tensors of a linear ``[N, K]`` with groups of ``g`` input features, by ``quant_method``:

* ``awq`` (``bits: 4``, ``version: gemm``, ``zero_point: true``): ``qweight`` ``[K, N / 8]`` int32, 8 output
  features a word in AutoAWQ's order (feature ``8c + [0, 2, 4, 6, 1, 3, 5, 7][i]`` in bits ``4i`` of word ``c``);
  ``qzeros`` ``[K / g, N / 8]`` packed the same way; ``scales`` ``[K / g, N]``. Zero: the stored integer.
* ``gptq`` (``bits: 4``, ``desc_act: false``, ``sym`` true or false): ``qweight`` ``[K / 8, N]`` int32, 8 input
  features a word (feature ``8r + i`` in bits ``4i`` of row ``r``); ``qzeros`` ``[K / g, N / 8]``, 8 output
  features a word; ``scales`` ``[K / g, N]``; ``g_idx`` ``[K]``, checked to be ``k // g``. Zero: the stored
  nibble + 1 in the v1 format (``checkpoint_format: gptq``, AutoGPTQ's "zero - 1" storage: 1..16, 16 where a zero
  of 0 wrapped, as its kernels read it), the nibble itself in ``gptq_v2``.
* ``compressed-tensors`` (``format: pack-quantized``; int4 weight-only schemes, strategy ``group`` or
  ``channel``): ``weight_packed`` ``[N, K / 8]`` int32 (feature ``8c + i`` in bits ``4i``) holding signed codes
  + 8; ``weight_scale`` ``[N, K / g]``; ``weight_zero_point`` absent (symmetric), ``[N, K / g]`` int8 signed, or
  ``[ceil(N / 8), K / g]`` int32 packed along the output features; ``weight_shape`` ``[N, K]`` checked. Zero:
  the signed zero point + 8.

A checkpoint group that is not one of ``GROUP_SIZES`` but a multiple of one (GPTQ's ``-1``, compressed-tensors'
``channel``: the whole row) is held in the largest that divides it, its scale and zero repeated (exact).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch

from questkv.layers.quantized_linear import QuantLayout
from questkv.models.weights import safetensors_files
from questkv.ops.quant_reference import GROUP_SIZES, QuantizedWeight, dequantize, pack_int4

__all__ = ["METHODS", "QuantizedCheckpoint", "checkpoint_quantization"]

METHODS = ("awq", "gptq", "compressed-tensors")
"""``quantization_config.quant_method`` values read natively (the ``quantization=`` that names them)."""

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ packs output feature 8c + _AWQ_ORDER[i] into bits 4i of word c
_PARTS = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales", "g_idx"),
          "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")}
_OPTIONAL = {"g_idx", "weight_zero_point", "weight_shape"}


def checkpoint_quantization(folder: Union[str, os.PathLike]) -> Optional[dict[str, Any]]:
    """The ``quantization_config`` of an HF folder's ``config.json`` (``None`` when it has none)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    return config.get("quantization_config") or None


def _field(config: dict, key: str, supported: tuple, where: str = "quantization_config") -> Any:
    value = config.get(key)
    if value not in supported:
        raise ValueError(f"config.json {where}.{key}={value!r} is not supported; supported: "
                         f"{', '.join(map(repr, supported))}")
    return value


def _check_config(config: dict) -> tuple[str, Optional[int], bool]:
    """``(method, group_size, gptq_v1)`` of a supported ``quantization_config`` (group ``None``: read per
    module from the scales' shape); ``ValueError`` naming the field and what is supported otherwise."""
    method = _field(config, "quant_method", METHODS)
    if method == "awq":
        _field(config, "bits", (4,))
        _field({"version": str(config.get("version", "gemm")).lower()}, "version", ("gemm",))
        _field({"zero_point": config.get("zero_point", True)}, "zero_point", (True,))
        return method, _group(config.get("group_size"), "group_size"), False
    if method == "gptq":
        _field(config, "bits", (4,))
        _field({"desc_act": config.get("desc_act", False)}, "desc_act", (False, None))
        fmt = _field({"checkpoint_format": config.get("checkpoint_format", "gptq")}, "checkpoint_format",
                     ("gptq", "gptq_v2"))
        return method, _group(config.get("group_size"), "group_size"), fmt == "gptq"
    _field({"format": config.get("format", "pack-quantized")}, "format", ("pack-quantized",))
    groups = config.get("config_groups") or {}
    if not groups:
        raise ValueError("config.json quantization_config.config_groups is empty; supported: int4 weight schemes")
    for key, scheme in groups.items():
        where = f"quantization_config.config_groups.{key}"
        if "format" in scheme and scheme["format"] is not None:
            _field(scheme, "format", ("pack-quantized",), where)
        for act in ("input_activations", "output_activations"):
            _field(scheme, act, (None,), where)
        weights = scheme.get("weights") or {}
        where += ".weights"
        _field(weights, "num_bits", (4,), where)
        _field(weights, "type", ("int",), where)
        _field(weights, "strategy", ("group", "channel"), where)
        _field({"actorder": weights.get("actorder")}, "actorder", (None, "weight", "static"), where)
        _field({"dynamic": weights.get("dynamic", False)}, "dynamic", (False,), where)
        if weights["strategy"] == "group":
            _group(weights.get("group_size"), f"config_groups.{key}.weights.group_size")
    return method, None, False


def _group(group_size: Any, field: str) -> int:
    if isinstance(group_size, int) and not isinstance(group_size, bool) and (
            group_size == -1 or (group_size > 0 and group_size % GROUP_SIZES[0] == 0)):
        return group_size
    raise ValueError(f"config.json quantization_config.{field}={group_size!r} is not supported; supported: -1 (whole "
                     f"rows) or a multiple of {GROUP_SIZES[0]} ({', '.join(map(str, GROUP_SIZES))} as they are)")


def _held_group(group: int, k: int, name: str) -> int:
    """The ``int4`` group size that holds a checkpoint group of ``group`` input features (``k``: the row)."""
    for size in reversed(GROUP_SIZES):
        if group % size == 0 and k % group == 0:
            return size
    raise ValueError(f"checkpoint module {name!r}: group size {group} (in_features {k}) is not held: supported: "
                     f"multiples of {GROUP_SIZES[0]} dividing in_features")


class QuantizedCheckpoint:
    """The packed linears of an HF folder stored by AWQ, GPTQ or compressed-tensors.

    Reads ``config.json`` and the safetensors headers (and GPTQ's ``g_idx`` / compressed-tensors' ``weight_shape``,
    a few integers a module); every field and shape is checked here, before any weight is read.

    Args:
        folder: the HF folder. config: its ``quantization_config`` (:func:`checkpoint_quantization`).

    Attributes:
        method: one of :data:`METHODS`.
        layouts: HF weight name (``<module>.weight``) -> :class:`~questkv.layers.quantized_linear.QuantLayout` of
            every packed linear.

    Raises:
        ValueError: an unsupported method, bit width, group size, ``desc_act``, format or scheme, a packed tensor of
            the wrong shape or dtype, or a module missing one of its tensors; each names the field and what is
            supported.
    """

    def __init__(self, folder: Union[str, os.PathLike], config: dict) -> None:
        from safetensors import safe_open

        self.folder = Path(folder)
        self.method, group, self._gptq_v1 = _check_config(config)
        self._files = safetensors_files(self.folder)
        headers: dict[str, tuple[Path, tuple[int, ...], str]] = {}  # tensor -> (file, shape, dtype)
        for path in self._files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    piece = f.get_slice(name)
                    headers[name] = (path, tuple(piece.get_shape()), piece.get_dtype())
        packed_part = _PARTS[self.method][0]
        self._modules: dict[str, dict[str, str]] = {}  # module -> part -> tensor name
        for name in headers:
            module, _, part = name.rpartition(".")
            if part in _PARTS[self.method]:
                self._modules.setdefault(module, {})[part] = name
        self.layouts: dict[str, QuantLayout] = {}
        self._groups: dict[str, int] = {}  # module -> checkpoint group size
        for module, parts in self._modules.items():
            if packed_part not in parts:
                continue
            missing = [p for p in _PARTS[self.method] if p not in parts and p not in _OPTIONAL]
            if missing:
                raise ValueError(f"checkpoint module {module!r} ({self.method}) lacks {', '.join(missing)}")
            shapes = {part: headers[tensor][1] for part, tensor in parts.items()}
            dtypes = {part: headers[tensor][2] for part, tensor in parts.items()}
            n, k, module_group = self._shape(module, shapes, group)
            self._check_shapes(module, shapes, dtypes, n, k, module_group)
            self._groups[module] = module_group
            held = _held_group(module_group, k, module)
            self.layouts[f"{module}.weight"] = QuantLayout("int4", held, (n, k))
        if not self.layouts:
            raise ValueError(f"config.json says quant_method={self.method!r} but no checkpoint tensor of "
                             f"{str(self.folder)!r} ends in .{packed_part}")
        self._check_small_tensors(headers)

    def _shape(self, module: str, shapes: dict, group: Optional[int]) -> tuple[int, int, int]:
        """``(N, K, group)`` of a module, from its packed weight (and, where the config has none, its scales)."""
        if self.method == "awq":
            (k, words), (groups, _) = shapes["qweight"], shapes["scales"]
            n = words * 8
        elif self.method == "gptq":
            (rows, n), (groups, _) = shapes["qweight"], shapes["scales"]
            k = rows * 8
        else:
            (n, words), (_, groups) = shapes["weight_packed"], shapes["weight_scale"]
            k = words * 8
        if group is None or group == -1:
            if groups < 1 or k % groups:
                raise ValueError(f"checkpoint module {module!r}: {groups} scale groups do not divide "
                                 f"in_features {k}")
            group = k // groups
        return n, k, group

    def _check_shapes(self, module: str, shapes: dict, dtypes: dict, n: int, k: int, group: int) -> None:
        if k % group:
            raise ValueError(f"checkpoint module {module!r}: in_features {k} is not a multiple of the group size "
                             f"{group}")
        if n % 8 and self.method != "compressed-tensors":
            raise ValueError(f"checkpoint module {module!r}: out_features {n} is not a multiple of 8 (int32 words)")
        g = k // group
        packed_zero = dtypes.get("weight_zero_point") == "I32"
        want = {"awq": {"qweight": (k, n // 8), "qzeros": (g, n // 8), "scales": (g, n)},
                "gptq": {"qweight": (k // 8, n), "qzeros": (g, n // 8), "scales": (g, n), "g_idx": (k,)},
                "compressed-tensors": {"weight_packed": (n, k // 8), "weight_scale": (n, g), "weight_shape": (2,),
                                       "weight_zero_point": (-(-n // 8), g) if packed_zero else (n, g)}}[self.method]
        for part, shape in shapes.items():
            if shape != want[part]:
                raise ValueError(f"checkpoint tensor '{module}.{part}' has shape {list(shape)}, expected "
                                 f"{list(want[part])} for a {self.method} linear of [{n}, {k}] with group size "
                                 f"{group}")
            if part in ("scales", "weight_scale"):
                allowed = ("F16", "BF16", "F32")
            elif part == "weight_zero_point":
                allowed = ("I8", "I32")
            elif part in ("g_idx", "weight_shape"):
                allowed = ("I32", "I64")
            else:
                allowed = ("I32",)
            if dtypes[part] not in allowed:
                raise ValueError(f"checkpoint tensor '{module}.{part}' has dtype {dtypes[part]}; supported for "
                                 f"{self.method}: {', '.join(allowed)}")

    def _check_small_tensors(self, headers: dict) -> None:
        """GPTQ's ``g_idx`` must be ``k // group`` (no act-order); compressed-tensors' ``weight_shape`` ``[N, K]``."""
        from safetensors import safe_open

        for module, parts in self._modules.items():
            if f"{module}.weight" not in self.layouts:
                continue
            n, k = self.layouts[f"{module}.weight"].shape
            for part, want in (("g_idx", None), ("weight_shape", [n, k])):
                if part not in parts:
                    continue
                with safe_open(str(headers[parts[part]][0]), framework="pt") as f:
                    tensor = f.get_tensor(parts[part])
                if part == "g_idx":
                    trivial = torch.arange(k) // min(self._groups[module], k)
                    if not torch.equal(tensor.long(), trivial):
                        raise ValueError(f"checkpoint tensor '{module}.g_idx' is not k // group_size: act-order "
                                         f"(desc_act) checkpoints are not supported; supported: desc_act false")
                elif tensor.tolist() != want:
                    raise ValueError(f"checkpoint tensor '{module}.weight_shape' is {tensor.tolist()}, but its "
                                     f"packed tensors are of a [{n}, {k}] linear")

    def weights(self, packed: frozenset[str] = frozenset(), device: Union[str, torch.device] = "cpu"
                ) -> Iterator[tuple[str, Union[torch.Tensor, QuantizedWeight]]]:
        """Yield ``(HF name, tensor)`` for every weight, read onto ``device``: a packed linear's ``<module>.weight``
        once all its tensors are read, as a :class:`~questkv.ops.quant_reference.QuantizedWeight` when it is in
        ``packed``, else dequantized to float32; every other tensor as stored."""
        from safetensors import safe_open

        pending: dict[str, dict[str, torch.Tensor]] = {}
        for path in self._files:
            with safe_open(str(path), framework="pt", device=str(torch.device(device))) as f:
                for name in f.keys():
                    module, _, part = name.rpartition(".")
                    if f"{module}.weight" not in self.layouts or part not in _PARTS[self.method]:
                        yield name, f.get_tensor(name)
                        continue
                    parts = pending.setdefault(module, {})
                    parts[part] = f.get_tensor(name)
                    if len(parts) == len(self._modules[module]):
                        del pending[module]
                        weight = self._unpack(module, parts)
                        if f"{module}.weight" not in packed:
                            layout = self.layouts[f"{module}.weight"]
                            weight = dequantize(*weight, "int4", layout.group_size)
                        yield f"{module}.weight", weight

    def _unpack(self, module: str, parts: dict[str, torch.Tensor]) -> QuantizedWeight:
        """A module's tensors as ``int4`` (module docstring): codes packed, scales and zeros ``[K / g, N]``."""
        layout = self.layouts[f"{module}.weight"]
        n, k = layout.shape
        if self.method == "awq":
            codes = _awq_columns(parts["qweight"]).t()  # [K, N] -> [N, K]
            zeros = _awq_columns(parts["qzeros"]).float()  # [G, N]
            scales = parts["scales"].float()
        elif self.method == "gptq":
            codes = _nibbles_along(parts["qweight"], dim=0).t()  # [K, N] -> [N, K]
            zeros = _nibbles_along(parts["qzeros"], dim=1).float() + (1 if self._gptq_v1 else 0)  # [G, N]
            scales = parts["scales"].float()
        else:
            codes = _nibbles_along(parts["weight_packed"], dim=1)  # [N, K], signed codes + 8
            scales = parts["weight_scale"].float().t()  # [G, N]
            zero_point = parts.get("weight_zero_point")
            if zero_point is None:
                zeros = torch.full_like(scales, 8.0)
            elif zero_point.dtype == torch.int8:
                zeros = zero_point.float().t() + 8  # [N, G] signed -> [G, N]
            else:
                zeros = _nibbles_along(zero_point, dim=0)[:n].float().t()  # [N, G] of zero + 8 -> [G, N]
        repeat = self._groups[module] // layout.group_size
        if repeat > 1:
            scales, zeros = scales.repeat_interleave(repeat, dim=0), zeros.repeat_interleave(repeat, dim=0)
        return QuantizedWeight(pack_int4(codes).contiguous(), scales.contiguous(), zeros.contiguous())


def _nibbles_along(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 ``words`` holding 8 nibbles each (element ``8j + i`` of ``dim`` in bits ``4i``) → uint8, ``dim`` 8x."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    if dim == 0:
        nib = (words.unsqueeze(1) >> shifts.view(1, 8, 1)) & 15  # [R, 8, C]
        return nib.reshape(-1, words.shape[1]).to(torch.uint8)
    nib = (words.unsqueeze(2) >> shifts.view(1, 1, 8)) & 15  # [R, C, 8]
    return nib.reshape(words.shape[0], -1).to(torch.uint8)


def _awq_columns(words: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's ``[R, C]`` int32 (feature ``8c + order[i]`` in bits ``4i``) → ``[R, 8C]`` uint8 in feature order."""
    slots = _nibbles_along(words, dim=1).view(words.shape[0], -1, 8)  # [R, C, 8]: slot i = feature order[i]
    inverse = torch.tensor([_AWQ_ORDER.index(j) for j in range(8)], device=words.device)
    return slots[:, :, inverse].reshape(words.shape[0], -1)
