"""``questkv bench latency``: dense and Quest in one run, JSON with provenance, the table, and bad flag values.

The model is a tiny dummy shape registered in ``DUMMY_SHAPES`` for the test (random weights, like ``--config
llama3.1-8b`` at full size), on the CPU in fp32.
"""

import json
import random
import statistics

import pytest

from questkv import bench, cli
from questkv.models.shapes import DUMMY_SHAPES

TINY = ("llama", dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=64,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
                      bos_token_id=0, eos_token_id=1))
ENGINE = ["--config", "tiny", "--device", "cpu", "--dtype", "float32"]


@pytest.fixture(autouse=True)
def tiny_shape(monkeypatch):
    monkeypatch.setitem(DUMMY_SHAPES, "tiny", TINY)


def run(argv, tmp_path):
    path = tmp_path / "latency.json"
    assert cli.main(["bench", "latency", *ENGINE, "--json", str(path), *argv]) == 0
    return json.loads(path.read_text())


def test_latency_measures_dense_and_quest_side_by_side_and_writes_json_with_provenance(tmp_path, capsys):
    batch, input_len, output_len, iters = random.randint(1, 3), random.randint(40, 60), random.randint(3, 6), 2
    document = run(["--input-len", str(input_len), "--output-len", str(output_len), "--batch-size", str(batch),
                    "--num-iters", str(iters), "--num-iters-warmup", "1", "--budget", "16", "--page-size", "4", "--dense-context-ratio", "1",
                    "--dense-layers", "1", "--max-model-len", "80"], tmp_path)
    assert list(document["results"]) == ["dense", "quest"]
    assert {"command", "commit", "machine", "torch", "date"} <= set(document["provenance"])
    assert document["model"] == "tiny (random weights)" and document["quest"]["token_budget"] == 16
    settings = document["settings"]
    assert (settings["input_len"], settings["output_len"], settings["batch_size"]) == (input_len, output_len, batch)
    assert settings["max_model_len"] == 80 and settings["load_format"] == "dummy"
    mean_context = input_len + output_len / 2
    for name, row in document["results"].items():
        assert len(row["iterations"]) == iters
        for it in row["iterations"]:
            assert it["prefill_steps"] == 1 and it["decode_steps"] == output_len - 1  # the prefill is one step
            assert it["e2e_s"] >= it["prefill_s"] > 0
            assert it["decode_ms_per_step"] > 0 and it["decode_tokens_per_s"] == pytest.approx(
                batch * 1e3 / it["decode_ms_per_step"])
        for key in ("prefill_s", "decode_ms_per_step", "decode_tokens_per_s", "e2e_s"):  # medians of the iterations
            assert row[key] == pytest.approx(statistics.median(it[key] for it in row["iterations"]))
        expected = mean_context if name == "dense" else (mean_context + 2 * 16) / 3  # 1 dense layer of 3
        assert row["mean_tokens_attended"] == pytest.approx(expected)
        assert row["kv_fraction"] == pytest.approx(expected / mean_context)
    dense, quest = document["results"]["dense"], document["results"]["quest"]
    assert document["speedup"] == pytest.approx(dense["decode_ms_per_step"] / quest["decode_ms_per_step"])
    out = capsys.readouterr().out
    assert "dense" in out and "quest" in out and "decode speedup, dense / Quest" in out
    assert f"batch {batch}, input {input_len}, output {output_len}, float32 on cpu" in out


def test_dense_only_and_quest_only_run_one_engine(tmp_path):
    argv = ["--input-len", "20", "--output-len", "3", "--num-iters", "1", "--num-iters-warmup", "0", "--budget", "8",
            "--page-size", "4", "--dense-layers", "1"]
    dense = run(argv + ["--dense-only"], tmp_path)
    assert list(dense["results"]) == ["dense"] and dense["speedup"] is None
    assert dense["settings"]["max_model_len"] == 23  # input + output by default
    quest = run(argv + ["--quest-only"], tmp_path)
    assert list(quest["results"]) == ["quest"]


def test_a_budget_larger_than_the_context_reads_the_whole_context_and_no_more(tmp_path, capsys):
    document = run(["--input-len", "10", "--output-len", "4", "--num-iters", "1", "--num-iters-warmup", "0",
                    "--budget", "64", "--page-size", "16", "--dense-layers", "1", "--quest-only"], tmp_path)
    row = document["results"]["quest"]
    assert row["mean_tokens_attended"] == pytest.approx(10 + 4 / 2) and row["kv_fraction"] == pytest.approx(1.0)
    assert row["kv_fraction"] <= 1 and " 100.0% " in capsys.readouterr().out


def test_one_output_token_has_no_decode_step(tmp_path):
    document = run(["--input-len", "10", "--output-len", "1", "--num-iters", "1", "--num-iters-warmup", "0",
                    "--dense-only"], tmp_path)
    row = document["results"]["dense"]
    assert row["decode_ms_per_step"] is None and row["decode_tokens_per_s"] is None and row["kv_fraction"] is None
    assert "n/a" in bench.format_table({**document, "quest": document["quest"]})


def test_a_prefill_larger_than_one_step_allows_is_timed_over_its_steps(monkeypatch):
    monkeypatch.setattr(bench, "MAX_PREFILL_TOKENS", 32)
    spec = bench.LatencySpec(input_len=20, output_len=3, batch_size=3, num_iters=1, num_iters_warmup=0)
    assert spec.engine_kwargs() == {"max_num_seqs": 3, "max_num_batched_tokens": 32, "enable_chunked_prefill": False}
    from questkv.engine.llm import LLM
    from questkv.models.shapes import dummy_config

    engine = LLM(dummy_config("tiny"), device="cpu", dtype="float32", load_format="dummy", max_model_len=23,
                 **spec.engine_kwargs()).engine
    (it,) = bench.measure(engine, spec, progress=False)["iterations"]
    assert it["prefill_steps"] >= 2 and it["decode_steps"] == 2


