"""QuantizedLinear and quantize_linears: a quantized layer multiplies by exactly its dequantized weight, fused
projections keep their shards, a quantized Llama gives the logits of the float model holding the dequantized
weights and stays close to the float model, the LM head stays float unless asked, bad arguments change nothing.

Tolerances (CPU, float32, the torch reference): a quantized model against the float model with its dequantized
weights: 1e-4 absolute (the same float32 matmuls). Against the original float model, relative error of the
prefill logits (||q - f|| / ||f||): int8 < 0.08 and int4 < 0.6 (measured 0.02 and 0.50 on these 2-layer
random models: round-to-nearest int4 of Gaussian weights errs ~10% per layer and random attention amplifies it;
unrelated logits would give ~1.4); one random Gaussian layer: int8 < 0.01, int4 < 0.12.
"""

import pytest
import torch
from torch import nn

from questkv import ops
from questkv.engine.llm import LLM
from questkv.engine.sampling_params import SamplingParams
from questkv.layers.linear import MergedLinear
from questkv.layers.quantized_linear import QuantizedLinear, QuantizedMergedLinear, quantize_linears
from questkv.models.llama import LlamaForCausalLM, ModelSpec
from questkv.ops import quant_reference as ref
from questkv.ops.quant_reference import METHODS, QuantizedWeight, dequantize, pack_int4
from tests.helpers import engine_greedy, tiny_config, tiny_hf_model

MODEL_TOL = {"int8": 0.08, "int4": 0.6}
LAYER_TOL = {"int8": 0.01, "int4": 0.12}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("method", METHODS)
def test_a_quantized_layer_multiplies_by_its_dequantized_weight_and_errs_little(method):
    gen = torch.Generator().manual_seed(1)
    linear = nn.Linear(256, 40, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 256, generator=gen) * 0.05)
        linear.bias.copy_(torch.randn(40, generator=gen))
    layer = QuantizedLinear.from_float(linear, method)
    x = torch.randn(2, 5, 256, generator=gen)  # leading dims are kept
    got = layer(x)
    assert got.shape == (2, 5, 40) and got.dtype == torch.float32
    want = x @ layer.dequantized_weight().t() + linear.bias
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert _rel(got - linear.bias, linear(x).detach() - linear.bias) < LAYER_TOL[method]
    assert not any(p.requires_grad for p in layer.parameters())
    fresh = QuantizedLinear(256, 40, method, bias=True, dtype=torch.float32)
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(fresh(x), got)


def test_a_merged_projection_keeps_its_shards_and_split():
    merged = MergedLinear(128, {"q": 64, "k": 32, "v": 32}, bias=True)
    with torch.no_grad():
        merged.bias.uniform_(-1, 1)
    layer = QuantizedLinear.from_float(merged, "int4")
    assert isinstance(layer, QuantizedMergedLinear)
    assert layer.shard_sizes == {"q": 64, "k": 32, "v": 32} and layer.shard_offsets == {"q": 0, "k": 64, "v": 96}
    q, k, v = layer.split(layer(torch.randn(3, 128)))
    assert (q.shape, k.shape, v.shape) == ((3, 64), (3, 32), (3, 32))
    with pytest.raises(RuntimeError, match="load the float weights, then quantize"):
        layer.load_shard("model.layers.0.self_attn.q_proj.weight", "q", "weight", torch.zeros(64, 128))


def test_grouped_int8_multiplies_by_its_dequantized_weight_on_every_cpu_backend():
    gen = torch.Generator().manual_seed(4)
    layer = QuantizedLinear(64, 24, "int8_grouped", bias=True, group_size=16, dtype=torch.float32)
    codes = torch.randint(-128, 128, (24, 64), generator=gen, dtype=torch.int8)
    scales = torch.rand(4, 24, generator=gen) * 1e-2
    layer.load_packed("w", QuantizedWeight(codes, scales, None))
    layer.bias.uniform_(-1, 1)
    weight = codes.float() * scales.t().repeat_interleave(16, dim=1)  # [24, 64]
    assert torch.equal(layer.dequantized_weight(), weight)
    x = torch.randn(5, 64, generator=gen)
    for backend in ("auto", "torch"):
        layer.set_backend(backend)
        torch.testing.assert_close(layer(x), x @ weight.t() + layer.bias, rtol=1e-5, atol=1e-5)
    assert "group_size=16" in repr(layer)
    with pytest.raises(ValueError, match=r"group_size must be one of 16, 32, 64, 128, 256; got 8"):
        QuantizedLinear(64, 24, "int8_grouped", group_size=8)


