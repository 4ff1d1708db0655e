"""Random engines under random workloads, against the engines whose maths they must repeat (CPU, float64).

Each case draws an engine (Quest budget, sink and recent pages, dense layers, selection reuse; lossless rounds or
none, fixed or adaptive; synchronous or asynchronous steps; chunked prefill and its token budget; prefix caching;
a pool small enough to preempt or not; model-dtype or fp8 K/V) and a batch of requests (shared prefixes, greedy or
seeded sampling with top-k, stop tokens, log-probabilities, per-request budgets, dense requests (teacher-forced
too) and lossless ones, a second turn that continues each conversation; in half the cases the requests arrive at
random steps and about one in five is aborted), then checks:

- a request whose every step attends densely (``dense``, or lossless) gives the tokens and log-probabilities of the
  dense engine with the same K/V dtype, run alone;
- a lossy Quest request gives its own tokens and log-probabilities run alone on the same engine (unless it was
  preempted: its recompute attends its generated tokens densely, docs/engine.md);
- every page is back once the engine is idle.

``QUESTKV_RANDOM_WORKLOADS`` sets the number of cases (default 8); a failure names its case's seed, and
``QUESTKV_RANDOM_WORKLOADS_SEED`` replays it.
"""

import os
import random

import pytest
import torch

from questkv import QuestConfig
from questkv.engine.sampling_params import SamplingParams
from tests.engine.test_llm import MAX_LEN, PAGE, VOCAB, make_llm, pool_memory
from tests.engine.test_prefix_caching import assert_pages_all_back
from tests.helpers import save_tiny_model

CASES = int(os.environ.get("QUESTKV_RANDOM_WORKLOADS", "8"))
FIRST_SEED = int(os.environ.get("QUESTKV_RANDOM_WORKLOADS_SEED", random.randrange(1 << 30)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), VOCAB, seed=random.randrange(1 << 16))


@pytest.fixture(scope="module")
def dense_engines(model_dir):
    """The dense engine per K/V dtype, built on first use."""
    engines = {}

    def get(kv_cache_dtype: str):
        if kv_cache_dtype not in engines:
            engines[kv_cache_dtype] = make_llm(model_dir, kv_cache_dtype=kv_cache_dtype)
        return engines[kv_cache_dtype]

    return get