@pytest.mark.parametrize("argv,message", [
    (["--input-len", "0"], "argument --input-len: '0' is not an integer >= 1"),
    (["--output-len", "x"], "argument --output-len: 'x' is not an integer >= 1"),
    (["--batch-size", "0"], "argument --batch-size: '0' is not an integer >= 1"),
    (["--num-iters", "0"], "argument --num-iters: '0' is not an integer >= 1"),
    (["--num-iters-warmup", "-1"], "argument --num-iters-warmup: '-1' is not an integer >= 0"),
    (["--config", "gpt2"], "argument --config: invalid choice: 'gpt2'"),
    (["--model", "m"], "argument --model: not allowed with argument --config"),
    (["--dense-only", "--quest-only"], "argument --quest-only: not allowed with argument --dense-only"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    (["--max-model-len", "1"], "argument --max-model-len: '1' is not an integer >= 2"),
    (["--seed", "-1"], "argument --seed: '-1' is not an integer >= 0"),
    (["--budget", "abc"], "budget 'abc' is not a positive integer or 'full'"),
    (["--budget", "24"], "multiple of page_size"),
])
def test_bad_values_exit_with_an_error_naming_them(argv, message, capsys, monkeypatch):
    monkeypatch.setattr("questkv.engine.llm.LLM", None)  # building an engine would fail the test
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "latency", *ENGINE, *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_runs_must_name_dense_or_quest():
    with pytest.raises(ValueError, match="runs must be 'dense' and/or 'quest'"):
        bench.run_latency(lambda quest: None, bench.LatencySpec(), None, runs=("hf",))


@pytest.mark.parametrize("argv,chunked", [([], False), (["--enable-chunked-prefill"], True)])
def test_prefills_are_unchunked_unless_asked(argv, chunked, monkeypatch, tmp_path):
    seen = []
    from questkv.engine import llm_engine

    init = llm_engine.LLMEngine.__init__

    def spy(self, config):
        seen.append(config.enable_chunked_prefill)
        init(self, config)

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", spy)
    run(["--dense-only", "--input-len", "8", "--output-len", "2", "--num-iters", "1", "--num-iters-warmup", "0",
         *argv], tmp_path)
    assert seen == [chunked]


LOSSLESS = ["--budget", "16", "--page-size", "4", "--dense-layers", "1", "--dense-context-ratio", "1",
            "--speculative-config", '{"method": "quest", "num_speculative_tokens": 3}']


def test_a_speculative_config_makes_the_quest_engine_lossless_and_adds_its_acceptance(tmp_path, capsys, monkeypatch):
    seen = []
    from questkv.engine import llm_engine

    init = llm_engine.LLMEngine.__init__

    def spy(self, config):
        seen.append(config.speculative_config)
        init(self, config)

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", spy)
    batch, output_len = random.randint(1, 3), random.randint(6, 10)
    document = run(["--input-len", str(random.randint(30, 50)), "--output-len", str(output_len), "--batch-size",
                    str(batch), "--num-iters", "2", "--num-iters-warmup", "0", "--max-model-len", "64", *LOSSLESS],
                   tmp_path)
    assert [None if s is None else s.num_speculative_tokens for s in seen] == [None, 3]  # the dense engine: none
    speculative = document["speculative_config"]
    assert (speculative["method"], speculative["num_speculative_tokens"]) == ("quest", 3)
    dense, quest = document["results"]["dense"], document["results"]["quest"]
    assert dense["acceptance_rate"] is None and dense["mean_tokens_per_verify"] is None
    assert 0 <= quest["acceptance_rate"] <= 1 and 1 <= quest["mean_tokens_per_verify"] <= 3 + 1
    for it in quest["iterations"]:  # a step of one token per request, equivalently
        assert it["decode_tokens_per_s"] == pytest.approx(batch * 1e3 / it["decode_ms_per_step"])
        assert it["decode_steps"] >= 1 and it["prefill_steps"] == 1
    assert document["speedup"] == pytest.approx(dense["decode_ms_per_step"] / quest["decode_ms_per_step"])
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("engine"))
    assert header.split()[-2:] == ["accepted", "tok/verify"]
    assert "quest is lossless: up to 3 Quest draft tokens per round" in out
    assert f"{quest['acceptance_rate']:.1%}" in out and f"{quest['mean_tokens_per_verify']:.2f}" in out


@pytest.mark.parametrize("argv, message", [
    (["--speculative-config", "{"], "argument --speculative-config: '{' is not JSON"),
    (["--speculative-config", '{"method": "quest", "num_speculative_tokens": 0}'],
     "argument --speculative-config: SpeculativeConfig.num_speculative_tokens must be >= 1, got 0"),
    ([*LOSSLESS, "--dense-only"], "--speculative-config makes the Quest engine lossless: it needs a --budget"),
    ([*LOSSLESS, "--budget", "full"], "--speculative-config makes the Quest engine lossless: it needs a --budget"),
])
def test_a_bad_or_unused_speculative_config_exits_before_any_engine_is_built(argv, message, capsys, monkeypatch):
    monkeypatch.setattr("questkv.engine.llm.LLM", None)  # building an engine would fail the test
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "latency", *ENGINE, *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
