"""A real ``python -m questkv.server`` process on 127.0.0.1 and what the server tests share.

The served model is a tiny random transformers Llama (3 layers, GQA 4 q / 2 KV heads) saved with
``save_pretrained`` once per session, with a word tokenizer whose words are ``x02`` ... ``x92`` plus the chat
roles (``assistant``, ``system``, ``user``) and a one-line Jinja chat template, so chat prompts tokenise to known
words. The server runs on the CPU in fp32 with Quest (budget 16, page 4, one dense layer), so greedy tokens must
equal the in-process :class:`~questkv.engine.llm.LLM` of the same folder and flags (:func:`reference_llm`) exactly.

:class:`ServerProcess` starts a server on a free port with ``OMP_NUM_THREADS=1``, waits for ``/health`` (bounded),
and stops it with SIGTERM (its exit code is checked by the fixtures). Its output goes to a log file, shown when a
start or a stop fails.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import httpx
import pytest

from questkv import QuestConfig
from tests.helpers import tiny_config, tiny_hf_model, word_tokenizer

ROOT = Path(__file__).resolve().parents[2]
VOCAB, PAGE, BUDGET, DENSE_LAYERS, LAYERS = 96, 4, 16, 1, 3
MAX_LEN = 128
MAX_NUM_SEQS = 64
KV_MEMORY = 1 << 23  # about 2000 pages of 4 tokens: 64 requests of 128 tokens fit without preemption
MODEL_NAME = "tiny-llama"
ROLES = ("assistant", "system", "user")
WORDS = [f"x{i:02d}" for i in range(2, VOCAB - len(ROLES))] + list(ROLES)  # with <unk>, <eos>: VOCAB tokens
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} {{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)
QUEST = QuestConfig(token_budget=BUDGET, page_size=PAGE, dense_layers=DENSE_LAYERS)
ENGINE_ARGS = dict(device="cpu", dtype="float32", max_model_len=MAX_LEN, kv_cache_memory=KV_MEMORY,
                   max_num_seqs=MAX_NUM_SEQS)
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0


def engine_flags(max_model_len: int = MAX_LEN, max_num_seqs: int = MAX_NUM_SEQS) -> list[str]:
    """The server's engine and Quest flags matching :data:`ENGINE_ARGS` and :data:`QUEST`."""
    return ["--device", "cpu", "--dtype", "float32", "--max-model-len", str(max_model_len),
            "--kv-cache-memory", str(KV_MEMORY), "--max-num-seqs", str(max_num_seqs),
            "--budget", str(BUDGET), "--page-size", str(PAGE), "--dense-layers", str(DENSE_LAYERS)]


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """``python -m questkv.server MODEL ARGS --host 127.0.0.1 --port <free>`` in a subprocess.

    Attributes:
        url: ``http://127.0.0.1:<port>``. proc: the ``subprocess.Popen``. log_path: its stdout and stderr.
    """

    def __init__(self, model: str, args: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TRITON_INTERPRET": "1",
               "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "NO_PROXY": "127.0.0.1"}
        command = [sys.executable, "-m", "questkv.server", model, *args, "--host", "127.0.0.1",
                   "--port", str(self.port)]
        self.command = command
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def log(self, tail: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:]

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Poll ``/health`` until it answers 200; raise (with the log) if the process dies or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} before it was ready:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.kill()
        raise RuntimeError(f"the server did not answer /health within {timeout:.0f} s:\n{self.log()}")

    def terminate(self, timeout: float = STOP_TIMEOUT_S) -> Optional[int]:
        """SIGTERM, then wait up to ``timeout`` s; returns the exit code, or ``None`` (then killed) on a hang."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def start_server(model_dir: Path, log_dir: Path, extra: list[str] = (), **flags: Any) -> ServerProcess:
    """A ready server of the tiny model with :func:`engine_flags` (``flags`` passed to it) and ``extra``."""
    args = engine_flags(**flags) + ["--served-model-name", MODEL_NAME, *extra]
    server = ServerProcess(str(model_dir), args, log_dir / f"server-{random.randrange(1 << 30)}.log")
    server.wait_ready()
    return server


def stop_server(server: ServerProcess, timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM ``server`` and check that it exits 0 within ``timeout`` s."""
    code = server.terminate(timeout)
    assert code == 0, f"the server exited with {code} after SIGTERM (None: hung, killed):\n{server.log()}"


