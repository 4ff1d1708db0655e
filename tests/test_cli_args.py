"""questkv.cli_args: Quest flags read from QuestConfig's fields, and the commands that use them."""

import argparse
import dataclasses
import json
import random
import re

import pytest

from questkv import QuestConfig, cli
from questkv.cli_args import FIELDS, add_quest_args, flag, quest_config, quest_options, resolve_dtype, seconds
from questkv.config import BACKENDS, GROUP_REDUCTIONS, PAGE_POLICY_OPTIONS, SELECTIONS
from questkv.demo import DEMO_PAGE_SIZE
from questkv.models import DEFAULT_MODEL

FLAGS = {
    "token_budget": "--budget", "page_size": "--page-size", "dense_layers": "--dense-layers",
    "selection": "--selection", "group_reduction": "--group-reduction", "sink_pages": "--sink-pages", "recent_pages": "--recent-pages",
    "backend": "--backend", "dense_context_ratio": "--dense-context-ratio", "selection_interval": "--selection-interval",
}


def parser_with(*args, **kwargs) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="test")
    add_quest_args(parser, *args, **kwargs)
    return parser


def parse_error(parser, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_every_field_has_its_flag_and_default():
    assert list(FIELDS) == [field.name for field in dataclasses.fields(QuestConfig)] == list(FLAGS)
    assert {name: flag(name) for name in FIELDS} == FLAGS
    assert flag("token_budget", plural=True) == "--budgets"
    args = parser_with().parse_args([])
    assert quest_options(args) == {field.name: field.default for field in dataclasses.fields(QuestConfig)}
    assert quest_config(args) == QuestConfig()


def test_flags_build_the_config():
    rng = random.Random()
    page_size = rng.choice([4, 8, 16])
    sink, recent = rng.randrange(3), rng.randrange(3)
    budget = page_size * (sink + recent + 1 + rng.randrange(4))
    expected = QuestConfig(
        token_budget=budget, page_size=page_size, dense_layers=rng.randrange(4), selection=rng.choice(SELECTIONS),
        group_reduction=rng.choice(GROUP_REDUCTIONS), sink_pages=sink, recent_pages=recent,
        backend=rng.choice(BACKENDS), dense_context_ratio=rng.uniform(1, 8), selection_interval=rng.randint(2, 9),
    )
    argv = [item for name in FIELDS for item in (FLAGS[name], str(getattr(expected, name)))]
    assert quest_config(parser_with().parse_args(argv)) == expected
    assert quest_config(parser_with().parse_args(["--budget", "full"])).token_budget is None


def test_choices_and_help_come_from_the_fields():
    actions = {action.dest: action for action in parser_with()._actions}
    assert actions["selection"].choices == SELECTIONS
    assert actions["group_reduction"].choices == GROUP_REDUCTIONS
    assert actions["backend"].choices == BACKENDS
    for name, field in FIELDS.items():
        assert actions[name].help.startswith(field.metadata["help"])
    assert actions["token_budget"].help.endswith("(default: full)")
    assert actions["page_size"].help.endswith("(default: 16)")


def test_plural_flags_take_lists_and_a_subset_of_fields():
    parser = parser_with(["token_budget", "page_size", "selection"], plural=["token_budget", "selection"],
                         defaults={"token_budget": [64, None]}, help={"page_size": "page of the demo"})
    args = parser.parse_args([])
    assert quest_options(args) == {"token_budget": [64, None], "page_size": 16, "selection": ["kv_head"]}
    args = parser.parse_args(["--budgets", "32,full,128", "--selections", "q_head,kv_head", "--page-size", "8"])
    assert args.token_budget == [32, None, 128] and args.selection == ["q_head", "kv_head"]
    configs = [quest_config(args, token_budget=b, selection=s) for b in args.token_budget for s in args.selection]
    assert configs[0] == QuestConfig(token_budget=32, page_size=8, selection="q_head")
    assert quest_options(args, ["page_size"]) == {"page_size": 8}
    assert not hasattr(args, "dense_layers")
    assert next(a for a in parser._actions if a.dest == "page_size").help == "page of the demo (default: 16)"
    with pytest.raises(ValueError, match="no Quest flag for field.s. dense_layers"):
        quest_options(args, ["dense_layers"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--budget", "abc"], "argument --budget: budget 'abc' is not a positive integer or 'full'"),
        (["--budget", "0"], "budget '0' is not a positive integer or 'full'"),
        (["--budget", "64,128"], "--budget takes one value, got '64,128'"),
        (["--page-size", "x"], "page-size 'x' is not a positive integer"),
        (["--dense-layers", "-1"], "dense-layers '-1' is not a non-negative integer"),
        (["--recent-pages", "1.5"], "recent-pages '1.5' is not a non-negative integer"),
        (["--selection", "page"], "argument --selection: invalid choice: 'page'"),
        (["--backend", "cuda"], "argument --backend: invalid choice: 'cuda'"),
        (["--dense-context-ratio", "0.5"], "dense-context-ratio '0.5' is not a number in [1.0, 1000000000.0]"),
        (["--dense-context-ratio", "high"], "dense-context-ratio 'high' is not a number in [1.0, 1000000000.0]"),
        (["--reselect-similarity", "0.9"], "unrecognized arguments: --reselect-similarity"),
    ],
)
def test_bad_values_are_refused_by_name(argv, message, capsys):
    parser = argparse.ArgumentParser(prog="test")
    add_quest_args(parser)
    assert message in parse_error(parser, argv, capsys)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--budgets", "64,abc"], "budget 'abc' is not a positive integer or 'full'"),
        (["--selections", "kv_head,page"], "selection 'page' is not one of kv_head, q_head"),
    ],
)
def test_bad_list_items_are_refused_by_name(argv, message, capsys):
    parser = argparse.ArgumentParser(prog="test")
    add_quest_args(parser, ["token_budget", "selection"], plural=["token_budget", "selection"])
    assert message in parse_error(parser, argv, capsys)