def random_engine(rng: random.Random, model_dir):
    """An engine of random settings and its description."""
    sink, recent = rng.choice([0, 1]), rng.choice([0, 1])
    budget = rng.choice([b for b in (8, 12, 16, 24) if b // PAGE >= sink + recent + 2])
    quest = QuestConfig(token_budget=budget, page_size=PAGE, dense_layers=rng.choice([0, 1]), dense_context_ratio=1.0,
                        selection_interval=rng.choice([1, 1, 2, 3]), sink_pages=sink, recent_pages=recent)
    k = rng.choice([None, 1, 2, 4, 8])
    settings = dict(
        speculative_config=None if k is None else {"method": "quest", "num_speculative_tokens": k,
                                                   "adaptive": rng.random() < 0.3},
        async_scheduling=rng.random() < 0.5, enable_chunked_prefill=rng.random() < 0.7,
        enable_prefix_caching=rng.random() < 0.7, max_num_seqs=rng.choice([2, 3, 8]),
        kv_cache_dtype=rng.choice(["auto", "auto", "fp8"]))
    if settings["enable_chunked_prefill"]:
        settings["max_num_batched_tokens"] = rng.choice([None, 16, 32, 64])
    if rng.random() < 0.3:  # a pool of 36-60 pages for prompts of up to 56 tokens and answers of up to 30: preemptions
        probe = make_llm(model_dir, quest, kv_cache_dtype=settings["kv_cache_dtype"])
        settings.update(kv_cache_memory=pool_memory(probe, rng.randint(36, 60)), max_model_len=96)
        probe.close()
    return make_llm(model_dir, quest, **settings), quest, k, {"quest": quest, **settings}


def random_requests(rng: random.Random, quest: QuestConfig, k, max_len: int):
    """2-7 prompts (half of them after a shared prefix) and, per prompt, its sampling fields and its Quest fields
    (forced tokens among them)."""
    shared = torch.randint(2, VOCAB, (rng.randint(4, 40),)).tolist()
    prompts, requests = [], []
    for _ in range(rng.randint(2, 7)):
        own = torch.randint(2, VOCAB, (rng.randint(1, 50),)).tolist()
        prompts.append(((shared + own) if rng.random() < 0.5 else own)[:max_len - 40])
        sampling = {"max_tokens": rng.randint(1, 30), "ignore_eos": True, "temperature": 0}
        if rng.random() < 0.3:
            sampling.update(temperature=rng.choice([0.7, 1.0]), seed=rng.randrange(1 << 30), top_k=rng.choice([0, 5]))
        if rng.random() < 0.15:
            sampling["stop_token_ids"] = [rng.randrange(2, VOCAB)]
        if rng.random() < 0.3:
            sampling["logprobs"] = rng.randint(0, 3)
        kind, fields = rng.choice(["engine's", "dense", "budget", "drafts"]), {}
        if kind == "dense":
            fields = {"dense": True}
            if rng.random() < 0.3:  # teacher forcing (beside other requests' verify steps on a lossless engine)
                forced = torch.randint(2, VOCAB, (rng.randint(1, sampling["max_tokens"]),)).tolist()
                fields["forced_token_ids"] = forced
        elif kind == "budget":
            low = (quest.sink_pages + quest.recent_pages + 2) * PAGE
            fields = {"token_budget": rng.choice([b for b in (8, 12, 16, 24) if low <= b <= quest.token_budget])}
            if rng.random() < 0.3:
                fields["selection_interval"] = rng.randint(1, quest.selection_interval)
        elif kind == "drafts" and k is not None:
            fields = {"speculative_tokens": rng.randint(0, k)}
        requests.append((sampling, fields))
    return prompts, requests


def staggered(rng: random.Random, engine, prompts, params) -> list:
    """Each request's final output when they arrive at random steps of ``engine`` and about one in five is aborted at
    a random step (its output ``None``)."""
    arrivals = sorted(rng.randint(0, 12) for _ in prompts)
    aborts = {i: rng.randint(arrivals[i], arrivals[i] + 12) for i in range(len(prompts)) if rng.random() < 0.2}
    ids, finals, step = {}, {}, 0
    while len(ids) < len(prompts) or engine.has_unfinished_requests():
        for i in range(len(prompts)):
            if i not in ids and arrivals[i] <= step:
                ids[i] = engine.add_request(prompts[i], params[i])
            if aborts.get(i) == step and i in ids:
                engine.abort_request(ids[i])
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        step += 1
    return [None if i in aborts else finals[ids[i]] for i in range(len(prompts))]


def same_logprobs(got, want) -> bool:
    """Whether two outputs' ``logprobs`` hold the same tokens at each position, with the same ranks and
    log-probabilities within float32 rounding."""
    if got is None or want is None:
        return got is want
    return len(got) == len(want) and all(
        list(g) == list(w) and all(g[t].rank == w[t].rank and abs(g[t].logprob - w[t].logprob) < 1e-5 for t in w)
        for g, w in zip(got, want))


@pytest.mark.parametrize("case", range(CASES))
def test_random_engines_give_the_tokens_of_the_engines_they_must_equal(model_dir, dense_engines, case):
    seed = FIRST_SEED + case
    rng = random.Random(seed)
    torch.manual_seed(seed)
    llm, quest, k, described = random_engine(rng, model_dir)
    dense = dense_engines(described["kv_cache_dtype"])
    max_len = described.get("max_model_len", MAX_LEN)
    prompts, requests = random_requests(rng, quest, k, max_len)
    params = [SamplingParams(**sampling, **fields) for sampling, fields in requests]
    if rng.random() < 0.5:
        turns = [(prompts, llm.generate(prompts, params, use_tqdm=False))]
    else:  # arrivals at random steps (joining running rounds), and aborts
        turns = [(prompts, staggered(rng, llm.engine, prompts, params))]
    if rng.random() < 0.5:  # a second turn: each conversation so far and a few new words (prefix hits on answers)
        nexts = [(p + list(out.token_ids if out else ()) + torch.randint(2, VOCAB, (rng.randint(1, 8),)).tolist())
                 [:max_len - 32] for p, out in zip(*turns[0])]
        turns.append((nexts, llm.generate(nexts, params, use_tqdm=False)))
    wrong = []
    for turn, (turn_prompts, outputs) in enumerate(turns):
        for i, (p, (sampling, fields), out) in enumerate(zip(turn_prompts, requests, outputs)):
            if out is None:  # aborted
                continue
            lossless = k is not None and fields.get("speculative_tokens", k) > 0 and not fields.get("dense")
            if fields.get("dense") or lossless:
                forced = {"forced_token_ids": fields["forced_token_ids"]} if "forced_token_ids" in fields else {}
                (want,) = dense.generate([p], SamplingParams(**sampling, **forced), use_tqdm=False)
            elif out.metrics.num_preemptions:
                continue
            else:
                (want,) = llm.generate([p], SamplingParams(**sampling, **fields), use_tqdm=False)
            if out.token_ids != want.token_ids or not same_logprobs(out.logprobs, want.logprobs):
                wrong.append(f"turn {turn} request {i} ({len(p)} prompt tokens, {sampling}, {fields}): "
                             f"{out.token_ids} != {want.token_ids} or their logprobs differ")
    assert not wrong, f"QUESTKV_RANDOM_WORKLOADS_SEED={seed}, engine {described}:\n" + "\n".join(wrong)
    assert_pages_all_back(llm)
    llm.close()