def test_grouped_int8_through_the_triton_kernel_matches_the_torch_backend():
    pytest.importorskip("questkv.ops.triton.quant_matmul")
    gen = torch.Generator().manual_seed(6)
    layer = QuantizedLinear(128, 24, "int8_grouped", bias=True, group_size=32, dtype=torch.float32, backend="torch")
    layer.load_packed("w", QuantizedWeight(torch.randint(-128, 128, (24, 128), generator=gen, dtype=torch.int8),
                                           torch.rand(4, 24, generator=gen) * 1e-2, None))
    layer.bias.uniform_(-1, 1)
    x = torch.randn(2, 3, 128, generator=gen)  # leading dims are kept
    want = layer(x)
    layer.set_backend("triton")
    got = layer(x)
    assert got.shape == (2, 3, 24) and "backend=triton" in repr(layer)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_words_serve_every_row_count_through_the_gemv_tensor_cores_or_the_float_weight(monkeypatch):
    """An int4 layer's one copy of its codes, the K-major words, on the ``triton`` backend (the kernels in the
    interpreter): ``int4_gemv`` up to 2 rows, ``int4_words_matmul`` up to 64, the float weight from the words
    above; where the CUDA kernels are built (faked here) and fit (bf16), one row takes the CUDA GEMV and 2 to
    ``MMA_MAX_M`` rows the tensor-core kernel."""
    quant_ops = pytest.importorskip("questkv.ops.triton.quant_ops")
    from questkv.ops.cuda import int4_gemv as cuda_gemv
    from questkv.ops.cuda import int4_mma

    gen = torch.Generator().manual_seed(8)
    layer = QuantizedLinear.from_float(nn.Linear(256, 64, bias=True), "int4", backend="triton")
    layer.bias.uniform_(-1, 1, generator=gen)
    assert "words" in dict(layer.named_buffers()) and "qweight" not in dict(layer.named_buffers())
    calls = []
    for name in ("int4_gemv", "int4_words_matmul", "dequantize_k_major"):
        real = getattr(quant_ops, name)
        monkeypatch.setattr(quant_ops, name, lambda *a, name=name, real=real, **k: calls.append(name)
                            or real(*a, **k))
    x = torch.randn(65, 256, generator=gen)
    want = x @ layer.dequantized_weight().t() + layer.bias
    tol = 1e-4 * want.abs().max().item()  # the GEMV's high nibbles carry 15 / 65536 of x (tests/ops)
    for rows in (1, 2, 4, 64, 65):
        torch.testing.assert_close(layer(x[:rows]), want[:rows], rtol=0, atol=tol)
    assert calls == ["int4_gemv", "int4_gemv", "int4_words_matmul", "int4_words_matmul", "dequantize_k_major"]
    calls.clear()
    monkeypatch.setattr(int4_mma, "available", lambda device: True)
    monkeypatch.setattr(int4_mma, "int4_mma", lambda x, *a: calls.append("int4_mma") or want[:len(x)])
    monkeypatch.setattr(cuda_gemv, "int4_gemv_cuda", lambda x, *a: calls.append("int4_gemv_cuda") or want[:1])
    xb, scales = x.to(torch.bfloat16), layer.scales.to(torch.bfloat16)
    for rows in (1, 2, 3, int4_mma.MMA_MAX_M, int4_mma.MMA_MAX_M + 1):
        quant_ops.int4_matmul(xb[:rows], layer.words, scales, layer.zeros, 128, None)
    quant_ops.int4_matmul(x[:5], layer.words, layer.scales, layer.zeros, 128, None)  # float32: not its rows
    quant_ops.int4_matmul(x[:1], layer.words, layer.scales, layer.zeros, 128, None)
    assert calls == ["int4_gemv_cuda", "int4_mma", "int4_mma", "int4_mma", "int4_words_matmul", "int4_words_matmul",
                     "int4_gemv"]


