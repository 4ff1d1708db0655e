"""Faults and bad input against a real server process: every field with a wrong type, out-of-range and non-finite
numbers (JSON's ``NaN`` and ``Infinity`` literals), odd Unicode, oversized and deeply nested bodies, a body and
a header that stall (raw sockets), clients that go away before their first token, a tiny positive temperature.

After each case the server answers ``/health`` (within a bounded wait; no timing is asserted). At the end the
KV pool is back to its idle size and every request sent to a completion route is counted in
``questkv_requests_total`` under exactly one status. The server is this module's own (the tiny model of
``conftest.py``) with a 64 KiB body limit and a 2 s body read timeout, so that the limits are cheap to reach.
"""

from __future__ import annotations

import json
import random
import socket

import httpx
import openai
import pytest

from tests.server import raw_http
from tests.server.conftest import (
    MAX_LEN, MODEL_NAME, VOCAB, idle, metrics, start_server, stop_server, text_prompt, token_prompt, wait_until,
)

MAX_BYTES = 64 << 10
BODY_TIMEOUT_S = 2
BOUND_S = 30.0  # a bound on a hang, not a timing assumption
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
SENT = [0]  # requests this module sent to a completion route (each must be counted once)


@pytest.fixture(scope="module")
def server(model_dir, log_dir):
    proc = start_server(model_dir, log_dir, extra=["--max-request-bytes", str(MAX_BYTES),
                                                   "--body-read-timeout", str(BODY_TIMEOUT_S)])
    state = {"url": proc.url, "proc": proc, "start": idle(proc.url), "counted": _counted(metrics(proc.url))}
    try:
        yield state
    finally:
        stop_server(proc)
    assert "Traceback" not in proc.log(100000), proc.log()


def _counted(values: dict) -> float:
    return values.get("questkv_requests_total", 0.0)


def healthy(url: str) -> None:
    response = httpx.get(url + "/health", timeout=BOUND_S)
    assert response.status_code == 200, response.text


def post(url: str, path: str, body) -> httpx.Response:
    """POST ``body`` (an object as JSON, or raw bytes); counted in :data:`SENT`."""
    SENT[0] += 1
    if isinstance(body, bytes):
        return httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=BOUND_S)
    return httpx.post(url + path, json=body, timeout=BOUND_S)


def completion(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": token_prompt(6), "max_tokens": 2, **fields}


def chat(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": text_prompt(5)}], "max_tokens": 2, **fields}


def check_400(response: httpx.Response, param) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"], error
    if param is not None:
        assert error["param"] is not None and param in error["param"], error
    return error


# ---- every field with a wrong type ---------------------------------------------------------------------------------

WRONG_TYPES = [  # (path, field, wrong value)
    *[(COMPLETIONS, field, value) for field, value in [
        ("model", 5), ("prompt", {"text": "x02"}), ("prompt", [1.5, 2]), ("prompt", [True]), ("prompt", [[3]]),
        ("max_tokens", 1.5), ("max_tokens", "5"), ("max_tokens", True), ("temperature", "hot"),
        ("temperature", [0]), ("temperature", True), ("top_p", "1"), ("seed", 1.5), ("seed", "7"), ("stop", 5),
        ("stop", [1]), ("n", "1"), ("stream", 1), ("stream", "true"), ("stream_options", 5), ("quest", "dense"),
        ("quest", {"token_budget": "8"}), ("quest", {"token_budget": 8.0}), ("quest", {"dense": 1}),
        ("ignore_eos", "yes"), ("return_token_ids", 1), ("logprobs", "x"), ("top_logprobs", "x"),
        ("logit_bias", []), ("presence_penalty", "x"), ("frequency_penalty", []), ("user", 5), ("metadata", 5),
        ("store", "x"), ("service_tier", 5), ("echo", "x"), ("best_of", "x"), ("suffix", 5),
    ]],
    *[(CHAT, field, value) for field, value in [
        ("messages", {"role": "user"}), ("messages", [5]), ("messages", [{"role": 5, "content": "x02"}]),
        ("messages", [{"role": "robot", "content": "x02"}]), ("messages", [{"role": "user", "content": 5}]),
        ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]),
        ("messages", [{"role": "user", "content": "x02", "name": 5}]), ("max_completion_tokens", "x"),
        ("tools", "x"), ("tool_choice", 5), ("response_format", 5), ("parallel_tool_calls", "x"),
    ]],
]


