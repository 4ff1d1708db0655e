"""Lossless Quest through the server, in-process (the app over an :class:`EngineLoop`, no socket): the request's
``quest.speculative_tokens``, its echo, its refusals, and the ``/metrics`` counters of draft, accepted and verify.

Two tiny dummy-weight engines (no tokenizer: responses carry token ids): a lossless one (Quest drafts, dense
attention verifies), drafting its K tokens every round (``"adaptive": false``: no choice from measured step times),
and a lossy Quest one without a speculative config.
"""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from questkv.config import QuestConfig
from questkv.engine.engine_config import EngineConfig
from questkv.engine.llm_engine import LLMEngine
from questkv.server import protocol
from questkv.server.app import build_app
from questkv.server.engine_loop import EngineLoop
from questkv.server.metrics import ServerMetrics
from questkv.server.protocol import CompletionRequest, RequestError
from tests.helpers import tiny_config
from tests.server.conftest import metric_values

K = 4  # the lossless engine's draft tokens per round
# Quest wherever the context exceeds the budget (dense_context_ratio 1), so the drafts select pages
BUDGET = 16
_QUEST = QuestConfig(token_budget=BUDGET, page_size=4, dense_layers=1, dense_context_ratio=1.0)
_ENGINE = dict(load_format="dummy", device="cpu", dtype="float32", max_model_len=64, kv_cache_memory=1 << 20,
               max_num_seqs=4)
_SPEC = ("questkv_spec_decode_num_draft_tokens_total", "questkv_spec_decode_num_accepted_tokens_total",
         "questkv_spec_decode_num_verify_steps_total")
_PER_POSITION = ("questkv_spec_decode_num_draft_tokens_per_pos_total",
                 "questkv_spec_decode_num_accepted_tokens_per_pos_total")


@pytest.fixture(scope="module")
def lossless():
    return LLMEngine(EngineConfig(model=tiny_config("llama3"), quest=_QUEST, **_ENGINE, speculative_config={
        "method": "quest", "num_speculative_tokens": K, "adaptive": False}))


@pytest.fixture(scope="module")
def lossy():
    return LLMEngine(EngineConfig(model=tiny_config("llama3"), quest=_QUEST, **_ENGINE))


def _prompt(length: int) -> list[int]:
    return [random.randrange(96) for _ in range(length)]


def _serve(engine, bodies: list[dict]) -> tuple[list[httpx.Response], list[dict[str, float]]]:
    """POST each body to ``/v1/completions`` in turn on a fresh app over ``engine``; the responses, and the metrics
    before the first and after each."""

    async def run():
        loop = EngineLoop(engine)
        loop.start()
        app = build_app(loop, "tiny")
        responses, metrics = [], []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            metrics.append(metric_values((await client.get("/metrics")).text))
            for body in bodies:
                responses.append(await client.post("/v1/completions", json={"model": "tiny", **body}))
                metrics.append(metric_values((await client.get("/metrics")).text))
        await loop.shutdown(1.0)
        return responses, metrics

    return asyncio.run(run())


def _greedy(prompt: list[int], quest: dict, max_tokens: int = 10) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "quest": quest}


# ---- protocol ------------------------------------------------------------------------------------------------------


def test_speculative_tokens_is_an_optional_strict_int_of_the_quest_object():
    def parse(quest: dict):
        return protocol.parse_request(CompletionRequest, json.dumps({"prompt": "x", "quest": quest}).encode())

    assert parse({"speculative_tokens": 3}).quest.speculative_tokens == 3
    assert parse({}).quest.speculative_tokens is None and parse({"speculative_tokens": None}).quest.speculative_tokens is None
    for value in ("2", True, 2.0):
        with pytest.raises(RequestError) as info:
            parse({"speculative_tokens": value})
        assert info.value.status == 400 and info.value.param == "quest.speculative_tokens", value


# ---- a lossless engine ---------------------------------------------------------------------------------------------


def test_a_lossless_request_gives_the_dense_tokens_and_echoes_its_drafts(lossless):
    prompt = _prompt(random.randint(30, 50))  # beyond the budget: the drafts select pages
    (lossless_answer, dense, default, lossy), _ = _serve(lossless, [
        _greedy(prompt, {"speculative_tokens": 2}), _greedy(prompt, {"dense": True}), _greedy(prompt, {}),
        _greedy(prompt, {"speculative_tokens": 0})])
    for response in (lossless_answer, dense, default, lossy):
        assert response.status_code == 200, response.text
    tokens = lossless_answer.json()["choices"][0]["token_ids"]
    assert tokens == dense.json()["choices"][0]["token_ids"] == default.json()["choices"][0]["token_ids"]
    assert len(tokens) == 10
    echo = lossless_answer.json()["quest"]
    assert echo["speculative_tokens"] == 2 and echo["token_budget"] == BUDGET and echo["dense"] is False
    assert 0 <= echo["acceptance_rate"] <= 1 and 1 <= echo["mean_tokens_per_verify"] <= 2 + 1
    assert 1 <= len(echo["acceptance_by_position"]) <= 2 and all(0 <= a <= 1 for a in echo["acceptance_by_position"])
    assert default.json()["quest"]["speculative_tokens"] == K  # the engine's
    for plain in (dense, lossy):  # no verify step: no acceptance to report
        echo = plain.json()["quest"]
        assert echo["speculative_tokens"] == 0 and "acceptance_rate" not in echo
        assert "mean_tokens_per_verify" not in echo and "acceptance_by_position" not in echo


