"""questkv.enable / disable on tiny random-weight models of every supported family (fp32, CPU)."""

import math

import pytest
import torch
from transformers import (
    AttentionInterface,
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import questkv
from questkv.integrations import hf
from questkv.ops import reference

PAGE = 8
COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=1024,
    pad_token_id=0,
)

FAMILIES = {
    "llama-gqa": (LlamaForCausalLM, LlamaConfig, dict(num_key_value_heads=2)),
    "llama-mha": (LlamaForCausalLM, LlamaConfig, dict(num_key_value_heads=4)),
    "mistral-gqa": (MistralForCausalLM, MistralConfig, dict(num_key_value_heads=2, sliding_window=None)),
    "qwen2-gqa": (Qwen2ForCausalLM, Qwen2Config, dict(num_key_value_heads=2)),
    "qwen3-mha": (Qwen3ForCausalLM, Qwen3Config, dict(num_key_value_heads=4, head_dim=16)),
}


def make_model(family: str, seed: int = 0):
    model_cls, config_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**COMMON, **extra)).eval()
    # Random init is nearly uniform attention; sharper queries make page selection matter.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
    return model


def prompt(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, COMMON["vocab_size"], (1, length), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids, new_tokens=12, **kwargs):
    return model.generate(
        ids,
        max_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        **kwargs,
    )


# An independent Quest simulation over transformers' own DynamicCache: pages are cut from the
# contiguous keys, then the reference ops are called directly. The questkv path must match it.
_SIM = {"config": None}


def _simulated_quest(module, query, key, value, attention_mask, scaling=None, **kwargs):
    config = _SIM["config"]
    if query.shape[2] != 1 or not config.is_sparse_layer(module.layer_idx):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    batch, num_kv_heads, length, head_dim = key.shape
    assert batch == 1
    pad = -length % config.page_size
    k = torch.nn.functional.pad(key[0].transpose(0, 1), (0, 0, 0, 0, 0, pad))  # [L', Hkv, D]
    v = torch.nn.functional.pad(value[0].transpose(0, 1), (0, 0, 0, 0, 0, pad))
    k_pages = k.view(-1, config.page_size, num_kv_heads, head_dim)
    v_pages = v.view(-1, config.page_size, num_kv_heads, head_dim)
    valid = (torch.arange(k_pages.shape[0] * config.page_size) < length).view(k_pages.shape[:2])[..., None, None]
    kmin = torch.where(valid, k_pages, math.inf).amin(1)
    kmax = torch.where(valid, k_pages, -math.inf).amax(1)
    table = torch.arange(k_pages.shape[0], dtype=torch.int32)[None]
    lens = torch.tensor([length], dtype=torch.int32)
    q = query[:, :, 0]
    scores = reference.page_scores(q, kmin, kmax, table, lens, config.page_size, config.selection, config.group_reduction)
    selected = reference.select_pages(scores, lens, config.page_size, config.budget_pages, config.sink_pages, config.recent_pages)
    out = reference.paged_decode_attention(q, k_pages, v_pages, table, lens, selected, scaling)
    return out.unsqueeze(1), None


