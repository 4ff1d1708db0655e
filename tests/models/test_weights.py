"""questkv.models.weights: safetensors folders (single file and sharded) and random dummy weights."""

import json

import pytest
import torch

from questkv.layers.norm import RMSNorm
from questkv.models.llama import LlamaForCausalLM, ModelSpec
from questkv.models.weights import init_dummy_weights, load_safetensors_weights, safetensors_files
from tests.helpers import engine_greedy, tiny_config, tiny_hf_model


@pytest.mark.parametrize("shard", [None, "20KB"])
@pytest.mark.parametrize("family", ["llama_linear", "qwen2"])
def test_a_saved_hf_folder_loads_into_the_model_tensor_for_tensor(tmp_path, family, shard):
    hf = tiny_hf_model(tiny_config(family), seed=4)
    hf.save_pretrained(tmp_path, **({} if shard is None else {"max_shard_size": shard}))
    files = safetensors_files(tmp_path)
    assert (len(files) > 1) == (shard is not None)
    assert (tmp_path / "model.safetensors.index.json").is_file() == (shard is not None)
    from_folder = LlamaForCausalLM(ModelSpec.from_hf_config(hf.config))
    from_folder.load_weights(load_safetensors_weights(tmp_path))
    from_memory = LlamaForCausalLM(ModelSpec.from_hf_config(hf.config))
    from_memory.load_weights(hf.state_dict().items())
    want = dict(from_memory.named_parameters())
    for name, param in from_folder.named_parameters():
        torch.testing.assert_close(param, want[name], rtol=0, atol=0, msg=name)


def test_weights_keep_their_stored_dtype(tmp_path):
    hf = tiny_hf_model(tiny_config("qwen3")).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    dtypes = {tensor.dtype for _, tensor in load_safetensors_weights(tmp_path, device="cpu")}
    assert dtypes == {torch.bfloat16}


def test_a_folder_without_checkpoint_files_raises_file_not_found_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors file in"):
        safetensors_files(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        next(load_safetensors_weights(tmp_path / "absent"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "part-1.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="part-1.safetensors"):
        safetensors_files(tmp_path)


def _dummy(family: str, seed: int) -> LlamaForCausalLM:
    model = LlamaForCausalLM(ModelSpec.from_hf_config(tiny_config(family))).eval()
    init_dummy_weights(model, seed=seed)
    return model


@pytest.mark.parametrize("family", ["llama_mha", "qwen3", "llama_linear"])
def test_dummy_weights_give_finite_logits_on_prefill_and_decode(family):
    model = _dummy(family, seed=0)
    prompts = [torch.randint(0, model.spec.vocab_size, (n,)) for n in (9, 3)]
    prefill, decode, tokens = engine_greedy(model, prompts, 2)
    assert all(torch.isfinite(logits).all() for logits in prefill + decode)
    assert tokens.shape == (2, 3)


def test_dummy_weights_are_normal_with_unit_norms_zero_biases_and_reproducible_by_seed():
    model = _dummy("llama_mha", seed=3)
    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    for name, param in model.named_parameters():
        if id(param) in norms:
            assert torch.equal(param, torch.ones_like(param)), name
        elif name.endswith("bias"):
            assert torch.equal(param, torch.zeros_like(param)), name
    embed = model.model.embed_tokens.weight
    assert abs(embed.std().item() - 0.02) < 0.002 and abs(embed.mean().item()) < 0.002
    again, other = _dummy("llama_mha", seed=3), _dummy("llama_mha", seed=4)
    assert torch.equal(again.model.layers[1].mlp.down_proj.weight, model.model.layers[1].mlp.down_proj.weight)
    assert not torch.equal(other.model.layers[1].mlp.down_proj.weight, model.model.layers[1].mlp.down_proj.weight)


def test_dummy_weights_keep_a_tied_head_tied():
    model = _dummy("qwen2", seed=0)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_dummy_weights_refuse_a_negative_seed():
    with pytest.raises(ValueError, match="init_dummy_weights.seed must be >= 0, got -1"):
        _dummy("qwen3", seed=-1)
