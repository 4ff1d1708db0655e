"""HF checkpoints stored by AWQ, GPTQ and compressed-tensors load packed, detected from ``config.json``: the
unpacked weights equal an independent dequantization of the packed tensors, the engine's greedy tokens equal those
of the same engine holding those float weights, and unsupported or inconsistent checkpoints are refused naming
the field before the model is built.

Each variant quantizes the linears of one tiny random Llama to integer codes, zero points and fp16 scales and packs
them by its project's rules (AutoAWQ's ``WQLinear_GEMM.from_linear``, AutoGPTQ's ``QuantLinear.pack``,
compressed-tensors' ``pack_to_int32``); the independent dequantizations read the packed tensors back the way those
projects' torch fallbacks do, and a float folder holding them is the engine's reference.
"""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from questkv.engine.llm import LLM
from questkv.layers.quantized_linear import QuantizedLinear
from questkv.models import engine_model
from questkv.models.engine_model import load_engine_model
from questkv.models.families import ModelFamily
from questkv.models.quantized_checkpoints import QuantizedCheckpoint
from questkv.ops.quant_reference import dequantize
from tests.helpers import greedy_params, tiny_config, tiny_hf_model, word_tokenizer

VOCAB = 96
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def quantize_groups(w: torch.Tensor, group: int, gen: torch.Generator, zero_range=(1, 15)):
    """Asymmetric 4-bit codes of ``w`` ``[N, K]``: ``(q [N, K] int, zeros [N, G] int, scales [N, G] fp16)``,
    zero points drawn in ``zero_range`` and scales from each group's spread."""
    n, k = w.shape
    groups = w.reshape(n, k // group, group)
    scales = ((groups.amax(-1) - groups.amin(-1)) / 15).clamp(min=1e-4).half()
    zeros = torch.randint(zero_range[0], zero_range[1] + 1, (n, k // group), generator=gen)
    q = torch.clamp(torch.round(groups / scales.float()[..., None]) + zeros[..., None], 0, 15).long()
    return q.reshape(n, k), zeros, scales


def awq_pack(q, zeros, scales):
    """AutoAWQ's GEMM packing: ``qweight`` ``[K, N/8]``, ``qzeros`` ``[G, N/8]`` (order_map), ``scales`` ``[G, N]``."""
    intweight = q.t().contiguous().int()  # [K, N]
    qweight = torch.zeros(intweight.shape[0], intweight.shape[1] // 8, dtype=torch.int32)
    for col in range(intweight.shape[1] // 8):
        for i in range(8):
            qweight[:, col] |= intweight[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
    z = zeros.t().contiguous().int()  # [G, N]
    qzeros = torch.zeros(z.shape[0], z.shape[1] // 8, dtype=torch.int32)
    for col in range(z.shape[1] // 8):
        for i in range(8):
            qzeros[:, col] |= z[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales.t().contiguous()}


def awq_dequantize(t):
    """AutoAWQ's ``dequantize_gemm`` (``unpack_awq`` + ``reverse_awq_order``): ``[N, K]`` float32."""
    shifts = torch.arange(0, 32, 4)
    reverse = [AWQ_ORDER.index(j) for j in range(8)]

    def unpack(x):
        nib = (x[:, :, None] >> shifts[None, None, :]) & 15  # [R, C, 8] by bit position
        return nib[:, :, reverse].reshape(x.shape[0], -1)

    iweight, izeros = unpack(t["qweight"]), unpack(t["qzeros"])  # [K, N], [G, N]
    group = iweight.shape[0] // izeros.shape[0]
    w = (iweight - izeros.repeat_interleave(group, 0)) * t["scales"].float().repeat_interleave(group, 0)
    return w.t()


def gptq_pack(q, zeros, scales, group, v1=True):
    """AutoGPTQ's ``pack`` (4 bits): ``qweight`` ``[K/8, N]``, ``qzeros`` ``[G, N/8]`` of ``zero - 1`` (v1),
    ``scales`` ``[G, N]``, ``g_idx`` ``[K]``."""
    intweight = q.t().contiguous().numpy().astype(np.uint32)  # [K, N]
    qweight = np.zeros((intweight.shape[0] // 8, intweight.shape[1]), dtype=np.uint32)
    for row in range(qweight.shape[0]):
        for j in range(8):
            qweight[row] |= intweight[row * 8 + j] << (4 * j)
    z = zeros.t().contiguous().numpy().astype(np.int64) - (1 if v1 else 0)
    z = z.astype(np.uint32)  # AutoGPTQ: -1 wraps to 0xFFFFFFFF
    qzeros = np.zeros((z.shape[0], z.shape[1] // 8), dtype=np.uint32)
    for col in range(qzeros.shape[1]):
        for j in range(8):
            qzeros[:, col] |= z[:, col * 8 + j] << np.uint32(4 * j)
    k = q.shape[1]
    return {"qweight": torch.from_numpy(qweight.astype(np.int32)), "qzeros": torch.from_numpy(qzeros.astype(np.int32)),
            "scales": scales.t().contiguous(), "g_idx": torch.arange(k, dtype=torch.int32) // group}


def gptq_dequantize(t, v1=True):
    """AutoGPTQ's torch fallback (``qlinear_cuda_old`` without its kernel): nibbles, ``zeros + 1`` in v1."""
    wf = torch.arange(0, 32, 4)
    zeros = ((t["qzeros"][:, :, None] >> wf[None, None, :]) & 15).reshape(t["qzeros"].shape[0], -1)
    zeros = zeros + (1 if v1 else 0)  # [G, N]
    weight = ((t["qweight"][:, None, :] >> wf[None, :, None]) & 15).reshape(-1, t["qweight"].shape[1])  # [K, N]
    group = weight.shape[0] // zeros.shape[0]
    scales = t["scales"].float().repeat_interleave(group, 0)
    return (scales * (weight - zeros.repeat_interleave(group, 0))).t()


def pack_to_int32(value: torch.Tensor, packed_dim: int = 1) -> torch.Tensor:
    """compressed-tensors' ``pack_to_int32`` for 4 bits: signed int8 values + 8, 8 a word along ``packed_dim``."""
    value = (value + 8).to(torch.uint8)
    if packed_dim == 0:
        value = value.t()
    value = value.contiguous()
    rows, cols = value.shape
    pad = -cols % 8
    value = torch.nn.functional.pad(value, (0, pad))
    packed = (value.view(rows, -1, 8).to(torch.int32) << (torch.arange(8, dtype=torch.int32) * 4)).sum(
        dim=2, dtype=torch.int32)
    return packed.t() if packed_dim == 0 else packed


def ct_pack(q, zeros, scales, symmetric, packed_zero_point=True):
    """compressed-tensors ``pack-quantized``: signed codes ``q - 8`` packed, ``weight_scale`` ``[N, G]``, and for an
    asymmetric scheme the signed zero point ``zero - 8``, packed along the output features (older releases stored
    it unpacked, int8)."""
    out = {"weight_packed": pack_to_int32((q - 8).to(torch.int8)), "weight_scale": scales.contiguous(),
           "weight_shape": torch.tensor(list(q.shape), dtype=torch.int64)}
    if not symmetric:
        zero_point = (zeros - 8).to(torch.int8)
        out["weight_zero_point"] = pack_to_int32(zero_point, packed_dim=0) if packed_zero_point else zero_point
    return out


def ct_dequantize(t):
    """compressed-tensors' ``unpack_from_int32`` + ``dequantize``: ``(q_signed - zero_point) * scale``."""
    shifts = torch.arange(8) * 4
    words = t["weight_packed"]
    signed = ((words[:, :, None] >> shifts) & 15).reshape(words.shape[0], -1) - 8  # [N, K]
    n, groups = t["weight_scale"].shape
    if "weight_zero_point" in t and t["weight_zero_point"].dtype == torch.int8:
        zp = t["weight_zero_point"].long()
    elif "weight_zero_point" in t:
        zp = t["weight_zero_point"]
        zp = ((zp[:, None, :] >> shifts[None, :, None]) & 15).reshape(-1, zp.shape[1])[:n] - 8  # [N, G]
    else:
        zp = torch.zeros(n, groups, dtype=torch.long)
    group = signed.shape[1] // groups
    return (signed - zp.repeat_interleave(group, 1)) * t["weight_scale"].float().repeat_interleave(group, 1)


VARIANTS = {
    # name: (quantization_config, group, zero_range)
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemm", "zero_point": True}, 64, (0, 15)),
    # zero points of 0 wrap in the v1 "zero - 1" storage (read back as 16, as AutoGPTQ's kernels do)
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False}, 32, (0, 15)),
    "gptq-sym-whole-rows": ({"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False, "sym": True},
                            -1, (8, 8)),
    "gptq-v2": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False,
                 "checkpoint_format": "gptq_v2"}, 32, (0, 15)),
    "compressed-tensors": ({"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                                          "weights": {"num_bits": 4, "type": "int", "symmetric": False,
                                                                      "strategy": "group", "group_size": 32}}}},
                           32, (0, 15)),
    "compressed-tensors-int8-zero-point": (
        {"quant_method": "compressed-tensors", "format": "pack-quantized",
         "config_groups": {"group_0": {"targets": ["Linear"],
                                       "weights": {"num_bits": 4, "type": "int", "symmetric": False,
                                                   "strategy": "group", "group_size": 64}}}}, 64, (0, 15)),
    "compressed-tensors-sym-channel": (
        {"quant_method": "compressed-tensors", "format": "pack-quantized",
         "config_groups": {"group_0": {"targets": ["Linear"],
                                       "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                   "strategy": "channel"}}}}, -1, (8, 8)),
}


def _pack(variant: str, q, zeros, scales):
    config, group, _ = VARIANTS[variant]
    if variant == "awq":
        return awq_pack(q, zeros, scales), awq_dequantize
    if variant.startswith("gptq"):
        v1 = config.get("checkpoint_format", "gptq") == "gptq"
        return gptq_pack(q, zeros, scales, group if group > 0 else q.shape[1], v1), lambda t: gptq_dequantize(t, v1)
    symmetric = config["config_groups"]["group_0"]["weights"]["symmetric"]
    return ct_pack(q, zeros, scales, symmetric, packed_zero_point="int8" not in variant), ct_dequantize


def write_checkpoint(folder, float_folder, variant: str, seed: int = 0):
    """A packed copy of the tiny model in ``float_folder`` at ``folder`` (``variant`` of :data:`VARIANTS`).

    Returns ``{HF weight name: [N, K] float32}``, the independent dequantization of every packed linear."""
    config, group, zero_range = VARIANTS[variant]
    state = load_file(str(float_folder / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    out, reference = {}, {}
    for name, tensor in state.items():
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or not module.endswith(LINEARS):
            out[name] = tensor
            continue
        k = tensor.shape[1]
        q, zeros, scales = quantize_groups(tensor.float(), group if group > 0 else k, gen, zero_range)
        tensors, dequantize = _pack(variant, q, zeros, scales)
        out.update({f"{module}.{part}": t for part, t in tensors.items()})
        reference[name] = dequantize(tensors).float().contiguous()
    folder.mkdir()
    for f in float_folder.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, folder / f.name)
    hf_config = json.loads((float_folder / "config.json").read_text())
    hf_config["quantization_config"] = config
    (folder / "config.json").write_text(json.dumps(hf_config))
    save_file({k: v.contiguous() for k, v in out.items()}, str(folder / "model.safetensors"))
    return reference


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    # hidden 128, intermediate 256, 4 heads of 32, 3 layers: whole groups of 32, 64 and 128 in every linear
    folder = tmp_path_factory.mktemp("hf") / "float"
    config = tiny_config("llama3", vocab_size=VOCAB, hidden_size=128, intermediate_size=256)
    tiny_hf_model(config, seed=7).save_pretrained(folder)
    word_tokenizer([f"x{i:02d}" for i in range(2, VOCAB)]).save_pretrained(folder)
    return folder


def _engine(folder, **kwargs) -> LLM:
    return LLM(str(folder), device="cpu", dtype="float32", max_model_len=64, kv_cache_memory=1 << 20, **kwargs)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_packed_checkpoint_loads_as_its_independent_dequantization_and_generates_its_tokens(
        variant, tiny_folder, tmp_path):
    reference = write_checkpoint(tmp_path / variant, tiny_folder, variant)
    checkpoint = QuantizedCheckpoint(tmp_path / variant, VARIANTS[variant][0])
    assert set(checkpoint.layouts) == set(reference)
    for name, weight in checkpoint.weights(frozenset(checkpoint.layouts)):
        if name in reference:
            got = dequantize(*weight, "int4", checkpoint.layouts[name].group_size)
            assert torch.equal(got, reference[name]), name  # exact: integers times fp16 scales, in float32
    state = load_file(str(tiny_folder / "model.safetensors"))
    state.update(reference)
    float_folder = tmp_path / "dequantized"
    shutil.copytree(tiny_folder, float_folder)
    save_file(state, str(float_folder / "model.safetensors"))
    prompts = [[5, 9, 33, 12, 40, 7, 19, 3, 60, 2, 44], [3, 4, 5]]
    with _engine(tmp_path / variant) as packed:
        model = packed.engine.runner.model
        swapped = {name for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
        assert len(swapped) == 4 * 3 and not any("lm_head" in name for name in swapped)
        groups = {name: m.group_size for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
        assert groups["model.layers.0.mlp.down_proj"] == checkpoint.layouts[
            "model.layers.0.mlp.down_proj.weight"].group_size  # whole rows of 256: one group of 256
        got = [out.token_ids for out in packed.generate(prompts, greedy_params(10), use_tqdm=False)]
    with _engine(float_folder) as dequantized:
        want = [out.token_ids for out in dequantized.generate(prompts, greedy_params(10), use_tqdm=False)]
    assert got == want


def _refused(folder, match, monkeypatch, quantization=None):
    """``load_engine_model`` raises ``ValueError`` matching ``match`` before building the model."""
    def no_model(*args, **kwargs):
        raise AssertionError("the model was built")

    with monkeypatch.context() as patch:
        patch.setattr(ModelFamily, "model_class", lambda family: no_model)
        with pytest.raises(ValueError, match=match):
            load_engine_model(str(folder), None, torch.float32, torch.device("cpu"), quantization=quantization)


def _edit(folder, config=None, tensors=None):
    if config is not None:
        hf_config = json.loads((folder / "config.json").read_text())
        hf_config["quantization_config"] = config
        (folder / "config.json").write_text(json.dumps(hf_config))
    if tensors is not None:
        state = load_file(str(folder / "model.safetensors"))
        tensors(state)
        save_file(state, str(folder / "model.safetensors"))


def test_unsupported_or_inconsistent_checkpoints_are_refused_naming_the_field_before_the_model_is_built(
        tiny_folder, tmp_path, monkeypatch):
    awq, gptq = tmp_path / "awq", tmp_path / "gptq"
    write_checkpoint(awq, tiny_folder, "awq")
    write_checkpoint(gptq, tiny_folder, "gptq")
    _refused(awq, r"quantization='int4' does not match the checkpoint's quantization_config.quant_method='awq'",
             monkeypatch, "int4")
    _refused(awq, r"quantization='gptq' does not match .* pass None \(detected\) or 'awq'", monkeypatch, "gptq")
    _refused(tiny_folder, r"quantization='awq' names a checkpoint format, but .* has no quantization_config",
             monkeypatch, "awq")
    awq_config, gptq_config = VARIANTS["awq"][0], VARIANTS["gptq"][0]
    cases = [
        (awq, {**awq_config, "quant_method": "bitsandbytes"},
         r"quantization_config.quant_method='bitsandbytes' is not supported; supported: 'awq', 'gptq', "
         r"'compressed-tensors'"),
        (awq, {**awq_config, "bits": 8}, r"quantization_config.bits=8 is not supported; supported: 4"),
        (awq, {**awq_config, "version": "gemv"}, r"quantization_config.version='gemv' is not supported; supported: "
                                                 r"'gemm'"),
        (awq, {**awq_config, "group_size": 16}, r"quantization_config.group_size=16 is not supported; supported: -1"),
        (gptq, {**gptq_config, "desc_act": True}, r"quantization_config.desc_act=True is not supported; supported: "
                                                  r"False"),
        (gptq, {**gptq_config, "checkpoint_format": "marlin"}, r"checkpoint_format='marlin' is not supported"),
        (gptq, {**gptq_config, "group_size": 64},
         r"checkpoint tensor 'model.layers.0.\w+.\w+.qzeros' has shape \[(4|8), 16\], expected \[(2|4), 16\] for a "
         r"gptq linear of \[\d+, \d+\] with group size 64"),
        (awq, {**VARIANTS["compressed-tensors"][0], "format": "marlin-24"},
         r"quantization_config.format='marlin-24' is not supported; supported: 'pack-quantized'"),
    ]
    for folder, config, match in cases:
        _edit(folder, config)
        _refused(folder, match, monkeypatch)
    _edit(gptq, gptq_config)
    _edit(gptq, tensors=lambda s: s.update({"model.layers.1.mlp.up_proj.scales": s[
        "model.layers.1.mlp.up_proj.scales"][:, :-8].contiguous()}))
    _refused(gptq, r"'model.layers.1.mlp.up_proj.scales' has shape \[4, 248\], expected \[4, 256\]", monkeypatch)
    _edit(awq, awq_config, tensors=lambda s: s.pop("model.layers.0.mlp.down_proj.qzeros"))
    _refused(awq, r"checkpoint module 'model.layers.0.mlp.down_proj' \(awq\) lacks qzeros", monkeypatch)
    act_order = tmp_path / "act-order"
    write_checkpoint(act_order, tiny_folder, "gptq")
    _edit(act_order, tensors=lambda s: s.update({"model.layers.0.self_attn.o_proj.g_idx": s[
        "model.layers.0.self_attn.o_proj.g_idx"].flip(0).contiguous()}))
    _refused(act_order, r"'model.layers.0.self_attn.o_proj.g_idx' is not k // group_size", monkeypatch)


def test_the_engine_accepts_exactly_the_round_to_nearest_methods_and_the_packed_formats():
    from questkv.engine.engine_config import QUANTIZATIONS, ROUND_TO_NEAREST

    assert set(QUANTIZATIONS) == set(ROUND_TO_NEAREST + engine_model.PACKED_FORMATS)
