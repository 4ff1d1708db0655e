"""Backpressure and shutdown: a full waiting queue answers 503 with Retry-After at once (no hang), and SIGTERM
during load exits 0 within the grace period. Each runs its own server process (the tiny model of ``conftest.py``).
"""

from __future__ import annotations

import asyncio
import random
import signal
import time

import httpx
import pytest

from tests.server.conftest import MAX_LEN, MODEL_NAME, idle, start_server, stop_server, token_prompt

GRACE_S = 1  # shorter than the load: the shutdown aborts requests still running


@pytest.fixture(scope="module")
def small_queue_server(model_dir, log_dir):
    """One sequence at a time and one waiting request at most."""
    proc = start_server(model_dir, log_dir, extra=["--max-waiting", "1"], max_num_seqs=1)
    try:
        yield proc.url
    finally:
        stop_server(proc)


async def timed_post(http: httpx.AsyncClient, body: dict) -> tuple[int, float, httpx.Headers, object]:
    """``(status, seconds, headers, body)``; a stream is read to its end."""
    began = time.monotonic()
    async with http.stream("POST", "/v1/completions", json=body) as response:
        raw = await response.aread()
    payload = response.json() if response.headers.get("content-type", "").startswith("application/json") else raw
    return response.status_code, time.monotonic() - began, response.headers, payload


def test_a_full_queue_answers_503_with_retry_after_at_once_and_serves_what_it_admitted(small_queue_server):
    url = small_queue_server
    start = idle(url)
    # Each admitted request runs to max_model_len (ignore_eos): the burst arrives while the first one runs.
    bodies = [{"model": MODEL_NAME, "prompt": token_prompt(10), "max_tokens": MAX_LEN - 10, "ignore_eos": True,
               "temperature": 0, "stream": i % 2 == 1} for i in range(16)]

    async def burst():
        limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, timeout=60.0, limits=limits) as http:
            return await asyncio.wait_for(asyncio.gather(*(timed_post(http, b) for b in bodies)), 90.0)

    results = asyncio.run(burst())
    statuses = [status for status, *_ in results]
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.count(503) >= 1 and statuses.count(200) >= 1, statuses
    first_served = min(seconds for status, seconds, *_ in results if status == 200)
    for status, seconds, headers, payload in results:
        if status != 503:
            continue
        assert seconds < first_served, "a 503 came after a served request ended: it waited instead of being refused"
        assert int(headers["retry-after"]) >= 0
        assert set(payload["error"]) >= {"message", "type", "param", "code"}, payload
    end = idle(url)
    assert end["questkv_kv_pages_free"] == start["questkv_kv_pages_free"]
    response = httpx.post(url + "/v1/completions", timeout=60,
                          json={"model": MODEL_NAME, "prompt": token_prompt(10), "max_tokens": 3})
    assert response.status_code == 200, response.text


def test_sigterm_during_load_exits_0_within_the_grace_period(model_dir, log_dir):
    proc = start_server(model_dir, log_dir, extra=["--shutdown-grace", str(GRACE_S)], max_model_len=256)
    ended: list[str] = []
    try:
        started = asyncio.Event()
        chunks = [0]

        async def client(http: httpx.AsyncClient, body: dict) -> None:
            """Read one stream to its end; record how it ended: "done" ([DONE] after the last token),
            "error" ([DONE] after an error event), "closed", or the transport error."""
            error_event = False
            try:
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith('data: {"error"'):
                            error_event = True
                        elif line.startswith("data: {"):
                            chunks[0] += 1
                            if chunks[0] >= 8:
                                started.set()
                        elif line == "data: [DONE]":
                            ended.append("error" if error_event else "done")
                            return
                ended.append(f"closed ({response.status_code})")
            except httpx.TransportError as error:
                ended.append(type(error).__name__)

        async def load() -> None:
            limits = httpx.Limits(max_connections=8, max_keepalive_connections=0)
            async with httpx.AsyncClient(base_url=proc.url, timeout=60.0, limits=limits) as http:
                tasks = [asyncio.create_task(client(http, {
                    "model": MODEL_NAME, "prompt": token_prompt(random.randint(10, 30)), "max_tokens": 220,
                    "temperature": 0, "stream": True})) for _ in range(8)]
                await asyncio.wait_for(started.wait(), 60.0)
                sent.append(time.monotonic())
                proc.proc.send_signal(signal.SIGTERM)
                await asyncio.wait_for(asyncio.gather(*tasks), GRACE_S + 30.0)

        sent: list[float] = []
        asyncio.run(load())
        code = proc.proc.wait(timeout=GRACE_S + 30.0)
        took = time.monotonic() - sent[0]
    finally:
        proc.kill()
    log = proc.log(20000)
    assert code == 0, f"exit code {code} after SIGTERM under load:\n{log}"
    assert took < GRACE_S + 10.0, f"the server took {took:.1f} s to exit after SIGTERM (grace {GRACE_S} s)"
    assert len(ended) == 8, ended  # every client's stream ended (finished, error event, or closed), none hung
    assert "Traceback" not in log, log
    with pytest.raises(httpx.TransportError):
        httpx.get(proc.url + "/health", timeout=2.0)
