"""Unit tests of the server's protocol models and engine loop, in-process (no server process, no HTTP socket).

The end-to-end tests (a real server process, real clients) are the other files of tests/server/.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from questkv.config import QuestConfig
from questkv.engine.engine_config import EngineConfig
from questkv.engine.llm import LLM
from questkv.engine.llm_engine import LLMEngine
from questkv.engine.sampling_params import SamplingParams
from questkv.engine.sequence import RequestOutput
from questkv.server import protocol
from questkv.server.app import build_app
from questkv.server.engine_loop import ACCEPTED, EngineFailure, EngineLoop, QueueFull
from questkv.server.protocol import ChatCompletionRequest, CompletionRequest, RequestError
from tests.helpers import tiny_config

_QUEST = dict(token_budget=8, page_size=4, dense_layers=1)
_ENGINE = dict(load_format="dummy", device="cpu", dtype="float32", max_model_len=64, kv_cache_memory=1 << 20,
               max_num_seqs=4)


def _parse(model, body):
    return protocol.parse_request(model, json.dumps(body).encode())


def _refusal(model, body) -> RequestError:
    with pytest.raises(RequestError) as info:
        _parse(model, body)
    return info.value


# ---- protocol ------------------------------------------------------------------------------------------------------


def test_a_completion_request_takes_a_string_or_token_ids_and_the_quest_extension():
    ids = [random.randrange(100) for _ in range(random.randint(1, 9))]
    body = _parse(CompletionRequest, {"prompt": ids, "max_tokens": 3, "quest": {"token_budget": 64}, "stop": "x"})
    assert body.prompt == ids and body.quest.token_budget == 64 and body.stop_list == ("x",)
    assert _parse(CompletionRequest, {"prompt": "hi", "quest": {"dense": True}}).quest.dense


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "x", "quest": {"budget": 64}}, "quest.budget"),
    ({"prompt": "x", "quest": {"token_budget": 64.0}}, "quest.token_budget"),
    ({"prompt": "x", "quest": {"selection_interval": 2.0}}, "quest.selection_interval"),
    ({"prompt": "x", "quest": {"dense": "yes"}}, "quest.dense"),
    ({"prompt": "x", "max_token": 5}, "max_token"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": -1}, "logprobs"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),
    ({"prompt": "x", "top_logprobs": 2}, "top_logprobs"),
    ({}, "prompt"),
])
def test_a_bad_completion_field_is_refused_naming_it(body, param):
    error = _refusal(CompletionRequest, body)
    assert error.status == 400 and error.param == param and error.type == "invalid_request_error"


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 3}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 2}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
])
def test_a_bad_chat_field_is_refused_naming_it(body, param):
    assert _refusal(ChatCompletionRequest, body).param == param


def test_malformed_json_and_a_non_object_body_are_refused():
    for raw in (b"{bad", b"[1, 2]", b"\xff"):
        with pytest.raises(RequestError) as info:
            protocol.parse_request(CompletionRequest, raw)
        assert info.value.status == 400 and info.value.param is None


def test_chat_text_parts_are_joined_and_max_completion_tokens_is_max_tokens():
    words = [f"w{random.randrange(1000)}" for _ in range(3)]
    body = _parse(ChatCompletionRequest, {"messages": [{"role": "developer", "content": [
        {"type": "text", "text": word} for word in words]}], "max_completion_tokens": 7})
    assert body.max_tokens == 7
    assert body.message_dicts() == [{"role": "system", "content": "".join(words)}]


# ---- engine loop and app, on a tiny random model -------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model=tiny_config("llama3"), quest=QuestConfig(**_QUEST), **_ENGINE))


def _prompt(length: int) -> list[int]:
    return [random.randrange(96) for _ in range(length)]


async def _collect(stream) -> list:
    events = []
    while not events or isinstance(events[-1], str) or (isinstance(events[-1], RequestOutput) and not events[-1].finished):
        events.append(await stream.get(30))
        if isinstance(events[-1], Exception):
            break
    return events


def test_the_loop_serves_mixed_budgets_like_llm_generate_and_frees_every_page(engine):
    prompts = [_prompt(random.randint(5, 20)) for _ in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, **knob)
              for knob in ({}, {"dense": True}, {"token_budget": 4}, {"token_budget": 8})]

    async def run():
        loop = EngineLoop(engine)
        loop.start()
        free = engine.cache.num_free_pages
        streams = [loop.submit(f"r{i}", p, q) for i, (p, q) in enumerate(zip(prompts, params))]
        results = await asyncio.gather(*[_collect(s) for s in streams])
        await loop.shutdown(1.0)
        return results, free

    results, free = asyncio.run(run())
    llm = LLM(tiny_config("llama3"), quest=QuestConfig(**_QUEST), **_ENGINE)
    expected = llm.generate(prompts, params, use_tqdm=False)
    for events, want in zip(results, expected):
        assert events[0] == ACCEPTED
        assert events[-1].token_ids == want.token_ids
    assert engine.cache.num_free_pages == free


def test_a_scrape_reads_between_two_publishes_of_the_pool_and_queue_counts(engine, monkeypatch):
    """The loop sets a step's counts under the metrics' lock and a scrape renders under it: a scrape that finds
    nothing running finds the pages the last request freed too (no scrape between the two gauges' updates)."""
    loop = EngineLoop(engine)
    metrics, held = loop.metrics, []
    for gauge in (metrics.running, metrics.waiting, metrics.pages_free, metrics.pages_used):
        set_value = gauge.set
        monkeypatch.setattr(gauge, "set", lambda value, set_value=set_value: (held.append(metrics.lock.locked()),
                                                                               set_value(value)))

    async def run():
        loop.start()
        events = await _collect(loop.submit("r0", _prompt(12), SamplingParams(temperature=0, max_tokens=4)))
        await loop.shutdown(1.0)
        return events

    assert isinstance(asyncio.run(run())[-1], RequestOutput)
    assert held and all(held)

    class CountingLock:
        entered = 0

        def __enter__(self):
            CountingLock.entered += 1

        def __exit__(self, *exc):
            return False

    metrics.lock = CountingLock()
    assert b"questkv_kv_pages_free" in metrics.render()[0] and CountingLock.entered == 1


def _fail_once(engine, monkeypatch, call: int) -> None:
    """Make the ``call``-th step that ``engine``'s runner executes raise."""
    execute, calls = engine.runner.execute, {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == call:
            raise RuntimeError("injected fault")
        return execute(batch)

    monkeypatch.setattr(engine.runner, "execute", flaky)


def _bad_then_good(engine, bad_prompt, good_prompt):
    """Serve a request that meets the fault, then one after it: both event streams and the loop's stats."""
    async def run():
        loop = EngineLoop(engine)
        loop.start()
        first = await _collect(loop.submit("bad", bad_prompt, SamplingParams(temperature=0, max_tokens=3)))
        second = await _collect(loop.submit("good", good_prompt, SamplingParams(temperature=0, max_tokens=3,
                                                                             ignore_eos=True)))
        stats = dict(loop.stats)
        await loop.shutdown(1.0)
        return first, second, stats

    return asyncio.run(run())


def test_a_failing_step_fails_its_requests_and_the_loop_keeps_serving(engine, monkeypatch):
    _fail_once(engine, monkeypatch, 1)
    free = engine.cache.num_free_pages
    first, second, stats = _bad_then_good(engine, _prompt(6), _prompt(6))
    assert isinstance(first[-1], EngineFailure)
    assert second[-1].finished and len(second[-1].token_ids) == 3
    assert stats["requests_running"] == 0 and engine.cache.num_free_pages == free


def test_a_failing_chunk_step_fails_the_request_being_prefilled_and_the_loop_keeps_serving(monkeypatch):
    engine = LLMEngine(EngineConfig(model=tiny_config("llama3"), quest=QuestConfig(**_QUEST),
                                    **{**_ENGINE, "max_num_batched_tokens": 8}))
    _fail_once(engine, monkeypatch, 2)  # the second chunk of the 30-token prompt: no token is in flight for it
    free = engine.cache.num_free_pages
    first, second, _ = _bad_then_good(engine, _prompt(30), _prompt(20))
    assert isinstance(first[-1], EngineFailure) and engine.scheduler.prefilling is None
    assert second[-1].finished and len(second[-1].token_ids) == 3
    assert engine.cache.num_free_pages == free


def test_an_aborted_request_frees_its_pages_and_a_full_queue_is_refused(engine):
    async def run():
        loop = EngineLoop(engine, max_waiting=1)
        loop.start()
        free = engine.cache.num_free_pages
        stream = loop.submit("long", _prompt(8), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
        with pytest.raises(QueueFull):
            loop.submit("over", _prompt(4), SamplingParams())
        while not isinstance(await stream.get(30), RequestOutput):
            pass
        stream.close()
        deadline = time.monotonic() + 30.0  # a bound on a hang, not a timing assumption
        while loop.stats["requests_running"] and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        stats = dict(loop.stats)
        await loop.shutdown(1.0)
        return stats, free

    stats, free = asyncio.run(run())
    assert stats["requests_running"] == 0 and stats["kv_pages_free"] == free


def test_the_app_answers_a_completion_and_refuses_what_the_engine_cannot_run(engine):
    prompt = _prompt(7)

    async def run():
        loop = EngineLoop(engine)
        loop.start()
        app = build_app(loop, "tiny")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            good = await client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                                              "temperature": 0, "quest": {"token_budget": 4}})
            bad = {
                "model": await client.post("/v1/completions", json={"model": "other", "prompt": prompt}),
                "max_tokens": await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 60}),
                "prompt": await client.post("/v1/completions", json={"prompt": _prompt(64)}),
                "quest.token_budget": await client.post("/v1/completions",
                                                        json={"prompt": prompt, "quest": {"token_budget": 6}}),
                "quest.selection_interval": await client.post(  # above the engine's (1)
                    "/v1/completions", json={"prompt": prompt, "quest": {"selection_interval": 2}}),
                "quest.dense": await client.post(  # the engine's rule (RequestQuest.resolve), as for SamplingParams
                    "/v1/completions", json={"prompt": prompt, "quest": {"dense": True, "token_budget": 4}}),
                "quest.selection_interval_0": await client.post(
                    "/v1/completions", json={"prompt": prompt, "quest": {"selection_interval": 0}}),
                "messages": await client.post("/v1/chat/completions",
                                              json={"messages": [{"role": "user", "content": "x"}]}),
            }
            metrics = (await client.get("/metrics")).text
        await loop.shutdown(1.0)
        return good, bad, metrics

    good, bad, metrics = asyncio.run(run())
    body = good.json()
    assert good.status_code == 200, body
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": body["usage"]["completion_tokens"],
                             "total_tokens": 7 + body["usage"]["completion_tokens"],
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert body["quest"]["token_budget"] == 4 and body["quest"]["dense"] is False
    for param, response in bad.items():
        assert response.status_code == (404 if param == "model" else 400), response.text
        assert response.json()["error"]["param"] == param.removesuffix("_0")
    assert bad["quest.dense"].json()["error"]["message"] == (
        "quest.dense=True attends every page; it excludes token_budget=4")
    assert bad["quest.selection_interval_0"].json()["error"]["message"] == (
        "quest.selection_interval must be >= 1, got 0")
    assert 'questkv_requests_total{status="invalid"} 8.0' in metrics