def test_invalid_combinations_are_left_to_quest_config():
    args = parser_with().parse_args(["--budget", "24", "--page-size", "16"])
    with pytest.raises(ValueError, match="QuestConfig.token_budget must be a multiple of page_size=16, got 24"):
        quest_config(args)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(names=["budget"]), "'budget' is not a QuestConfig field"),
        (dict(names=["page_size"], plural=["token_budget"]), "plural names field.s. token_budget not in names"),
        (dict(names=["page_size"], defaults={"selection": "q_head"}), "defaults names field.s. selection not in"),
        (dict(names=["page_size"], help={"backend": "x"}), "help names field.s. backend not in"),
    ],
)
def test_bad_helper_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        add_quest_args(argparse.ArgumentParser(), **kwargs)


def test_commands_take_their_quest_flags_from_the_config():
    parser = cli.build_parser()
    defaults = {field.name: field.default for field in dataclasses.fields(QuestConfig)}
    generate = parser.parse_args(["generate", "--prompt", "hi"])
    assert quest_config(generate) == QuestConfig(page_size=DEMO_PAGE_SIZE)  # the demo's page size (below)
    evaluation = parser.parse_args(["eval", "sweep", "--tasks", "passkey"])
    names = ["token_budget", "page_size", "dense_layers", *PAGE_POLICY_OPTIONS]
    assert quest_options(evaluation) == {**{n: defaults[n] for n in names}, "token_budget": [256, 512]}
    demo = parser.parse_args(["demo", "--budgets", "32,full", "--page-size", "8"])
    assert quest_options(demo) == {"token_budget": [32, None], "page_size": 8}
    argv = ["eval", "passkey", "--budgets", "32", "--page-size", "8", "--dense-layers", "1", "--selection", "q_head",
            "--group-reduction", "max", "--sink-pages", "1", "--recent-pages", "2", "--top-p", "0.5"]
    assert quest_options(parser.parse_args(argv)) == dict(
        token_budget=[32], page_size=8, dense_layers=1, selection="q_head", group_reduction="max", sink_pages=1,
        recent_pages=2,
    )


