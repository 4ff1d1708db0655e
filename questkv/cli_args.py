"""Command-line flags of the Quest knobs, read from :class:`~questkv.QuestConfig`'s fields.

:func:`add_quest_args` adds one flag per field. Its name (``--budget``, ``--page-size``, ...), help,
choices and allowed ints come from the field's metadata in :mod:`questkv.config` and its default
from the field, so every command that takes Quest knobs (``generate``, ``eval``, ``bench latency``,
``serve``) spells them the same. A sweep's field takes a comma-separated list instead (``plural``:
the flag gains an ``s``, ``--budgets``). A flag's value lands on ``args.<field name>``
(``args.token_budget``); :func:`quest_options` and :func:`quest_config` read them back::

    add_quest_args(parser)                           # every knob, one value each
    config = quest_config(parser.parse_args(argv))   # validated by QuestConfig

    add_quest_args(parser, ["token_budget", "page_size"], plural=["token_budget"])
    configs = [quest_config(args, token_budget=budget) for budget in args.token_budget]

This module parses the text of a value (an int, the word for ``None``, a choice); what depends on
several fields (a budget that is a multiple of the page size) is left to :class:`~questkv.QuestConfig`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any, Callable, Iterable, Mapping, Optional

from questkv.config import MAX_SPECULATIVE_TOKENS, QuestConfig, SpeculativeConfig
from questkv.engine.engine_config import KV_CACHE_DTYPES, QUANTIZATIONS

__all__ = ["FIELDS", "add_quest_args", "flag", "quest_config", "quest_options"]

FIELDS: dict[str, dataclasses.Field] = {field.name: field for field in dataclasses.fields(QuestConfig)}


def flag(name: str, plural: bool = False) -> str:
    """The flag of field ``name``: ``flag("token_budget")`` is ``"--budget"``, plural ``"--budgets"``."""
    return _field(name).metadata["flag"] + ("s" if plural else "")


def add_quest_args(
    parser,
    names: Optional[Iterable[str]] = None,
    plural: Iterable[str] = (),
    defaults: Optional[Mapping[str, Any]] = None,
    help: Optional[Mapping[str, str]] = None,
) -> None:
    """Add a flag for each :class:`~questkv.QuestConfig` field in ``names`` to ``parser``.

    Args:
        parser: an ``argparse.ArgumentParser`` or argument group.
        names: field names, in the order the flags appear; default every field.
        plural: fields of ``names`` whose flag (its name plus ``s``) takes a comma-separated list;
            ``args.<field>`` is then a list.
        defaults: defaults instead of the fields' own (a list for a plural field, whose default is
            otherwise ``[the field's default]``).
        help: help texts instead of the fields' own (what the knob means for this command).

    Raises:
        ValueError: a name that is not a field, or a ``plural``, ``defaults`` or ``help`` entry for a
            field not in ``names``.
    """
    names = list(FIELDS) if names is None else list(names)
    plural, defaults, help = set(plural), dict(defaults or {}), dict(help or {})
    for name in names:
        _field(name)
    for kind, given in (("plural", plural), ("defaults", defaults), ("help", help)):
        extra = sorted(set(given) - set(names))
        if extra:
            raise ValueError(f"add_quest_args {kind} names field(s) {', '.join(extra)} not in names {names}")
    for name in names:
        meta, many = FIELDS[name].metadata, name in plural
        default = defaults.get(name, [FIELDS[name].default] if many else FIELDS[name].default)
        shown = ",".join(_show(name, value) for value in default) if many else _show(name, default)
        text = help.get(name, meta["help"]) + (" (comma-separated; " if many else " (") + f"default: {shown})"
        metavar = meta["flag"].lstrip("-").replace("-", "_").upper()  # --page-size PAGE_SIZE, --budgets BUDGET,...
        if many:
            parser.add_argument(flag(name, True), dest=name, type=_list_parser(name), default=default, help=text,
                                metavar=f"{metavar},...")
        elif meta["choices"]:
            parser.add_argument(flag(name), dest=name, choices=meta["choices"], default=default, help=text)
        else:
            parser.add_argument(flag(name), dest=name, type=_single_parser(name), default=default, help=text,
                                metavar=metavar)


def quest_options(args: argparse.Namespace, names: Optional[Iterable[str]] = None) -> dict[str, Any]:
    """``{field: value}`` of the Quest flags on ``args`` (those of ``names``, default all that are there).

    Raises:
        ValueError: a name of ``names`` that is not a field or has no flag on ``args``.
    """
    if names is None:
        return {name: getattr(args, name) for name in FIELDS if hasattr(args, name)}
    names = [_field(name).name for name in names]
    missing = [name for name in names if not hasattr(args, name)]
    if missing:
        raise ValueError(f"no Quest flag for field(s) {', '.join(missing)} on these arguments")
    return {name: getattr(args, name) for name in names}


def quest_config(args: argparse.Namespace, **overrides: Any) -> QuestConfig:
    """The :class:`~questkv.QuestConfig` of the Quest flags on ``args`` (fields without a flag keep
    their defaults), ``overrides`` replacing them (e.g. one budget of a plural ``--budgets``).

    Raises:
        ValueError: an invalid combination (from :class:`~questkv.QuestConfig`).
    """
    return QuestConfig(**{**quest_options(args), **overrides})


def _field(name: str) -> dataclasses.Field:
    if name not in FIELDS:
        raise ValueError(f"{name!r} is not a QuestConfig field; fields: {', '.join(FIELDS)}")
    return FIELDS[name]


def _show(name: str, value: Any) -> str:
    """A value of field ``name`` as typed on the command line (``None`` as the field's word for it)."""
    word = FIELDS[name].metadata["none"]
    return word if value is None and word is not None else str(value)


def _value_parser(name: str) -> Callable[[str], Any]:
    """Text to value for one field: one of its ``choices``, a float in its ``interval``, or an int >= its
    ``minimum`` (or its word for ``None``)."""
    meta = FIELDS[name].metadata
    noun = meta["flag"].lstrip("-")

    def parse(text: str) -> Any:
        item = text.strip()
        if meta["choices"]:
            if item not in meta["choices"]:
                raise argparse.ArgumentTypeError(f"{noun} {item!r} is not one of {', '.join(meta['choices'])}")
            return item
        if meta["none"] is not None and item == meta["none"]:
            return None
        word = f" or {meta['none']!r}" if meta["none"] is not None else ""
        if meta["interval"] is not None:
            low, high = meta["interval"]
            try:
                value = float(item)
            except ValueError:
                value = None
            if value is None or not low <= value <= high:
                raise argparse.ArgumentTypeError(f"{noun} {item!r} is not a number in [{low}, {high}]{word}")
            return value
        minimum = meta["minimum"]
        try:
            value = int(item)
        except ValueError:
            value = None
        if value is None or (minimum is not None and value < minimum):
            kind = {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}.get(
                minimum, f"an integer >= {minimum}"
            )
            raise argparse.ArgumentTypeError(f"{noun} {item!r} is not {kind}{word}")
        return value

    return parse


def _single_parser(name: str) -> Callable[[str], Any]:
    """Text to value of a one-value flag (a list, as a plural flag takes, is refused by name)."""
    parse = _value_parser(name)

    def single(text: str) -> Any:
        if "," in text:
            raise argparse.ArgumentTypeError(f"{flag(name)} takes one value, got {text!r}")
        return parse(text)

    return single


def _list_parser(name: str) -> Callable[[str], list]:
    """Text to values of a plural flag: ``"64,256,full"`` parsed item by item."""
    parse = _value_parser(name)
    return lambda text: [parse(item) for item in text.split(",")]


# ---------------------------------------------------------------------------------------------------------------
# Engine flags (generate, bench latency, demo, serve)
# ---------------------------------------------------------------------------------------------------------------

_BYTE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an int >= ``minimum`` (argparse names the flag in its error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= {minimum}")
        return value

    parse.__name__ = f"int >= {minimum}"
    return parse


def fraction(text: str) -> float:
    """An argparse type: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in (0, 1]")
    return value


def unit_interval(text: str) -> float:
    """An argparse type: a number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number in [0, 1]")
    return value


def seconds(allow_zero: bool = False) -> Callable[[str], float]:
    """An argparse type: a number of seconds > 0 (>= 0 with ``allow_zero``)."""
    bound = ">= 0" if allow_zero else "> 0"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not (value >= 0 if allow_zero else value > 0):
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds {bound}")
        return value

    parse.__name__ = f"seconds {bound}"
    return parse


def byte_size(text: str) -> int:
    """An argparse type: ``"4GiB"``, ``"512MiB"``, ``"2G"`` or a plain number of bytes (>= 1)."""
    import re

    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]i?)?[bB]?\s*", text)
    value = int(float(match.group(1)) * _BYTE_UNITS[(match.group(2) or "").lower()]) if match else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size in bytes (e.g. 4GiB, 512MiB, 1000000)")
    return value


def speculative_config(text: str) -> Optional[SpeculativeConfig]:
    """An argparse type: vLLM's ``--speculative-config``, a JSON object such as
    ``'{"method": "quest", "num_speculative_tokens": 4}'`` (:meth:`~questkv.config.SpeculativeConfig.from_value`;
    ``null``: none)."""
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({error}); give an object such as "
                                         '\'{"method": "quest", "num_speculative_tokens": 4}\'') from None
    try:
        return SpeculativeConfig.from_value(value, "--speculative-config")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_engine_args(parser, device: str = "auto", dtype: str = "auto", max_model_len: bool = True,
                    seed_help: str = "random seed", serving: bool = False, speculative: bool = True) -> None:
    """The engine's flags: ``--device``, ``--dtype``, ``--max-model-len``, ``--enforce-eager``,
    ``--tensor-parallel-size``, ``--seed``; with ``speculative`` ``--speculative-config`` (lossless Quest: a command
    that also builds a dense engine passes it to its Quest engine only, or leaves it out);
    with ``serving`` also ``--max-num-seqs``, ``--max-num-batched-tokens``, ``--kv-cache-memory``,
    ``--gpu-memory-utilization``, ``--graph-capture`` and ``--load-format``. :func:`engine_kwargs` reads them back."""
    group = parser.add_argument_group("engine")
    group.add_argument("--device", default=device, choices=["auto", "cpu", "cuda"],
                       help=f"where the engine runs; auto: CUDA when available (default: {device})")
    group.add_argument("--dtype", default=dtype, choices=["auto", "bfloat16", "float16", "float32"],
                       help=f"weights and KV cache; auto: bfloat16 on CUDA, float32 on CPU (default: {dtype})")
    if max_model_len:
        group.add_argument("--max-model-len", type=int_at_least(2), default=None,
                           help="the most tokens per sequence, prompt and output (default: the model's)")
    group.add_argument("--enforce-eager", action="store_true", help="never capture CUDA graphs")
    group.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="schedule and launch each decode step before reading the previous step's tokens, so the "
                       "host's work overlaps the GPU's (default: on with CUDA graphs, off on CPU)")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                       help="share the KV pages of a repeated prompt prefix between requests and keep them after "
                       "the requests finish (evicted least recently used), so that a prefix is prefilled once; "
                       "--no-enable-prefix-caching or --no-prefix-caching turns it off (default: on)")
    group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help=argparse.SUPPRESS)
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                       help="split each prefill into chunks and mix them with the running decodes' tokens in steps "
                       "of at most --max-num-batched-tokens tokens, so that a long prompt never stalls running "
                       "decodes for seconds; --no-enable-chunked-prefill prefills each prompt in one step "
                       "(default: on)")
    group.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                       help="weight-only quantized linears: int4 (groups of 128) or int8 (per row) rounded to nearest "
                       "after loading, or a checkpoint's own packed weights: gguf (Q4_0/Q4_1/Q4_K/Q8_0/Q6_K of a .gguf), "
                       "awq, gptq, compressed-tensors (detected from config.json when not given) (default: none, "
                       "the checkpoint's dtype)")
    group.add_argument("--quantize-lm-head", action="store_true", default=None,
                       help="with --quantization int4/int8: round the LM head too (at batch 1 the bf16 LM head of an "
                       "8B model is about a tenth of an int4 decode step; its error lands on the logits) "
                       "(default: it stays in --dtype)")
    group.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                       help="the K/V pages' dtype, vLLM's names: auto (--dtype) or fp8 / fp8_e4m3 (float8 e4m3, one "
                       "byte per element: half of bf16's bytes per decode step and about twice the tokens per GPU; "
                       "scales from the weights so that nothing saturates, or the checkpoint's k_scale / v_scale; layers "
                       "whose key bias dwarfs their keys stay in --dtype) (default: auto)")
    group.add_argument("--tensor-parallel-size", type=int_at_least(1), default=1, metavar="N",
                       help="shard the model over N ranks by attention heads: this process and N-1 spawned workers, "
                       "one GPU each (cuda:0..N-1, NCCL) or N CPU processes (gloo); heads, KV heads and the "
                       "intermediate size must be divisible by N (default: 1, one device)")
    if speculative:
        group.add_argument(
            "--speculative-config", type=speculative_config, default=None, metavar="JSON",
            help="lossless Quest, vLLM's spelling: a JSON object '{\"method\": \"quest\", \"num_speculative_tokens\": "
            f"K}}' (K in 1..{MAX_SPECULATIVE_TOKENS}). Quest drafts up to K tokens per round and one dense forward "
            "verifies them, keeping the drafts dense attention would have chosen: dense attention's output, its "
            "draft steps at Quest's cost. The engine picks each round's drafts (0: dense steps) from the step times "
            "and acceptance it measures; \"adaptive\": false drafts K every round. Needs --budget (default: none, "
            "Quest's steps are the output)")
    group.add_argument("--seed", type=int_at_least(0), default=0, help=f"{seed_help} (default: 0)")
    if serving:
        group.add_argument("--max-num-seqs", type=int_at_least(1), default=32,
                           help="the most requests decoded together (default: 32)")
        group.add_argument("--max-num-batched-tokens", type=int_at_least(1), default=None,
                           help="the most tokens per step, decode tokens and prefill chunks together, at least "
                           "--max-num-seqs (default: max(8192, max-num-seqs)); with --no-enable-chunked-prefill the "
                           "most prompt tokens per prefill step (default: max(max-model-len, 8192))")
        group.add_argument("--kv-cache-memory", type=byte_size, default=None,
                           help="KV-cache size, e.g. 4GiB (default: what --gpu-memory-utilization leaves, or 1 GiB "
                           "on CPU)")
        group.add_argument("--gpu-memory-utilization", type=fraction, default=0.9,
                           help="fraction of the GPU's whole memory this engine may occupy: weights, activations "
                           "and KV cache, as vLLM; the KV cache never takes more than is free (default: 0.9)")
        group.add_argument("--graph-capture", default="startup", choices=["startup", "lazy"],
                           help="startup: capture every decode CUDA graph (and compile its kernels, and the prefill "
                           "attention's) before serving, so that no request waits for one; lazy: at the first step "
                           "that needs each (default: startup)")
        group.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                           help="auto: the checkpoint's weights; dummy: random weights at the model's shapes "
                           "(default: auto)")


