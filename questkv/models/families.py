"""The supported model families: one table, read by everything that names a family.

A family is a transformers ``model_type`` that questkv's own model runs (:class:`~questkv.models.llama.ModelSpec`
reads its flags from here), the HF drop-in accepts (:func:`questkv.enable`), the GGUF reader maps natively
(:mod:`questkv.models.gguf_native`, by ``general.architecture``) and a dummy shape may name
(:mod:`questkv.models.shapes`). What varies within a family is read from each checkpoint's config instead: sizes and
head counts, the rope type and its scaling (:data:`questkv.layers.rotary.ROPE_TYPES`), tied embeddings,
``attention_bias`` where the family leaves it to the config, ``mlp_bias``.

A Llama-like family is one entry of :data:`FAMILIES` (and a tiny config in ``tests/helpers.py``, so that
``tests/models/test_llama.py`` checks its logits against transformers). The model class is named rather than
imported (its module reads this table) and imported when the engine builds one (:meth:`ModelFamily.model_class`);
nothing here imports torch or transformers.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Optional

from questkv.validation import check_choice

__all__ = ["FAMILIES", "GGUF_ARCHITECTURES", "MODEL_TYPES", "ModelFamily", "gguf_family", "model_family"]


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One supported family: its names elsewhere and the flags that set it apart.

    Attributes:
        model_type: transformers' ``config.model_type``.
        model_class_path: the questkv model class that runs it, ``"package.module.Class"``.
        gguf_architecture: the ``general.architecture`` of its GGUF files read natively (``quantization="gguf"``),
            or ``None`` where its files say another family's (Mistral's say ``llama`` and load as Llama).
        gguf_qk_permuted: llama.cpp's converter interleaved the two rotary halves of every q/k head of these files
            (its ``llama`` architecture); the GGUF reader permutes those rows back.
        qkv_bias: whether the q/k/v projections have a bias (Qwen2: always), or ``None``: the config's
            ``attention_bias``.
        o_proj_bias: whether the output projection has a bias (Qwen2: never), or ``None``: the config's
            ``attention_bias``.
        qk_norm: RMSNorm over ``head_dim`` of every query and key head before RoPE (Qwen3).
        sliding_window_everywhere: a ``config.sliding_window`` that is set applies to every layer (Mistral); the
            other families name their sliding layers in ``config.layer_types``.
    """

    model_type: str
    model_class_path: str = "questkv.models.llama.LlamaForCausalLM"
    gguf_architecture: Optional[str] = None
    gguf_qk_permuted: bool = False
    qkv_bias: Optional[bool] = None
    o_proj_bias: Optional[bool] = None
    qk_norm: bool = False
    sliding_window_everywhere: bool = False

    def model_class(self) -> type:
        """The class :attr:`model_class_path` names (imported now: it brings torch)."""
        module, _, name = self.model_class_path.rpartition(".")
        return getattr(importlib.import_module(module), name)


FAMILIES: dict[str, ModelFamily] = {
    family.model_type: family
    for family in (
        ModelFamily("llama", gguf_architecture="llama", gguf_qk_permuted=True),
        ModelFamily("mistral", sliding_window_everywhere=True),
        ModelFamily("qwen2", gguf_architecture="qwen2", qkv_bias=True, o_proj_bias=False),
        ModelFamily("qwen3", gguf_architecture="qwen3", qk_norm=True),
    )
}
"""``model_type`` -> its family, every supported one."""

MODEL_TYPES: tuple[str, ...] = tuple(FAMILIES)
"""The supported ``config.model_type`` values."""

GGUF_ARCHITECTURES: tuple[str, ...] = tuple(f.gguf_architecture for f in FAMILIES.values() if f.gguf_architecture)
"""The GGUF ``general.architecture`` values read natively."""


def model_family(model_type: object, name: str = "config.model_type") -> ModelFamily:
    """The family of ``model_type``.

    Raises:
        ValueError: another model type, naming ``name``, the value and :data:`MODEL_TYPES`.
    """
    return FAMILIES[check_choice(name, model_type, MODEL_TYPES)]


def gguf_family(architecture: object) -> Optional[ModelFamily]:
    """The family whose GGUF files say ``general.architecture = architecture``, or ``None`` (not read natively)."""
    return next((f for f in FAMILIES.values() if f.gguf_architecture == architecture), None)
