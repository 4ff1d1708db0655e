"""EngineConfig and the offline API's argument checks: every bad argument of ``LLM`` / ``EngineConfig`` and every
bad request raises a ``ValueError`` naming it, and a failing ``generate`` leaves the engine as it was.

Engines here run a tiny random Llama from a transformers config with ``load_format="dummy"`` (no checkpoint, no
tokenizer): building one takes milliseconds, so every test gets its own.
"""

import dataclasses
import random
import re

import pytest
import torch

from questkv import QuestConfig
from questkv.engine.engine_config import EngineConfig, dtype_name
from questkv.engine.llm import LLM
from questkv.engine.sampling_params import SamplingParams
from tests.helpers import tiny_config

VOCAB, MAX_LEN = 96, 64


def dummy_config(**overrides):
    """A tiny Llama (3 layers, 4 q / 2 KV heads, head_dim 16) as a transformers config."""
    return tiny_config("llama3", vocab_size=VOCAB, **overrides)


def dummy_llm(quest=None, **kwargs) -> LLM:
    kwargs = {"device": "cpu", "dtype": "float32", "max_model_len": MAX_LEN, "load_format": "dummy",
              "kv_cache_memory": 1 << 20, **kwargs}  # a few hundred pages, not the CPU default of 1 GiB
    return LLM(dummy_config(), quest=quest, **kwargs)


def prompt(n: int) -> list[int]:
    return [random.randrange(VOCAB) for _ in range(n)]


