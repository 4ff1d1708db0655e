"""A command needs only its own dependencies: ``questkv --help``, ``questkv bench latency --help`` and
``questkv serve --help`` work in a process where the evaluation stack's and the server's third-party packages
cannot be imported (a meta-path hook refuses them, as on an image without the ``eval`` or ``server`` extra).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("wonderwords", "matplotlib", "fastapi", "uvicorn", "starlette", "prometheus_client")
RUN = f"""
import sys

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ImportError(f"{{name}} is blocked by the test (an image without it)")
        return None

sys.meta_path.insert(0, Blocked())
from questkv.cli import main
sys.exit(main())
"""


def questkv(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", RUN, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("argv, shows", [
    ((), ["demo", "generate", "bench", "serve", "eval"]),
    (("bench", "latency"), ["--input-len", "--output-len", "--budget"]),
    (("serve",), ["--max-request-bytes", "--body-read-timeout", "--budget"]),
], ids=["questkv", "bench-latency", "serve"])
def test_help_works_without_the_eval_and_server_packages(argv, shows):
    done = questkv(*argv, "--help")
    assert done.returncode == 0, done.stderr
    for word in shows:
        assert word in done.stdout, done.stdout


def test_the_hook_does_block_what_eval_needs():
    done = questkv("eval", "sweep", "--help")  # eval does need wonderwords: the hook must make it fail
    assert done.returncode != 0 and "wonderwords is blocked by the test" in done.stderr, done.stderr