def test_ignore_eos_is_accepted_as_vllms_extension_and_must_be_a_bool():
    from questkv.server.protocol import CompletionRequest, RequestError, parse_request

    assert parse_request(CompletionRequest, b'{"prompt": "x", "ignore_eos": true}').ignore_eos is True
    with pytest.raises(RequestError) as error:
        parse_request(CompletionRequest, b'{"prompt": "x", "ignore_eos": "yes"}')
    assert error.value.param == "ignore_eos"


def test_a_server_without_a_tokenizer_streams_every_token_id_once_in_order(engine):
    prompt = _prompt(random.randint(5, 12))
    max_tokens = random.randint(3, 6)
    request = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}

    async def run():
        loop = EngineLoop(engine)
        loop.start()
        app = build_app(loop, "tiny")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            whole = await client.post("/v1/completions", json=request)
            streamed = await client.post("/v1/completions", json={**request, "stream": True})
        await loop.shutdown(1.0)
        return whole, streamed

    whole, streamed = asyncio.run(run())
    llm = LLM(tiny_config("llama3"), quest=QuestConfig(**_QUEST), **_ENGINE)
    want = list(llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                             use_tqdm=False)[0].token_ids)
    assert whole.status_code == 200 and whole.json()["choices"][0]["token_ids"] == want
    chunks = [json.loads(line[len("data: "):]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    per_chunk = [chunk["choices"][0]["token_ids"] for chunk in chunks if chunk["choices"]]
    # A chunk carries the tokens the engine produced since the last one the client read: one each while the reader
    # keeps up, several after a stall (which a loaded machine may cause), never a token twice or out of order.
    assert [token for ids in per_chunk for token in ids] == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_return_token_ids_is_vllms_extension_and_must_be_a_bool():
    assert _parse(CompletionRequest, {"prompt": "x", "return_token_ids": True}).return_token_ids is True
    assert _refusal(CompletionRequest, {"prompt": "x", "return_token_ids": 1}).param == "return_token_ids"