def greedy(max_tokens: int = 4, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


QUEST = QuestConfig(token_budget=32, page_size=4, dense_layers=1)


# ---------------------------------------------------------------------------------------------------------------
# EngineConfig itself
# ---------------------------------------------------------------------------------------------------------------


def test_engine_config_is_frozen_and_reports_its_derived_values():
    config = EngineConfig(model=dummy_config(), load_format="dummy", dtype="float32", device="cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_num_seqs = 4
    assert config.torch_dtype is torch.float32
    assert config.torch_device == torch.device("cpu")
    assert config.page_size == 16  # a dense engine's page
    assert not config.use_cuda_graphs  # CPU: always eager
    quest = EngineConfig(model="smollm2-135m", quest=QUEST, device="cpu")
    assert quest.page_size == QUEST.page_size and quest.dtype == "bfloat16"
    # Prefill tokens per step: chunks of 8192 by default, an unchunked step as long as the longest prompt.
    assert config.enable_chunked_prefill and config.prefill_tokens_per_step(32768) == 8192
    unchunked = dataclasses.replace(config, enable_chunked_prefill=False)
    assert unchunked.prefill_tokens_per_step(32768) == 32768 and unchunked.prefill_tokens_per_step(1024) == 8192
    assert dataclasses.replace(config, max_num_batched_tokens=512).prefill_tokens_per_step(32768) == 512
    # With chunking a step carries a token of every decode: the default grows with max_num_seqs.
    assert dataclasses.replace(config, max_num_seqs=10000).prefill_tokens_per_step(32768) == 10000


def test_dtype_name_takes_names_and_torch_dtypes_and_refuses_the_rest():
    assert dtype_name(torch.bfloat16) == "bfloat16" and dtype_name("float16") == "float16"
    for bad in ("int8", torch.int8, None):
        with pytest.raises(ValueError, match="dtype must be one of bfloat16, float16, float32"):
            dtype_name(bad)


def test_llm_takes_a_torch_dtype_and_builds_one_engine_config():
    llm = dummy_llm(dtype=torch.float32, max_num_seqs=3, seed=5)
    assert llm.config == EngineConfig(model=llm.config.model, dtype="float32", device="cpu", max_num_seqs=3,
                                      max_model_len=MAX_LEN, kv_cache_memory=1 << 20, seed=5, load_format="dummy")
    assert llm.tokenizer is None  # dummy weights come without a tokenizer
    assert llm.engine.max_model_len == MAX_LEN


def test_max_model_len_defaults_to_the_models_max_position_embeddings():
    llm = dummy_llm(max_model_len=None, kv_cache_memory=1 << 22)
    assert llm.engine.max_model_len == dummy_config().max_position_embeddings


# ---------------------------------------------------------------------------------------------------------------
# Bad arguments of LLM / EngineConfig
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,message", [
    (dict(bogus=1), "LLM got unknown arguments ['bogus']"),
    (dict(pipeline_parallel_size=2, bogus=1), "unknown arguments ['bogus', 'pipeline_parallel_size']"),
    (dict(dtype="int8"), "dtype must be one of bfloat16, float16, float32, float64, got 'int8'"),
    (dict(dtype=torch.int8), "dtype must be one of"),
    (dict(device="tpu"), "EngineConfig.device must be one of 'cpu', 'cuda'; got 'tpu'"),
    (dict(max_num_seqs=0), "EngineConfig.max_num_seqs must be >= 1, got 0"),
    (dict(max_num_seqs=2.0), "EngineConfig.max_num_seqs must be an int"),
    (dict(max_model_len=1), "EngineConfig.max_model_len must be >= 2, got 1"),
    (dict(max_num_batched_tokens=0), "EngineConfig.max_num_batched_tokens must be >= 1, got 0"),
    (dict(max_num_batched_tokens=4, max_num_seqs=8),
     "EngineConfig.max_num_batched_tokens=4 must be >= max_num_seqs=8 with chunked prefill"),
    (dict(kv_cache_memory=0), "EngineConfig.kv_cache_memory must be >= 1, got 0"),
    (dict(kv_cache_memory=1.5e9), "EngineConfig.kv_cache_memory must be an int"),
    (dict(gpu_memory_utilization=0), "EngineConfig.gpu_memory_utilization must be in (0.0, 1.0], got 0"),
    (dict(gpu_memory_utilization=1.5), "EngineConfig.gpu_memory_utilization must be in (0.0, 1.0]"),
    (dict(enforce_eager="yes"), "EngineConfig.enforce_eager must be a bool"),
    (dict(enable_chunked_prefill=1), "EngineConfig.enable_chunked_prefill must be a bool"),
    (dict(seed=-1), "EngineConfig.seed must be >= 0, got -1"),
    (dict(tensor_parallel_size=0), "EngineConfig.tensor_parallel_size must be >= 1, got 0"),
    (dict(tensor_parallel_size="2"), "EngineConfig.tensor_parallel_size must be an int, got '2'"),
    (dict(graph_capture="eager"), "EngineConfig.graph_capture must be one of 'lazy', 'startup'; got 'eager'"),
    (dict(load_format="pt"), "EngineConfig.load_format must be one of 'auto', 'dummy'; got 'pt'"),
    (dict(quest={"token_budget": 64}), "EngineConfig.quest must be a QuestConfig or None, got dict"),
    (dict(load_format="auto"),
     "EngineConfig.model is a transformers config: it has no weights, pass load_format='dummy'"),
])
def test_every_invalid_llm_argument_raises_a_value_error_naming_it(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        dummy_llm(**kwargs)


@pytest.mark.parametrize("model,kwargs,message", [
    (42, {}, "EngineConfig.model must be a name, a path or a transformers config, got 42"),
    (42, dict(load_format="dummy"), "EngineConfig.model must be a name, a path or a transformers config, got 42"),
    (None, {}, "EngineConfig.model must be"),
    ("no-such-model-or-folder", {}, "unknown model 'no-such-model-or-folder'"),
])
def test_a_model_that_is_neither_a_name_a_path_nor_a_config_is_refused(model, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(model, device="cpu", dtype="float32", **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_a_gpu_is_refused_before_loading_anything():
    with pytest.raises(ValueError, match=re.escape("EngineConfig.device='cuda' but no CUDA device is available")):
        EngineConfig(model="no-such-model", device="cuda")


def test_max_model_len_above_the_models_positions_is_refused():
    limit = dummy_config().max_position_embeddings
    with pytest.raises(ValueError, match=re.escape(f"EngineConfig.max_model_len={limit + 1} exceeds the model's "
                                                   f"max_position_embeddings={limit}")):
        dummy_llm(max_model_len=limit + 1)


def test_a_kv_cache_too_small_for_one_sequence_is_refused_naming_kv_cache_memory():
    # 3 layers * (2 * 16 + 2) * 2 KV heads * 16 dims * 4 bytes per page; one 64-token sequence needs 4 + 1 scratch
    page_bytes = 3 * 34 * 2 * 16 * 4
    with pytest.raises(ValueError, match=r"holds 4 pages of 16 tokens.*fewer than one sequence of max_model_len=64 "
                                         r"tokens needs \(5 with the scratch page\); raise kv_cache_memory"):
        dummy_llm(kv_cache_memory=5 * page_bytes - 1)
    assert dummy_llm(kv_cache_memory=5 * page_bytes).engine.cache.num_pages == 5


def test_quest_leaving_no_sparse_layer_is_refused_naming_dense_layers():
    quest = QuestConfig(token_budget=32, page_size=4, dense_layers=3)
    with pytest.raises(ValueError, match=re.escape("QuestConfig.dense_layers=3 leaves no sparse layer in a model of "
                                                   "3 layers")):
        dummy_llm(quest=quest)
    dummy_llm(quest=QuestConfig(page_size=4, dense_layers=3))  # a dense QuestConfig has no sparse layer to leave


@pytest.mark.parametrize("make,message", [
    (lambda: __import__("transformers").GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB),
     "config.model_type must be one of 'llama', 'mistral', 'qwen2', 'qwen3'; got 'gpt2'"),
    (lambda: dummy_config(hidden_act="gelu"), "config.hidden_act must be one of 'silu'; got 'gelu'"),
])
def test_an_unsupported_architecture_is_refused_naming_what_is_supported(make, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(make(), device="cpu", dtype="float32", load_format="dummy")


# ---------------------------------------------------------------------------------------------------------------
# Bad requests
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad_prompt,message", [
    ([], "prompt is empty: it must hold at least one token"),
    ([3, VOCAB, 5], f"prompt token ids must be in [0, {VOCAB}), got [{VOCAB}]"),
    ([-1, 4], f"prompt token ids must be in [0, {VOCAB}), got [-1]"),
    ([1.5, 2], "prompt must be a str or a list of token ids, got list"),
    ([True, 2], "prompt must be a str or a list of token ids, got list"),
    ("some text", "a text prompt needs a tokenizer; a dummy-weight model takes token-id prompts only"),
    (None, "prompt must be a str or a list of token ids, got NoneType"),
])
def test_bad_prompts_are_refused_naming_the_problem(bad_prompt, message):
    llm = dummy_llm()
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate([prompt(5), bad_prompt], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.engine.add_request(bad_prompt, greedy())


def test_a_prompt_of_max_model_len_tokens_is_refused_and_one_token_shorter_runs():
    llm = dummy_llm()
    with pytest.raises(ValueError, match=re.escape(f"the prompt has {MAX_LEN} tokens but max_model_len={MAX_LEN} "
                                                   f"allows at most {MAX_LEN - 1}")):
        llm.generate([prompt(MAX_LEN)], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match=re.escape(f"max_tokens=8 with the prompt's {MAX_LEN - 1} tokens exceeds "
                                                   f"max_model_len={MAX_LEN}: max_tokens may be at most 1")):
        llm.generate([prompt(MAX_LEN - 1)], greedy(8), use_tqdm=False)  # refused, never clamped
    (out,) = llm.generate([prompt(MAX_LEN - 1)], greedy(1), use_tqdm=False)
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


@pytest.mark.parametrize("quest,budget,message", [
    (None, 16, "SamplingParams.token_budget=16 needs an engine with Quest"),
    (QuestConfig(page_size=4), 16, "SamplingParams.token_budget=16 needs an engine with Quest"),
    (QUEST, 18, "SamplingParams.token_budget must be a multiple of page_size=4 in [4, 32] (the engine's budget), "
                "got 18"),
    (QUEST, 36, "SamplingParams.token_budget must be a multiple of page_size=4 in [4, 32]"),
    (QuestConfig(token_budget=32, page_size=4, dense_layers=1, sink_pages=1, recent_pages=1), 8,
     "SamplingParams.token_budget must be a multiple of page_size=4 in [12, 32] (the engine's budget), got 8"),
])
def test_a_token_budget_the_engine_cannot_run_is_refused(quest, budget, message):
    llm = dummy_llm(quest=quest)
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate([prompt(5)], greedy(token_budget=budget), use_tqdm=False)
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.engine.add_request(prompt(5), greedy(token_budget=budget))


def test_stop_strings_on_a_model_without_tokenizer_are_refused():
    llm = dummy_llm()
    with pytest.raises(ValueError, match=re.escape("SamplingParams.stop needs a tokenizer; a dummy-weight model has "
                                                   "none (use stop_token_ids)")):
        llm.engine.add_request(prompt(4), greedy(stop=["x"]))


def test_generate_refuses_a_sampling_params_count_that_differs_from_the_prompts():
    llm = dummy_llm()
    with pytest.raises(ValueError, match=re.escape("got 1 SamplingParams for 2 prompts")):
        llm.generate([prompt(3), prompt(4)], [greedy()], use_tqdm=False)


def test_add_request_refuses_params_that_are_not_sampling_params_and_duplicate_ids():
    engine = dummy_llm().engine
    with pytest.raises(ValueError, match=re.escape("params must be a SamplingParams, got dict")):
        engine.add_request(prompt(3), {"max_tokens": 4})
    engine.add_request(prompt(3), greedy(), request_id="a")
    with pytest.raises(ValueError, match=re.escape("request id 'a' is already waiting or running")):
        engine.add_request(prompt(3), greedy(), request_id="a")
    with pytest.raises(ValueError, match="Sequence.request_id must be a non-empty str"):
        engine.add_request(prompt(3), greedy(), request_id="")
    assert engine.scheduler.num_waiting == 1


@pytest.mark.parametrize("bad", [
    "empty prompt", "over-long prompt", "token out of vocab", "bad budget", "stop string without tokenizer",
    "params not SamplingParams",
])
def test_a_failing_generate_call_leaves_the_engine_untouched(bad):
    """The bad request comes second: the first, valid, one must not be queued either."""
    llm = dummy_llm(quest=QUEST)
    engine, cache = llm.engine, llm.engine.cache
    free = cache.num_free_pages
    good = prompt(6)
    (before,) = llm.generate([good], greedy(6), use_tqdm=False)
    bad_prompt, bad_params = {
        "empty prompt": ([], greedy()),
        "over-long prompt": (prompt(MAX_LEN), greedy()),
        "token out of vocab": ([VOCAB + 3], greedy()),
        "bad budget": (prompt(4), greedy(token_budget=6)),
        "stop string without tokenizer": (prompt(4), greedy(stop=["x"])),
        "params not SamplingParams": (prompt(4), {"max_tokens": 4}),
    }[bad]
    with pytest.raises(ValueError):
        llm.generate([good, bad_prompt], [greedy(6), bad_params], use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.num_waiting == engine.scheduler.num_running == 0
    assert cache.num_free_pages == free and cache.sequences == [engine.runner.scratch_seq]
    (after,) = llm.generate([good], greedy(6), use_tqdm=False)
    assert after.token_ids == before.token_ids


def test_float64_is_refused_where_the_engine_would_run_on_cuda(monkeypatch):
    """float64 (the CPU reference dtype of the exactness tests) has no Triton kernels: refused before anything is built
    when the engine would pick CUDA, named with the device; accepted on the CPU."""
    assert EngineConfig(model="m", dtype="float64", device="cpu").torch_dtype == torch.float64
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match=r"dtype='float64' runs on the CPU only .* got device 'cuda'"):
        EngineConfig(model="m", dtype="float64")
