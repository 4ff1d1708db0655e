"""The engine with weight-only quantized linears (``LLM(..., quantization=...)``) on CPU: the quantized engine is
the float engine holding the dequantized weights (same tokens in fp32), the LM head and embeddings stay float, and a
bad ``quantization`` is refused before anything loads."""

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
def test_a_quantized_engine_gives_the_tokens_of_the_float_engine_holding_the_dequantized_weights(method, quest):
    quantized = dummy_llm(quest, quantization=method)
    modules = dict(quantized.engine.runner.model.named_modules())
    swapped = {name for name, module in modules.items() if isinstance(module, QuantizedLinear)}
    assert swapped and not any(name.endswith("lm_head") for name in swapped)  # the LM head stays float
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
