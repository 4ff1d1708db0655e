"""Model shapes by name, for random-weight runs (``load_format="dummy"``) at real sizes without checkpoints.

Owns the numbers (copied from the models' published ``config.json``); each shape names a supported family
(:mod:`questkv.models.families`); turning a config into a model is ``ModelSpec.from_hf_config``'s and random weights
are ``init_dummy_weights``'s.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

from questkv.models.families import model_family
from questkv.validation import check_optional_int

__all__ = ["DUMMY_SHAPES", "dummy_config"]

_QWEN2_5 = dict(  # what the Qwen2.5 shapes share
    rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    max_position_embeddings=32768, use_sliding_window=False, bos_token_id=151643,
)
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# name -> (model_type of a supported family, transformers config keyword arguments)
DUMMY_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    # meta-llama/Llama-3.1-8B
    "llama3.1-8b": ("llama", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_parameters=_LLAMA3_ROPE,
        max_position_embeddings=131072, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
    )),
    # meta-llama/Llama-2-7b-hf (MHA), the Quest paper's model
    "llama2-7b": ("llama", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )),
    # meta-llama/Llama-3.1-70B (the Llama 3 70B shape with Llama 3.1's rope scaling and 128k positions)
    "llama3-70b": ("llama", dict(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, rms_norm_eps=1e-5, rope_parameters=_LLAMA3_ROPE,
        max_position_embeddings=131072, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
    )),
    # Qwen/Qwen2.5-7B-Instruct (QKV bias)
    "qwen2.5-7b": ("qwen2", dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False, eos_token_id=151645, **_QWEN2_5,
    )),
    # Qwen/Qwen2.5-Coder-1.5B (QKV bias, tied embeddings): the real model of the lossless and accuracy runs
    "qwen2.5-1.5b": ("qwen2", dict(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True, eos_token_id=151643, **_QWEN2_5,
    )),
}


def dummy_config(name: str, max_position_embeddings: Optional[int] = None):
    """A fresh transformers config for shape ``name`` (a key of :data:`DUMMY_SHAPES`).

    Args:
        max_position_embeddings: overrides the model's (e.g. ``llama2-7b`` at 32k for long-context
            benchmarks; rope extrapolates, which is fine for random weights). llama3 rope scaling keeps its
            pretraining length (``original_max_position_embeddings``) either way.

    Raises:
        ValueError: an unknown name (the known ones are listed), a shape of an unsupported family (the families are
            listed) or a bad ``max_position_embeddings``.
    """
    if name not in DUMMY_SHAPES:
        raise ValueError(f"dummy config name must be one of {', '.join(map(repr, DUMMY_SHAPES))}; got {name!r}")
    check_optional_int("dummy_config.max_position_embeddings", max_position_embeddings, minimum=1)
    from transformers import AutoConfig

    model_type, kwargs = DUMMY_SHAPES[name]
    family = model_family(model_type, f"DUMMY_SHAPES[{name!r}] model_type")
    kwargs = copy.deepcopy(kwargs)  # transformers edits rope_parameters in place
    if max_position_embeddings is not None:
        kwargs["max_position_embeddings"] = max_position_embeddings
    return AutoConfig.for_model(family.model_type, **kwargs)
