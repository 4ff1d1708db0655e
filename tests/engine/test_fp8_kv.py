"""The engine with an fp8 (e4m3) KV cache on CPU (``kv_cache_dtype="fp8"``): with a budget covering the context
Quest gives fp8 dense's tokens exactly; prefix caching, chunked prefill, preemption and lossless decoding give the
tokens of a plain fp8 engine; the (fp8) page bounds equal the stored keys' min and max after every step; the pool
holds the tokens its bytes allow; bad settings are refused before anything is allocated. The tiny random model and
prompts of ``test_llm.py``."""

import math
import random

import pytest
import torch

from questkv.engine.engine_config import EngineConfig
from tests.engine.test_llm import FULL, PAGE, SMALL, VOCAB, greedy, make_llm, pool_memory, prompt, run
from tests.helpers import save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), VOCAB, seed=random.randrange(1 << 16))


@pytest.fixture(scope="module")
def fp8_dense(model_dir):
    return make_llm(model_dir, kv_cache_dtype="fp8")


def ragged(count: int = 4):
    prompts = [prompt(random.randint(1, 90)) for _ in range(count)]
    return prompts, [greedy(random.randint(1, 30)) for _ in prompts]


def test_quest_with_a_covering_budget_gives_fp8_dense_tokens(model_dir, fp8_dense):
    prompts, params = ragged()
    assert run(make_llm(model_dir, FULL, kv_cache_dtype="fp8"), prompts, params) == run(fp8_dense, prompts, params)


@pytest.mark.parametrize("kwargs", [{"enable_prefix_caching": False}, {"enable_chunked_prefill": False},
                                    {"max_num_batched_tokens": 40},
                                    {"speculative_config": {"method": "quest", "num_speculative_tokens": 3,
                                                            "adaptive": False}}])
def test_engine_modes_give_the_tokens_of_a_plain_fp8_engine(model_dir, fp8_dense, kwargs):
    prompts, params = ragged(5)
    quest = SMALL if "speculative_config" in kwargs else None
    assert run(make_llm(model_dir, quest, kv_cache_dtype="fp8", **kwargs), prompts, params) == run(fp8_dense, prompts,
                                                                                                  params)


def test_preemption_gives_the_tokens_of_an_unconstrained_fp8_engine(model_dir):
    unconstrained = make_llm(model_dir, FULL, kv_cache_dtype="fp8", max_model_len=64)
    pages = math.ceil(64 / PAGE) + 2
    spec = unconstrained.engine.spec
    page_bytes = spec.num_layers * (2 * PAGE + 2) * spec.num_kv_heads * spec.head_dim  # fp8 K/V and bounds
    assert pool_memory(make_llm(model_dir, FULL, max_model_len=64), pages) > pages * page_bytes
    tiny = make_llm(model_dir, FULL, kv_cache_dtype="fp8", max_model_len=64, kv_cache_memory=pages * page_bytes)
    assert tiny.engine.cache.num_pages == pages
    prompts = [prompt(random.randint(10, 24)) for _ in range(4)]
    params = [greedy(30), greedy(36), greedy(30), greedy(25)]
    outputs = tiny.generate(prompts, params, use_tqdm=False)
    assert sum(out.metrics.num_preemptions for out in outputs) > 0
    assert [out.token_ids for out in outputs] == run(unconstrained, prompts, params)


def test_page_bounds_equal_the_stored_keys_after_every_step(model_dir):
    llm = make_llm(model_dir, SMALL, kv_cache_dtype="fp8")
    engine, cache = llm.engine, llm.engine.cache
    assert cache.kv_dtype == cache.kmin.dtype == torch.float8_e4m3fn and cache.dtype == torch.float64
    for p in [prompt(random.randint(30, 80)) for _ in range(3)]:
        engine.add_request(p, greedy(30))
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            length = cache.seq_len(seq.cache_id)
            for logical, page in enumerate(cache.pages_of(seq.cache_id)):
                keys = cache.k_pages[:, page, :min(PAGE, length - logical * PAGE)].float()
                assert torch.equal(cache.kmin[:, page].float(), keys.amin(dim=1))
                assert torch.equal(cache.kmax[:, page].float(), keys.amax(dim=1))


