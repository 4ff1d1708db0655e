"""A server whose engine spans two ranks (``--tensor-parallel-size 2``, gloo on the CPU): it streams the tokens of
the one-device engine, and once a worker is killed it answers 503, exits non-zero and leaves no process behind.

One test, in two phases, so that one server start (a worker takes seconds) serves both.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil

from questkv.engine.sampling_params import SamplingParams
from tests.server.conftest import MODEL_NAME, chunk_text, sse_events, start_server, text_prompt

CLIENT_TIMEOUT_S = 60.0
DEADLINE_S = 60.0  # a bound for states awaited (the server's exit, its processes gone); never a sleep


def workers_of(pid: int) -> list[psutil.Process]:
    """The tensor-parallel workers among ``pid``'s children (``spawn`` processes; not its resource tracker)."""
    return [child for child in psutil.Process(pid).children(recursive=True)
            if "spawn_main" in " ".join(child.cmdline())]


def wait_gone(processes: list[psutil.Process]) -> None:
    """Wait (bounded) until none of ``processes`` runs."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        alive = [p.pid for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return
        assert time.monotonic() < deadline, f"processes {alive} outlived the server by {DEADLINE_S} s"
        time.sleep(0.05)


def test_a_two_rank_server_streams_and_a_killed_worker_gives_503_a_non_zero_exit_and_no_orphans(
        model_dir, log_dir, reference_llm):
    server = start_server(model_dir, log_dir, extra=["--tensor-parallel-size", "2"])
    try:
        children = psutil.Process(server.proc.pid).children(recursive=True)
        (worker,) = workers_of(server.proc.pid)
        prompt = text_prompt(30)
        (ref,) = reference_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=CLIENT_TIMEOUT_S) as response:
            assert response.status_code == 200
            events = sse_events(list(response.iter_lines()))
        assert "".join(chunk_text(c) for c in events[:-1]) == ref.text

        os.kill(worker.pid, signal.SIGKILL)
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=CLIENT_TIMEOUT_S)
        assert response.status_code == 503, response.text
        assert server.proc.wait(timeout=DEADLINE_S) == 1, server.log()
        assert "tensor-parallel worker rank 1" in server.log()
        wait_gone(children)
    finally:
        server.terminate()
