"""The engine with weight-only quantized linears (``LLM(..., quantization=...)``) on CPU: the quantized engine is
the float engine holding the dequantized weights (same tokens in fp32), the LM head and embeddings stay float
unless ``quantize_lm_head`` rounds the head too, and a bad ``quantization`` is refused before anything loads."""

import random

import pytest
import torch

from questkv import QuestConfig
from questkv.engine.llm import LLM
from questkv.layers.quantized_linear import QuantizedLinear
from tests.helpers import greedy_params, tiny_config

VOCAB = 96
QUEST = QuestConfig(token_budget=16, page_size=4, dense_layers=1)


def dummy_llm(quest=None, **kwargs) -> LLM:
    # hidden 128 and intermediate 256: every quantized layer's in_features is a multiple of the int4 group (128)
    config = tiny_config("llama3", vocab_size=VOCAB, hidden_size=128, intermediate_size=256)
    return LLM(config, quest=quest, load_format="dummy", device="cpu", dtype="float32", max_model_len=128,
               kv_cache_memory=1 << 22, seed=3, **kwargs)


@pytest.mark.parametrize("method", ["int4", "int8"])
@pytest.mark.parametrize("quest", [None, QUEST], ids=["dense", "quest"])
@pytest.mark.parametrize("lm_head", [False, True], ids=["head-float", "head-quantized"])
def test_a_quantized_engine_gives_the_tokens_of_the_float_engine_holding_the_dequantized_weights(method, quest,
                                                                                                 lm_head):
    quantized = dummy_llm(quest, quantization=method, quantize_lm_head=lm_head)
    modules = dict(quantized.engine.runner.model.named_modules())
    swapped = {name for name, module in modules.items() if isinstance(module, QuantizedLinear)}
    assert swapped and any(name.endswith("lm_head") for name in swapped) == lm_head  # float unless asked
    reference = dummy_llm(quest)
    with torch.no_grad():
        for name, module in reference.engine.runner.model.named_modules():
            if name in swapped:
                module.weight.copy_(modules[name].dequantized_weight(torch.float32))
    prompts = [torch.randint(2, VOCAB, (random.randint(5, 60),)).tolist() for _ in range(3)]
    params = greedy_params(12)
    got = [out.token_ids for out in quantized.generate(prompts, params, use_tqdm=False)]
    assert got == [out.token_ids for out in reference.generate(prompts, params, use_tqdm=False)]


def test_an_unknown_quantization_is_refused_naming_it_before_anything_loads():
    with pytest.raises(ValueError, match="EngineConfig.quantization must be one of"):
        dummy_llm(quantization="fp4")


@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_quantize_lm_head_needs_a_quantization_that_rounds_at_load(quantization):
    with pytest.raises(ValueError, match=r"EngineConfig.quantize_lm_head=True rounds the LM head at load: it needs "
                                         r"quantization one of \('int4', 'int8'\), got "):
        dummy_llm(quantization=quantization, quantize_lm_head=True)
    with pytest.raises(ValueError, match="EngineConfig.quantize_lm_head must be a bool"):
        dummy_llm(quantization="int4", quantize_lm_head="yes")