@pytest.mark.parametrize("dtype, on_cuda, want", [
    ("auto", True, "bfloat16"), ("auto", False, "float32"), ("float16", False, "float16"), ("bfloat16", False, "bfloat16"),
])
def test_auto_dtype_is_bfloat16_on_cuda_and_float32_elsewhere(dtype, on_cuda, want):
    assert resolve_dtype(dtype, on_cuda) == want


@pytest.mark.parametrize("allow_zero, text, ok", [
    (False, "1.5", True), (False, "0", False), (False, "-1", False), (False, "soon", False), (False, "nan", False),
    (True, "0", True), (True, "-0.1", False), (True, "2", True),
])
def test_seconds_accepts_positive_numbers_and_zero_only_when_allowed(allow_zero, text, ok):
    parse = seconds(allow_zero)
    if ok:
        assert parse(text) == float(text)
    else:
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(f"{text!r} is not a number of seconds")):
            parse(text)


def test_every_engine_command_takes_the_tensor_parallel_size(capsys):
    from questkv.cli_args import engine_kwargs
    from questkv.server.launch import add_serve_args

    parser = cli.build_parser()
    for argv in (["generate", "--prompt", "hi"], ["demo"], ["bench", "latency"]):
        assert engine_kwargs(parser.parse_args(argv))["tensor_parallel_size"] == 1
        assert engine_kwargs(parser.parse_args([*argv, "--tensor-parallel-size", "2"]))["tensor_parallel_size"] == 2
    serve = argparse.ArgumentParser(prog="serve")
    add_serve_args(serve)
    assert engine_kwargs(serve.parse_args(["m", "--tensor-parallel-size", "4"]))["tensor_parallel_size"] == 4
    assert "--tensor-parallel-size" in parse_error(serve, ["m", "--tensor-parallel-size", "0"], capsys)


def test_every_engine_command_takes_the_quantization_and_quantize_lm_head():
    from questkv.cli_args import engine_kwargs
    from questkv.server.launch import add_serve_args

    parser = cli.build_parser()
    serve = argparse.ArgumentParser(prog="serve")
    add_serve_args(serve)
    for parse, argv in ((parser.parse_args, ["generate", "--prompt", "hi"]), (parser.parse_args, ["demo"]),
                        (parser.parse_args, ["bench", "latency"]), (serve.parse_args, ["m"])):
        plain = engine_kwargs(parse(argv))
        assert "quantization" not in plain and "quantize_lm_head" not in plain  # the config's defaults
        kwargs = engine_kwargs(parse([*argv, "--quantization", "int4", "--quantize-lm-head"]))
        assert kwargs["quantization"] == "int4" and kwargs["quantize_lm_head"] is True
    args = parser.parse_args(["eval", "ppl", "--model", "m", "--quantization", "int8", "--quantize-lm-head"])
    assert args.quantization == "int8" and args.quantize_lm_head is True


def test_generate_defaults_to_the_page_size_that_finds_the_key_on_the_default_model():
    """The README and the demo: on the default model page 8 matched full attention on passkey prompts, page 16 did
    not; `questkv generate` (whose default model that is) takes the demo's page size by default."""
    args = cli.build_parser().parse_args(["generate", "--prompt", "hi", "--budget", "256"])
    assert args.model == DEFAULT_MODEL and args.page_size == DEMO_PAGE_SIZE == 8
    assert quest_config(args) == QuestConfig(token_budget=256, page_size=8)
    assert cli.build_parser().parse_args(["generate", "--prompt", "hi", "--page-size", "16"]).page_size == 16


def test_every_model_command_takes_model_and_serve_keeps_its_positional_alias(capsys):
    from questkv.server.launch import add_serve_args, serve_model

    parser = cli.build_parser()
    for argv in (["generate", "--prompt", "hi"], ["demo"], ["bench", "latency"], ["eval", "ppl"]):
        assert parser.parse_args([*argv, "--model", "m"]).model == "m"
    serve = argparse.ArgumentParser(prog="serve")
    add_serve_args(serve)
    for argv in (["--model", "m"], ["m"], ["m", "--model", "m"], ["--port", "0", "m"]):
        assert serve_model(serve.parse_args(argv)) == "m"
    with pytest.raises(ValueError, match="a model is required: --model MODEL"):
        serve_model(serve.parse_args([]))
    with pytest.raises(ValueError, match="MODEL 'a' and --model 'b' differ"):
        serve_model(serve.parse_args(["a", "--model", "b"]))
    serve.print_help()
    text = capsys.readouterr().out
    assert "--model MODEL" in text and "the same as --model, positional" in text


