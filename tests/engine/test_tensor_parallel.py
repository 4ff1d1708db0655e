"""Tensor parallelism on the CPU (gloo, 2 processes): the same tokens as one device, clear errors before any
process starts, and a dead or hung worker turned into an error in bounded time with no process left behind.

Tiny random models saved as HF folders, so that loading slices real checkpoint tensors: a Llama with MHA and
every bias (the row-parallel biases count once) and a vocabulary of 97 (the vocab-parallel embedding and head pad
it to 98), a Qwen2 with QKV biases, GQA 14:2 (one KV head per rank) and tied embeddings, and a GQA Llama quantized
to int8 after loading (a row-parallel shard's row scales are the whole rows'). fp32 activations: greedy tokens and
seeded samples must match exactly. The first Llama engine schedules asynchronously (the sampled tokens feed the
next step from every rank's device), the others synchronously; the Qwen2 engines run steps of 8 tokens, prompts
cut in chunks beside the decodes' tokens (a step whose prefill rows are a partial one samples for its decode rows
only). One engine of each size is shared by the tests of a
model (a worker takes seconds to start); their pools are tiny (18 pages of 4 tokens), so a batch preempts. A packed
GPTQ checkpoint (groups of 32) shards on group boundaries too. A worker that dies while rank 0 waits for it in the
rendezvous (a fake one that exits at once, a script without ``if __name__ == "__main__":``) fails the start naming it.
"""

from __future__ import annotations

import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from questkv import QuestConfig
from questkv.distributed.group import TensorParallel
from questkv.engine import tp_workers
from questkv.engine.engine_config import EngineConfig
from questkv.engine.llm import LLM
from questkv.engine.sampling_params import SamplingParams
from questkv.engine.tp_workers import TensorParallelError
from tests.engine.test_chunked_prefill import mixed_steps, staggered
from tests.helpers import greedy_params, save_tiny_model, tiny_config, tiny_hf_model

PAGE, MAX_LEN, POOL_PAGES = 4, 64, 18
QUEST = QuestConfig(token_budget=16, page_size=PAGE, dense_layers=1)
MODELS = {"llama": dict(family="llama_mha", vocab_size=97, engine=dict(async_scheduling=True)),
          "qwen2": dict(family="qwen2", vocab_size=96, engine=dict(async_scheduling=False, max_num_batched_tokens=8)),
          "llama int8": dict(family="llama3", vocab_size=96, engine=dict(async_scheduling=False, quantization="int8"))}
DEADLINE_S = 60.0  # a bound for states awaited (a worker's death noticed, processes gone); never a sleep


def make_llm(model_dir, tensor_parallel_size: int, **kwargs) -> LLM:
    """An engine whose pool holds ``POOL_PAGES`` pages on every rank (``kv_cache_memory`` is per rank)."""
    return LLM(str(model_dir), QUEST, kv_cache_memory=pool_bytes(model_dir, tensor_parallel_size), device="cpu",
               dtype="float64", max_model_len=MAX_LEN, max_num_seqs=8, tensor_parallel_size=tensor_parallel_size,
               **kwargs)


