"""The ``questkv`` command line.

Each subcommand imports its code only when it runs: :func:`main` builds in full only the parser of the command
named on the command line (the others are stubs holding their one-line help), so that ``questkv --help`` and
``questkv bench latency --help`` never import the evaluation stack (``wonderwords``, ``matplotlib``: the
``eval`` extra) nor the server's (``fastapi``, ``uvicorn``: the ``server`` extra).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Iterable, Optional, Sequence

from questkv.cli_args import (
    add_engine_args, add_quest_args, byte_size, engine_kwargs, fraction, int_at_least, quest_config, quest_options,
    resolve_dtype, unit_interval,
)
from questkv.engine.engine_config import KV_CACHE_DTYPES, QUANTIZATIONS
from questkv.config import PAGE_POLICY_OPTIONS, QuestConfig


def _add_demo(subparsers) -> None:
    from questkv import demo
    from questkv.models import DEFAULT_MODEL

    parser = subparsers.add_parser(
        "demo",
        help=_HELP["demo"],
        description="Hide a pass key in a few thousand tokens of filler, answer greedily with the engine dense and "
        "with Quest, and print both answers, whether each found the key, decode tokens/s and the share of the KV "
        f"cache each decode step read. Quest keeps QuestConfig's default of {QuestConfig().dense_layers} dense layers.",
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"alias, HF folder or .gguf (default: {DEFAULT_MODEL})")
    parser.add_argument("--length", type=int_at_least(64), default=demo.DEMO_LENGTH,
                        help=f"prompt tokens (default: {demo.DEMO_LENGTH})")
    parser.add_argument("--depth", type=unit_interval, default=demo.DEMO_DEPTH,
                        help=f"where the key sits, 0 (start) to 1 (end) (default: {demo.DEMO_DEPTH})")
    add_quest_args(parser, ["token_budget", "page_size"], plural=["token_budget"],
                   defaults={"token_budget": list(demo.DEMO_BUDGETS), "page_size": demo.DEMO_PAGE_SIZE},
                   help={"token_budget": "Quest budgets, one Quest engine each (the dense engine always runs)"})
    parser.add_argument("--max-tokens", type=int_at_least(1), default=demo.DEMO_MAX_TOKENS,
                        help=f"answer tokens (default: {demo.DEMO_MAX_TOKENS})")
    add_engine_args(parser, device="cpu", dtype="float32", max_model_len=False, seed_help="picks the pass key",
                    speculative=False)  # its dense engine takes the same engine flags
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH")
    parser.set_defaults(func=_run_demo)


def _run_demo(args) -> int:
    from questkv.demo import format_passkey_demo, run_passkey_demo

    for budget in args.token_budget:  # invalid knobs fail here, before the model loads
        quest_config(args, token_budget=budget)
    result = run_passkey_demo(args.model, length=args.length, depth=args.depth, budgets=args.token_budget,
                              page_size=args.page_size, max_tokens=args.max_tokens, seed=args.seed,
                              **engine_kwargs(args))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    print(format_passkey_demo(result))
    return 0


def _add_demo_tensors(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo-tensors",
        help=_HELP["demo-tensors"],
        description="Build a paged KV cache of random keys in which a few pages are relevant to the query, "
        "then compare Quest attention at several token budgets with dense attention.",
    )
    add_quest_args(parser, ["token_budget", "page_size"], plural=["token_budget"],
                   defaults={"token_budget": [64, 256, 1024, None]})
    parser.add_argument("--context", type=int, default=8192, help="tokens per sequence (default: 8192)")
    parser.add_argument("--batch", type=int, default=2, help="number of sequences (default: 2)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    parser.set_defaults(func=_run_demo_tensors)


def _run_demo_tensors(args) -> int:
    from questkv.demo import format_table, run_demo

    rows = run_demo(budgets=args.token_budget, batch=args.batch, context=args.context, page_size=args.page_size,
                    seed=args.seed)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)
    print(format_table(rows))
    return 0


def _int_list(text: str) -> list[int]:
    """Parse ``"2048,4096"`` into ``[2048, 4096]``."""
    items = [item.strip() for item in text.split(",")]
    if not all(item.isdigit() and int(item) > 0 for item in items):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive integers")
    return [int(item) for item in items]


def _add_model_args(parser) -> None:
    from questkv.models import ALIASES, DEFAULT_MODEL

    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"alias ({', '.join(ALIASES)}), HF model folder or .gguf file (default: {DEFAULT_MODEL})")
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                        help="weights and KV-cache dtype; auto: bfloat16 on CUDA, float32 elsewhere (CPUs without "
                        "bf16 instructions multiply bfloat16 matrices tens of times slower) (default: auto)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")


def _add_generate(subparsers) -> None:
    from questkv.demo import DEMO_PAGE_SIZE
    from questkv.models import ALIASES, DEFAULT_MODEL

    parser = subparsers.add_parser(
        "generate",
        help=_HELP["generate"],
        description="Prefill the prompt densely, decode with Quest selection (dense without --budget), stream the "
        "text to stdout, then print prompt tokens, prefill and decode tokens per second and the mean KV tokens "
        "each decode step attended (to stderr). With --speculative-config Quest drafts and dense attention "
        "verifies (the text is dense attention's), and the statistics add the share of drafts kept.",
    )
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"alias ({', '.join(ALIASES)}), HF model folder or .gguf file (default: {DEFAULT_MODEL})")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt text")
    source.add_argument("--prompt-file", help="read the prompt from this file")
    add_quest_args(parser.add_argument_group("Quest"), defaults={"page_size": DEMO_PAGE_SIZE}, help={
        "page_size": f"tokens per KV-cache page, a power of two; {DEMO_PAGE_SIZE} by default as in `questkv demo`: on "
        f"the default model page {DEMO_PAGE_SIZE} matched full attention on passkey prompts and page 16 did not"})
    parser.add_argument("--max-new-tokens", type=int_at_least(1), default=128,
                        help="tokens to generate (default: 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default: 0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default: 1.0)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    add_engine_args(parser)
    parser.set_defaults(func=_run_generate)


def _run_generate(args) -> int:
    from questkv.engine.sampling_params import SamplingParams
    from questkv.generate import generate_text

    quest = quest_config(args)  # invalid knobs fail here, before the model loads
    SamplingParams(temperature=args.temperature, top_p=args.top_p)  # likewise
    if args.prompt_file:
        with open(args.prompt_file) as handle:
            prompt = handle.read()
    else:
        prompt = args.prompt
    stats = generate_text(
        prompt,
        quest=quest,
        model=args.model,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        chat=args.chat,
        seed=args.seed,
        **engine_kwargs(args),
    )
    print(stats.summary(), file=sys.stderr)
    return 0


def _add_bench(subparsers) -> None:
    from questkv.bench import LatencySpec
    from questkv.models import DEFAULT_MODEL
    from questkv.models.shapes import DUMMY_SHAPES

    parser = subparsers.add_parser("bench", help=_HELP["bench"],
                                   description="Benchmarks of the engine.")
    commands = parser.add_subparsers(dest="bench_command", required=True)
    latency = commands.add_parser(
        "latency",
        help="prefill and decode latency, dense and Quest side by side in one run",
        description="vLLM-style latency benchmark: each iteration runs --batch-size requests of --input-len random "
        "token ids to --output-len greedy tokens (ignore_eos). Reports prefill seconds, ms per decode step, decode "
        "tokens/s (batch / step time), end-to-end seconds and KV read per step, for the dense engine and the Quest "
        "engine (built one after the other, on the same prompts), and the decode speedup dense / Quest. Prompts "
        "are prefilled unchunked unless --enable-chunked-prefill is given. With --speculative-config the Quest "
        "engine is lossless: its row adds the share of draft tokens kept and the tokens per verify step, and its "
        "ms per decode step is that of an equivalent one-token step (decode time over the tokens a request gained).",
    )
    source = latency.add_mutually_exclusive_group()
    source.add_argument("--model", default=None,
                        help=f"alias, HF folder or .gguf file (default: {DEFAULT_MODEL} unless --config)")
    source.add_argument("--config", choices=list(DUMMY_SHAPES), default=None,
                        help="a model shape with random weights instead of --model (no checkpoint needed)")
    defaults = LatencySpec()
    latency.add_argument("--input-len", type=int_at_least(1), default=defaults.input_len,
                         help=f"prompt tokens per request (default: {defaults.input_len})")
    latency.add_argument("--output-len", type=int_at_least(1), default=defaults.output_len,
                         help=f"generated tokens per request (default: {defaults.output_len})")
    latency.add_argument("--batch-size", type=int_at_least(1), default=defaults.batch_size,
                         help=f"requests decoded together (default: {defaults.batch_size})")
    latency.add_argument("--num-iters", type=int_at_least(1), default=defaults.num_iters,
                         help=f"timed iterations (default: {defaults.num_iters})")
    latency.add_argument("--num-iters-warmup", type=int_at_least(0), default=defaults.num_iters_warmup,
                         help=f"untimed iterations first (default: {defaults.num_iters_warmup})")
    which = latency.add_mutually_exclusive_group()
    which.add_argument("--dense-only", action="store_true", help="measure only the dense engine")
    which.add_argument("--quest-only", action="store_true", help="measure only the Quest engine")
    add_quest_args(latency.add_argument_group("Quest"), defaults={"token_budget": 1024})
    add_engine_args(latency)
    latency.add_argument("--json", metavar="PATH", help="also write the results and their provenance to PATH")
    latency.set_defaults(func=_run_bench_latency)


def _run_bench_latency(args) -> int:
    import torch

    from questkv import bench
    from questkv.eval.provenance import provenance
    from questkv.models import DEFAULT_MODEL

    quest = quest_config(args)  # invalid knobs fail here, before the model loads
    spec = bench.LatencySpec(input_len=args.input_len, output_len=args.output_len, batch_size=args.batch_size,
                             num_iters=args.num_iters, num_iters_warmup=args.num_iters_warmup, seed=args.seed)
    flags = engine_kwargs(args)
    speculative = flags.pop("speculative_config", None)  # the Quest engine's only
    if speculative is not None and (args.dense_only or quest.is_dense):  # before the dense run, not after it
        raise ValueError("--speculative-config makes the Quest engine lossless: it needs a --budget and a Quest run "
                         "(not --dense-only)")
    kwargs = {**flags, **spec.engine_kwargs(), "seed": args.seed}
    if "enable_chunked_prefill" in flags:  # the one run setting a flag may change
        kwargs["enable_chunked_prefill"] = flags["enable_chunked_prefill"]
    kwargs.setdefault("max_model_len", args.input_len + args.output_len)
    if args.config is not None:
        from questkv.models.shapes import DUMMY_SHAPES, dummy_config

        positions = max(DUMMY_SHAPES[args.config][1]["max_position_embeddings"], kwargs["max_model_len"])
        model, kwargs["load_format"] = dummy_config(args.config, max_position_embeddings=positions), "dummy"
        name = f"{args.config} (random weights)"
    else:
        model = name = args.model or DEFAULT_MODEL

    def make_engine(quest_or_none):
        from questkv.engine.llm import LLM

        lossless = {} if quest_or_none is None else {"speculative_config": speculative}
        return LLM(model, quest=quest_or_none, **kwargs, **lossless).engine

    runs = ("dense",) if args.dense_only else ("quest",) if args.quest_only else bench.RUNS
    document = bench.run_latency(make_engine, spec, quest, runs)
    device = kwargs["device"] or ("cuda" if torch.cuda.is_available() else "cpu")
    document = {
        "provenance": provenance(device, command="questkv " + " ".join(sys.argv[1:])),
        "model": name,
        "settings": {**dataclasses.asdict(spec), **kwargs},
        "quest": dataclasses.asdict(quest),
        "speculative_config": None if speculative is None else dataclasses.asdict(speculative),
        **document,
    }
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(document, handle, indent=2)
    print(f"{name}: batch {spec.batch_size}, input {spec.input_len}, output {spec.output_len}, "
          f"{kwargs['dtype']} on {device}")
    print(bench.format_table(document))
    return 0


def _name_list(kind: str, known: Sequence[str]):
    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",")]
        bad = [item for item in items if item not in known]
        if bad:
            raise argparse.ArgumentTypeError(f"{kind} {', '.join(map(repr, bad))} not known; allowed: {', '.join(known)}")
        return items

    return parse


def _policy_list(text: str) -> list[str]:
    """``--policies``: comma-separated policy strings (:func:`questkv.eval.harness.parse_policy`)."""
    from questkv.eval.harness import parse_policy
    from questkv.policies import POLICIES

    items = [item.strip() for item in text.split(",")]
    _name_list("policy", tuple(POLICIES))(",".join(item.split(":")[0] for item in items))
    for item in items:
        try:
            parse_policy(item)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from error
    return items


def _add_eval(subparsers) -> None:
    from questkv.eval.harness import EVAL_BACKENDS
    from questkv.eval.sweep import ALL_TASKS
    from questkv.policies import POLICIES

    parser = subparsers.add_parser(
        "eval",
        help=_HELP["eval"],
        description="Evaluate KV-selection policies under Quest's protocol: each context is prefilled densely, "
        "then every policy and budget decodes the question tail one token at a time and answers greedily (ppl: scores "
        "the window's last tokens through decode steps; agreement_book/agreement_code: the share of positions where "
        "each setting's argmax is dense's greedy token over real text, engine only). full and quest run on the "
        "engine by default, the other policies on the HF drop-in (--eval-backend). `questkv eval TASK` runs one "
        "task, `questkv eval sweep` several; results are resumable JSON, a markdown table and a PNG plot.",
    )
    commands = parser.add_subparsers(dest="eval_command", required=True, metavar="{sweep,report," + ",".join(ALL_TASKS) + "}")
    for name in ("sweep",) + ALL_TASKS:
        sub = commands.add_parser(
            name,
            help="several tasks in one run" if name == "sweep" else f"the {name} task",
            description="Run a grid of tasks x lengths x policies x budgets." if name == "sweep" else f"Run the {name} task.",
        )
        _add_model_args(sub)
        if name == "sweep":
            sub.add_argument("--tasks", type=_name_list("task", ALL_TASKS), required=True,
                             help=f"comma-separated tasks: {', '.join(ALL_TASKS)}")
        sub.add_argument("--lengths", type=_int_list, default=[4096], help="context lengths in tokens (default: 4096)")
        sub.add_argument("--policies", type=_policy_list, default=["full", "quest"],
                         help=f"comma-separated policies: {', '.join(POLICIES)}, each optionally with options of its "
                         "own that override the flags below, NAME:option=value:... (e.g. quest:selection=q_head, "
                         "quest:page_size=8, quest:selection_interval=4 (engine only), "
                         "quest-topp:top_p=0.9:min_budget=128, quest-rerank:shortlist=4:rerank=max, "
                         "quest-rerank:shortlist=16:key_bits=2) "
                         "(default: full,quest)")
        add_quest_args(sub, ["token_budget", "page_size", "dense_layers"], plural=["token_budget"],
                       defaults={"token_budget": [256, 512]},
                       help={"token_budget": "token budgets of every policy but full"})
        sub.add_argument("--samples", type=int, default=10,
                         help="prompts per task and length; ppl: text windows per length (default: 10)")
        pages = sub.add_argument_group("page policies (quest, oracle, quest-topp, quest-rerank)")
        add_quest_args(pages, PAGE_POLICY_OPTIONS)
        pages.add_argument("--top-p", type=float, default=0.9,
                           help="quest-topp: estimated attention mass to reach; its budget is the cap (default: 0.9)")
        sub.add_argument("--score-tokens", type=int, default=256,
                         help="ppl: tokens scored at the end of every window, each through a decode step (default: 256)")
        sub.add_argument("--text-file", default=None,
                         help="ppl: UTF-8 text to score (default: the Python stdlib's pydoc_data.topics)")
        sub.add_argument("--agreement-tokens", type=int_at_least(1), default=128,
                         help="agreement_*: positions scored per window, each a token dense attention decoded "
                         "greedily (default: 128)")
        sub.add_argument("--code-commit", default=None,
                         help="agreement_code: the commit of questkv's source to read with git (default: the "
                         "tree's; where git is missing, the tree itself)")
        backend = sub.add_argument_group("backend")
        backend.add_argument("--eval-backend", choices=list(EVAL_BACKENDS), default="auto",
                             help="what decodes the settings: engine (questkv.LLM: full and quest, selection_interval "
                             "included), hf (the HF drop-in: every policy but selection_interval > 1), auto (the engine "
                             "where it runs the policy, else hf) (default: auto)")
        backend.add_argument("--max-num-seqs", type=int_at_least(1), default=128,
                             help="engine: the most requests decoded together (default: 128)")
        backend.add_argument("--gpu-memory-utilization", type=fraction, default=0.9,
                             help="engine: share of the GPU's whole memory it may occupy (default: 0.9)")
        backend.add_argument("--kv-cache-memory", type=byte_size, default=None,
                             help="engine: KV-cache size, e.g. 40GiB (default: what --gpu-memory-utilization "
                             "leaves, 1 GiB on CPU)")
        backend.add_argument("--enforce-eager", action="store_true", help="engine: never capture CUDA graphs")
        backend.add_argument("--quantization", choices=list(QUANTIZATIONS), default=None,
                             help="engine only: its weights, as `questkv generate --quantization` (gguf: a GGUF on its "
                             "own packed bits; int4/int8: a float checkpoint rounded at load) (default: the "
                             "checkpoint's dtype, a GGUF dequantized)")
        backend.add_argument("--quantize-lm-head", action="store_true",
                             help="engine only, with --quantization int4/int8: round the LM head too (default: it "
                             "stays in --dtype)")
        backend.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                             help="engine only: the K/V pages' dtype, as `questkv generate --kv-cache-dtype` (fp8: "
                             "float8 e4m3) (default: auto, --dtype)")
        sub.add_argument("--json", metavar="PATH",
                         help="write the cells to PATH after every setting, plus PATH's .md table and .png plot; an "
                         "existing PATH with the same settings is resumed (its finished cells are skipped)")
        sub.add_argument("--fresh", action="store_true", help="ignore (overwrite) an existing --json PATH instead of resuming")
        sub.add_argument("--plot", metavar="PNG", help="write the plot here (default: the --json PATH with .png)")
        sub.add_argument("--no-plot", action="store_true",
                         help="skip the PNG (e.g. where matplotlib is missing); `questkv eval report PATH` draws it later")
        sub.set_defaults(func=_run_eval)
    _add_eval_report(commands)


def _run_eval(args) -> int:
    from pathlib import Path

    from questkv.eval import sweep
    from questkv.eval.engine_backend import EngineSource
    from questkv.eval.provenance import provenance

    quest = quest_options(args, sweep.QUEST_FIELDS)
    spec = sweep.SweepSpec(
        tasks=args.tasks if args.eval_command == "sweep" else [args.eval_command],
        lengths=args.lengths,
        policies=args.policies,
        budgets=args.token_budget if any(p != "full" for p in args.policies) else [],
        samples=args.samples,
        seed=args.seed,
        top_p=args.top_p,
        score_tokens=args.score_tokens,
        text_file=args.text_file,
        eval_backend=args.eval_backend,
        agreement_tokens=args.agreement_tokens,
        code_commit=args.code_commit,
        quantization=args.quantization,
        quantize_lm_head=args.quantize_lm_head,
        kv_cache_dtype=args.kv_cache_dtype,
        **quest,
    )

    dtype = resolve_dtype(args.dtype, on_cuda=args.device.startswith("cuda"))

    def load():
        from questkv.models import load_model

        return load_model(args.model, device=args.device, dtype=dtype)

    def load_tokenizer():
        from questkv.models.loader import load_tokenizer

        return load_tokenizer(args.model)

    def run_info() -> dict:
        return {**provenance(args.device, command="questkv " + " ".join(sys.argv[1:])), "dtype": dtype}

    engine = EngineSource(args.model, {
        "device": args.device.split(":")[0], "dtype": dtype, "enforce_eager": args.enforce_eager,
        "gpu_memory_utilization": args.gpu_memory_utilization, "kv_cache_memory": args.kv_cache_memory,
    }, max_num_seqs=args.max_num_seqs)
    path = Path(args.json) if args.json else None
    document = sweep.resume_sweep(path, args.model, spec, load, run_info, fresh=args.fresh, engine=engine,
                                  load_tokenizer=load_tokenizer)
    _write_reports(document, path, args.plot, args.no_plot)
    return 0


def _write_reports(document: dict, path, plot, no_plot: bool) -> None:
    """Print the table; write the JSON, its .md beside it, and the PNG plot (unless ``no_plot``)."""
    from pathlib import Path

    from questkv.eval import report, sweep

    plot = None if no_plot else (Path(plot) if plot else (path.with_suffix(".png") if path else None))
    if plot is not None:
        spec = document["spec"]
        report.plot_sweep(document["cells"], plot, title=f"{document['model']}, page {spec['page_size']}, "
                          f"{spec['samples']} samples per cell")
    if path is not None:
        sweep.save(path, document)
        path.with_suffix(".md").write_text(report.markdown(document, None if plot is None else plot.name))
    print(report.format_table(document["cells"]))


def _add_eval_report(commands) -> None:
    sub = commands.add_parser(
        "report", help="redraw the table, .md and plot of an existing result JSON (no model needed)",
        description="Read a `questkv eval` JSON and write its markdown table (PATH with .md) and PNG plot again.",
    )
    sub.add_argument("json", metavar="PATH", help="the result JSON of `questkv eval`")
    sub.add_argument("--plot", metavar="PNG", help="write the plot here (default: PATH with .png)")
    sub.add_argument("--no-plot", action="store_true", help="skip the PNG")
    sub.set_defaults(func=_run_eval_report)


def _run_eval_report(args) -> int:
    from pathlib import Path

    path = Path(args.json)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is not a file")
    with open(path) as handle:
        document = json.load(handle)
    _write_reports(document, path, args.plot, args.no_plot)
    return 0


_HELP = {
    "demo": "a passkey prompt answered by the engine dense and with Quest (what `make demo` runs)",
    "demo-tensors": "Quest vs dense decode attention on random tensors (no model needed)",
    "generate": "generate text on the engine, dense or with Quest, streaming, with prefill/decode speed",
    "bench": "benchmarks of the engine (latency)",
    "serve": "OpenAI-compatible HTTP server on the engine, with per-request Quest budgets",
    "eval": "accuracy / perplexity of KV-selection policies by budget (RULER tasks, passkey, ppl) with plots",
}


def build_parser(commands: Optional[Iterable[str]] = None) -> argparse.ArgumentParser:
    """The ``questkv`` parser with the subcommands ``commands`` (default: all) built in full; the others are
    stubs holding their one-line help (building a subcommand imports its code)."""
    builders = {"demo": _add_demo, "demo-tensors": _add_demo_tensors, "generate": _add_generate, "bench": _add_bench,
                "serve": _add_serve, "eval": _add_eval}
    full = set(builders if commands is None else commands)
    parser = argparse.ArgumentParser(prog="questkv", description="Query-aware KV-cache page sparsity (Quest) for long-context decoding.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, build in builders.items():
        if name in full:
            build(subparsers)
        else:
            subparsers.add_parser(name, help=_HELP[name])
    return parser


def _command(argv: Sequence[str]) -> Optional[str]:
    """The subcommand ``argv`` names (its first word that is not an option), if any."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def _add_serve(subparsers) -> None:
    from questkv.server import add_serve_args, run_server

    parser = subparsers.add_parser(
        "serve",
        help=_HELP["serve"],
        description="Serve --model over HTTP with OpenAI's /v1/completions and /v1/chat/completions (streaming too), "
        "/v1/models, /health and /metrics. A request may pick its own Quest budget with the body field "
        '"quest": {"token_budget": N} (up to --budget) or {"dense": true}, and on a lossless engine '
        '(--speculative-config) its draft tokens per round with {"speculative_tokens": K} (0: lossy Quest).',
    )
    add_serve_args(parser)
    parser.set_defaults(func=run_server)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser([name for name in [_command(argv)] if name in _HELP])
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as error:
        command = {"eval": f"eval {getattr(args, 'eval_command', '')}",
                   "bench": f"bench {getattr(args, 'bench_command', '')}"}.get(args.command, args.command)
        parser.exit(2, f"questkv {command}: error: {error}\n")


if __name__ == "__main__":
    sys.exit(main())