def test_an_int4_layer_on_the_kernels_prepares_them_when_its_backend_is_set(monkeypatch):
    """``set_backend`` (outside graph capture) asks the ops to build the int4 kernels for the layer's device unless
    the backend is the torch reference; an int8 layer asks nothing."""
    prepared = []
    monkeypatch.setattr(ops, "prepare_int4_matmul", lambda device: prepared.append(device))
    layer = QuantizedLinear.from_float(nn.Linear(256, 16), "int4")
    assert prepared == [torch.device("cpu")]
    layer.set_backend("torch")
    layer.set_backend("triton")
    QuantizedLinear.from_float(nn.Linear(256, 16), "int8")
    assert prepared == [torch.device("cpu")] * 2


def test_an_int4_layer_holds_only_the_words_and_saves_and_loads_the_checkpoint_layout():
    """The K-major words as the int4 layer's only copy of its codes: the same products through the kernels at 1, 4
    and 6 rows (interpreter), a state dict in the checkpoint layout, a state dict and packed rows load into the
    words bit for bit."""
    pytest.importorskip("questkv.ops.triton.quant_ops")
    gen = torch.Generator().manual_seed(21)
    linear = nn.Linear(256, 48, bias=True)
    nn.init.normal_(linear.weight, generator=gen)
    layer = QuantizedLinear.from_float(linear, "int4", group_size=64, backend="torch")
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    codes = state["qweight"]
    assert torch.equal(codes, ref.quantize_weight(linear.weight, "int4", 64).qweight)
    assert torch.equal(layer.words, ref.pack_int4_k_major(codes, 64))
    x = torch.randn(6, 256, generator=gen)
    want = x @ layer.dequantized_weight().t() + layer.bias
    layer.set_backend("triton")
    assert torch.equal(layer.dequantized_weight(), dequantize(codes, layer.scales, layer.zeros, "int4", 64))
    tol = 1e-4 * want.abs().max().item()  # the GEMV's high nibbles carry 15 / 65536 of x (tests/ops)
    for rows in (1, 4, 6):
        torch.testing.assert_close(layer(x[:rows]), want[:rows], rtol=0, atol=tol)
    saved = layer.state_dict()
    assert saved.keys() == state.keys() and all(torch.equal(saved[k], v) for k, v in state.items())
    fresh = QuantizedLinear(256, 48, "int4", bias=True, group_size=64, backend="torch")
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.state_dict()["qweight"], codes) and torch.equal(fresh.words, layer.words)
    other = QuantizedLinear.from_float(nn.Linear(256, 48, bias=True), "int4", group_size=64, backend="torch")
    other.load_state_dict(state)  # into the words
    torch.testing.assert_close(other(x), want, rtol=1e-5, atol=1e-5)
    other.load_packed("w", QuantizedWeight(codes[:16].flip(0), layer.scales[:, :16], layer.zeros[:, :16]), slice(8, 24))
    loaded = other.state_dict()["qweight"]
    assert torch.equal(loaded[8:24], codes[:16].flip(0)) and torch.equal(loaded[24:], codes[24:])
    with pytest.raises(ValueError, match=r"qweight has shape \(16, 64\), the int4 layer expects \(16, 128\)"):
        layer.load_packed("w", QuantizedWeight(codes[:16, :64], layer.scales[:, :16], layer.zeros[:, :16]),
                          slice(0, 16))


def test_integer_zero_points_are_held_as_bytes_and_fractions_widen_them_without_rounding():
    """Round to nearest's zero points (integers in 0..15) take one byte per group instead of the scales' two, and the
    layer multiplies as before; packed rows with fractional zero points (GGUF Q4_1 / Q4_K offsets) widen the
    whole buffer to the scales' dtype, keeping the byte rows and the fractions exact; a state dict with fractions
    loads into a fresh (byte) layer the same way; a shape error widens nothing."""
    gen = torch.Generator().manual_seed(5)
    linear = nn.Linear(256, 48, bias=False).to(torch.bfloat16)
    nn.init.normal_(linear.weight, generator=gen)
    layer = QuantizedLinear.from_float(linear, "int4", group_size=64, backend="torch")
    assert layer.zeros.dtype == torch.uint8 and layer.scales.dtype == torch.bfloat16
    want = ref.quantize_weight(linear.weight, "int4", 64)
    assert torch.equal(layer.zeros, want.zeros.to(torch.uint8))
    assert torch.equal(layer.dequantized_weight(), dequantize(want.qweight, want.scales, want.zeros, "int4", 64))
    fraction = torch.rand(4, 16, generator=gen).to(torch.bfloat16) + want.zeros[:, :16]
    with pytest.raises(ValueError, match="qweight has shape"):
        layer.load_packed("w", QuantizedWeight(want.qweight[:16, :64], want.scales[:, :16], fraction), slice(0, 16))
    assert layer.zeros.dtype == torch.uint8
    layer.load_packed("w", QuantizedWeight(want.qweight[:16], want.scales[:, :16], fraction), slice(8, 24))
    assert layer.zeros.dtype == torch.bfloat16
    assert torch.equal(layer.zeros[:, 8:24], fraction) and torch.equal(layer.zeros[:, 24:], want.zeros[:, 24:])
    fresh = QuantizedLinear(256, 48, "int4", group_size=64, dtype=torch.bfloat16, backend="torch")
    fresh.load_state_dict(layer.state_dict())
    assert fresh.zeros.dtype == torch.bfloat16 and torch.equal(fresh.zeros, layer.zeros)