@pytest.mark.parametrize("path,field,value", WRONG_TYPES, ids=[f"{p[4:]}-{f}-{v!r}" for p, f, v in WRONG_TYPES])
def test_a_field_of_the_wrong_type_is_a_400_naming_it(server, path, field, value):
    body = (completion if path == COMPLETIONS else chat)(**{field: value})
    check_400(post(server["url"], path, body), field)
    healthy(server["url"])


# ---- out-of-range and non-finite numbers ---------------------------------------------------------------------------

def _raw(field_json: str, chat_body: bool = False) -> bytes:
    """A body whose last field is written as raw JSON text (``NaN``, ``Infinity``, a huge integer)."""
    base = json.dumps(chat() if chat_body else completion())[:-1]
    return f"{base}, {field_json}}}".encode()


NUMBERS = [  # (raw JSON of one field, the param named)
    ('"temperature": NaN', "temperature"), ('"temperature": Infinity', "temperature"),
    ('"temperature": -Infinity', "temperature"), ('"temperature": 1e308', "temperature"),
    ('"temperature": 2.0000001', "temperature"), ('"top_p": NaN', "top_p"), ('"top_p": 1e-400', "top_p"),
    ('"top_p": -0.0', "top_p"), ('"presence_penalty": NaN', "presence_penalty"),
    ('"frequency_penalty": -Infinity', "frequency_penalty"), ('"max_tokens": NaN', "max_tokens"),
    ('"max_tokens": 1000000', "max_tokens"), ('"max_tokens": 100000000000000000000000000000', "max_tokens"),
    ('"max_tokens": -1', "max_tokens"), ('"seed": 18446744073709551616', "seed"), ('"seed": -1', "seed"),
    ('"seed": Infinity', "seed"), ('"n": 100000000000000000000', "n"),
    ('"quest": {"token_budget": 1000000000000000000000000000000}', "token_budget"),
    ('"quest": {"token_budget": NaN}', "token_budget"), ('"quest": {"token_budget": -4}', "token_budget"),
    ('"stop": ["a", "b", "c", "d", "e"]', "stop"), ('"stop": [""]', "stop"),
]


@pytest.mark.parametrize("field_json,param", NUMBERS, ids=[n for n, _ in NUMBERS])
def test_an_out_of_range_or_non_finite_number_is_a_400_naming_the_field(server, field_json, param):
    check_400(post(server["url"], COMPLETIONS, _raw(field_json)), param)
    healthy(server["url"])


@pytest.mark.parametrize("prompt", [[VOCAB], [-1], [2**70], [5, 2**63]], ids=["vocab", "negative", "2**70", "2**63"])
def test_token_ids_outside_the_vocabulary_are_a_400(server, prompt):
    error = check_400(post(server["url"], COMPLETIONS, completion(prompt=prompt)), "prompt")
    assert str(VOCAB) in error["message"], error
    healthy(server["url"])


def test_the_openai_client_gets_bad_request_errors_naming_the_field(server):
    api = openai.OpenAI(base_url=server["url"] + "/v1", api_key="x", timeout=BOUND_S, max_retries=0)
    calls = [  # (param, call): the client itself refuses NaN and lone surrogates before sending
        ("max_tokens", lambda: api.completions.create(model=MODEL_NAME, prompt=token_prompt(4), max_tokens=10**6)),
        ("temperature", lambda: api.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "x05"}], temperature=1e300)),
        ("quest.token_budget", lambda: api.completions.create(
            model=MODEL_NAME, prompt="x05 x06", max_tokens=2, extra_body={"quest": {"token_budget": 10**30}})),
    ]
    for param, call in calls:
        SENT[0] += 1
        with pytest.raises(openai.BadRequestError) as info:
            call()
        assert info.value.body["param"] == param, info.value.body
    healthy(server["url"])


def test_a_tiny_positive_temperature_is_greedy(server):
    prompt = token_prompt(random.randint(4, 20))
    texts = []
    for temperature in (0, 1e-45, 5e-324, 1e-6):  # float32 subnormal, float64 subnormal, below 1e-5
        response = post(server["url"], COMPLETIONS, completion(prompt=prompt, max_tokens=12, temperature=temperature,
                                                               return_token_ids=True, ignore_eos=True))
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["token_ids"])
    assert texts[1:] == texts[:1] * 3, texts
    healthy(server["url"])