_SERVING_FIELDS = ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory", "gpu_memory_utilization",
                   "graph_capture", "load_format")


def resolve_dtype(dtype: str, on_cuda: bool) -> str:
    """``dtype`` as given, or for ``"auto"`` bfloat16 on CUDA and float32 elsewhere (CPUs without bf16
    instructions multiply bfloat16 matrices tens of times slower than float32)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if on_cuda else "float32"


def engine_kwargs(args) -> dict:
    """``EngineConfig`` fields of the engine flags on ``args`` (``auto`` device and dtype resolved)."""
    import torch

    device = None if args.device == "auto" else args.device
    on_cuda = device == "cuda" or (device is None and torch.cuda.is_available())
    kwargs = {"device": device, "dtype": resolve_dtype(args.dtype, on_cuda), "enforce_eager": args.enforce_eager,
              "tensor_parallel_size": args.tensor_parallel_size}
    for name in ("async_scheduling", "quantization", "quantize_lm_head", "enable_prefix_caching",
                 "enable_chunked_prefill", "speculative_config", "kv_cache_dtype"):
        if getattr(args, name, None) is not None:
            kwargs[name] = getattr(args, name)
    if getattr(args, "max_model_len", None) is not None:
        kwargs["max_model_len"] = args.max_model_len
    for name in _SERVING_FIELDS:
        if hasattr(args, name):
            kwargs[name] = getattr(args, name)
    return kwargs
