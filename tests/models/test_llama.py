"""questkv.models.llama against transformers, for each supported family: logits on a ragged batched prefill
and on every batched decode step, greedy tokens, Quest at a covering budget, spec reading and weight loading."""

import dataclasses
import math

import pytest
import torch
import transformers

from questkv.config import QuestConfig
from questkv.integrations.hf import cache_argument
from questkv.layers.rotary import RopeScaling
from questkv.models.llama import FP8_FRAGILE_RATIO, LlamaForCausalLM, ModelSpec
from questkv.ops import reference
from tests.helpers import PAGE_SIZE, TINY_CONFIGS, engine_greedy, tiny_config, tiny_hf_model

PROMPT_LENS = (11, 6)  # ragged, both spanning several pages
DECODE_STEPS = 4
ATOL = 1e-4


def _engine_model(hf, quest=None) -> LlamaForCausalLM:
    model = LlamaForCausalLM(ModelSpec.from_hf_config(hf.config), quest).eval()
    model.load_weights(hf.state_dict().items())
    return model


@torch.no_grad()
def _hf_greedy(hf, prompt, steps: int):
    """transformers on one sequence with its DynamicCache: ``(prompt_logits, [step logits], tokens)``."""
    cache = {cache_argument(hf): transformers.DynamicCache(config=hf.config)}  # filled in place
    prompt_logits = hf(prompt[None], use_cache=True, **cache).logits[0]
    tokens, step_logits = [prompt_logits[-1].argmax()], []
    for _ in range(steps):
        out = hf(tokens[-1].view(1, 1), use_cache=True, **cache)
        step_logits.append(out.logits[0, -1])
        tokens.append(out.logits[0, -1].argmax())
    return prompt_logits, step_logits, torch.stack(tokens)


def _prompts(vocab_size: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen) for n in PROMPT_LENS]


