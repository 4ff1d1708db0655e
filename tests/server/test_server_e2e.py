"""The server end to end: completions and chat, streamed and not, from the official ``openai`` client and raw HTTP,
against the in-process engine of the same folder and flags; 64 concurrent streaming clients with mixed Quest
budgets, 16 of which disconnect part way.

Every request is greedy (or seeded) in fp32, so the served text must equal ``LLM.generate`` of the same request
exactly; prompts are fresh random words or token ids in every test.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import openai
import pytest

from questkv.engine.sampling_params import SamplingParams
from tests.server.conftest import (
    BUDGET, MAX_LEN, MAX_NUM_SEQS, MODEL_NAME, PAGE, chunk_text, idle, metrics, sse_events, text_prompt, token_prompt,
    wait_until,
)

QUESTS = [None, {"dense": True}, {"token_budget": 4}, {"token_budget": 8}, {"token_budget": 12},
          {"token_budget": BUDGET}]
CLIENT_TIMEOUT_S = 60.0  # one request; the 64-client runs are bounded as a whole too
LOAD_TIMEOUT_S = 90.0


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=CLIENT_TIMEOUT_S, max_retries=0)


def params(quest, **kwargs) -> SamplingParams:
    """The engine's SamplingParams of a request with the ``quest`` extension ``quest`` (greedy by default)."""
    kwargs = {"temperature": 0.0, **kwargs}
    if quest is not None and quest.get("dense"):
        kwargs["dense"] = True
    elif quest is not None:
        kwargs.update(quest)  # token_budget, selection_interval
    return SamplingParams(**kwargs)


def reference(llm, prompt, quest=None, **kwargs):
    """``LLM.generate`` of one request alone."""
    (out,) = llm.generate([prompt], params(quest, **kwargs), use_tqdm=False)
    return out


def chat_prompt(llm, messages) -> str:
    return llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def expected_quest(quest) -> dict:
    """What the response's ``quest`` object echoes for a request's ``quest`` field (without the mean)."""
    if quest is not None and quest.get("dense"):
        return {"token_budget": None, "dense": True, "selection_interval": None}
    quest = quest or {}
    return {"token_budget": quest.get("token_budget", BUDGET), "dense": False,
            "selection_interval": quest.get("selection_interval", 1)}


def check_quest_echo(echo, quest, ref) -> None:
    assert echo is not None, "the final response carries no quest object"
    assert {k: echo[k] for k in ("token_budget", "dense", "selection_interval")} == expected_quest(quest)
    if ref.metrics.mean_tokens_attended is None:  # the first token ended it: no decode step, documented as 0.0
        assert echo["mean_tokens_attended"] == 0.0, echo
    else:
        assert echo["mean_tokens_attended"] == pytest.approx(ref.metrics.mean_tokens_attended, rel=1e-6)


def finish_reason(ref) -> str:
    return ref.finish_reason  # "stop" or "length", spelled as OpenAI does


def num_prompt_tokens(llm, prompt) -> int:
    return len(prompt) if isinstance(prompt, list) else len(llm.tokenizer(prompt)["input_ids"])


# ---------------------------------------------------------------------------------------------------------------
# One request at a time
# ---------------------------------------------------------------------------------------------------------------


def test_health_and_models_list_the_served_model(server):
    assert httpx.get(server + "/health", timeout=10).status_code == 200
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    body = httpx.get(server + "/v1/models", timeout=10).json()
    assert body["object"] == "list" and body["data"][0]["object"] == "model" and body["data"][0]["id"] == MODEL_NAME


