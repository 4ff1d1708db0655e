"""The server's app under uvicorn in a thread of the test process, over a dummy-weight engine, for what needs a
hand inside it: a tokenizer that blocks until told (so the test knows a prompt is being tokenised, without
timing), and a fault injected into request preparation (a 500 on purpose).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import pytest

from questkv.config import QuestConfig
from questkv.engine.engine_config import EngineConfig
from questkv.engine.llm_engine import LLMEngine
from questkv.server.app import build_app
from questkv.server.engine_loop import EngineLoop
from tests.helpers import tiny_config
from tests.server import raw_http
from tests.server.conftest import metric_values, wait_until

_ENGINE = dict(load_format="dummy", device="cpu", dtype="float32", max_model_len=64, kv_cache_memory=1 << 20,
               max_num_seqs=4)
BOUND_S = 30.0  # a bound on a hang, not a timing assumption


class BlockingTokenizer:
    """Encodes ``"w w w"`` as one id per word; a prompt starting with ``block`` waits for :attr:`release`."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        if text.startswith("block"):
            self.entered.set()
            if not self.release.wait(BOUND_S):
                raise RuntimeError("the test never released the tokenizer")
        return {"input_ids": [5 + len(word) % 50 for word in text.split()]}


@contextlib.contextmanager
def serve(app):
    import uvicorn

    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on",
                            timeout_keep_alive=120)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn-under-test", daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), 60.0, "uvicorn to start", interval=0.05)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(BOUND_S)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model=tiny_config("llama3"), quest=QuestConfig(token_budget=8, page_size=4,
                                                                                 dense_layers=1), **_ENGINE))


@pytest.fixture(scope="module")
def served(engine):
    app = build_app(EngineLoop(engine), "dummy", shutdown_grace=1.0)
    with serve(app) as url:
        yield url, app.state.serving


def _requests(url: str) -> dict[str, float]:
    values = metric_values(httpx.get(url + "/metrics", timeout=BOUND_S).text)
    return {key: value for key, value in values.items() if key.startswith("questkv_requests_total{")}


def test_health_answers_while_a_prompt_is_being_tokenized(served, monkeypatch):
    url, serving = served
    tokenizer = BlockingTokenizer()
    monkeypatch.setattr(serving, "tokenizer", tokenizer)
    answer = {}

    def post() -> None:
        answer["response"] = httpx.post(url + "/v1/completions", json={"prompt": "block these words", "max_tokens": 2,
                                                                       "temperature": 0}, timeout=2 * BOUND_S)

    client = threading.Thread(target=post)
    client.start()
    try:
        assert tokenizer.entered.wait(BOUND_S), "the prompt never reached the tokenizer"
        health = httpx.get(url + "/health", timeout=BOUND_S)  # the event loop is free while the tokenizer waits
        assert health.status_code == 200, health.text
        assert httpx.get(url + "/v1/models", timeout=BOUND_S).status_code == 200
    finally:
        tokenizer.release.set()
        client.join(2 * BOUND_S)
    assert answer["response"].status_code == 200, answer["response"].text
    assert answer["response"].json()["usage"]["prompt_tokens"] == 3


def test_an_unexpected_exception_is_a_500_counted_as_error_and_the_connection_is_kept(served, monkeypatch):
    url, serving = served
    before = _requests(url)

    def broken(raw: bytes):
        raise RuntimeError("an injected fault")

    monkeypatch.setattr(serving, "_prepare_completion", broken)
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 2}).encode()
    with raw_http.connect(url) as sock:
        sock.sendall(raw_http.request_bytes("POST", "/v1/completions", body))
        failed = raw_http.read_response(sock)
        assert failed.status == 500, failed.body
        error = failed.json()["error"]
        assert error["type"] == "internal_error" and "an injected fault" in error["message"], error
        assert failed.headers.get("connection", "").lower() != "close", failed.headers
        sock.sendall(raw_http.request_bytes("GET", "/health"))  # the same connection still serves
        assert raw_http.read_response(sock).status == 200
    monkeypatch.undo()
    after = _requests(url)
    assert after['questkv_requests_total{status="error"}'] == before['questkv_requests_total{status="error"}'] + 1
    assert sum(after.values()) == sum(before.values()) + 1
    good = httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}, timeout=BOUND_S)
    assert good.status_code == 200, good.text


def test_a_stream_that_fails_mid_way_ends_with_an_error_event_and_counts_as_error(served, monkeypatch):
    url, serving = served
    before = _requests(url)
    from questkv.server import serving as serving_module

    def broken(self, output, sent):
        raise RuntimeError("an injected fault in a stream")

    monkeypatch.setattr(serving_module._Run, "_visible", broken)
    with httpx.stream("POST", url + "/v1/completions", timeout=BOUND_S,
                      json={"prompt": [5, 6, 7], "max_tokens": 4, "stream": True}) as response:
        lines = [line for line in response.iter_lines() if line]
    assert response.status_code == 200
    assert lines[-1] == "data: [DONE]" and '"internal_error"' in lines[-2], lines
    monkeypatch.undo()
    deadline = time.monotonic() + BOUND_S
    while sum(_requests(url).values()) == sum(before.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    after = _requests(url)
    assert after['questkv_requests_total{status="error"}'] == before['questkv_requests_total{status="error"}'] + 1
    assert sum(after.values()) == sum(before.values()) + 1
