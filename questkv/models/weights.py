"""Weights for questkv's own models: tensors streamed from an HF safetensors folder, or random ones.

Owns reading checkpoint files and the random initialisation of benchmarks; which name goes into which
parameter is ``LlamaForCausalLM.load_weights``'s business.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator, Union

import torch
from torch import nn

from questkv.layers.norm import RMSNorm
from questkv.layers.parallel import shard_of
from questkv.validation import check_int

__all__ = ["init_dummy_weights", "load_safetensors_weights", "safetensors_files"]

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(folder: Union[str, os.PathLike]) -> list[Path]:
    """The checkpoint files of an HF folder: those of ``model.safetensors.index.json`` when it exists, else
    every ``*.safetensors`` file, sorted.

    Raises:
        FileNotFoundError: no such folder, or no safetensors file in it (or one the index names is absent).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {str(folder)!r} does not exist")
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
        absent = [str(f.name) for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} names files absent from {str(folder)!r}: {', '.join(absent)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {str(folder)!r}")
    return files


def load_safetensors_weights(
    folder: Union[str, os.PathLike], device: Union[str, torch.device] = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of every checkpoint file of ``folder``, one at a time.

    Tensors keep their stored dtype and are read straight onto ``device`` (``"cuda"`` skips a host copy);
    feed them to ``LlamaForCausalLM.load_weights``. The files are listed (and checked) before the first yield.
    """
    from safetensors import safe_open

    files = safetensors_files(folder)
    device = str(torch.device(device))
    for path in files:
        with safe_open(str(path), framework="pt", device=device) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Overwrite every parameter of ``model`` with random values, generated on its own device.

    Linear and embedding weights are drawn from ``N(0, std^2)``, biases are zero, RMSNorm weights one:
    outputs stay finite through any depth, which is all a speed benchmark needs. Each parameter is filled in
    place by one device kernel (an 8B model on a GPU takes well under a second). Same seed, device and
    dtype: same weights, whatever the tensor-parallel size (a shard is drawn at its full shape and sliced).
    """
    check_int("init_dummy_weights.seed", seed, minimum=0)
    generators: dict[torch.device, torch.Generator] = {}
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    for _, param in model.named_parameters():  # a tied weight comes once
        if id(param) in norm_weights:
            param.fill_(1.0)
        elif param.dim() == 1:
            param.zero_()
        else:
            gen = generators.get(param.device)
            if gen is None:
                gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            full_shape = getattr(param, "tp_full_shape", None)
            if full_shape is None:
                param.normal_(0.0, std, generator=gen)
            else:  # a tensor-parallel shard: drawn whole and sliced, so every tensor-parallel size gets one model
                full = torch.empty(full_shape, dtype=param.dtype, device=param.device).normal_(0.0, std, generator=gen)
                param.copy_(shard_of(param, full))