# ---------------------------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-server")
    config = tiny_config("llama3", vocab_size=VOCAB)
    tiny_hf_model(config, seed=random.randrange(1 << 16)).save_pretrained(path)
    tokenizer = word_tokenizer(WORDS)
    assert len(tokenizer) == VOCAB
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session")
def server(model_dir, log_dir):
    """The shared server's base URL (``http://127.0.0.1:<port>``); it must exit 0 on SIGTERM at the end."""
    proc = start_server(model_dir, log_dir)
    try:
        yield proc.url
    finally:
        stop_server(proc)


@pytest.fixture(scope="session")
def reference_llm(model_dir):
    """The in-process engine of the served folder with the server's flags."""
    from questkv.engine.llm import LLM

    return LLM(str(model_dir), quest=QUEST, **ENGINE_ARGS)


# ---------------------------------------------------------------------------------------------------------------
# Requests and responses
# ---------------------------------------------------------------------------------------------------------------


def token_prompt(n: int) -> list[int]:
    """``n`` random token ids of words (no special token)."""
    return [random.randrange(2, VOCAB) for _ in range(n)]


def text_prompt(n: int) -> str:
    """``n`` random words of the tokenizer (``n`` tokens)."""
    return " ".join(random.choice(WORDS) for _ in range(n))


def sse_events(lines: list[str]) -> list[Any]:
    """The payloads of a server-sent event stream's lines: parsed JSON objects, then the string ``"[DONE]"``.

    Checks the framing: every non-empty line is ``data: <payload>``, events are separated by a blank line,
    ``[DONE]`` comes exactly once, last.
    """
    events, expect_blank = [], False
    for line in lines:
        if line == "":
            expect_blank = False
            continue
        assert not expect_blank, f"two data lines without a blank line between them: {line!r}"
        assert line.startswith("data: "), f"an SSE line that is not 'data: ...': {line!r}"
        assert "[DONE]" not in events, f"data after [DONE]: {line!r}"
        payload = line[len("data: "):]
        events.append("[DONE]" if payload == "[DONE]" else json.loads(payload))
        expect_blank = True
    assert events and events[-1] == "[DONE]", f"the stream does not end with data: [DONE]: {events[-3:]!r}"
    return events


def chunk_text(chunk: dict) -> str:
    """The text a completion or chat chunk adds (``""`` for a usage-only chunk)."""
    out = []
    for choice in chunk.get("choices", []):
        if "delta" in choice:
            out.append(choice["delta"].get("content") or "")
        else:
            out.append(choice.get("text") or "")
    return "".join(out)


def metric_values(text: str) -> dict[str, float]:
    """Prometheus text exposition -> ``{"name{labels}": value}`` (and ``{"name": sum over labels}``)."""
    values: dict[str, float] = {}
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        values[key] = float(value)
        name = key.split("{", 1)[0]
        sums[name] = sums.get(name, 0.0) + float(value)
    return {**values, **sums}


def metrics(url: str) -> dict[str, float]:
    response = httpx.get(url + "/metrics", timeout=10.0)
    assert response.status_code == 200, response.text
    return metric_values(response.text)


def wait_until(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.2) -> None:
    """Poll ``condition`` until it is true; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def idle(url: str) -> dict[str, float]:
    """Wait (bounded) until the server runs and queues no request; return its metrics then."""
    state = {}

    def check() -> bool:
        state.update(metrics(url))
        return state.get("questkv_requests_running") == 0 and state.get("questkv_requests_waiting") == 0

    wait_until(check, 30.0, "no running or waiting request in /metrics")
    return state
