"""GGUF read natively (``quantization="gguf"``): every packed block type unpacks to the codes it was built from
(bit-exact) and to the ``gguf`` package's own dequantization within the stated bound; a tiny GGUF of mixed types
gives the logits and tokens of the same file dequantized by transformers; bad files and arguments are refused
before the model is built.

Blocks are built here by each type's published bit layout from known codes (the ``gguf`` dequantizer then checks
the packer), and by ``gguf.quants.quantize`` where it supports the type (Q4_0, Q4_1, Q8_0).

Bound (questkv.models.gguf_native): ``|w - gguf| <= (u + 3 * 2**-24) * (1 + u) * (|gguf| + |offset|)`` with ``u``
the unit roundoff of the scales' dtype (2**-8 bf16, 2**-24 float32) and ``offset`` the group's ``zero * scale``.
"""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from questkv.layers.quantized_linear import QuantizedLinear, QuantizedMergedLinear
from questkv.models import gguf_native
from questkv.models.engine_model import load_engine_model
from questkv.models.families import ModelFamily
from questkv.models.gguf_native import GGUFWeights, resolve_gguf, unpack_blocks
from questkv.ops.quant_reference import dequantize, unpack_int4
from tests.helpers import engine_greedy, greedy_params, tiny_config, tiny_hf_model

T = gguf.GGMLQuantizationType