@pytest.mark.parametrize("family", list(TINY_CONFIGS))
def test_logits_and_greedy_tokens_equal_transformers_on_prefill_and_every_decode_step(family):
    hf = tiny_hf_model(tiny_config(family), seed=1)
    model = _engine_model(hf)
    prompts = _prompts(hf.config.vocab_size)
    prefill, decode, tokens = engine_greedy(model, prompts, DECODE_STEPS)
    for b, prompt in enumerate(prompts):
        want_prefill, want_decode, want_tokens = _hf_greedy(hf, prompt, DECODE_STEPS)
        assert prefill[b].dtype == torch.float32
        torch.testing.assert_close(prefill[b], want_prefill, rtol=0, atol=ATOL)
        assert tokens[b].tolist() == want_tokens.tolist()
        for step, want in enumerate(want_decode):
            torch.testing.assert_close(decode[step][b], want, rtol=0, atol=ATOL, msg=f"decode step {step}, seq {b}")


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_quest_with_a_budget_covering_the_context_gives_the_dense_logits(family):
    hf = tiny_hf_model(tiny_config(family), seed=2)
    prompts = _prompts(hf.config.vocab_size)
    covering = PAGE_SIZE * math.ceil((max(PROMPT_LENS) + DECODE_STEPS) / PAGE_SIZE)
    quest = QuestConfig(token_budget=covering, page_size=PAGE_SIZE, dense_layers=1)
    dense = engine_greedy(_engine_model(hf), prompts, DECODE_STEPS)
    sparse = engine_greedy(_engine_model(hf, quest), prompts, DECODE_STEPS, quest)
    for want, got in zip(dense[1], sparse[1]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert sparse[2].tolist() == dense[2].tolist()
    # a budget below the context does go through page selection: the long sequence's logits move
    small = QuestConfig(token_budget=2 * PAGE_SIZE, page_size=PAGE_SIZE, dense_layers=1)
    _, decode, _ = engine_greedy(_engine_model(hf, small), prompts, DECODE_STEPS, small)
    assert not torch.allclose(decode[-1][0], dense[1][-1][0], atol=1e-3)
    assert all(torch.isfinite(logits).all() for logits in decode)


def test_a_bfloat16_model_gives_float32_logits_close_to_the_float32_model():
    hf = tiny_hf_model(tiny_config("qwen3"), seed=3)
    prompts = _prompts(hf.config.vocab_size)
    want_prefill, _, _ = engine_greedy(_engine_model(hf), prompts, 2)
    model = _engine_model(hf).to(torch.bfloat16)
    prefill, decode, _ = engine_greedy(model, prompts, 2, dtype=torch.bfloat16)
    for got, want in zip(prefill, want_prefill):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=0.2)
    # decode tokens may differ from the float32 run's, so only their logits' sanity is checked
    assert all(logits.dtype == torch.float32 and torch.isfinite(logits).all() for logits in decode)
    hidden = torch.randn(3, hf.config.hidden_size, dtype=torch.bfloat16)
    out = torch.full((3, hf.config.vocab_size), float("nan"))  # (a CUDA graph's shared output)
    assert model.compute_logits(hidden, out) is out
    torch.testing.assert_close(out, model.compute_logits(hidden), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# ModelSpec.from_hf_config


def test_spec_reads_each_family_flag_from_its_config():
    specs = {family: ModelSpec.from_hf_config(tiny_config(family)) for family in TINY_CONFIGS}
    assert specs["llama3"].rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 32)
    assert specs["llama_linear"].rope_scaling == RopeScaling("linear", 2.0)
    assert specs["llama_linear"].tie_word_embeddings and specs["llama_linear"].num_kv_heads == 1
    mha = specs["llama_mha"]
    assert mha.rope_scaling is None and mha.rope_theta == 500000.0 and mha.num_kv_heads == mha.num_q_heads
    assert mha.attention_bias and mha.o_proj_bias and mha.mlp_bias
    assert specs["mistral"].head_dim == 32 and specs["mistral"].hidden_size == 64
    qwen2 = specs["qwen2"]
    assert (qwen2.num_q_heads, qwen2.num_kv_heads, qwen2.head_dim, qwen2.hidden_size) == (14, 2, 64, 128)
    assert qwen2.attention_bias and not qwen2.o_proj_bias and qwen2.tie_word_embeddings and not qwen2.qk_norm
    assert specs["qwen3"].qk_norm and not specs["qwen3"].attention_bias and specs["qwen3"].head_dim == 32
    assert not any(s.qk_norm for f, s in specs.items() if f != "qwen3")


def test_spec_derives_head_dim_from_hidden_size_when_the_config_has_none():
    config = transformers.Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    assert not hasattr(config, "head_dim")
    assert ModelSpec.from_hf_config(config).head_dim == 16


def test_spec_reads_the_old_rope_scaling_attribute_format():
    config = transformers.LlamaConfig(rope_scaling={"type": "linear", "factor": 4.0}, rope_theta=20000.0)
    spec = ModelSpec.from_hf_config(config)
    assert spec.rope_scaling == RopeScaling("linear", 4.0) and spec.rope_theta == 20000.0


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: transformers.GPT2Config(),
         r"config.model_type must be one of 'llama', 'mistral', 'qwen2', 'qwen3'; got 'gpt2'"),
        (lambda: transformers.GemmaConfig(), r"got 'gemma'"),
        (lambda: tiny_config("llama3", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                                                        "original_max_position_embeddings": 64}),
         r"rope_type'\] must be one of 'default', 'linear', 'llama3'; got 'yarn'"),
        (lambda: tiny_config("llama3", rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
         r"got 'dynamic'"),
        (lambda: tiny_config("mistral", sliding_window=16), r"sliding_window=16 .*supported"),
        (lambda: tiny_config("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1),
         r"sliding_window=16"),
        (lambda: tiny_config("llama3", hidden_act="gelu"), r"hidden_act must be one of 'silu'; got 'gelu'"),
    ],
)
def test_unsupported_architectures_raise_value_error_naming_what_is_supported(make, match):
    config = make()
    with pytest.raises(ValueError, match=match):
        ModelSpec.from_hf_config(config)