AttentionInterface.register("questkv_test_sim", _simulated_quest)
AttentionMaskInterface.register("questkv_test_sim", sdpa_mask)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_budget_covering_context_matches_unpatched(family):
    model = make_model(family)
    ids = prompt(40)
    dense = greedy(model, ids)
    questkv.enable(model, questkv.QuestConfig(token_budget=64, page_size=PAGE, dense_layers=1))
    quest = greedy(model, ids)
    assert torch.equal(quest.sequences, dense.sequences)
    for step_quest, step_dense in zip(quest.logits, dense.logits):
        torch.testing.assert_close(step_quest, step_dense, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("selection,reduction", [("kv_head", "sum"), ("kv_head", "max"), ("q_head", "sum")])
def test_small_budget_is_quest_over_selected_pages(family, selection, reduction):
    config = questkv.QuestConfig(  # Quest's selection from a short context (the route's cost model off)
        token_budget=3 * PAGE, page_size=PAGE, dense_layers=1, selection=selection, group_reduction=reduction,
        dense_context_ratio=1.0,
    )
    ids = prompt(70)
    model = make_model(family)
    dense = greedy(model, ids)
    _SIM["config"] = config
    model.set_attn_implementation("questkv_test_sim")
    simulated = greedy(model, ids)
    model.set_attn_implementation("sdpa")
    questkv.enable(model, config)
    quest = greedy(model, ids)
    assert torch.equal(quest.sequences, simulated.sequences)
    for step_quest, step_sim in zip(quest.logits, simulated.logits):
        torch.testing.assert_close(step_quest, step_sim, atol=1e-4, rtol=0)
    # Not vacuous: sparsity changed the logits.
    assert max((a - b).abs().max().item() for a, b in zip(quest.logits, dense.logits)) > 1e-3


@pytest.mark.parametrize("budget", [2 * PAGE, None])
def test_left_padded_batch_equals_each_prompt_alone(budget):
    model = make_model("llama-gqa")
    questkv.enable(model, questkv.QuestConfig(token_budget=budget, page_size=PAGE, dense_layers=1))
    first, second = prompt(37, seed=2), prompt(21, seed=3)
    alone = [greedy(model, ids).sequences[0, ids.shape[1]:] for ids in (first, second)]
    pad = first.shape[1] - second.shape[1]
    batch = torch.cat([first, torch.nn.functional.pad(second, (pad, 0), value=0)])
    mask = torch.ones_like(batch)
    mask[1, :pad] = 0
    together = greedy(model, batch, attention_mask=mask).sequences[:, first.shape[1]:]
    assert torch.equal(together[0], alone[0])
    assert torch.equal(together[1], alone[1])


def test_sampling_settings_pass_through():
    model = make_model("qwen2-gqa")
    ids = prompt(30)
    kwargs = dict(max_new_tokens=10, do_sample=True, temperature=0.7, top_k=20, pad_token_id=0)
    torch.manual_seed(5)
    dense = model.generate(ids, **kwargs)
    questkv.enable(model, questkv.QuestConfig(token_budget=64, page_size=PAGE))
    torch.manual_seed(5)
    assert torch.equal(model.generate(ids, **kwargs), dense)


def test_plain_forward_calls_and_chunked_prefill():
    model = make_model("llama-gqa")
    ids = prompt(50)
    with torch.no_grad():
        reference_logits = model(ids).logits
        questkv.enable(model, questkv.QuestConfig(token_budget=128, page_size=PAGE))
        out = model(ids[:, :30])  # a QuestCache is created for the call
        assert isinstance(out.cache if hasattr(out, "cache") else out.past_key_values, questkv.QuestCache)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        chunk = model(ids[:, 30:45], **{hf.cache_argument(model): cache}).logits  # multi-token over a cache
        steps = [model(ids[:, i : i + 1], **{hf.cache_argument(model): cache}).logits for i in range(45, 50)]
    torch.testing.assert_close(out.logits, reference_logits[:, :30], atol=1e-4, rtol=0)
    torch.testing.assert_close(chunk, reference_logits[:, 30:45], atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.cat(steps, 1), reference_logits[:, 45:], atol=1e-4, rtol=0)


def test_page_pool_grows(monkeypatch):
    monkeypatch.setattr(hf, "_HEADROOM_TOKENS", 0)
    model = make_model("llama-mha")
    ids = prompt(9)
    dense = greedy(model, ids, new_tokens=30)
    questkv.enable(model, questkv.QuestConfig(token_budget=64, page_size=PAGE))
    quest = greedy(model, ids, new_tokens=30)
    assert torch.equal(quest.sequences, dense.sequences)


def test_disable_restores_original_behaviour():
    model = make_model("llama-gqa")
    model.set_attn_implementation("eager")
    ids = prompt(40)
    before = greedy(model, ids)
    questkv.enable(model, questkv.QuestConfig(token_budget=2 * PAGE, page_size=PAGE, dense_layers=1))
    assert model.config._attn_implementation == hf.ATTN_IMPLEMENTATION
    greedy(model, ids)
    questkv.disable(model)
    assert model.config._attn_implementation == "eager"
    assert not model._forward_pre_hooks and not hf.is_enabled(model)
    after = greedy(model, ids)
    assert torch.equal(after.sequences, before.sequences)
    for a, b in zip(after.logits, before.logits):
        assert torch.equal(a, b)
    questkv.disable(model)  # a no-op when not enabled


def test_enable_twice_swaps_config():
    model = make_model("llama-gqa")
    questkv.enable(model, questkv.QuestConfig(token_budget=2 * PAGE, page_size=PAGE))
    questkv.enable(model, questkv.QuestConfig(token_budget=None, page_size=PAGE))
    assert len(model._forward_pre_hooks) == 1
    assert model._questkv.config.token_budget is None


def test_unsupported_model_is_rejected():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32))
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        questkv.enable(model, questkv.QuestConfig())


def test_sliding_window_is_rejected():
    model_cls, config_cls, extra = FAMILIES["mistral-gqa"]
    model = model_cls(config_cls(**COMMON, **{**extra, "sliding_window": 32}))
    with pytest.raises(ValueError, match="sliding-window"):
        questkv.enable(model, questkv.QuestConfig())


def test_bad_configs_are_rejected():
    model = make_model("llama-gqa")
    with pytest.raises(ValueError, match="questkv.QuestConfig"):
        questkv.enable(model, {"token_budget": 64})
    with pytest.raises(ValueError, match="dense_layers=3 leaves no sparse layer"):
        questkv.enable(model, questkv.QuestConfig(token_budget=64, dense_layers=3))
    with pytest.raises(ValueError, match="selection_interval=2: selection reuse runs in the engine"):
        questkv.enable(model, questkv.QuestConfig(token_budget=64, selection_interval=2))
    assert not hf.is_enabled(model)