# ---- odd Unicode ---------------------------------------------------------------------------------------------------

LONE_SURROGATES = [  # (path, body as JSON text with \\u escapes, the param named)
    (COMPLETIONS, '{"prompt": "x02 \\ud800 x03", "max_tokens": 2}', "prompt"),
    (COMPLETIONS, '{"prompt": "x02 \\udfff", "max_tokens": 2}', "prompt"),
    (COMPLETIONS, '{"prompt": "\\ude00\\ud83d", "max_tokens": 2}', "prompt"),  # a pair in the wrong order
    (COMPLETIONS, '{"prompt": "x02", "stop": ["\\ud800"], "max_tokens": 2}', "stop"),
    (COMPLETIONS, '{"prompt": "x02", "model": "\\ud800", "max_tokens": 2}', "model"),
    (COMPLETIONS, '{"prompt": "x02", "user": "\\udc00", "max_tokens": 2}', "user"),
    (COMPLETIONS, '{"prompt": "x02", "metadata": {"\\ud800": "x"}, "max_tokens": 2}', "metadata"),
    (CHAT, '{"messages": [{"role": "user", "content": "x02 \\ud800"}], "max_tokens": 2}', "messages[0].content"),
    (CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udbff"}]}], "max_tokens": 2}',
     "messages[0].content"),
]


@pytest.mark.parametrize("path,body,param", LONE_SURROGATES, ids=[f"{b[:40]}" for _, b, _ in LONE_SURROGATES])
def test_a_lone_surrogate_is_a_400_naming_the_field(server, path, body, param):
    error = check_400(post(server["url"], path, body.encode()), param)
    assert "Unicode" in error["message"], error
    healthy(server["url"])


@pytest.mark.parametrize("text", ["x02 \U0001F600 x03", "x02\u0000x03", "\ufeffx02", "x02 \u202e x03", "\u00e9\u0301",
                                  "x02 \ufffd", "\U0010FFFF", "x02\r\n\t\u2028x03"],
                         ids=["emoji", "nul", "bom", "rtl", "combining", "replacement", "max-code-point", "spaces"])
def test_odd_but_valid_unicode_is_served(server, text):
    response = post(server["url"], COMPLETIONS, completion(prompt=text))
    assert response.status_code == 200, response.text
    response = post(server["url"], CHAT, chat(messages=[{"role": "user", "content": text}], stop=[text[-1]]))
    assert response.status_code == 200, response.text
    healthy(server["url"])


def test_the_engine_refuses_a_lone_surrogate_with_a_value_error_naming_the_prompt(reference_llm):
    with pytest.raises(ValueError, match="prompt is not valid Unicode: a lone surrogate"):
        reference_llm.engine.add_request("x02 \ud800", None)
    assert not reference_llm.engine.has_unfinished_requests()


# ---- oversized and nested bodies -----------------------------------------------------------------------------------

@pytest.mark.parametrize("depth", [40, 30_000], ids=["40", "30000"])  # 30000: 60 KB, within the limit
def test_a_deeply_nested_body_is_a_400(server, depth):
    nested = "[" * depth + "]" * depth
    check_400(post(server["url"], COMPLETIONS, _raw(f'"metadata": {{"x": {nested}}}')), None)
    check_400(post(server["url"], COMPLETIONS, nested.encode()), None)
    healthy(server["url"])


def test_a_body_over_the_limit_by_its_length_is_a_413_and_the_connection_closes(server):
    with raw_http.connect(server["url"]) as sock:  # the headers announce it; the body never comes
        SENT[0] += 1
        sock.sendall(raw_http.request_bytes("POST", COMPLETIONS, headers={
            "Content-Type": "application/json", "Content-Length": str(MAX_BYTES + 1)}))
        response = raw_http.read_response(sock)
        assert response.status == 413, response.body
        assert response.json()["error"]["code"] == "request_too_large"
        assert response.headers.get("connection") == "close" and raw_http.is_closed_by_server(sock)
    healthy(server["url"])


