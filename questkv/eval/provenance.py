"""Where a result came from: command, commit, machine, software and date, stored beside every result."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys

import torch


def git_commit() -> str:
    """``$QUESTKV_COMMIT`` when set (the GPU machine gets a copy of the working tree whose ``.git``
    may be stale), else ``git rev-parse HEAD``, else ``"unknown"``."""
    if os.environ.get("QUESTKV_COMMIT"):
        return os.environ["QUESTKV_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine(device: str) -> str:
    """The GPU's name for a CUDA device, else the CPU architecture and torch's thread count."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({platform.machine()}), {torch.get_num_threads()} threads"


def provenance(device: str, command: str | None = None) -> dict:
    """``{"command", "commit", "machine", "python", "torch", "transformers", "date"}``; ``command``
    defaults to this process's command line."""
    import transformers

    return {
        "command": command if command is not None else " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "commit": git_commit(),
        "machine": machine(device),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