def pool_bytes(model_dir, tensor_parallel_size: int) -> int:
    """``kv_cache_memory`` for ``POOL_PAGES`` pages of one rank's KV heads (K, V, min and max keys, float64)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    kv_heads = config.num_key_value_heads // tensor_parallel_size
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return POOL_PAGES * config.num_hidden_layers * (2 * PAGE + 2) * kv_heads * head_dim * 8


@pytest.fixture(scope="module", params=list(MODELS))
def engines(request, tmp_path_factory):
    """``(one device, two ranks)`` engines of one saved model."""
    model = MODELS[request.param]
    folder = save_tiny_model(tmp_path_factory.mktemp(request.param), model["vocab_size"],
                             seed=random.randrange(1 << 16), family=model["family"])
    single = make_llm(folder, 1, **model["engine"])
    sharded = make_llm(folder, 2, **model["engine"])
    try:
        yield single, sharded
    finally:
        sharded.close()
        single.close()


def prompt(vocab: int, n: int) -> list[int]:
    return torch.randint(2, vocab, (n,)).tolist()


def tokens(llm: LLM, prompts, params) -> list[tuple[int, ...]]:
    return [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def test_two_ranks_give_the_tokens_of_one_device_for_ragged_quest_dense_and_sampled_requests(engines):
    single, sharded = engines
    vocab = single.engine.spec.vocab_size
    first = prompt(vocab, 11)
    prompts = [first, prompt(vocab, 3), prompt(vocab, 17), first, prompt(vocab, 6)]  # a prompt twice: one computed
    params = [greedy_params(9), greedy_params(14, dense=True), greedy_params(5),
              SamplingParams(temperature=0.8, seed=random.randrange(1 << 30), max_tokens=8, ignore_eos=True),
              greedy_params(12, token_budget=8)]
    expected = tokens(single, prompts, params)
    assert tokens(sharded, prompts, params) == expected
    # Again, on both: the prompts now start on prefix-cache pages (the ranks attend the cached K/V of their heads).
    # Against the single device's second run, whose cache and schedule are the same: a hit computes fewer rows than
    # the first run did, which may round differently (at a budget of 2 pages, a near-tie of page scores can flip).
    assert tokens(sharded, prompts, params) == tokens(single, prompts, params)
    assert sharded.engine.cache.num_free_pages == POOL_PAGES - 1  # every page back but the scratch page


def test_two_ranks_under_preemption_give_the_tokens_of_one_device(engines):
    single, sharded = engines
    vocab = single.engine.spec.vocab_size
    prompts = [prompt(vocab, random.randint(10, 20)) for _ in range(4)]
    params = [greedy_params(30), greedy_params(36), greedy_params(25), greedy_params(28)]
    outputs = sharded.generate(prompts, params, use_tqdm=False)
    assert sum(out.metrics.num_preemptions for out in outputs) > 0
    assert [out.token_ids for out in outputs] == tokens(single, prompts, params)


def test_two_ranks_replay_steps_mixing_decodes_and_prefill_chunks_as_one_device(engines):
    single, sharded = engines
    vocab = single.engine.spec.vocab_size
    torch.manual_seed(vocab)
    lens, params = (5, 23, 14, 19), [greedy_params(16), greedy_params(8, dense=True), greedy_params(9),
                                     greedy_params(6, token_budget=8)]
    requests = [(prompt(vocab, n), sp) for n, sp in zip(lens, params)]  # arriving while the earlier ones decode
    got, launched = staggered(sharded, requests)
    assert mixed_steps(launched) and got == staggered(single, requests)[0]
    assert sharded.engine.cache.num_free_pages == POOL_PAGES - 1


def test_an_int8_row_parallel_shard_holds_the_one_device_codes_and_row_scales(engines):
    single, sharded = engines
    if single.config.quantization != "int8":
        pytest.skip("a check of the int8 engines")
    for layer in ("self_attn.o_proj", "mlp.down_proj"):
        whole = single.engine.runner.model.model.layers[0].get_submodule(layer)
        shard = sharded.engine.runner.model.model.layers[0].get_submodule(layer)  # rank 0: the first input half
        assert torch.equal(shard.scales, whole.scales), layer
        assert torch.equal(shard.qweight, whole.qweight[:, :whole.in_features // 2]), layer


def children() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


def wait_gone(pids) -> None:
    """Wait (bounded) until none of ``pids`` is a live process."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return
        assert time.monotonic() < deadline, f"processes {alive} still alive {DEADLINE_S} s after the engine closed"
        time.sleep(0.05)


@pytest.mark.parametrize("family,size,message", [
    ("qwen2", 4, "num_attention_heads=14 is not divisible by tensor_parallel_size=4"),
    ("llama3", 3, "num_attention_heads=4 is not divisible by tensor_parallel_size=3"),
    ("llama_linear", 2, "num_key_value_heads=1 is not divisible by tensor_parallel_size=2"),
])
def test_heads_that_do_not_split_over_the_ranks_are_refused_before_any_process_starts(family, size, message):
    before = children()
    with pytest.raises(ValueError, match=message):
        LLM(tiny_config(family), load_format="dummy", device="cpu", dtype="float32", tensor_parallel_size=size)
    assert children() == before


def test_a_shard_that_would_cut_int4_groups_is_refused_naming_the_layer_before_any_process_starts():
    before = children()
    config = tiny_config("llama3", hidden_size=128, intermediate_size=256)  # o_proj: 128 inputs, 64 per rank
    with pytest.raises(ValueError, match=r"group size 128, got 64 \(layer model\.layers\.0\.self_attn\.o_proj\), its "
                                         r"shard of tensor_parallel_size=2"):
        LLM(config, load_format="dummy", device="cpu", dtype="float32", quantization="int4", tensor_parallel_size=2)
    assert children() == before


def test_a_packed_gptq_checkpoint_shards_on_group_boundaries_and_gives_the_tokens_of_one_device(tmp_path):
    from tests.models.test_quantized_checkpoints import write_checkpoint

    float_folder = tmp_path / "float"  # every linear holds whole groups of 32 on each rank
    tiny_hf_model(tiny_config("llama3", vocab_size=96, hidden_size=128, intermediate_size=256)).save_pretrained(
        float_folder)
    write_checkpoint(tmp_path / "gptq", float_folder, "gptq")
    prompts = [prompt(96, 11), prompt(96, 4)]
    with make_llm(tmp_path / "gptq", 1) as single:
        expected = tokens(single, prompts, greedy_params(10))
    with make_llm(tmp_path / "gptq", 2) as sharded:
        assert tokens(sharded, prompts, greedy_params(10)) == expected


def test_more_ranks_than_cuda_devices_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs as many CUDA devices, but 1 are visible"):
        EngineConfig(model=tiny_config("llama3"), load_format="dummy", device="cuda", tensor_parallel_size=2)