def test_a_window_covering_every_position_is_full_attention():
    spec = ModelSpec.from_hf_config(tiny_config("mistral", sliding_window=256))
    assert spec.model_type == "mistral"
    spec = ModelSpec.from_hf_config(tiny_config("qwen2", use_sliding_window=True, sliding_window=16,
                                                max_window_layers=2))  # no layer at or above 2
    assert spec.model_type == "qwen2"


def test_spec_validates_its_fields():
    spec = ModelSpec.from_hf_config(tiny_config("llama3"))
    with pytest.raises(ValueError, match="ModelSpec.num_q_heads must be a multiple of num_kv_heads=3"):
        dataclasses.replace(spec, num_kv_heads=3)
    with pytest.raises(ValueError, match="ModelSpec.head_dim must be even"):
        dataclasses.replace(spec, head_dim=15)


# ---------------------------------------------------------------------------------------------------------------
# load_weights


def _state(family: str, **overrides) -> dict:
    return dict(tiny_hf_model(tiny_config(family, **overrides)).state_dict())


def _model(family: str, **overrides) -> LlamaForCausalLM:
    return LlamaForCausalLM(ModelSpec.from_hf_config(tiny_config(family, **overrides)))


def test_fused_projections_hold_the_checkpoint_shards_in_q_k_v_and_gate_up_order():
    state = _state("qwen2")
    model = _model("qwen2")
    model.load_weights(state.items())
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    p = "model.layers.1."
    want_qkv = torch.cat([state[p + f"self_attn.{s}_proj.weight"] for s in "qkv"])
    want_bias = torch.cat([state[p + f"self_attn.{s}_proj.bias"] for s in "qkv"])
    torch.testing.assert_close(attn.qkv_proj.weight, want_qkv, rtol=0, atol=0)
    torch.testing.assert_close(attn.qkv_proj.bias, want_bias, rtol=0, atol=0)
    want_gate_up = torch.cat([state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]])
    torch.testing.assert_close(mlp.gate_up_proj.weight, want_gate_up, rtol=0, atol=0)
    assert attn.o_proj.bias is None
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied


def test_tied_models_accept_checkpoints_with_or_without_lm_head_and_ignore_inv_freq():
    state = _state("llama_linear")
    assert "lm_head.weight" in state
    _model("llama_linear").load_weights(state.items())
    state.pop("lm_head.weight")
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    _model("llama_linear").load_weights(state.items())


def test_missing_weights_raise_value_error_naming_them():
    state = _state("llama3")
    del state["model.layers.2.mlp.up_proj.weight"], state["lm_head.weight"]
    with pytest.raises(ValueError, match=r"missing weights \(2\): 'model.layers.2.mlp.up_proj.weight', 'lm_head"):
        _model("llama3").load_weights(state.items())


def test_unknown_weights_raise_value_error_naming_them():
    state = _state("qwen3")
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(4 * 32)
    state["vision_tower.weight"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"unknown weights for qwen3 \(2\): 'model.layers.0.self_attn.q_proj.bias', "
                                         r"'vision_tower.weight'"):
        _model("qwen3").load_weights(state.items())


def test_a_weight_of_the_wrong_shape_raises_value_error_naming_it():
    state = _state("mistral")
    state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(2 * 32 + 1, 64)
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.k_proj.weight' has shape \(65, 64\), the model "
                                         r"expects \(64, 64\)"):
        _model("mistral").load_weights(state.items())


def test_expected_weight_names_are_exactly_the_transformers_state_dict_names():
    for family in TINY_CONFIGS:
        state = _state(family)
        model = _model(family)
        names = set(state) - ({"lm_head.weight"} if model.spec.tie_word_embeddings else set())
        assert set(model.expected_weight_names()) == names, family