@pytest.mark.parametrize("quest", [None, {"dense": True}, {"token_budget": 8}], ids=["default", "dense", "budget 8"])
def test_a_greedy_completion_from_the_openai_client_equals_llm_generate(server, reference_llm, quest):
    prompt = text_prompt(random.randint(20, 60))
    max_tokens = random.randint(4, 16)
    ref = reference(reference_llm, prompt, quest, max_tokens=max_tokens)
    extra = {} if quest is None else {"extra_body": {"quest": quest}}
    out = client(server).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                            **extra)
    assert out.object == "text_completion" and out.model == MODEL_NAME and out.id
    (choice,) = out.choices
    assert choice.index == 0 and choice.text == ref.text and choice.finish_reason == finish_reason(ref)
    assert choice.logprobs is None
    assert out.usage.prompt_tokens == num_prompt_tokens(reference_llm, prompt)
    assert out.usage.completion_tokens == len(ref.token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    check_quest_echo(out.model_extra.get("quest"), quest, ref)


def test_a_completion_of_token_ids_over_raw_http_equals_llm_generate(server, reference_llm):
    prompt = token_prompt(random.randint(17, 60))
    max_tokens = random.randint(2, 16)
    ref = reference(reference_llm, prompt, max_tokens=max_tokens)
    response = httpx.post(server + "/v1/completions", timeout=CLIENT_TIMEOUT_S, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert body["object"] == "text_completion" and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": ref.text, "finish_reason": finish_reason(ref), "logprobs": None}]
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]  # whole pages hit by earlier tests' prompts
    assert cached % PAGE == 0 and 0 <= cached < len(prompt)
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(ref.token_ids),
                             "total_tokens": len(prompt) + len(ref.token_ids),
                             "prompt_tokens_details": {"cached_tokens": cached}}
    check_quest_echo(body["quest"], None, ref)


def test_a_streamed_completion_over_raw_http_is_server_sent_events_ending_in_done(server, reference_llm):
    prompt = text_prompt(random.randint(20, 60))
    max_tokens = random.randint(6, 16)
    quest = {"token_budget": random.choice([4, 8, 12])}
    ref = reference(reference_llm, prompt, quest, max_tokens=max_tokens)
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "quest": quest}
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=CLIENT_TIMEOUT_S) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(list(response.iter_lines()))
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "text_completion" for c in chunks)
    assert all(c["model"] == MODEL_NAME for c in chunks)
    *choice_chunks, usage_chunk = chunks
    cached = usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == {
        "prompt_tokens": num_prompt_tokens(reference_llm, prompt), "completion_tokens": len(ref.token_ids),
        "total_tokens": num_prompt_tokens(reference_llm, prompt) + len(ref.token_ids),
        "prompt_tokens_details": {"cached_tokens": cached}}
    assert cached % PAGE == 0 and 0 <= cached < num_prompt_tokens(reference_llm, prompt)
    assert all(c.get("usage") is None for c in choice_chunks)  # usage only in the extra last chunk
    assert "".join(chunk_text(c) for c in choice_chunks) == ref.text
    reasons = [c["choices"][0]["finish_reason"] for c in choice_chunks]
    assert reasons[-1] == finish_reason(ref) and all(r is None for r in reasons[:-1])
    echo = [c["quest"] for c in chunks if c.get("quest") is not None]
    assert echo, "no chunk carries the quest object"
    check_quest_echo(echo[-1], quest, ref)


def test_a_repeated_prompt_reports_its_prefix_cache_hit_as_cached_tokens(server):
    prompt = token_prompt(4 * PAGE + 2)  # fresh random ids: the first request finds nothing cached
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 3, "temperature": 0}
    first = httpx.post(server + "/v1/completions", json=body, timeout=CLIENT_TIMEOUT_S).json()
    second = httpx.post(server + "/v1/completions", json=body, timeout=CLIENT_TIMEOUT_S).json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 4 * PAGE}  # whole pages
    # The openai client reads it, in the final usage chunk of a stream too; a chat request over the same engine.
    stream = client(server).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3, temperature=0,
                                               stream=True, stream_options={"include_usage": True})
    assert list(stream)[-1].usage.prompt_tokens_details.cached_tokens == 4 * PAGE
    messages = [{"role": "user", "content": text_prompt(40)}]
    chat = [client(server).chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2, temperature=0)
            for _ in range(2)]
    prompt_tokens = chat[1].usage.prompt_tokens
    assert chat[1].usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // PAGE * PAGE