@pytest.mark.parametrize("quest, param", [
    ({"speculative_tokens": 17}, "quest.speculative_tokens"),
    ({"speculative_tokens": -1}, "quest.speculative_tokens"),
    ({"speculative_tokens": "2"}, "quest.speculative_tokens"),
    ({"speculative_tokens": True}, "quest.speculative_tokens"),
    ({"dense": True, "speculative_tokens": 2}, "quest.dense"),  # the engine's rule, as for SamplingParams
])
def test_a_bad_speculative_tokens_is_a_400_naming_it_and_the_server_keeps_serving(lossless, quest, param):
    prompt = _prompt(12)
    (bad, good), metrics = _serve(lossless, [_greedy(prompt, quest), _greedy(prompt, {"speculative_tokens": 1}, 4)])
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == param
    assert metrics[1]['questkv_requests_total{status="invalid"}'] == metrics[0]['questkv_requests_total{status="invalid"}'] + 1
    assert good.status_code == 200 and len(good.json()["choices"][0]["token_ids"]) == 4


def test_the_metrics_count_the_drafts_kept_and_the_verify_steps_as_the_echo_does(lossless):
    """Fixed prompts, so whether a draft is kept does not vary from run to run (a Quest draft differs from dense
    attention's token now and then, so a random one might keep none)."""
    rng = random.Random(42)
    bodies = [_greedy([rng.randrange(96) for _ in range(rng.randint(30, 50))], {}) for _ in range(4)]
    responses, metrics = _serve(lossless, bodies)
    verify_rows = 'questkv_step_tokens_total{kind="verify"}'
    for response, before, after in zip(responses, metrics, metrics[1:]):
        assert response.status_code == 200, response.text
        draft, accepted, verify = (after[name] - before[name] for name in _SPEC)
        assert draft > 0 and verify > 0
        echo = response.json()["quest"]  # the same rounds, counted per request
        assert accepted / draft == pytest.approx(echo["acceptance_rate"])
        assert (accepted + verify) / verify == pytest.approx(echo["mean_tokens_per_verify"])
        assert after[verify_rows] - before[verify_rows] >= verify + draft  # each verify row: its last token and drafts
        by_position = []  # per draft position: the request's drafts scored and kept there
        for position in range(len(echo["acceptance_by_position"])):
            by_position.append(tuple(after.get(f'{name}{{position="{position}"}}', 0) - before.get(
                f'{name}{{position="{position}"}}', 0) for name in _PER_POSITION))
        assert [kept / scored for scored, kept in by_position] == pytest.approx(echo["acceptance_by_position"])
        assert by_position[0][0] == verify  # every verify step scored a first draft
        assert sum(scored for scored, _ in by_position) == draft and sum(kept for _, kept in by_position) == accepted
    assert metrics[-1][_SPEC[1]] > 0  # some drafts were kept


# ---- an engine without a speculative config ------------------------------------------------------------------------


def test_an_engine_without_a_speculative_config_refuses_draft_tokens_and_keeps_serving(lossy):
    prompt = _prompt(12)
    (bad, zero, good), metrics = _serve(lossy, [_greedy(prompt, {"speculative_tokens": 2}),
                                                _greedy(prompt, {"speculative_tokens": 0}), _greedy(prompt, {})])
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "quest.speculative_tokens"
    assert "needs an engine with lossless Quest" in bad.json()["error"]["message"]
    assert zero.status_code == good.status_code == 200
    assert zero.json()["choices"][0]["token_ids"] == good.json()["choices"][0]["token_ids"]
    assert all(metrics[-1][name] == 0 for name in _SPEC)


def test_every_kind_of_step_row_is_a_label_from_the_start():
    values = metric_values(ServerMetrics().render()[0].decode())
    assert {kind: values[f'questkv_step_tokens_total{{kind="{kind}"}}'] for kind in ("decode", "verify", "prefill")} == {
        "decode": 0, "verify": 0, "prefill": 0}
    assert all(values[name] == 0 for name in _SPEC)
