"""Where a benchmark result came from: the commit of the tree that produced it."""

from __future__ import annotations

import os
import subprocess


def git_commit() -> str:
    """``git rev-parse HEAD``; on a machine without the repository's history (the GPU machine gets
    a copy of the working tree), ``$QUESTKV_COMMIT`` or ``"unknown"``."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("QUESTKV_COMMIT", "unknown")