@pytest.mark.parametrize("max_num_seqs", [1, 3])
def test_an_engine_keeps_one_copy_of_the_codes_at_any_batch_and_its_kernels_give_the_reference_tokens(max_num_seqs):
    """Every engine, batching or not, builds its int4 layers with the K-major words as their one copy of the codes,
    and its layers on the kernels (the interpreter) give the torch reference's tokens."""
    pytest.importorskip("questkv.ops.triton.quant_ops")
    config = tiny_config("llama3", hidden_size=128, intermediate_size=256, head_dim=32, vocab_size=96)
    llm = LLM(config, load_format="dummy", device="cpu", dtype="float32", max_model_len=64, kv_cache_memory=1 << 20,
              quantization="int4", max_num_seqs=max_num_seqs)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(set(dict(m.named_buffers())) == {"words", "scales", "zeros"} for m in layers)
    for layer in layers:
        layer.set_backend("triton")
    prompts, params = [[5, 17, 3, 88, 41, 9, 60], [30, 2, 71]], SamplingParams(temperature=0, max_tokens=6,
                                                                               ignore_eos=True)
    got = [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.close()
    reference = LLM(config, load_format="dummy", device="cpu", dtype="float32", max_model_len=64,
                    kv_cache_memory=1 << 20, quantization="int4", max_num_seqs=max_num_seqs)
    assert got == [list(o.token_ids) for o in reference.generate(prompts, params, use_tqdm=False)]
    reference.close()


def test_packed_shards_and_bias_load_into_the_rows_of_a_merged_layer_after_their_shapes_are_checked():
    merged = MergedLinear(64, {"gate": 16, "up": 8}, bias=True)
    layer = QuantizedLinear.empty_like(merged, "int4", group_size=32)
    assert isinstance(layer, QuantizedMergedLinear) and layer.backend == "torch"
    gen = torch.Generator().manual_seed(5)
    parts = {}
    for shard, rows in (("gate", 16), ("up", 8)):
        q = torch.randint(0, 16, (rows, 64), generator=gen)
        parts[shard] = QuantizedWeight(pack_int4(q), torch.rand(2, rows, generator=gen), torch.rand(2, rows) * 15)
        layer.load_shard(f"{shard}.weight", shard, "weight", parts[shard])
        layer.load_shard(f"{shard}.bias", shard, "bias", torch.full((rows,), float(rows)))
    want = torch.cat([dequantize(*parts[s], "int4", 32) for s in ("gate", "up")])
    assert torch.equal(layer.dequantized_weight(), want)
    assert layer.bias.tolist() == [16.0] * 16 + [8.0] * 8
    bad = QuantizedWeight(parts["up"].qweight, parts["up"].scales[:1], parts["up"].zeros)
    with pytest.raises(ValueError, match=r"weight 'up.weight': scales has shape \(1, 8\), the int4 layer expects "
                                         r"\(2, 8\)"):
        layer.load_shard("up.weight", "up", "weight", bad)
    with pytest.raises(ValueError, match="zeros must be given for int4"):
        layer.load_shard("up.weight", "up", "weight", QuantizedWeight(bad.qweight, parts["up"].scales, None))


def _model_pair(family: str):
    """A tiny random Llama-family model (hidden 128, intermediate 256, 4 query heads of 32: whole int4 groups)
    and a builder of fresh float copies of it."""
    config = tiny_config(family, hidden_size=128, intermediate_size=256, head_dim=32, num_attention_heads=4,
                         num_key_value_heads=2)
    hf = tiny_hf_model(config, seed=1)

    def build() -> LlamaForCausalLM:
        model = LlamaForCausalLM(ModelSpec.from_hf_config(config)).eval()
        model.load_weights(hf.state_dict().items())
        return model

    return config, build


@pytest.mark.parametrize("family, method", [("llama_mha", "int4"), ("qwen3", "int8"), ("qwen2", "int4")])
def test_a_quantized_llama_gives_the_logits_of_its_dequantized_weights_close_to_the_float_model(family, method):
    config, build = _model_pair(family)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in (11, 6)]
    model = build()
    names = quantize_linears(model, method)
    assert len(names) == 4 * config.num_hidden_layers and "lm_head" not in names
    assert isinstance(model.lm_head, nn.Linear) and isinstance(model.model.embed_tokens, nn.Embedding)
    dequantized = build()
    for name in names:
        dequantized.get_submodule(name).weight.data.copy_(model.get_submodule(name).dequantized_weight())
    got, got_decode, got_tokens = engine_greedy(model, prompts, 2)
    want, want_decode, want_tokens = engine_greedy(dequantized, prompts, 2)
    for g, w in zip(got + got_decode, want + want_decode):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-4)
    assert torch.equal(got_tokens, want_tokens)
    float_prefill, _, _ = engine_greedy(build(), prompts, 0)
    assert _rel(torch.cat(got), torch.cat(float_prefill)) < MODEL_TOL[method]