def test_cache_errors_are_clear():
    model = make_model("llama-gqa")
    questkv.enable(model, questkv.QuestConfig(token_budget=64, page_size=PAGE))
    ids = prompt(10)
    name = hf.cache_argument(model)
    with pytest.raises(ValueError, match="page_size"):
        model(ids, **{name: questkv.QuestCache(model.config, page_size=16)})
    full = DynamicCache(config=model.config)
    questkv.disable(model)
    model(ids, **{name: full})
    questkv.enable(model, questkv.QuestConfig(token_budget=64, page_size=PAGE))
    with pytest.raises(ValueError, match="non-empty DynamicCache"):
        model(ids, **{name: full})
    cache = questkv.QuestCache(model.config, page_size=PAGE)
    questkv.disable(model)
    with pytest.raises(RuntimeError, match="questkv.enable"):
        model(ids, **{name: cache})


class DecodeSpy:
    """Records every QuestDecodeStep.dense / .sparse call (which step object, which layer's pages),
    every reference decode attention and whether it ran inside one of them, and SDPA's query lengths."""

    def __init__(self, monkeypatch):
        from questkv.decode.step import QuestDecodeStep

        self.steps: list[tuple[str, int, int]] = []  # (method, id(step), k_pages data_ptr)
        self.attention_outside_step = 0
        self.attention_calls = 0
        self.sdpa_query_lengths: list[int] = []
        self.configs_built = 0
        self._depth = 0
        for name in ("dense", "sparse"):
            monkeypatch.setattr(QuestDecodeStep, name, self._wrap(name, getattr(QuestDecodeStep, name)))
        attention = reference.paged_decode_attention

        def attention_spy(*args, **kwargs):
            self.attention_calls += 1
            self.attention_outside_step += self._depth == 0
            return attention(*args, **kwargs)

        monkeypatch.setattr(reference, "paged_decode_attention", attention_spy)

        def sdpa_spy(module, query, *args, **kwargs):
            self.sdpa_query_lengths.append(query.shape[2])
            return sdpa_attention_forward(module, query, *args, **kwargs)

        monkeypatch.setattr(hf, "sdpa_attention_forward", sdpa_spy)
        post_init = questkv.QuestConfig.__post_init__

        def count_configs(config):
            self.configs_built += 1
            post_init(config)

        monkeypatch.setattr(questkv.QuestConfig, "__post_init__", count_configs)

    def _wrap(self, name, method):
        def spy(step, q, layer, *args, **kwargs):
            self.steps.append((name, id(step), layer.k_pages.data_ptr()))
            self._depth += 1
            try:
                return method(step, q, layer, *args, **kwargs)
            finally:
                self._depth -= 1

        return spy


def test_decode_runs_through_the_one_decode_step(monkeypatch):
    model = make_model("llama-gqa")  # 3 layers
    questkv.enable(model, questkv.QuestConfig(token_budget=2 * PAGE, page_size=PAGE, dense_layers=1,
                                              dense_context_ratio=1.0))
    ids = prompt(37)
    new_tokens = 12  # 11 decode steps: the first token comes from the prefill
    spy = DecodeSpy(monkeypatch)
    out = greedy(model, ids, new_tokens)
    cache = getattr(out, "past_key_values", None)
    cache = cache if cache is not None else out.cache
    assert isinstance(cache, questkv.QuestCache)
    decode_steps = new_tokens - 1
    layers = [cache.paged.layer(i).k_pages.data_ptr() for i in range(3)]
    assert [(name, ptr) for name, _, ptr in spy.steps] == [
        ("dense", layers[0]), ("sparse", layers[1]), ("sparse", layers[2])
    ] * decode_steps
    # One step object serves every layer of a decode step, and it is the enabled decoder's.
    for start in range(0, len(spy.steps), 3):
        assert len({step for _, step, _ in spy.steps[start : start + 3]}) == 1
    decoder_steps = {id(step) for step in model._questkv.decoder._steps.values()}
    assert {step for _, step, _ in spy.steps} <= decoder_steps
    # Nothing else computes decode attention: every reference attention ran inside the step, and
    # SDPA only saw the prefill (37 queries per layer).
    assert spy.attention_calls == 3 * decode_steps and spy.attention_outside_step == 0
    assert spy.sdpa_query_lengths == [ids.shape[1]] * 3
    assert spy.configs_built == 0  # routes were decided at enable, not per layer or step
    assert cache.mean_tokens_attended == 2 * PAGE and cache.sparse_steps == 2 * decode_steps


def test_dense_decoding_runs_through_the_one_decode_step_too(monkeypatch):
    model = make_model("qwen2-gqa")
    questkv.enable(model, questkv.QuestConfig(token_budget=None, page_size=PAGE, dense_layers=1))
    spy = DecodeSpy(monkeypatch)
    greedy(model, prompt(20), new_tokens=5)
    assert [name for name, _, _ in spy.steps] == ["dense"] * 3 * 4
    assert spy.attention_calls == 3 * 4 and spy.attention_outside_step == 0
    assert spy.sdpa_query_lengths == [20] * 3 and spy.configs_built == 0