def test_serve_refuses_a_missing_or_doubled_model_before_loading_one(capsys, monkeypatch):
    monkeypatch.setattr("questkv.engine.llm_engine.LLMEngine", None)  # loading a model would fail the test
    for argv, message in ((["serve"], "a model is required"), (["serve", "a", "--model", "b"], "differ")):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "questkv serve: error: " in err and message in err


SPECULATIVE = '{"method": "quest", "num_speculative_tokens": 4}'


def test_every_quest_engine_command_takes_vllms_speculative_config_and_it_reaches_the_engine_config():
    from questkv.cli_args import engine_kwargs
    from questkv.config import SpeculativeConfig
    from questkv.engine.engine_config import EngineConfig
    from questkv.server.launch import _engine_config, add_serve_args
    from tests.helpers import tiny_config

    parser = cli.build_parser()
    serve = argparse.ArgumentParser(prog="serve")
    add_serve_args(serve)
    k = random.randint(1, 16)
    given = json.dumps({"method": "quest", "num_speculative_tokens": k})
    for parse, argv in ((parser.parse_args, ["generate", "--prompt", "hi"]), (parser.parse_args, ["bench", "latency"]),
                        (serve.parse_args, ["m"])):
        assert "speculative_config" not in engine_kwargs(parse(argv))  # the config's default: lossy Quest
        args = parse([*argv, "--budget", "16", "--page-size", "4", "--speculative-config", given])
        kwargs = engine_kwargs(args)
        assert kwargs["speculative_config"] == SpeculativeConfig("quest", k)
        config = EngineConfig(model=tiny_config("llama3"), quest=quest_config(args), **{**kwargs, "load_format": "dummy"})
        assert config.speculative_config == SpeculativeConfig("quest", k)
    args = serve.parse_args(["m", "--budget", "16", "--page-size", "4", "--speculative-config", given,
                             "--load-format", "dummy"])
    args.model = tiny_config("llama3")
    assert _engine_config(args).speculative_config == SpeculativeConfig("quest", k)
    assert parser.parse_args(["generate", "--prompt", "hi", "--speculative-config", "null"]).speculative_config is None
    assert not hasattr(parser.parse_args(["demo"]), "speculative_config")  # its dense engine takes the engine flags


@pytest.mark.parametrize("value, message", [
    ("{method: quest}", "is not JSON"),
    ('{"method": "ngram", "num_speculative_tokens": 4}', "SpeculativeConfig.method must be one of 'quest'"),
    ('{"method": "quest", "num_speculative_tokens": 0}', "SpeculativeConfig.num_speculative_tokens must be >= 1"),
    ('{"method": "quest", "num_speculative_tokens": 17}', "SpeculativeConfig.num_speculative_tokens must be <= 16"),
    ('{"method": "quest", "num_speculative_tokens": "4"}', "SpeculativeConfig.num_speculative_tokens must be an int"),
    ('{"method": "quest", "k": 4}', "--speculative-config has unknown keys ['k']"),
    ("4", "--speculative-config must be a dict"),
])
def test_a_bad_speculative_config_is_an_argparse_error_naming_the_flag(value, message, capsys):
    from questkv.server.launch import add_serve_args

    serve = argparse.ArgumentParser(prog="serve")
    add_serve_args(serve)
    for parser, argv in ((cli.build_parser(), ["generate", "--prompt", "hi"]), (cli.build_parser(), ["bench", "latency"]),
                         (serve, ["m"])):
        err = parse_error(parser, [*argv, "--speculative-config", value], capsys)
        assert "argument --speculative-config: " in err and message in err


def test_the_speculative_config_help_says_what_it_does(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--speculative-config JSON" in text and '\'{"method": "quest", "num_speculative_tokens": K}\'' in text
    assert "dense attention's output" in text and "Needs --budget" in text