@pytest.fixture(autouse=True, scope="module")
def _cache_dir(tmp_path_factory):
    """The config / tokenizer cache of native loads goes to a temporary folder, not the user's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QUESTKV_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield
U = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(len(x), 2)


def _nibble_bytes(q: np.ndarray, chunk: int) -> np.ndarray:
    """Codes ``[B, 2 * bytes]`` → bytes: per ``chunk`` bytes, the first ``chunk`` codes low, the next high."""
    q = q.reshape(len(q), -1, 2, chunk).astype(np.uint8)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(len(q), -1)


def build_blocks(type_name: str, n: int, k: int, rng: np.random.Generator):
    """Random blocks of ``type_name`` for an ``[n, k]`` weight, packed by the published layout.

    Returns ``(data [n, bytes per row] uint8, codes [n, k] as the layout stores them, floats [n, k] float64 by
    the type's formula, offsets [n, k] |zero * scale| per weight)``; a few groups get a zero scale."""
    if type_name in ("Q4_0", "Q4_1", "Q8_0"):
        blocks = n * k // 32
        d = (rng.uniform(0.5, 2, blocks) * 2e-3).astype(np.float16)
        d[::7] = 0  # groups of scale 0
        d64 = d.astype(np.float64)[:, None]
        if type_name == "Q8_0":
            q = rng.integers(-128, 128, (blocks, 32))
            data = np.concatenate([_f16(d), q.astype(np.int8).view(np.uint8)], axis=1)
            return data.reshape(n, -1), q.reshape(n, k), (d64 * q).reshape(n, k), np.zeros((n, k))
        q = rng.integers(0, 16, (blocks, 32))
        if type_name == "Q4_0":
            data = np.concatenate([_f16(d), _nibble_bytes(q, 16)], axis=1)
            return data.reshape(n, -1), q.reshape(n, k), (d64 * (q - 8)).reshape(n, k), np.broadcast_to(
                8 * d64, q.shape).reshape(n, k)
        m = (rng.uniform(-16, 0, blocks) * 2e-3).astype(np.float16)
        data = np.concatenate([_f16(d), _f16(m), _nibble_bytes(q, 16)], axis=1)
        floats = d64 * q + m.astype(np.float64)[:, None]
        q = np.where(d[:, None] == 0, 0, q)  # a flat group is held with codes 0
        return data.reshape(n, -1), q.reshape(n, k), floats.reshape(n, k), np.broadcast_to(
            np.abs(m.astype(np.float64))[:, None], q.shape).reshape(n, k)
    blocks = n * k // 256
    d = (rng.uniform(0.5, 2, blocks) * 1e-4).astype(np.float16)
    if type_name == "Q4_K":
        dmin = (rng.uniform(0.5, 2, blocks) * 1e-4).astype(np.float16)
        sc, mn = rng.integers(0, 64, (blocks, 8)), rng.integers(0, 64, (blocks, 8))
        sc[:, 3] = 0  # sub-blocks of scale 0
        q = rng.integers(0, 16, (blocks, 8, 32))
        scales = np.concatenate([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),  # bytes 0-3
                                 (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),  # bytes 4-7
                                 (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=1).astype(np.uint8)
        data = np.concatenate([_f16(d), _f16(dmin), scales, _nibble_bytes(q.reshape(blocks, 256), 32)], axis=1)
        scale = d.astype(np.float64)[:, None] * sc
        offset = dmin.astype(np.float64)[:, None] * mn
        floats = scale[:, :, None] * q - offset[:, :, None]
        q = np.where(sc[:, :, None] == 0, 0, q)
        return data.reshape(n, -1), q.reshape(n, k), floats.reshape(n, k), np.broadcast_to(
            offset[:, :, None], q.shape).reshape(n, k)
    # Q6_K: ql (low 4 bits), qh (high 2 bits), int8 scales per 16, fp16 d
    sc = rng.integers(-128, 128, (blocks, 16))
    q = rng.integers(0, 64, (blocks, 256))
    low = (q & 15).reshape(blocks, 2, 2, 64)  # [half, nibble, byte]
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(blocks, 128)
    high = (q >> 4).reshape(blocks, 2, 4, 32)  # [half, 2-bit field, byte]
    qh = sum(high[:, :, j] << (2 * j) for j in range(4)).reshape(blocks, 64)
    data = np.concatenate([ql.astype(np.uint8), qh.astype(np.uint8), sc.astype(np.int8).view(np.uint8), _f16(d)],
                          axis=1)
    floats = d.astype(np.float64)[:, None, None] * sc[:, :, None] * (q.reshape(blocks, 16, 16) - 32)
    return data.reshape(n, -1), (q - 32).reshape(n, k), floats.reshape(n, k), np.zeros((n, k))


def _codes(weight) -> torch.Tensor:
    return unpack_int4(weight.qweight).long() if weight.zeros is not None else weight.qweight.long()


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_each_block_type_unpacks_to_its_codes_and_to_the_gguf_dequantization_within_the_bound(type_name, dtype):
    rng = np.random.default_rng(list(gguf_native.PACKED_TYPES).index(type_name))
    n, k = 6, 512
    data, codes, floats, offsets = build_blocks(type_name, n, k, rng)
    reference = gguf.quants.dequantize(data, T[type_name]).astype(np.float64)  # [n, k]
    np.testing.assert_allclose(reference, floats, rtol=1e-6, atol=1e-12)  # the packer follows the layout
    weight = unpack_blocks(data, type_name, (n, k))
    assert torch.equal(_codes(weight), torch.from_numpy(codes).long())  # bit-exact codes
    method, group = gguf_native.PACKED_TYPES[type_name]
    stored = [None if t is None else (t.to(dtype) if t.is_floating_point() else t) for t in weight]
    got = dequantize(*stored, method, group).double().numpy()
    bound = (U[dtype] + 3 * 2.0**-24) * (1 + U[dtype]) * (np.abs(reference) + offsets)
    assert (np.abs(got - reference) <= bound).all(), np.abs(got - reference).max()


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocks_of_the_gguf_quantizer_unpack_to_its_dequantization(type_name):
    w = np.random.default_rng(3).standard_normal((16, 256)).astype(np.float32) * 0.05
    data = gguf.quants.quantize(w, T[type_name])
    reference = gguf.quants.dequantize(data, T[type_name])
    weight = unpack_blocks(data, type_name, w.shape)
    got = dequantize(*weight, *gguf_native.PACKED_TYPES[type_name]).numpy()
    np.testing.assert_allclose(got, reference, rtol=0, atol=4 * 2.0**-24 * 2 * np.abs(w).max())


# ---------------------------------------------------------------------------------------------------------------
# Tiny GGUF files
# ---------------------------------------------------------------------------------------------------------------

_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
# a Q4_K_M-like mixture: the QKV shards differ (that projection stays float), every other linear is packed
MIXED = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_0", "ffn_gate": "Q4_1",
         "ffn_up": "Q4_1", "ffn_down": "Q8_0", "token_embd": "Q8_0", "output": "Q6_K"}


def write_gguf(path: Path, config, state: dict, types: dict[str, str], rng: np.random.Generator,
               exact: bool = False) -> Path:
    """Write a tiny GGUF of ``config``'s architecture (``llama`` or ``qwen2``) from an HF state dict, as
    llama.cpp's converter lays it out (Llama's q/k rows interleaved per head), tensors typed by ``types`` (GGUF
    base name -> type; others F32), with a small SentencePiece-style vocabulary. K-quant tensors are random blocks
    (no quantizer for them here); with ``exact`` every tensor is."""
    arch = "llama" if config.model_type == "llama" else "qwen2"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch == "llama":
        writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "</s>"] + [f"\u2581x{i:02d}" for i in range(3, config.vocab_size)]
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 3 + [-float(i) for i in range(3, config.vocab_size)])
    writer.add_token_types([2, 3, 3] + [1] * (config.vocab_size - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # llama.cpp writes no output tensor for a tied head
        array = tensor.detach().numpy()
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            base = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm",
                    "lm_head.weight": "output"}[name]
            gguf_name = f"{base}.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, param = rest.rsplit(".", 1)
            base = _GGUF_NAMES[module]
            gguf_name = f"blk.{layer}.{base}.{param}"
            heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(base)
            if arch == "llama" and heads:  # llama.cpp's permute
                array = array.reshape(heads, 2, array.shape[0] // heads // 2, *array.shape[1:]).swapaxes(1, 2)
                array = array.reshape(tensor.shape)
        type_name = types.get(base, "F32") if array.ndim == 2 else "F32"
        if type_name == "F32":
            writer.add_tensor(gguf_name, np.ascontiguousarray(array, dtype=np.float32))
        elif type_name in ("Q4_K", "Q6_K") or exact:
            data, *_ = build_blocks(type_name, *array.shape, rng)
            writer.add_tensor(gguf_name, data, raw_dtype=T[type_name])
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, T[type_name]), raw_dtype=T[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tiny(family: str):
    # in_features of 256 (hidden) for the K-quants, 320 (down) for a 32-block type; GGUF has no head_dim for Qwen2,
    # so heads * head_dim is the hidden size (as in the real ones)
    if family == "llama":
        config = tiny_config("llama3", hidden_size=256, intermediate_size=320, num_attention_heads=4,
                             num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    else:
        config = tiny_config("qwen2", hidden_size=256, intermediate_size=320, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=64)
    return config, tiny_hf_model(config, seed=4).state_dict()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def mixed_gguf(request, tmp_path_factory):
    config, state = _tiny(request.param)
    path = tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf"
    return write_gguf(path, config, state, MIXED, np.random.default_rng(5))


def test_a_native_gguf_gives_the_logits_and_tokens_of_the_gguf_dequantized_by_transformers(mixed_gguf):
    prompts = [torch.tensor([5, 9, 33, 12, 40, 7, 19, 3]), torch.tensor([3, 4, 5, 61])]
    cpu = torch.device("cpu")
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        for quantization in ("gguf", None):
            loaded = load_engine_model(str(mixed_gguf), None, dtype, cpu, quantization=quantization)
            prefill, decode, tokens = engine_greedy(loaded.model, prompts, 4, dtype=dtype)
            runs[dtype, quantization] = (torch.cat(prefill + decode), tokens, loaded.model)
    layer = runs[torch.float32, "gguf"][2].model.layers[0]
    assert type(layer.self_attn.qkv_proj).__name__ == "MergedLinear"  # Q4_K q/k beside a Q6_K v: float
    assert isinstance(layer.self_attn.o_proj, QuantizedLinear) and layer.self_attn.o_proj.method == "int4"
    assert isinstance(layer.mlp.gate_up_proj, QuantizedMergedLinear) and layer.mlp.gate_up_proj.group_size == 32
    assert layer.mlp.down_proj.method == "int8_grouped"
    assert {m.backend for m in layer.modules() if isinstance(m, QuantizedLinear)} == {"auto"}  # filled, then chosen
    native, want = runs[torch.float32, "gguf"], runs[torch.float32, None]
    torch.testing.assert_close(native[0], want[0], rtol=0, atol=1e-4)
    assert torch.equal(native[1], want[1])
    # bf16: the native weights are no farther from the float32 logits than the bf16 dequantization is
    truth = want[0]
    err = {q: ((runs[torch.bfloat16, q][0] - truth).norm() / truth.norm()).item() for q in ("gguf", None)}
    assert err["gguf"] <= 1.5 * err[None] + 1e-3, err


def test_the_engine_loads_a_gguf_natively_only_when_asked_and_generates_its_tokens(mixed_gguf):
    from questkv.engine.llm import LLM

    kwargs = dict(device="cpu", dtype="float32", max_model_len=64, kv_cache_memory=1 << 20)
    prompts = [[5, 9, 33, 12, 40, 7], [3, 4, 5]]
    with LLM(str(mixed_gguf), quantization="gguf", **kwargs) as native:
        assert any(isinstance(m, QuantizedLinear) for m in native.engine.runner.model.modules())
        got = [out.token_ids for out in native.generate(prompts, greedy_params(6), use_tqdm=False)]
    with LLM(str(mixed_gguf), **kwargs) as dequantized:
        assert not any(isinstance(m, QuantizedLinear) for m in dequantized.engine.runner.model.modules())
        assert got == [out.token_ids for out in dequantized.generate(prompts, greedy_params(6), use_tqdm=False)]


def test_a_q4_0_gguf_has_every_linear_packed_biases_included_and_the_tied_head_float(tmp_path):
    config, state = _tiny("qwen2")  # QKV biases, tied embeddings: no output.weight
    path = write_gguf(tmp_path / "q4.gguf", config, state, {b: "Q4_0" for b in MIXED}, np.random.default_rng(6))
    weights = GGUFWeights(path, config.num_attention_heads, config.num_key_value_heads)
    assert weights.architecture == "qwen2" and weights.types["model.embed_tokens.weight"] == "Q4_0"
    cpu = torch.device("cpu")
    loaded = load_engine_model(str(path), None, torch.float32, cpu, quantization="gguf")
    swapped = [m for m in loaded.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(swapped) == 4 * config.num_hidden_layers and all(m.method == "int4" for m in swapped)
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    prompts = [torch.tensor([7, 8, 9, 50, 51])]
    got, _, _ = engine_greedy(loaded.model, prompts, 0)
    want, _, _ = engine_greedy(load_engine_model(str(path), None, torch.float32, cpu).model, prompts, 0)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-4)
    from questkv.models.loader import cache_dir

    assert len(list((cache_dir() / "gguf-metadata").iterdir())) >= 1  # config and tokenizer kept for the next load
    config_again, tokenizer = gguf_native.gguf_config_and_tokenizer(path)
    assert (config_again.model_type, config_again.num_hidden_layers) == ("qwen2", config.num_hidden_layers)
    assert tokenizer.convert_ids_to_tokens(5) == "\u2581x05"


def _write(path: Path, arch: str, tensors: dict[str, np.ndarray]) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_bad_gguf_input_is_refused_before_any_weight_is_loaded(tmp_path, monkeypatch, mixed_gguf):
    from questkv.models.llama import LlamaForCausalLM

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built")

    cpu = torch.device("cpu")
    with monkeypatch.context() as patch:
        patch.setattr(ModelFamily, "model_class", lambda family: no_model)
        with pytest.raises(ValueError, match="EngineConfig.quantization='awq' does not match .*GGUF file; use "
                                             "quantization='gguf'"):
            load_engine_model(str(mixed_gguf), None, torch.float32, cpu, quantization="awq")
        folder = tmp_path / "folder"
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        with pytest.raises(ValueError, match="quantization='gguf' needs a .gguf file or an alias"):
            load_engine_model(str(folder), None, torch.float32, cpu, quantization="gguf")
    with pytest.raises(ValueError, match=r"general.architecture 'phi2' is not read natively; supported: llama, "
                                         "qwen2, qwen3"):
        GGUFWeights(_write(tmp_path / "phi.gguf", "phi2", {"token_embd.weight": np.zeros((4, 32), np.float32)}), 4, 4)
    with pytest.raises(ValueError, match="GGUF tensor 'blk.0.attn_qkv.weight' has no counterpart"):
        GGUFWeights(_write(tmp_path / "odd.gguf", "llama", {"blk.0.attn_qkv.weight": np.zeros((4, 32), np.float32)}),
                    4, 4)
    with pytest.raises(ValueError, match=r"Q4_0 tensor of shape \(2, 64\) must be stored as \[2, 36\] bytes"):
        unpack_blocks(np.zeros((2, 18), np.uint8), "Q4_0", (2, 64))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(mixed_gguf.read_bytes()[:-4096])
    with pytest.raises(ValueError, match="truncated.gguf is truncated: tensor .* ends past the end of the file"):
        GGUFWeights(truncated, 4, 2)
    # a packed tensor whose shape is not the config's: refused by the model before any weight is read
    config, state = _tiny("llama")
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(352, 256)
    wrong = write_gguf(tmp_path / "wrong.gguf", config, state, MIXED, np.random.default_rng(0))
    monkeypatch.setattr(LlamaForCausalLM, "load_weights", no_model)
    with pytest.raises(ValueError, match=r"packed weight 'model.layers.1.mlp.up_proj.weight' has shape \(352, 256\), "
                                         r"the model expects \(320, 256\)"):
        load_engine_model(str(wrong), None, torch.float32, cpu, quantization="gguf")


def test_an_alias_in_several_packages_is_joined_once_into_the_staged_copy_and_checksummed(tmp_path, monkeypatch):
    import dataclasses
    import hashlib

    from questkv.models import loader

    parts = [tmp_path / "a.bin", tmp_path / "b.bin"]
    parts[0].write_bytes(b"GGUF" + b"1" * 100)
    parts[1].write_bytes(b"2" * 50)
    digest = hashlib.sha256(parts[0].read_bytes() + parts[1].read_bytes()).hexdigest()
    alias = dataclasses.replace(loader.ALIASES["qwen2.5-coder-1.5b"], packages=(("a", "1"), ("b", "1")),
                                files=("a.bin", "b.bin"), sha256=digest)
    monkeypatch.setitem(gguf_native.ALIASES, "toy", alias)
    monkeypatch.setenv("QUESTKV_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def package_file(what, install, dist, version, rel):
        calls.append(dist)
        return tmp_path / rel

    monkeypatch.setattr(gguf_native, "package_file", package_file)
    path = resolve_gguf("toy")
    assert path == tmp_path / "cache" / "toy.gguf" and path.read_bytes() == b"GGUF" + b"1" * 100 + b"2" * 50
    assert resolve_gguf("toy") == path and calls == ["a", "b"]  # the second call reads the staged copy
    path.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="has SHA-256 .* expected"):
        resolve_gguf("toy")