def test_a_stream_without_include_usage_has_no_usage_chunk(server, reference_llm):
    prompt = token_prompt(random.randint(17, 40))
    ref = reference(reference_llm, prompt, max_tokens=5)
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=CLIENT_TIMEOUT_S) as response:
        events = sse_events(list(response.iter_lines()))
    assert all(c["choices"] for c in events[:-1]) and all(c.get("usage") is None for c in events[:-1])
    assert "".join(chunk_text(c) for c in events[:-1]) == ref.text


def test_a_streamed_completion_from_the_openai_client_reports_usage_last(server, reference_llm):
    prompt = text_prompt(random.randint(20, 60))
    max_tokens = random.randint(4, 16)
    ref = reference(reference_llm, prompt, {"dense": True}, max_tokens=max_tokens)
    stream = client(server).completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"quest": {"dense": True}})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert chunks[-1].usage.prompt_tokens == num_prompt_tokens(reference_llm, prompt)


def test_a_greedy_chat_completion_equals_llm_generate_of_the_chat_template(server, reference_llm):
    messages = [{"role": "system", "content": text_prompt(random.randint(3, 10))},
                {"role": "user", "content": text_prompt(random.randint(15, 40))}]
    prompt = chat_prompt(reference_llm, messages)
    max_tokens = random.randint(4, 16)
    ref = reference(reference_llm, prompt, max_tokens=max_tokens)
    out = client(server).chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=max_tokens,
                                                 temperature=0)
    assert out.object == "chat.completion" and out.model == MODEL_NAME
    (choice,) = out.choices
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert choice.finish_reason == finish_reason(ref)
    assert out.usage.prompt_tokens == num_prompt_tokens(reference_llm, prompt)
    assert out.usage.completion_tokens == len(ref.token_ids)
    check_quest_echo(out.model_extra.get("quest"), None, ref)


def test_a_streamed_chat_completion_sends_the_role_first_and_usage_last(server, reference_llm):
    messages = [{"role": "user", "content": text_prompt(random.randint(15, 40))}]
    prompt = chat_prompt(reference_llm, messages)
    max_tokens = random.randint(4, 16)
    quest = {"token_budget": 8}
    ref = reference(reference_llm, prompt, quest, max_tokens=max_tokens)
    stream = client(server).chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"quest": quest})
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks) and len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish_reason(ref)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert chunks[-1].usage.prompt_tokens == num_prompt_tokens(reference_llm, prompt)
    echo = [c.model_extra["quest"] for c in chunks if c.model_extra.get("quest") is not None]
    assert echo, "no chunk carries the quest object"
    check_quest_echo(echo[-1], quest, ref)


def test_completion_logprobs_are_the_engines_with_token_texts_and_offsets(server, reference_llm):
    prompt = text_prompt(random.randint(20, 60))
    max_tokens = random.randint(4, 12)
    ref = reference(reference_llm, prompt, max_tokens=max_tokens, logprobs=3)
    out = client(server).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                            logprobs=3)
    logprobs = out.choices[0].logprobs
    texts = [reference_llm.tokenizer.decode([t]) for t in ref.token_ids]
    assert logprobs.tokens == texts
    assert logprobs.token_logprobs == pytest.approx([e[t].logprob for e, t in zip(ref.logprobs, ref.token_ids)],
                                                    abs=1e-5)
    assert logprobs.text_offset == [sum(map(len, texts[:i])) for i in range(len(texts))]
    for top, entry in zip(logprobs.top_logprobs, ref.logprobs):  # the output token and the 3 most likely
        assert top == pytest.approx({reference_llm.tokenizer.decode([t]): lp.logprob for t, lp in entry.items()},
                                    abs=1e-5)