def test_the_lm_head_is_quantized_only_when_not_skipped_and_a_tied_embedding_stays_float():
    _, build = _model_pair("qwen2")  # tied embeddings
    model = build()
    embedding = model.model.embed_tokens.weight.detach().clone()
    names = quantize_linears(model, "int8", skip=())
    assert "lm_head" in names and isinstance(model.lm_head, QuantizedLinear)
    assert isinstance(model.model.embed_tokens, nn.Embedding)
    assert torch.equal(model.model.embed_tokens.weight, embedding)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, QuantizedMergedLinear)
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, QuantizedMergedLinear)


def test_bad_arguments_raise_value_errors_and_leave_the_model_float():
    _, build = _model_pair("llama3")
    model = build()
    with pytest.raises(ValueError, match="quantization must be one of 'int4', 'int8'; got 'fp8'"):
        quantize_linears(model, "fp8")
    with pytest.raises(ValueError, match=r"group_size must be one of 32, 64, 128, 256; got 48"):
        quantize_linears(model, "int4", group_size=48)
    small = LlamaForCausalLM(ModelSpec.from_hf_config(tiny_config("llama3")))  # hidden 64, intermediate 96
    with pytest.raises(ValueError, match=r"multiple of the int4 group size 128, got 64 \(layer model.layers.0"):
        quantize_linears(small, "int4")
    for m in (model, small):
        assert not any(isinstance(x, QuantizedLinear) for x in m.modules())
    with pytest.raises(ValueError, match="quantization must be one of 'int4', 'int8', 'int8_grouped'; got 'int2'"):
        QuantizedLinear(128, 8, "int2")
    with pytest.raises(ValueError, match="quantization must be one of 'int4', 'int8'; got 'int8_grouped'"):
        quantize_linears(model, "int8_grouped")  # a checkpoint format: nothing rounds to it
    with pytest.raises(ValueError, match="QuantizedLinear.in_features must be a multiple of the int4 group size 128"):
        QuantizedLinear(200, 8, "int4")
    with pytest.raises(ValueError, match="QuantizedLinear.backend must be one of"):
        QuantizedLinear(128, 8, "int4", backend="marlin")
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'torch', 'triton'; got 'gemv'"):
        QuantizedLinear(128, 8, "int4", backend="gemv")  # kernels are the ops' choice, by rows


@pytest.mark.parametrize("method", METHODS)
def test_an_engine_with_quantized_linears_generates(method):
    config = tiny_config("llama3", hidden_size=128, intermediate_size=256, head_dim=32, vocab_size=96)
    llm = LLM(config, load_format="dummy", device="cpu", dtype="float32", max_model_len=64, kv_cache_memory=1 << 20)
    names = quantize_linears(llm.engine.runner.model, method)
    assert len(names) == 4 * config.num_hidden_layers
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = llm.generate([[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]], params, use_tqdm=False)
    assert [len(out.token_ids) for out in outs] == [5, 5]