def test_the_pool_holds_the_tokens_its_bytes_allow(model_dir):
    """At equal memory an fp8 pool holds as many times the tokens of a model-dtype pool as that dtype has bytes (8 for
    these float64 tests, 2 for bf16): K, V and the page bounds all in one byte; its description names the dtype."""
    memory = 1 << 22
    wide, narrow = (make_llm(model_dir, kv_cache_memory=memory, kv_cache_dtype=dtype) for dtype in ("auto", "fp8"))
    ratio = narrow.engine.runner.cache_spec.kv_tokens / wide.engine.runner.cache_spec.kv_tokens
    assert ratio == pytest.approx(torch.finfo(wide.engine.cache.dtype).bits / 8, rel=0.01)
    assert "KV cache (fp8_e4m3)" in narrow.engine.runner.cache_spec.describe()
    assert "KV cache (float64)" in wide.engine.runner.cache_spec.describe()


@pytest.mark.parametrize("value", ["int8", "fp8_e5m2", "FP8", None])
def test_an_unknown_kv_cache_dtype_is_refused(model_dir, value):
    with pytest.raises(ValueError, match=r"EngineConfig.kv_cache_dtype must be one of .*'fp8'"):
        EngineConfig(model=str(model_dir), kv_cache_dtype=value, device="cpu")


@pytest.mark.parametrize("kwargs", [{"tensor_parallel_size": 2}, {"quantization": "int8"}])
def test_fp8_kv_with_tensor_parallel_ranks_or_int8_weights(loud_dir, kwargs):
    """On the loud model with per-head checkpoint key scales (its values scaled from the weights, each rank its own
    heads'): two gloo ranks (each its KV heads' fp8 pool) give one device's tokens; int8 weights beside fp8 K/V give
    the tokens of an int8 engine's fp8 run whatever else it does (here: decode densely, once alone, once batched)."""
    prompts, params = ragged(4)
    with make_llm(loud_dir, kv_cache_dtype="fp8", **kwargs) as llm:
        got = run(llm, prompts, params)
        if "quantization" in kwargs:
            assert got == [run(llm, [p], sp)[0] for p, sp in zip(prompts, params)]
            return
    assert got == run(make_llm(loud_dir, kv_cache_dtype="fp8"), prompts, params)