def test_chat_logprobs_and_their_stream_are_the_engines(server, reference_llm):
    messages = [{"role": "user", "content": text_prompt(random.randint(15, 40))}]
    prompt = chat_prompt(reference_llm, messages)
    max_tokens = random.randint(4, 12)
    ref = reference(reference_llm, prompt, max_tokens=max_tokens, logprobs=2)
    out = client(server).chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=max_tokens,
                                                 temperature=0, logprobs=True, top_logprobs=2)
    stream = client(server).chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=max_tokens,
                                                    temperature=0, logprobs=True, top_logprobs=2, stream=True)
    streamed = [item for c in stream if c.choices and c.choices[0].logprobs for item in c.choices[0].logprobs.content]
    for content in (out.choices[0].logprobs.content, streamed):
        assert [item.token for item in content] == [reference_llm.tokenizer.decode([t]) for t in ref.token_ids]
        for item, entry, token in zip(content, ref.logprobs, ref.token_ids):
            assert item.logprob == pytest.approx(entry[token].logprob, abs=1e-5)
            assert item.bytes == list(item.token.encode("utf-8"))
            best = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank <= 2)
            assert [top.token for top in item.top_logprobs] == [reference_llm.tokenizer.decode([t]) for _, t in best]


def test_a_streamed_completion_carries_every_tokens_logprobs_once(server, reference_llm):
    prompt = token_prompt(random.randint(17, 50))
    ref = reference(reference_llm, prompt, max_tokens=10, logprobs=0)
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 10, "temperature": 0, "stream": True, "logprobs": 0}
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=CLIENT_TIMEOUT_S) as response:
        events = sse_events(list(response.iter_lines()))
    parts = [c["choices"][0]["logprobs"] for c in events[:-1] if c["choices"][0]["logprobs"] is not None]
    assert [lp for part in parts for lp in part["token_logprobs"]] == pytest.approx(
        [e[t].logprob for e, t in zip(ref.logprobs, ref.token_ids)], abs=1e-5)
    assert all(len(top) == 1 for part in parts for top in part["top_logprobs"])  # logprobs=0: the token's own
    texts = [text for part in parts for text in part["tokens"]]
    assert [o for part in parts for o in part["text_offset"]] == [sum(map(len, texts[:i])) for i in range(len(texts))]


def test_a_seeded_sampled_completion_equals_llm_generate_with_the_same_seed(server, reference_llm):
    prompt = token_prompt(random.randint(17, 50))
    seed = random.randrange(1 << 30)
    ref = reference(reference_llm, prompt, temperature=1.0, top_p=0.9, seed=seed, max_tokens=12)
    out = client(server).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=1.0,
                                            top_p=0.9, seed=seed)
    assert out.choices[0].text == ref.text and out.usage.completion_tokens == len(ref.token_ids)


def test_a_stop_string_cuts_the_text_as_llm_generate_does(server, reference_llm):
    for _ in range(10):  # a prompt whose greedy text has three words or more
        prompt = text_prompt(random.randint(20, 50))
        words = reference(reference_llm, prompt, max_tokens=16).text.split()
        if len(words) >= 3:
            break
    else:
        pytest.skip("the random model ended ten texts within two words")
    stop = words[len(words) // 2]
    ref = reference(reference_llm, prompt, max_tokens=16, stop=[stop])
    out = client(server).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0,
                                            stop=[stop])
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == len(ref.token_ids)


# ---------------------------------------------------------------------------------------------------------------
# Many clients at once
# ---------------------------------------------------------------------------------------------------------------