def test_a_chunked_body_over_the_limit_is_a_413(server):
    part = b" " * 4096
    chunk = f"{len(part):x}\r\n".encode() + part + b"\r\n"
    with raw_http.connect(server["url"]) as sock:
        SENT[0] += 1
        sock.sendall(raw_http.request_bytes("POST", COMPLETIONS, headers={
            "Content-Type": "application/json", "Transfer-Encoding": "chunked"}))
        for _ in range(MAX_BYTES // len(part) + 1):  # one chunk more than the limit, no terminating chunk
            sock.sendall(chunk)
        response = raw_http.read_response(sock)
        assert response.status == 413, response.body
    healthy(server["url"])


def test_a_long_prompt_within_the_limit_is_refused_for_its_length_not_its_size(server):
    prompt = " ".join(random.choice(["x02", "x03", "x50"]) for _ in range(MAX_BYTES // 5))  # ~52 KB, 13k tokens
    check_400(post(server["url"], COMPLETIONS, completion(prompt=prompt)), "prompt")
    healthy(server["url"])


# ---- stalls and disconnects ----------------------------------------------------------------------------------------

def test_a_body_that_stalls_is_a_408_and_the_connection_closes(server):
    with raw_http.connect(server["url"]) as sock:
        SENT[0] += 1
        body = json.dumps(completion()).encode()
        sock.sendall(raw_http.request_bytes("POST", COMPLETIONS, body[:10], headers={
            "Content-Type": "application/json", "Content-Length": str(len(body))}))
        healthy(server["url"])  # others are served meanwhile
        response = raw_http.read_response(sock)  # comes after --body-read-timeout
        assert response.status == 408, response.body
        assert response.headers.get("connection") == "close" and raw_http.is_closed_by_server(sock)
    healthy(server["url"])


def test_a_header_that_stalls_holds_only_its_own_connection(server):
    with raw_http.connect(server["url"]) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")  # never finished
        healthy(server["url"])
        response = post(server["url"], COMPLETIONS, completion())
        assert response.status_code == 200, response.text
    healthy(server["url"])


@pytest.mark.parametrize("stream", [False, True], ids=["collected", "streamed"])
def test_a_client_that_goes_away_before_its_first_token_is_counted_once_and_frees_its_pages(server, stream):
    url = server["url"]
    before = _counted(metrics(url))
    body = json.dumps(completion(prompt=token_prompt(MAX_LEN // 2), max_tokens=MAX_LEN // 2 - 1, ignore_eos=True,
                                 stream=stream)).encode()
    with raw_http.connect(url) as sock:
        SENT[0] += 1
        sock.sendall(raw_http.request_bytes("POST", COMPLETIONS, body))
        sock.shutdown(socket.SHUT_RDWR)  # gone before any answer: prefill may or may not have begun
    # aborted, or finished first if it was quick: either way counted once, its pages freed
    wait_until(lambda: _counted(metrics(url)) == before + 1, BOUND_S, "the request to be counted")
    assert idle(url)["questkv_kv_pages_free"] == server["start"]["questkv_kv_pages_free"]
    healthy(url)


def test_a_stream_cut_during_generation_is_counted_once_and_frees_its_pages(server):
    url = server["url"]
    before = _counted(metrics(url))
    SENT[0] += 1
    with httpx.stream("POST", url + COMPLETIONS, timeout=BOUND_S, json=completion(
            prompt=token_prompt(8), max_tokens=MAX_LEN - 9, ignore_eos=True, stream=True)) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # the first token is out: go away
    wait_until(lambda: _counted(metrics(url)) == before + 1, BOUND_S, "the request to be counted")
    assert idle(url)["questkv_kv_pages_free"] == server["start"]["questkv_kv_pages_free"]


# ---- at the end ----------------------------------------------------------------------------------------------------

def test_at_the_end_the_pool_is_idle_and_every_request_is_counted_once(server):
    url = server["url"]
    wait_until(lambda: _counted(metrics(url)) - server["counted"] == SENT[0], BOUND_S,
               f"{SENT[0]} requests counted in questkv_requests_total")
    end = idle(url)
    assert end["questkv_kv_pages_free"] == server["start"]["questkv_kv_pages_free"]
    assert end['questkv_requests_total{status="error"}'] == 0, "a bad request became a 500"
    healthy(url)
