"""Request preparation (parse, validate, tokenise) off the event loop: a small request is answered while a large
body's tokenisation is still under way, in-process over the ASGI transport with a tokenizer that blocks until told
(the test waits for states, never for a duration).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from questkv.config import QuestConfig
from questkv.engine.engine_config import EngineConfig
from questkv.engine.llm_engine import LLMEngine
from questkv.server.app import build_app
from questkv.server.engine_loop import EngineLoop
from tests.helpers import tiny_config
from tests.server.test_serving_inprocess import BOUND_S, BlockingTokenizer

_ENGINE = dict(load_format="dummy", device="cpu", dtype="float32", max_model_len=64, kv_cache_memory=1 << 20,
               max_num_seqs=4)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model=tiny_config("llama3"), quest=QuestConfig(token_budget=8, page_size=4,
                                                                                 dense_layers=1), **_ENGINE))


def _body(prompt: str) -> bytes:
    return json.dumps({"prompt": prompt, "max_tokens": 2, "temperature": 0}).encode()


def test_a_small_request_is_answered_while_a_large_body_is_still_being_tokenized(engine, monkeypatch):
    tokenizer = BlockingTokenizer()  # a prompt starting with "block" waits for tokenizer.release
    large, small = _body("block " + "w " * 40), _body("two words")

    async def run():
        loop = EngineLoop(engine)
        loop.start()
        app = build_app(loop, "tiny")
        serving = app.state.serving
        monkeypatch.setattr(serving, "tokenizer", tokenizer)
        monkeypatch.setattr(serving, "large_body_bytes", len(large))  # the large body and no smaller one
        headers = {"content-type": "application/json"}
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                         timeout=2 * BOUND_S) as client:
                blocked = asyncio.create_task(client.post("/v1/completions", content=large, headers=headers))
                entered = await asyncio.to_thread(tokenizer.entered.wait, BOUND_S)
                assert entered, "the large body never reached the tokenizer"
                answered = await client.post("/v1/completions", content=small, headers=headers)
                large_done_first = blocked.done()  # it cannot finish before the release
                tokenizer.release.set()
                released = await blocked
        finally:
            tokenizer.release.set()
            serving.close()
            await loop.shutdown(1.0)
        return answered, large_done_first, released

    answered, large_done_first, released = asyncio.run(run())
    assert answered.status_code == 200, answered.text
    assert answered.json()["usage"]["prompt_tokens"] == 2
    assert not large_done_first
    assert released.status_code == 200, released.text
    assert released.json()["usage"]["prompt_tokens"] == 41