def random_requests(llm, count: int, max_tokens: tuple[int, int] = (8, 16),
                    long: frozenset[int] = frozenset()) -> list[dict]:
    """``count`` requests: completions of token ids or text and chats, each with a quest choice of
    :data:`QUESTS` (cycled), prompts of 17..60 tokens (longer than the budget 16); with each request's
    reference ``LLM.generate`` run alone. The requests of index in ``long`` ignore the end of sequence and run
    to ``max_model_len``: a client that leaves one of them early leaves long before it could end."""
    requests = []
    for i in range(count):
        quest = QUESTS[i % len(QUESTS)]
        kind = random.choice(["ids", "text", "chat"])
        n = random.randint(17, 60)
        body = {"model": MODEL_NAME, "max_tokens": random.randint(*max_tokens), "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        if quest is not None:
            body["quest"] = quest
        if kind == "chat":
            messages = [{"role": "user", "content": text_prompt(n)}]
            body["messages"], prompt, path = messages, chat_prompt(llm, messages), "/v1/chat/completions"
        else:
            prompt = token_prompt(n) if kind == "ids" else text_prompt(n)
            body["prompt"], path = prompt, "/v1/completions"
        prompt_tokens = num_prompt_tokens(llm, prompt)
        if i in long:  # never read to its end: no reference run
            body["max_tokens"], body["ignore_eos"], ref = MAX_LEN - prompt_tokens, True, None
        else:
            ref = reference(llm, prompt, quest, max_tokens=body["max_tokens"])
        requests.append({"path": path, "body": body, "quest": quest, "ref": ref, "prompt_tokens": prompt_tokens})
    return requests


async def stream_one(http: httpx.AsyncClient, request: dict, stop_after=None) -> dict:
    """One streaming request; closes the stream after ``stop_after`` data chunks when given.

    Returns ``{"events": the parsed chunks, "done": True}`` for a stream read to its ``[DONE]``, else
    ``{"chunks": the data lines read, "done": False}``.
    """
    chunks, lines = [], []
    async with http.stream("POST", request["path"], json=request["body"]) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            lines.append(line)
            if line.startswith("data: {"):
                chunks.append(line)
                if stop_after is not None and len(chunks) >= stop_after:
                    return {"chunks": chunks, "done": False}  # leaving the block closes the connection
    events = sse_events(lines)
    return {"events": events[:-1], "done": True}


async def run_clients(url: str, requests: list[dict], stop_after: dict[int, int]) -> list[dict]:
    """All ``requests`` at once (``stop_after``: request index -> chunks read before disconnecting); returns
    their results."""
    limits = httpx.Limits(max_connections=len(requests) + 1, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S, limits=limits) as http:
        tasks = [stream_one(http, r, stop_after.get(i)) for i, r in enumerate(requests)]
        return await asyncio.wait_for(asyncio.gather(*tasks), LOAD_TIMEOUT_S)


def check_served_alone(result: dict, request: dict) -> None:
    """The finished stream of ``request`` equals its reference run alone, usage and quest echo included."""
    ref, events = request["ref"], result["events"]
    assert result["done"]
    assert len({e["id"] for e in events}) == 1
    *choice_chunks, usage_chunk = events
    assert "".join(chunk_text(c) for c in choice_chunks) == ref.text, request["body"]
    assert [c["choices"][0]["finish_reason"] for c in choice_chunks][-1] == finish_reason(ref)
    assert usage_chunk["usage"]["completion_tokens"] == len(ref.token_ids)
    assert usage_chunk["usage"]["prompt_tokens"] == request["prompt_tokens"]
    echo = [e["quest"] for e in events if e.get("quest") is not None]
    assert echo, "no chunk carries the quest object"
    check_quest_echo(echo[-1], request["quest"], ref)


def test_64_concurrent_streaming_clients_with_mixed_budgets_each_get_their_request_served_alone(
        server, reference_llm):
    requests = random_requests(reference_llm, MAX_NUM_SEQS)
    start = idle(server)
    results = asyncio.run(run_clients(server, requests, {}))
    ids = set()
    for result, request in zip(results, requests):
        check_served_alone(result, request)
        ids.add(result["events"][0]["id"])
    assert len(ids) == len(requests)  # one id per request: no stream got another's chunks
    end = idle(server)
    assert end["questkv_kv_pages_free"] == start["questkv_kv_pages_free"]
    assert end["questkv_generation_tokens_total"] - start["questkv_generation_tokens_total"] == sum(
        len(r["ref"].token_ids) for r in requests)


def test_16_of_64_clients_disconnecting_mid_stream_free_their_pages_and_the_rest_are_served(server, reference_llm):
    dropped = frozenset(random.sample(range(MAX_NUM_SEQS), 16))
    requests = random_requests(reference_llm, MAX_NUM_SEQS, max_tokens=(12, 16), long=dropped)
    start = idle(server)
    stop_after = {i: random.randint(1, 6) for i in dropped}
    results = asyncio.run(run_clients(server, requests, stop_after))
    for i, (result, request) in enumerate(zip(results, requests)):
        if i in dropped:  # the client read its chunks and left
            assert not result["done"] and len(result["chunks"]) == stop_after[i]
        else:
            check_served_alone(result, request)

    total = "questkv_requests_total"
    counted = {}

    def drained() -> bool:
        counted.update(metrics(server))
        return (counted["questkv_requests_running"] == 0 and counted["questkv_requests_waiting"] == 0
                and counted[total] - start[total] == len(requests))

    wait_until(drained, 30.0, "every request counted once in /metrics and none running or waiting")
    assert counted["questkv_kv_pages_free"] == start["questkv_kv_pages_free"]
    served = {status: counted[f'{total}{{status="{status}"}}'] - start[f'{total}{{status="{status}"}}']
              for status in ("stop", "length", "abort")}
    # A left request ends as "abort" when the server sees the disconnect first, else (it ran to max_model_len
    # while its client was leaving) as "length": either way it is counted once and frees its pages.
    assert sum(served.values()) == len(requests)
    assert served["abort"] <= len(dropped)
    # and the server still serves
    prompt = token_prompt(20)
    ref = reference(reference_llm, prompt, max_tokens=4)
    out = client(server).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0)
    assert out.choices[0].text == ref.text


