"""Bad requests: each gets its 4xx and an OpenAI-style error object naming the bad field, changes no engine state,
and a good request right after it succeeds.

The server is the shared one of ``conftest.py`` (max_model_len 128, Quest budget 16 in pages of 4).
"""

from __future__ import annotations

import random

import httpx
import openai
import pytest

from tests.server.conftest import BUDGET, MAX_LEN, MODEL_NAME, VOCAB, idle, text_prompt, token_prompt

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def completion(**fields):
    return {"model": MODEL_NAME, "prompt": token_prompt(10), "max_tokens": 4, **fields}


def chat(**fields):
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": text_prompt(8)}], "max_tokens": 4, **fields}


# (case, path, JSON body or raw bytes, status, a word the error's param must hold, or None: any param)
BAD = [
    ("malformed JSON", COMPLETIONS, b'{"model": "tiny-llama", "prompt": [5, 6', 400, None),
    ("a JSON array body", COMPLETIONS, b"[1, 2]", 400, None),
    ("max_tokens of the wrong type", COMPLETIONS, completion(max_tokens="many"), 400, "max_tokens"),
    ("a prompt of the wrong type", COMPLETIONS, completion(prompt=5), 400, "prompt"),
    ("temperature of the wrong type", COMPLETIONS, completion(temperature="hot"), 400, "temperature"),
    ("messages of the wrong type", CHAT, chat(messages="hello"), 400, "messages"),
    ("a message without content", CHAT, chat(messages=[{"role": "user"}]), 400, "messages"),
    ("stream of the wrong type", COMPLETIONS, completion(stream="yes please"), 400, "stream"),
    ("an unknown field inside quest", COMPLETIONS, completion(quest={"token_budget": 8, "budget": 8}), 400, "quest"),
    ("quest of the wrong type", COMPLETIONS, completion(quest=8), 400, "quest"),
    ("quest dense with a budget", COMPLETIONS, completion(quest={"dense": True, "token_budget": 8}), 400, "quest"),
    ("max_tokens 0", COMPLETIONS, completion(max_tokens=0), 400, "max_tokens"),
    ("max_tokens negative", CHAT, chat(max_tokens=-3), 400, "max_tokens"),
    ("max_tokens beyond the context", COMPLETIONS, completion(max_tokens=MAX_LEN), 400, "max_tokens"),
    ("a prompt longer than max_model_len", COMPLETIONS, completion(prompt=token_prompt(MAX_LEN + 10)), 400, "prompt"),
    ("messages longer than max_model_len", CHAT, chat(messages=[{"role": "user", "content": text_prompt(MAX_LEN)}]),
     400, "messages"),
    ("an empty prompt", COMPLETIONS, completion(prompt=""), 400, "prompt"),
    ("token ids outside the vocabulary", COMPLETIONS, completion(prompt=[5, VOCAB + 3]), 400, "prompt"),
    ("no prompt", COMPLETIONS, {"model": MODEL_NAME, "max_tokens": 4}, 400, "prompt"),
    ("a budget not a multiple of the page size", COMPLETIONS, completion(quest={"token_budget": 6}), 400,
     "token_budget"),
    ("a budget above the maximum", CHAT, chat(quest={"token_budget": 2 * BUDGET}), 400, "token_budget"),
    ("a budget of zero", COMPLETIONS, completion(quest={"token_budget": 0}), 400, "token_budget"),
    ("top_p above one", COMPLETIONS, completion(top_p=1.5), 400, "top_p"),
    ("a negative temperature", CHAT, chat(temperature=-1), 400, "temperature"),
    ("an unknown model", COMPLETIONS, completion(model="gpt-4"), 404, "model"),
    ("an unknown model in a chat", CHAT, chat(model="gpt-4"), 404, "model"),
    ("empty messages", CHAT, chat(messages=[]), 400, "messages"),
    ("n = 2", COMPLETIONS, completion(n=2), 400, "n"),
    ("n = 2 in a chat", CHAT, chat(n=2), 400, "n"),
    ("a streamed request with n = 2", COMPLETIONS, completion(n=2, stream=True), 400, "n"),
]


def check_error(response: httpx.Response, status: int, param) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert error["type"] == "invalid_request_error", error
    if param is not None:
        assert isinstance(error["param"], str) and param in error["param"], error
    return error


def good_request_succeeds(url: str) -> None:
    response = httpx.post(url + COMPLETIONS, json=completion(max_tokens=2, temperature=0), timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


@pytest.fixture(scope="module")
def start_state(server):
    return idle(server)


@pytest.mark.parametrize("case,path,body,status,param", BAD, ids=[case[0] for case in BAD])
def test_a_bad_request_gets_its_4xx_and_an_error_object_naming_the_field(server, start_state, case, path, body,
                                                                          status, param):
    if isinstance(body, bytes):
        response = httpx.post(server + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        response = httpx.post(server + path, json=body, timeout=30)
    check_error(response, status, param)
    good_request_succeeds(server)


def test_an_unknown_model_names_the_served_model_in_the_message(server):
    error = check_error(httpx.post(server + COMPLETIONS, json=completion(model="gpt-4"), timeout=30), 404, "model")
    assert "gpt-4" in error["message"] and MODEL_NAME in error["message"]


def test_the_budget_error_says_what_is_allowed(server):
    budget = random.choice([6, 10, 2 * BUDGET])
    error = check_error(httpx.post(server + COMPLETIONS, json=completion(quest={"token_budget": budget}), timeout=30),
                        400, "token_budget")
    assert str(budget) in error["message"] and str(BUDGET) in error["message"]


def test_the_openai_client_raises_bad_request_with_the_error_body(server):
    api = openai.OpenAI(base_url=server + "/v1", api_key="x", timeout=30, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model=MODEL_NAME, prompt=text_prompt(5), max_tokens=0)
    assert "max_tokens" in info.value.body["param"]
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x05"}])


def test_bad_requests_change_no_engine_state(server, start_state):
    # runs after the table (same module): every rejected request left the pool and the queues as they were
    end = idle(server)
    assert end["questkv_kv_pages_free"] == start_state["questkv_kv_pages_free"]
    assert end["questkv_kv_pages_used"] == start_state["questkv_kv_pages_used"]
    good_request_succeeds(server)