@pytest.mark.parametrize("family", list(TINY_CONFIGS))
def test_kv_bounds_hold_for_inputs_of_any_size_at_any_rope_angle_and_the_worst_inputs_reach_them(family):
    """``LlamaAttention.kv_bounds`` (the data-free scales of an fp8 pool): no input, however large or small, at any
    rotary angle, gives a key or value beyond its head's bound. The input along a value row (signed like its bias)
    reaches that row's bound (up to the norm's eps): the bound is as tight as Cauchy-Schwarz. The input along a key
    row, at the angles that turn each RoPE pair into its first half, tests the rotation's share of the key bound."""
    hf = tiny_hf_model(tiny_config(family), seed=int(torch.randint(1 << 16, ())))
    model = _engine_model(hf)
    for layer in model.model.layers:
        attention, gamma = layer.self_attn, layer.input_layernorm.weight.detach()
        bounds = attention.kv_bounds(gamma)
        heads, dim, proj = attention.num_kv_heads, attention.head_dim, attention.qkv_proj
        assert bounds.shape == (2, heads) and bounds.dtype == torch.float32
        worst = []  # per head: the input along its key row, then along its value row, of the largest bound
        for shard in ("k", "v"):
            rows = slice(proj.shard_offsets[shard], proj.shard_offsets[shard] + proj.shard_sizes[shard])
            weight = proj.weight[rows].detach() * gamma
            bias = torch.zeros(weight.shape[0]) if proj.bias is None else proj.bias[rows].detach()
            row_bounds = weight.norm(dim=1) * gamma.shape[0] ** 0.5 + bias.abs()
            worst += [weight[r] * (1 if bias[r] >= 0 else -1)
                      for r in row_bounds.view(heads, dim).argmax(dim=1) + torch.arange(heads) * dim]
        x = torch.randn(256, gamma.shape[0]) * 10 ** torch.empty(256, 1).uniform_(-4, 4)
        with torch.no_grad():
            _, k, v = proj.split(proj(layer.input_layernorm(torch.cat([x, torch.stack(worst)]))))
            k, v = k.reshape(-1, heads, dim), v.reshape(-1, heads, dim)
            if attention.qk_norm:
                k = attention.k_norm(k)
            angles = torch.rand(k.shape[0], dim // 2) * 2 * math.pi
            for h in range(heads):  # the worst key inputs: each pair's angle turns all of it into the first half
                row = k[len(x) + h, h]
                angles[len(x) + h] = torch.atan2(-row[dim // 2 :], row[: dim // 2])
            k = reference.rotate(k, angles.cos(), angles.sin())
        assert (k.abs().amax(dim=(0, 2)) <= bounds[0] * (1 + 1e-5)).all()
        assert (v.abs().amax(dim=(0, 2)) <= bounds[1] * (1 + 1e-5)).all()
        reached = torch.stack([v[len(x) + heads + h, h].abs().max() for h in range(heads)])
        torch.testing.assert_close(reached, bounds[1], rtol=1e-2, atol=0)


def test_fp8_fragile_layers_are_those_whose_key_bias_outweighs_the_keys_more_than_the_ratio_in_some_head():
    """``LlamaForCausalLM.fp8_fragile_layers``: layer 1's first KV head given a key bias 1.1 times ``FP8_FRAGILE_RATIO``
    its keys' token-dependent part is picked (alone: its other head is not); 0.9 times is not; a family without
    biases has none."""
    hf = tiny_hf_model(tiny_config("qwen2"), seed=int(torch.randint(1 << 16, ())))
    model = _engine_model(hf)
    assert model.fp8_fragile_layers() == []
    attention, gamma = model.model.layers[1].self_attn, model.model.layers[1].input_layernorm.weight.detach()
    proj, dim = attention.qkv_proj, attention.head_dim
    start = proj.shard_offsets["k"]
    part = (proj.weight[start : start + dim].detach() * gamma).norm()  # head 0's token-dependent key norm
    for times, fragile in ((0.9, []), (1.1, [1])):
        with torch.no_grad():
            bias = proj.bias[start : start + dim]
            bias.mul_(times * FP8_FRAGILE_RATIO * part / bias.norm())
        assert model.fp8_fragile_layers() == fragile
        assert attention.key_bias_ratios(gamma)[1] < FP8_FRAGILE_RATIO
    assert _engine_model(tiny_hf_model(tiny_config("llama3"))).fp8_fragile_layers() == []