def with_kv_scales(model_dir, folder, k_scale=None, v_scale=None, loud: bool = False, fragile: bool = False):
    """A copy of the saved model in ``folder`` with ``self_attn.k_scale`` / ``v_scale`` (anything ``torch.tensor``
    takes; None: none) in every layer; ``loud``: ``v_proj`` (weight and bias) times 2**12 and ``o_proj`` times 2**-12
    (the same function in fp32, values far past e4m3's 448); ``fragile`` (a model with QKV biases): layer 1's first
    KV head's key bias 40 times its keys' token-dependent part (``LlamaForCausalLM.fp8_fragile_layers``)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, folder)
    weights = load_file(folder / "model.safetensors")
    layers = 1 + max(int(name.split(".")[2]) for name in weights if name.startswith("model.layers."))
    for i in range(layers):
        prefix = f"model.layers.{i}.self_attn."
        for which, scale in (("k", k_scale), ("v", v_scale)):
            if scale is not None:
                weights[f"{prefix}{which}_scale"] = torch.tensor(scale, dtype=torch.float32)
        if loud:
            for name in (prefix + "v_proj.weight", prefix + "v_proj.bias"):
                if name in weights:
                    weights[name] *= LOUD
            weights[prefix + "o_proj.weight"] /= LOUD
    if fragile:
        dim = weights["model.layers.1.self_attn.k_proj.weight"].shape[0] // 2  # 2 KV heads
        head = weights["model.layers.1.self_attn.k_proj.weight"][:dim] * weights["model.layers.1.input_layernorm.weight"]
        bias = weights["model.layers.1.self_attn.k_proj.bias"]
        bias[:dim] *= 40 * head.norm() / bias[:dim].norm()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


LOUD = 2.0**12


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    """A tiny Qwen2 (QKV biases) whose layer 1 is fp8-fragile in one KV head (:func:`with_kv_scales`)."""
    plain = save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), VOCAB, seed=random.randrange(1 << 16), family="qwen2")
    return with_kv_scales(plain, tmp_path_factory.mktemp("fragile") / "model", fragile=True)


@pytest.fixture(scope="module")
def loud_dir(qwen_dir, tmp_path_factory):
    """``qwen_dir``, loud (:func:`with_kv_scales`), with per-KV-head key scales 0.5 and 2 from the checkpoint."""
    return with_kv_scales(qwen_dir, tmp_path_factory.mktemp("loud") / "model", k_scale=[0.5, 2.0], loud=True)


def prefill_slots(llm, length: int) -> slice:
    """The pool slots of a request of ``length`` prompt tokens run first on ``llm`` (the pages after the scratch
    sequence's; freed since, kept)."""
    first = len(llm.engine.cache.pages_of(llm.engine.runner.scratch_seq)) * llm.engine.cache.page_size
    return slice(first, first + length)


@pytest.mark.parametrize("k_scale, v_scale", [(0.25, 4.0), ([0.25, 2.0], [4.0, 0.5])], ids=["per-tensor", "per-head"])
def test_checkpoint_kv_scales_divide_what_an_fp8_pool_stores(model_dir, tmp_path, k_scale, v_scale):
    """k_scale / v_scale per tensor or per KV head (compressed-tensors' names): an fp8 pool holds k / k_scale and
    v / v_scale (powers of two here: exactly the fp32 pool's values scaled, then rounded); a model-dtype pool ignores
    them."""
    scaled = with_kv_scales(model_dir, tmp_path / "scaled", k_scale, v_scale)
    p = prompt(37)
    engines = {name: make_llm(folder, kv_cache_dtype=dtype)
               for name, folder, dtype in (("plain", model_dir, "auto"), ("fp8", scaled, "fp8"),
                                           ("ignored", scaled, "auto"))}
    tokens = {name: run(llm, [p], greedy(1)) for name, llm in engines.items()}
    assert tokens["ignored"] == tokens["plain"]  # a model-dtype pool: the scales are not applied
    plain, fp8 = engines["plain"].engine.cache, engines["fp8"].engine.cache
    slots = prefill_slots(engines["plain"], len(p))
    assert slots == prefill_slots(engines["fp8"], len(p))
    # Layer 0 only: the layers above read hidden states that the fp8 rounding of layer 0's K/V already changed.
    k_plain, v_plain = plain.k_pages[0].flatten(0, 1)[slots], plain.v_pages[0].flatten(0, 1)[slots]  # [T, Hkv, D]
    k_scale, v_scale = (torch.tensor(s).reshape(-1, 1) for s in (k_scale, v_scale))
    assert torch.equal(fp8.k_pages[0].flatten(0, 1)[slots].float(), (k_plain / k_scale).to(torch.float8_e4m3fn).float())
    assert torch.equal(fp8.v_pages[0].flatten(0, 1)[slots].float(), (v_plain / v_scale).to(torch.float8_e4m3fn).float())


def test_data_free_scales_keep_values_past_e4m3s_range_unsaturated(qwen_dir, tmp_path):
    """The loud model's values reach far past e4m3's 448: from the weights alone the fp8 engine gives each layer's
    value heads the power of two that keeps them in range (``LlamaAttention.kv_bounds``), so layer 0's pool holds
    v / s rounded and no stored value sits at 448; with v_scale = 1 from the checkpoint the pool saturates."""
    p = prompt(37)
    plain = make_llm(qwen_dir)
    loud = make_llm(with_kv_scales(qwen_dir, tmp_path / "loud", loud=True), kv_cache_dtype="fp8")
    forced = make_llm(with_kv_scales(qwen_dir, tmp_path / "forced", v_scale=1.0, loud=True), kv_cache_dtype="fp8")
    for llm in (plain, loud, forced):
        run(llm, [p], greedy(1))
    slots = prefill_slots(plain, len(p))
    scales = loud.engine.runner.model.model.layers[0].self_attn.attn.kv_scales  # [2, Hkv]
    assert scales[0].tolist() == [1.0, 1.0] and (scales[1] >= 2).all()
    assert torch.equal(torch.exp2(torch.log2(scales[1]).round()), scales[1])  # powers of two
    v_loud = plain.engine.cache.v_pages[0].flatten(0, 1)[slots] * LOUD  # exactly the loud model's layer-0 values
    assert v_loud.abs().max() > 448
    stored = loud.engine.cache.layer(0).v_pages.flatten(0, 1)[slots].float()
    assert torch.equal(stored, (v_loud / scales[1, :, None]).to(torch.float8_e4m3fn).float())
    narrow = [i for i in range(loud.engine.cache.num_layers) if i not in loud.engine.cache.model_dtype_layers]
    assert max(loud.engine.cache.layer(i).v_pages.float().abs().max() for i in narrow) < 448  # none saturated
    assert forced.engine.cache.layer(0).v_pages.flatten(0, 1)[slots].float().abs().max() == 448


def test_a_layer_whose_key_bias_outweighs_its_keys_keeps_the_model_dtype_in_an_fp8_pool(qwen_dir):
    """Layer 1 of the fragile model (``LlamaForCausalLM.fp8_fragile_layers``) keeps model-dtype K/V and bounds, the others
    fp8; the pool's pages are planned with those bytes and ``describe()`` names the layer; Quest with a covering
    budget still gives fp8 dense's tokens."""
    dense = make_llm(qwen_dir, kv_cache_dtype="fp8")
    cache, spec = dense.engine.cache, dense.engine.spec
    assert cache.model_dtype_layers == (1,)
    assert [cache.layer(i).k_pages.dtype for i in range(cache.num_layers)] == [
        cache.dtype if i == 1 else torch.float8_e4m3fn for i in range(cache.num_layers)]
    per_layer = (2 * cache.page_size + 2) * spec.num_kv_heads * spec.head_dim  # bytes of one fp8 layer
    model_dtype_bytes = cache.layer(1).k_pages.element_size()
    assert dense.engine.runner.cache_spec.page_bytes == per_layer * (cache.num_layers - 1 + model_dtype_bytes)
    assert "KV cache (fp8_e4m3, layers [1] in the model dtype)" in dense.engine.runner.cache_spec.describe()
    prompts, params = ragged(3)
    assert run(make_llm(qwen_dir, FULL, kv_cache_dtype="fp8"), prompts, params) == run(dense, prompts, params)


@pytest.mark.parametrize("shape, value, message", [((3,), 1.0, r"must be one number .* got shape \(3,\)"),
                                                   ((), 0.0, r"must hold positive finite scales, got \[0.0\]")])
def test_a_kv_scale_of_the_wrong_shape_or_value_is_refused_naming_it(model_dir, tmp_path, shape, value, message):
    folder = with_kv_scales(model_dir, tmp_path / "bad", torch.full(shape, value).tolist(), 1.0)
    with pytest.raises(ValueError, match=r"weight 'model\.layers\.0\.self_attn\.k_scale' " + message):
        make_llm(folder, kv_cache_dtype="fp8")