def test_a_worker_killed_mid_run_fails_the_step_naming_it_and_leaves_no_process():
    config = tiny_config("llama3")
    kwargs = dict(load_format="dummy", device="cpu", dtype="float32", max_model_len=MAX_LEN, seed=3)
    single = LLM(config, QUEST, **kwargs)
    llm = LLM(config, QUEST, tensor_parallel_size=2, **kwargs)
    workers = llm.engine.workers.pids
    assert len(workers) == 1 and set(workers) <= children()
    engine = llm.engine
    prompts = [prompt(96, 9), prompt(96, 14)]
    reference = dict(enumerate(tokens(single, prompts, greedy_params(40))))
    ids = {engine.add_request(p, greedy_params(40)): i for i, p in enumerate(prompts)}
    outputs = {}
    for _ in range(3):  # random weights drawn whole and sliced: the shards are one model's
        outputs.update({ids[out.request_id]: out.token_ids for out in engine.step()})
    assert outputs == {i: reference[i][:len(toks)] for i, toks in outputs.items()} and len(outputs) == 2
    os.kill(workers[0], signal.SIGKILL)
    began = time.monotonic()
    with pytest.raises(TensorParallelError, match=rf"tensor-parallel worker rank 1 \(pid {workers[0]}\) exited"):
        while time.monotonic() - began < DEADLINE_S:
            engine.step()
    with pytest.raises(TensorParallelError):  # the engine stays failed
        engine.step()
    llm.close()
    wait_gone(workers)
    single.close()


def test_a_hung_worker_fails_the_step_within_the_collective_timeout_and_is_killed_on_close(monkeypatch):
    monkeypatch.setenv("QUESTKV_TP_TIMEOUT", "3")
    llm = LLM(tiny_config("llama3"), QUEST, load_format="dummy", device="cpu", dtype="float32", max_model_len=MAX_LEN,
              tensor_parallel_size=2)
    workers = llm.engine.workers.pids
    llm.engine.add_request(prompt(96, 9), greedy_params(40))
    llm.engine.step()
    os.kill(workers[0], signal.SIGSTOP)  # alive, but never answers a collective again
    with pytest.raises(TensorParallelError, match="a tensor-parallel step failed on rank 0"):
        llm.engine.step()
    llm.close()
    wait_gone(workers)


def _report_and_exit(config, rank, store_path, max_model_len, timeout, conn) -> None:
    """A fake :func:`~questkv.engine.tp_workers.worker_main` that fails at once, reporting its error as it does."""
    conn.send(("error", "ValueError: a fake worker's error"))
    sys.exit(1)


def _exit_silently(config, rank, store_path, max_model_len, timeout, conn) -> None:
    """A fake worker that exits at once, reporting nothing: as one that dies in the spawn start method's bootstrap."""
    os._exit(1)


@pytest.mark.parametrize("fake,message", [
    (_report_and_exit, r"; its error:\nValueError: a fake worker's error"),
    # what follows names the main module's guard when there is a script to re-run (not under pytest-xdist's workers)
    (_exit_silently, r" before it started.* \(its traceback is on stderr\)"),
])
def test_a_worker_that_exits_while_rank_0_waits_in_the_rendezvous_fails_the_wait_naming_it(monkeypatch, fake, message):
    monkeypatch.setattr(tp_workers, "worker_main", fake)
    config = EngineConfig(model=tiny_config("llama3"), load_format="dummy", device="cpu", tensor_parallel_size=2)
    pool = tp_workers.WorkerPool(config, MAX_LEN)
    try:
        with pytest.raises(TensorParallelError,
                           match=rf"tensor-parallel worker rank 1 \(pid {pool.pids[0]}\) exited with code 1{message}"):
            pool.connect(TensorParallel(0, 2))
    finally:
        pool.close()
    wait_gone(pool.pids)


ROOT = pathlib.Path(__file__).resolve().parents[2]
NO_GUARD = """from questkv.engine.llm import LLM
from tests.helpers import tiny_config

LLM(tiny_config("llama3"), load_format="dummy", device="cpu", dtype="float32", max_model_len=64, tensor_parallel_size=2)
"""


@pytest.mark.parametrize("source", ["file", "stdin"])
def test_a_script_without_a_main_guard_fails_the_start_naming_rank_1_and_the_guard_it_needs(tmp_path, source):
    script = tmp_path / "no_guard.py"
    script.write_text(NO_GUARD)
    args = [sys.executable, str(script) if source == "file" else "-"]
    done = subprocess.run(args, input=NO_GUARD if source == "stdin" else None, capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)  # a hang's bound
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1, done.stderr
    assert last.startswith("questkv.engine.tp_workers.TensorParallelError: tensor-parallel worker rank 1 (pid "), last
    assert 'needs that code under if __name__ == "__main__":' in last
    if source == "file":  # the worker re-ran the script, which started an engine: it exits with code 3
        assert f"exited with code 3: the spawn start method re-imports the main module {str(script)!r}" in last
    else:  # the spawn start method cannot re-import <stdin>
        assert "exited with code 1 before it started" in last and "(python -) cannot be re-imported" in last