def test_metrics_expose_the_contracts_series(server):
    text = httpx.get(server + "/metrics", timeout=10).text
    for name in ("questkv_requests_total", "questkv_prompt_tokens_total", "questkv_generation_tokens_total",
                 "questkv_requests_running", "questkv_requests_waiting", "questkv_kv_pages_used",
                 "questkv_kv_pages_free", "questkv_mean_tokens_attended", "questkv_time_to_first_token_seconds",
                 "questkv_inter_token_latency_seconds", "questkv_prefix_cache_queries_total",
                 "questkv_prefix_cache_hits_total", "questkv_prefix_cache_pages", "questkv_engine_steps_total",
                 "questkv_step_tokens_total"):
        assert name in text, f"/metrics lacks {name}"
    values = metrics(server)
    assert values["questkv_kv_pages_used"] + values["questkv_kv_pages_free"] > 0


def test_the_steps_of_a_request_are_counted_by_kind_with_their_tokens(server):
    prompt = token_prompt(37)  # random ids: no page of it is cached
    before = metrics(server)
    client(server).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0)
    after = metrics(server)
    delta = {key: after[key] - before[key] for key in after if key.startswith(("questkv_engine_steps", "questkv_step"))}
    assert delta['questkv_step_tokens_total{kind="prefill"}'] == 37
    # its first token comes from the prefill; at most 3 more, and one discarded step under asynchronous scheduling
    assert 0 <= delta['questkv_step_tokens_total{kind="decode"}'] <= 4
    assert delta['questkv_engine_steps_total{kind="prefill"}'] + delta['questkv_engine_steps_total{kind="mixed"}'] >= 1
    assert delta['questkv_engine_steps_total{kind="decode"}'] <= 4


def test_a_repeated_prompt_is_counted_as_prefix_cache_hits_and_gives_the_same_text(server, reference_llm):
    prompt = token_prompt(44)
    before = metrics(server)
    texts = [client(server).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0)
             .choices[0].text for _ in range(2)]
    after = metrics(server)
    # The second request finds the first's ten full pages (page size 4), leaving its last page to compute.
    assert after["questkv_prefix_cache_hits_total"] - before["questkv_prefix_cache_hits_total"] >= 40
    assert after["questkv_prefix_cache_queries_total"] - before["questkv_prefix_cache_queries_total"] >= 88
    assert after["questkv_prefix_cache_pages"] >= 10
    assert texts[0] == texts[1] == reference(reference_llm, prompt, max_tokens=4).text
