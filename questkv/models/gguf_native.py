"""GGUF files read natively: 4- and 8-bit blocks kept packed, mapped exactly into questkv's quantized layouts.

Owns reading a ``.gguf`` file's tensors under HF names (:class:`GGUFWeights`; the header is parsed here, skipping
the tokenizer's arrays that make ``gguf.GGUFReader`` take seconds), the unpacking of each block type into
:mod:`questkv.ops.quant_reference`'s formats, finding an alias's file (:func:`resolve_gguf`) and the config and
tokenizer (:func:`gguf_config_and_tokenizer`: transformers' GGUF reader, its result cached per file). Which linears
hold packed weights is ``LlamaForCausalLM.use_packed_linears``'s business, and ``LLM(..., quantization="gguf")``
asks for this path (without it a GGUF is dequantized by transformers, as before).

Mappings (``q``: the stored codes, bit-exact; ``d``, ``dmin``: fp16; every product below is exact in float32):

========  ==========================  ===========================================================================
type      layout                      per group
========  ==========================  ===========================================================================
Q4_0      ``int4``, groups of 32      ``w = d * (q - 8)``: scale ``d``, zero ``8``
Q4_1      ``int4``, groups of 32      ``w = d * q + m``: scale ``d``, zero ``-m / d``
Q4_K      ``int4``, groups of 32      ``w = d * sc * q - dmin * mn`` (6-bit ``sc``, ``mn`` per 32 of a 256
                                      super-block): scale ``d * sc``, zero ``dmin * mn / (d * sc)``
Q8_0      ``int8_grouped``, 32        ``w = d * q``: scale ``d``, code ``q``
Q6_K      ``int8_grouped``, 16        ``w = d * sc * (q - 32)`` (int8 ``sc`` per 16): scale ``d * sc``, code
                                      ``q - 32``
========  ==========================  ===========================================================================

A group whose scale is 0 (every weight equal to its offset ``c``) gets codes 0, scale 1 and zero ``-c``: the same
weights. Q6_K goes to ``int8_grouped`` rather than bf16: its 16-element groups with their own int8 scales fit no
``int4`` group, and 8-bit codes with a scale per 16 take 9 bits a weight (bf16: 16) with nothing re-rounded.

Error bound: the codes are exact and scales and zero points round once, to the model dtype (unit roundoff ``u``:
2**-8 bf16, 2**-11 fp16, 2**-24 float32), so each weight is off GGUF's own float32 dequantization ``w`` by at most
``(u + 3 * 2**-24) * (1 + u) * (|w| + |zero * scale|)`` (float32 rounding of the zero's division, of the
dequantization and of GGUF's own sum included). ``zero * scale`` is the group's offset: ``|m|`` for Q4_1,
``dmin * mn`` for Q4_K; Q4_0 (zero 8, exact), Q8_0 and Q6_K have none and err by ``(u + 2**-24) * |w|``. That is
the order of rounding ``w`` itself to the model dtype, what the dequantizing path does.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Optional, Union

import numpy as np
import torch

from questkv.layers.quantized_linear import QuantLayout
from questkv.models.families import GGUF_ARCHITECTURES, gguf_family
from questkv.models.loader import ALIASES, cache_dir, package_file, sha256_file, staged_gguf
from questkv.ops.quant_reference import QuantizedWeight, pack_int4

__all__ = ["PACKED_TYPES", "GGUFWeights", "gguf_config_and_tokenizer", "resolve_gguf", "unpack_blocks"]

PACKED_TYPES: dict[str, tuple[str, int]] = {
    "Q4_0": ("int4", 32),
    "Q4_1": ("int4", 32),
    "Q4_K": ("int4", 32),
    "Q8_0": ("int8_grouped", 32),
    "Q6_K": ("int8_grouped", 16),
}
"""GGUF block type -> ``(method, group_size)`` it is held in; every other type is dequantized to the model dtype."""

_QK_K = 256
_BLOCK_BYTES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (_QK_K, 144), "Q8_0": (32, 34), "Q6_K": (_QK_K, 210)}

# GGUF tensor name -> HF name of questkv's Llama-family models (llama.cpp's names for these architectures)
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_IGNORED = ("rope_freqs.weight",)  # llama3 rope factors: the config's rope scaling already holds them
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def _hf_name(name: str) -> str:
    match = _BLOCK_NAME.match(name)
    if match is not None and match.group(2) in _BLOCK_NAMES:
        layer, part, param = match.groups()
        return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{param}"
    base, _, param = name.rpartition(".")
    if base in _TOP_NAMES and param in ("weight", "bias"):
        return f"{_TOP_NAMES[base]}.{param}"
    raise ValueError(f"GGUF tensor {name!r} has no counterpart in questkv's Llama-family models; supported: "
                     f"{', '.join(_TOP_NAMES)}, blk.N.{{{', '.join(_BLOCK_NAMES)}}} and {', '.join(_IGNORED)}")


def _fp16(blocks: np.ndarray, start: int) -> np.ndarray:
    """``[B, 1]`` float32 of the fp16 at byte ``start`` of every block."""
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, chunk: int) -> np.ndarray:
    """``qs`` ``[B, bytes]`` → ``[B, 2 * bytes]`` codes: per ``chunk`` bytes, their low nibbles then their high."""
    q = qs.reshape(qs.shape[0], -1, 1, chunk) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 15).reshape(qs.shape[0], -1)


def _offset_groups(q: np.ndarray, scale: np.ndarray, offset: np.ndarray):
    """``w = scale * q - offset`` per group (``q`` ``[B, G, g]``, ``scale`` / ``offset`` ``[B, G]``) as
    ``(codes, scale, zero)`` with ``w = (q - zero) * scale``; groups of scale 0 get codes 0, scale 1."""
    flat = scale == 0
    q = np.where(flat[..., None], 0, q)
    scale = np.where(flat, 1.0, scale).astype(np.float32)
    return q, scale, (offset / scale).astype(np.float32)


def unpack_blocks(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedWeight:
    """One GGUF tensor's blocks in its questkv format (:data:`PACKED_TYPES`; module docstring).

    Args:
        data: ``[N, bytes per row]`` uint8, the tensor's rows as stored (``ReaderTensor.data``).
        type_name: a key of :data:`PACKED_TYPES`. shape: ``(N, K)``, the float weight's.

    Returns:
        A :class:`~questkv.ops.quant_reference.QuantizedWeight` on the host, scales and zero points float32.
    """
    n, k = shape
    block, nbytes = _BLOCK_BYTES[type_name]
    if k % block or tuple(data.shape) != (n, k // block * nbytes):
        raise ValueError(f"GGUF {type_name} tensor of shape {shape} must be stored as [{n}, {k // block * nbytes}] "
                         f"bytes ({k} a multiple of {block}), got {list(data.shape)}")
    blocks = np.ascontiguousarray(data).reshape(-1, nbytes)  # [B, nbytes], B = N * K / block
    if type_name == "Q4_0":
        q, scale, zero = _nibbles(blocks[:, 2:], 16), _fp16(blocks, 0), np.full((len(blocks), 1), 8, np.float32)
    elif type_name == "Q4_1":
        q, scale, zero = _offset_groups(_nibbles(blocks[:, 4:], 16)[:, None], _fp16(blocks, 0), -_fp16(blocks, 2))
    elif type_name == "Q4_K":
        sc, mn = _scale_min_k4(blocks[:, 4:16])  # [B, 8] each, 6-bit
        q = _nibbles(blocks[:, 16:], 32).reshape(-1, 8, 32)  # [B, 8 groups, 32]
        q, scale, zero = _offset_groups(q, _fp16(blocks, 0) * sc, _fp16(blocks, 2) * mn)
    elif type_name == "Q8_0":
        q, scale, zero = blocks[:, 2:].view(np.int8), _fp16(blocks, 0), None
    else:  # Q6_K
        low = _nibbles(blocks[:, :128], 64)  # [B, 256]: bits 0-3
        high = (blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
        q = (low | (high.reshape(-1, _QK_K) << 4)).astype(np.int8) - np.int8(32)  # [B, 256] in -32..31
        scale = _fp16(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)  # [B, 16]
        zero = None
    groups = k // PACKED_TYPES[type_name][1]
    codes = torch.from_numpy(np.ascontiguousarray(q).reshape(n, k))
    scales = torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32).reshape(n, groups)).t().contiguous()
    if zero is None:
        return QuantizedWeight(codes.to(torch.int8), scales, None)  # [N, K], [G, N]
    zeros = torch.from_numpy(np.ascontiguousarray(zero, dtype=np.float32).reshape(n, groups)).t().contiguous()
    return QuantizedWeight(pack_int4(codes), scales, zeros)  # [N, K / 2], [G, N], [G, N]


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes of 6-bit scales and mins → ``([B, 8], [B, 8])`` float32 (llama.cpp's
    ``get_scale_min_k4``: bytes 0-3 and 4-7 hold the low 6 bits of scales / mins 0-3 and, in their top 2 bits,
    bits 4-5 of scales / mins 4-7, whose bits 0-3 are the nibbles of bytes 8-11)."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


class _TensorInfo(NamedTuple):
    name: str
    type_id: int
    shape: tuple[int, ...]  # torch order: rows first
    data: np.ndarray  # [rows, bytes per row] uint8, memory-mapped


# GGUF metadata value types of a fixed size -> struct format (8 is a string, 9 an array)
_VALUE_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _read_header(path: Path) -> tuple[dict[str, Any], list[_TensorInfo]]:
    """A little-endian GGUF (version 2 or 3): ``(scalar metadata, tensors)``. Arrays are skipped, not parsed."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    mm = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(mm)
    if bytes(buf[:4]) != b"GGUF" or struct.unpack_from("<I", buf, 4)[0] not in (2, 3):
        raise ValueError(f"{path.name} is not a little-endian GGUF file of version 2 or 3")
    num_tensors, num_fields = struct.unpack_from("<QQ", buf, 8)
    pos = 24

    def string() -> str:
        nonlocal pos
        (length,) = struct.unpack_from("<Q", buf, pos)
        pos += 8 + length
        return bytes(buf[pos - length:pos]).decode("utf-8", errors="replace")

    def value(kind: int) -> Any:
        nonlocal pos
        if kind == 8:
            return string()
        if kind == 9:
            item, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if item in _VALUE_FORMATS:
                pos += count * struct.calcsize(_VALUE_FORMATS[item])
            else:
                for _ in range(count):
                    value(item)
            return None  # arrays (the tokenizer's) are not needed here
        (result,) = struct.unpack_from(_VALUE_FORMATS[kind], buf, pos)
        pos += struct.calcsize(_VALUE_FORMATS[kind])
        return result

    fields = {}
    for _ in range(num_fields):
        key = string()
        (kind,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        fields[key] = value(kind)
    infos = []
    for _ in range(num_tensors):
        name = string()
        (dims,) = struct.unpack_from("<I", buf, pos)
        ne = struct.unpack_from(f"<{dims}Q", buf, pos + 4)
        type_id, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * dims)
        pos += 4 + 8 * dims + 12
        infos.append((name, type_id, tuple(int(d) for d in reversed(ne)), offset))
    alignment = fields.get("general.alignment") or 32
    start = -(-pos // alignment) * alignment
    tensors = []
    for name, type_id, shape, offset in infos:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
        row_bytes = shape[-1] // block * type_size
        rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
        if start + offset + rows * row_bytes > len(mm):
            raise ValueError(f"{path.name} is truncated: tensor {name!r} ends past the end of the file")
        data = mm[start + offset:start + offset + rows * row_bytes].reshape(rows, row_bytes)
        tensors.append(_TensorInfo(name, type_id, shape, data))
    return fields, tensors


def _reverse_permutation(rows: int, num_heads: int) -> np.ndarray:
    """For each HF row of a Llama q/k projection, its row in the GGUF file: llama.cpp's converter interleaves the
    two rotary halves of every head (transformers undoes it the same way)."""
    return np.arange(rows).reshape(num_heads, rows // num_heads // 2, 2).swapaxes(1, 2).reshape(rows)


class GGUFWeights:
    """The tensors of one GGUF file under HF names, those of :data:`PACKED_TYPES` kept packed.

    Reads the header only (the data is memory-mapped and converted tensor by tensor in :meth:`weights`); every
    name, type and shape is checked here, before any weight is read. Little-endian GGUF of version 2 or 3.

    Args:
        path: the ``.gguf`` file, of an architecture in :data:`~questkv.models.families.GGUF_ARCHITECTURES`.
        num_q_heads, num_kv_heads: the model's (the q/k rows of a family with ``gguf_qk_permuted`` are permuted back
            by head).

    Attributes:
        architecture: the file's ``general.architecture``.
        layouts: HF weight name -> :class:`~questkv.layers.quantized_linear.QuantLayout` of every 2-D tensor of a
            :data:`PACKED_TYPES` type.
        types: HF name -> GGUF type name of every tensor (for messages and reports).
    """

    def __init__(self, path: Union[str, os.PathLike], num_q_heads: int, num_kv_heads: int) -> None:
        from gguf import GGMLQuantizationType

        self.path = Path(path)
        fields, tensors = _read_header(self.path)
        self.architecture = fields.get("general.architecture")
        family = gguf_family(self.architecture)
        if family is None:
            raise ValueError(f"{self.path.name}: GGUF general.architecture {self.architecture!r} is not read natively; "
                             f"supported: {', '.join(GGUF_ARCHITECTURES)} (load it without quantization='gguf')")
        self._heads = {"q_proj": num_q_heads, "k_proj": num_kv_heads} if family.gguf_qk_permuted else {}
        self._tensors = {}
        self.layouts: dict[str, QuantLayout] = {}
        self.types: dict[str, str] = {}
        for tensor in tensors:
            if tensor.name in _IGNORED:
                continue
            name = _hf_name(tensor.name)
            type_name = GGMLQuantizationType(tensor.type_id).name
            shape = tensor.shape
            if type_name in PACKED_TYPES and len(shape) == 2:
                method, group = PACKED_TYPES[type_name]
                self.layouts[name] = QuantLayout(method, group, shape)
            self._tensors[name] = (tensor, type_name, shape)
            self.types[name] = type_name

    def weights(self, packed: frozenset[str] = frozenset(), device: Union[str, torch.device] = "cpu"
                ) -> Iterator[tuple[str, Union[torch.Tensor, QuantizedWeight]]]:
        """Yield ``(HF name, tensor)`` for every tensor, in file order, unpacked on the host and moved to
        ``device``: a :class:`~questkv.ops.quant_reference.QuantizedWeight` for the names in ``packed`` (which
        must have a layout), else a float32 tensor (GGUF's own dequantization, as transformers loads it)."""
        from gguf import dequantize

        for name, (tensor, type_name, shape) in self._tensors.items():
            rows = self._rows(name, shape[0])
            if name in packed:
                weight = unpack_blocks(tensor.data, type_name, shape)
                if rows is not None:
                    weight = QuantizedWeight(weight.qweight[rows], weight.scales[:, rows],
                                             None if weight.zeros is None else weight.zeros[:, rows])
                yield name, QuantizedWeight(*(None if t is None else t.to(device) for t in weight))
                continue
            values = torch.from_numpy(np.array(dequantize(tensor.data, tensor.type_id), dtype=np.float32)
                                      .reshape(shape))  # a copy: the file is a read-only memory map
            yield name, (values if rows is None else values[rows]).to(device)

    def _rows(self, name: str, rows: int) -> Optional[torch.Tensor]:
        """HF row order of a permuted q/k weight or bias (``None``: as stored)."""
        proj = name.rsplit(".", 2)[-2]
        if proj not in self._heads:
            return None
        return torch.from_numpy(_reverse_permutation(rows, self._heads[proj]))


def gguf_config_and_tokenizer(path: Path):
    """``(transformers config, tokenizer)`` of a GGUF file, as transformers reads them from its metadata (seconds:
    it parses every token), saved under ``cache_dir() / "gguf-metadata"`` keyed by the file's path, size and
    modification time, so later loads of the same file read them back at once."""
    from transformers import AutoConfig, AutoTokenizer

    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:20]
    folder = cache_dir() / "gguf-metadata" / key
    if (folder / "config.json").is_file():
        return AutoConfig.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{key}-") as tmp:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, folder)
        except OSError:  # another process saved it first
            pass
    return config, tokenizer


def resolve_gguf(name_or_path: str) -> Path:
    """The GGUF file of an alias or a ``.gguf`` path. An alias's file is its staged copy
    (:func:`~questkv.models.loader.staged_gguf`) or the one its package ships; parts shipped in several packages
    are joined once into the staged copy. The checksum is verified.

    Raises:
        FileNotFoundError: an alias whose packages are missing (the message says how to install them).
        ValueError: anything but an alias or an existing ``.gguf`` file.
    """
    if name_or_path not in ALIASES:
        path = Path(name_or_path).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            return path
        raise ValueError(f"quantization='gguf' needs a .gguf file or an alias ({', '.join(ALIASES)}), got "
                         f"{name_or_path!r}")
    alias = ALIASES[name_or_path]
    target = staged_gguf(name_or_path)
    if not target.is_file():
        parts = [package_file(f"model {name_or_path!r}", alias.install, dist, version, rel)
                 for (dist, version), rel in zip(alias.packages, alias.files)]
        if len(parts) == 1:
            target = parts[0]
        else:
            cache_dir().mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=cache_dir(), prefix=f".{name_or_path}-", delete=False) as out:
                for part in parts:
                    with open(part, "rb") as handle:
                        shutil.copyfileobj(handle, out, 1 << 24)
            os.replace(out.name, target)
    digest = sha256_file(target)
    if digest != alias.sha256:
        raise ValueError(f"{target} has SHA-256 {digest}, expected {alias.sha256} for {name_or_path!r}; reinstall: "
                         f"{alias.install}")
    return target
