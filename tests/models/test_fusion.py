"""questkv.models.fusion: the fused elementwise ops a runner switches on, checked against transformers."""

from __future__ import annotations

import pytest
import torch

from questkv.layers.activation import SiluAndMul
from questkv.layers.norm import RMSNorm
from questkv.models.fusion import fuse_elementwise
from questkv.models.llama import LlamaForCausalLM, ModelSpec
from tests.helpers import engine_greedy, tiny_config, tiny_hf_model


def _engine_model(hf) -> LlamaForCausalLM:
    model = LlamaForCausalLM(ModelSpec.from_hf_config(hf.config)).eval()
    model.load_weights(hf.state_dict().items())
    return model


def test_fuse_elementwise_puts_every_norm_and_activation_and_nothing_else_on_auto():
    model = _engine_model(tiny_hf_model(tiny_config("qwen3"), seed=2))  # q/k norms too
    layers = [m for m in model.modules() if isinstance(m, (RMSNorm, SiluAndMul))]
    assert layers and all(m.backend == "torch" for m in layers)
    others = {name: m.backend for name, m in model.named_modules()
              if hasattr(m, "backend") and not isinstance(m, (RMSNorm, SiluAndMul))}
    fuse_elementwise(model)
    assert all(m.backend == "auto" for m in layers)
    assert {name: m.backend for name, m in model.named_modules() if name in others} == others


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_the_fused_kernels_give_the_logits_of_the_torch_ops(family):
    pytest.importorskip("triton")
    hf = tiny_hf_model(tiny_config(family), seed=3)
    torch_model, fused = _engine_model(hf), _engine_model(hf)
    fuse_elementwise(fused)
    for module in fused.modules():
        if isinstance(module, (RMSNorm, SiluAndMul)):
            module.backend = "triton"  # what "auto" takes on CUDA; here under the interpreter
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=gen) for n in (11, 6)]
    want = engine_greedy(torch_model, prompts, 3)
    got = engine_greedy(fused, prompts, 3)
    for b in range(len(prompts)):
        torch.testing.assert_close(got[0][b], want[0][b], rtol=1e-5, atol=1e-5)
    for step in range(3):
        torch.testing.assert_close(got[1][step], want[1][step], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[2], want[2])
