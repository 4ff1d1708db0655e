"""questkv.models.families: one table of the supported families, and what reads it."""

import pytest
import transformers

import questkv
from questkv.models.families import FAMILIES, GGUF_ARCHITECTURES, MODEL_TYPES, ModelFamily, gguf_family, model_family
from questkv.models.llama import LlamaForCausalLM, ModelSpec
from questkv.models.shapes import DUMMY_SHAPES, dummy_config
from tests.helpers import TINY_CONFIGS, tiny_config, tiny_hf_model


def test_every_family_has_a_tiny_config_for_the_logits_test():
    assert {tiny_config(family).model_type for family in TINY_CONFIGS} == set(MODEL_TYPES)


def test_the_table_names_each_family_once_with_its_class_and_gguf_architecture():
    assert MODEL_TYPES == ("llama", "mistral", "qwen2", "qwen3")
    assert all(key == family.model_type for key, family in FAMILIES.items())
    assert {family.model_class() for family in FAMILIES.values()} == {LlamaForCausalLM}
    assert GGUF_ARCHITECTURES == ("llama", "qwen2", "qwen3")
    assert gguf_family("qwen3") is FAMILIES["qwen3"] and gguf_family("phi2") is None
    assert [t for t, f in FAMILIES.items() if f.gguf_qk_permuted] == ["llama"]


def test_an_unknown_model_type_is_refused_naming_the_field_and_the_families():
    with pytest.raises(ValueError, match=r"config.model_type must be one of 'llama', 'mistral', 'qwen2', 'qwen3'; "
                                         r"got 'gpt2'"):
        model_family("gpt2")
    assert model_family("qwen2") is FAMILIES["qwen2"]


def test_the_spec_the_dummy_shapes_and_the_drop_in_take_the_flags_from_the_table(monkeypatch):
    """What an entry says is what they do: a family is one entry."""
    monkeypatch.setitem(FAMILIES, "qwen3", ModelFamily("qwen3", qkv_bias=True, o_proj_bias=False))
    spec = ModelSpec.from_hf_config(tiny_config("qwen3"))
    assert spec.attention_bias and not spec.o_proj_bias and not spec.qk_norm
    monkeypatch.setitem(DUMMY_SHAPES, "tiny-qwen3", ("qwen3", dict(hidden_size=64, num_attention_heads=4)))
    assert dummy_config("tiny-qwen3").model_type == "qwen3"
    monkeypatch.setitem(FAMILIES, "llama", ModelFamily("llama", sliding_window_everywhere=True))
    model = tiny_hf_model(tiny_config("llama3", sliding_window=32))  # a window LlamaConfig itself would ignore
    with pytest.raises(ValueError, match="sliding-window"):
        questkv.enable(model, questkv.QuestConfig())


def test_a_dummy_shape_of_an_unsupported_family_is_refused_naming_it(monkeypatch):
    monkeypatch.setitem(DUMMY_SHAPES, "gpt2-small", ("gpt2", dict(n_layer=1)))
    with pytest.raises(ValueError, match=r"DUMMY_SHAPES\['gpt2-small'\] model_type must be one of 'llama', "
                                         r"'mistral', 'qwen2', 'qwen3'; got 'gpt2'"):
        dummy_config("gpt2-small")
    assert isinstance(dummy_config("llama2-7b"), transformers.LlamaConfig)
