"""Accuracy, perplexity and agreement over tasks x lengths x policies x budgets, resumable (``questkv eval``).

A :class:`SweepSpec` is the grid plus the settings every cell shares. Each setting runs on a backend
(:meth:`SweepSpec.backend`): by default ``full`` and ``quest`` on the engine
(:mod:`questkv.eval.engine_backend`: every (setting, sample) a request of its own, one engine per
engine-level config serving all of its settings, a prompt's copies sharing one prefill) and every other
policy on the HF path. :func:`run_sweep` runs the engine's cells first, then walks the HF path's one
context length at a time: all accuracy tasks' samples of that length form one batch, prefilled densely
once; every decode setting runs from its own copy of that prefill (so every setting sees exactly the
same prompts), and yields one cell per task. ``ppl`` windows form a second batch per length. Both paths
follow Quest's protocol (dense prefill, the question tail decoded a token per step, a greedy answer) and
make the same prompts. The ``agreement_*`` tasks (:mod:`questkv.eval.agreement`) run on the engine only.
Finished cells (from an earlier, interrupted run) are skipped: :func:`resume_sweep` runs a spec against
the JSON document of an earlier run (:func:`document`), adding only what it lacks.

A policy of the grid is a policy string (:func:`questkv.eval.harness.parse_policy`): a name of
:data:`questkv.policies.POLICIES`, optionally with its own options, e.g. ``quest:selection=q_head``,
``quest:page_size=8``, ``quest:selection_interval=4`` (engine only), ``quest-topp:min_budget=128:top_p=0.9``
or ``quest-rerank:shortlist=4``. Its own options override the spec's (``selection``, ``top_p``, ...); a
``page_size`` of its own gets its own dense prefill (same prompts), so one sweep compares page sizes too.

A cell::

    {"task", "length", "policy" (the policy string, options sorted), "budget",
     "metric": "accuracy" | "ppl" | "agreement", "value", "samples",
     "scores" (per sample; ppl: per window), "mean_tokens_attended" (the task's rows' mean tokens
     attended per sparse layer and decode step; None for full),
     "selection_rate" (engine: the requests' mean fraction of (decode step, sparse layer, head) that
     selected pages, :attr:`questkv.engine.sequence.RequestMetrics.selection_rate`; None for full),
     "kv_bytes_per_step" (KV-cache bytes one decode step of one sequence reads over all layers at
     the cell's length, :func:`questkv.policies.cost.model_kv_bytes_per_step` with the measured
     mean tokens attended and selection rate), "kv_bytes_fraction" (that over full attention's),
     "seconds" (HF: decode wall time of the whole batch; engine: wall time of the pass that ran the
     cell, prefills included, shared by the settings of that pass), "backend" ("engine" or "hf"),
     "outputs" (accuracy tasks), "preemptions" (engine: requests recomputed, 0 by design),
     "ppl" and "ppl_scores" (agreement: the perplexity of dense's tokens, overall and per window)}

Documents of earlier versions (cells without the ``kv_bytes_*`` or ``backend`` keys: HF) resume as they are.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch

from questkv.config import PAGE_POLICY_OPTIONS, QuestConfig
from questkv.engine.engine_config import KV_CACHE_DTYPES, QUANTIZATIONS, ROUND_TO_NEAREST
from questkv.eval import agreement, engine_backend, harness, perplexity, tasks
from questkv.eval.harness import EVAL_BACKENDS, Setting
from questkv.policies import POLICIES
from questkv.policies.cost import model_kv_bytes_per_step
from questkv.validation import check_bool, check_choice, check_int

PPL = "ppl"
ALL_TASKS: tuple[str, ...] = tasks.TASKS + (PPL,) + agreement.TASKS
QUEST_FIELDS: tuple[str, ...] = ("page_size", "dense_layers") + PAGE_POLICY_OPTIONS
"""The :class:`~questkv.QuestConfig` fields of a :class:`SweepSpec` (its budgets are the grid's)."""
# Settings shared by every cell: a resumed run must match them (the grid itself may grow).
_SHARED = ("samples", "seed", "top_p", *QUEST_FIELDS, "score_tokens", "text_file", "eval_backend",
           "agreement_tokens", "code_commit", "quantization", "quantize_lm_head", "kv_cache_dtype")
# What a document written before a shared setting existed ran with, where that is not the field's default.
_LEGACY = {"eval_backend": "hf"}
# The options a spec gives the policies that take them (see SweepSpec.settings).
_POLICY_OPTIONS = PAGE_POLICY_OPTIONS + ("top_p",)
# Tasks share one batched prefill while rows x length^2 stays under this (the padding mask SDPA
# materialises is [rows, 1, length, length] in the model's dtype; H2O's prefill recording is of the same order).
PREFILL_GROUP_ELEMENTS = 2**32


@dataclasses.dataclass(frozen=True)
class SweepSpec:
    """An evaluation grid.

    Attributes:
        tasks: names of :data:`ALL_TASKS`. lengths: prompt / window lengths in tokens.
        policies: policy strings (see the module docstring); ``full`` runs once per (task, length).
        budgets: token budgets of every policy but ``full``.
        samples: prompts per (task, length), or ``ppl`` windows per length.
        page_size, dense_layers: as in :class:`questkv.QuestConfig`.
        seed: seed of the generated prompts.
        top_p: ``quest-topp``'s mass target (its budget is the cap K).
        selection, group_reduction, sink_pages, recent_pages: the page policies' selection (quest,
            oracle, quest-topp, quest-rerank; full and quest run :class:`questkv.QuestConfig` with them), as in
            :class:`questkv.QuestConfig` (the forced pages count against the budget).
        score_tokens: ``ppl``: tokens scored per window (the window's last ones).
        text_file: ``ppl``: the text (``None``: the stdlib's ``pydoc_data.topics``).
        eval_backend: what decodes each setting (:data:`questkv.eval.harness.EVAL_BACKENDS`): ``auto`` runs
            ``full`` and ``quest`` on the engine and the other policies on the HF path, ``engine`` or ``hf``
            everything there (refusing what that path does not run).
        agreement_tokens: ``agreement_*``: positions scored per window (:mod:`questkv.eval.agreement`).
        code_commit: ``agreement_code``: the commit of questkv's source to read (``None``: the tree's).
        quantization: the engine's weights (:attr:`questkv.engine.engine_config.EngineConfig.quantization`: ``"gguf"``
            runs a GGUF on its own packed bits, ``"int4"`` / ``"int8"`` round a float checkpoint at load);
            ``None``: the checkpoint's dtype (a GGUF dequantized). Engine only: every setting must run there.
        quantize_lm_head: round the LM head too (:attr:`~questkv.engine.engine_config.EngineConfig.quantize_lm_head`;
            ``quantization`` ``"int4"`` or ``"int8"``).
        kv_cache_dtype: the engine's K/V pages (:attr:`~questkv.engine.engine_config.EngineConfig.kv_cache_dtype`:
            ``"auto"`` or ``"fp8"``). Engine only, as ``quantization``.
    """

    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    policies: tuple[str, ...]
    budgets: tuple[int, ...] = ()
    samples: int = 10
    page_size: int = QuestConfig.page_size
    dense_layers: int = QuestConfig.dense_layers
    seed: int = 0
    top_p: float = 0.9
    selection: str = QuestConfig.selection
    group_reduction: str = QuestConfig.group_reduction
    sink_pages: int = QuestConfig.sink_pages
    recent_pages: int = QuestConfig.recent_pages
    score_tokens: int = 256
    text_file: Optional[str] = None
    eval_backend: str = "auto"
    agreement_tokens: int = 128
    code_commit: Optional[str] = None
    quantization: Optional[str] = None
    quantize_lm_head: bool = False
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        for name in ("tasks", "lengths", "policies", "budgets"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name, known in (("tasks", ALL_TASKS), ("policies", POLICIES), ("lengths", None), ("budgets", None)):
            values = getattr(self, name)
            if not values and name != "budgets":
                raise ValueError(f"SweepSpec.{name} is empty")
            for index, value in enumerate(values):
                if known is None:
                    check_int(f"SweepSpec.{name}[{index}]", value, minimum=1)
                elif name == "policies":
                    harness.parse_policy(value, f"SweepSpec.{name}[{index}]")
                else:
                    check_choice(f"SweepSpec.{name}[{index}]", value, known)
        if any(policy != "full" for policy in self.policies) and not self.budgets:
            raise ValueError(f"policies {[p for p in self.policies if p != 'full']} need at least one budget")
        check_int("SweepSpec.samples", self.samples, minimum=1)
        if PPL in self.tasks:
            check_int("SweepSpec.score_tokens", self.score_tokens, minimum=1)
            if self.score_tokens > min(self.lengths) - 2:
                raise ValueError(
                    f"SweepSpec.score_tokens must be <= {min(self.lengths) - 2} (the shortest length, "
                    f"{min(self.lengths)}, minus a prefilled token and the first target), got {self.score_tokens}"
                )
        check_choice("SweepSpec.eval_backend", self.eval_backend, EVAL_BACKENDS)
        if self.quantization is not None:
            check_choice("SweepSpec.quantization", self.quantization, QUANTIZATIONS)
        check_bool("SweepSpec.quantize_lm_head", self.quantize_lm_head)
        check_choice("SweepSpec.kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.quantize_lm_head and self.quantization not in ROUND_TO_NEAREST:
            raise ValueError(f"SweepSpec.quantize_lm_head=True needs quantization one of {ROUND_TO_NEAREST}, got "
                             f"{self.quantization!r}")
        measured = [task for task in self.tasks if task in agreement.TASKS]
        if measured:
            check_int("SweepSpec.agreement_tokens", self.agreement_tokens, minimum=1)
            if self.agreement_tokens > min(self.lengths) - 2:
                raise ValueError(
                    f"SweepSpec.agreement_tokens must be <= {min(self.lengths) - 2} (the shortest length, "
                    f"{min(self.lengths)}, minus a context token and dense's first token), got {self.agreement_tokens}"
                )
        for setting in self.settings():
            setting.build(self.page_size, self.dense_layers)  # raises ValueError on a bad combination
            if setting.backend(self.eval_backend) != "engine" and measured:  # raises for what no path runs
                raise ValueError(f"task {measured[0]!r} runs on the engine backend only, and policy "
                                 f"{setting.name!r} on the HF path: sweep it apart")
            for name, value, unset in (("quantization", self.quantization, None),
                                       ("kv_cache_dtype", self.kv_cache_dtype, "auto")):
                if setting.backend(self.eval_backend) != "engine" and value != unset:
                    raise ValueError(f"SweepSpec.{name}={value!r} runs on the engine backend only, and policy "
                                     f"{setting.name!r} on the HF path: sweep it apart")

    def backend(self, setting: Setting) -> str:
        """``"engine"`` or ``"hf"``: what decodes ``setting`` (:meth:`questkv.eval.harness.Setting.backend`)."""
        return setting.backend(self.eval_backend)

    def settings(self) -> list[Setting]:
        """Every decode setting: ``full`` once, every other policy string at every budget."""
        out = []
        for text in self.policies:
            policy, own = harness.parse_policy(text)
            if policy == "full":
                out.append(Setting("full", None))
                continue
            variant = harness.format_policy("", own)
            own = dict(own)
            page_size = own.pop("page_size", None)
            # Every option of the policy that the spec holds (the page policies' selection, quest-topp's
            # top_p), overridden by the policy string's own.
            options = {name: getattr(self, name) for name in POLICIES[policy].options if name in _POLICY_OPTIONS}
            options = tuple(sorted({**options, **own}.items()))
            out.extend(Setting(policy, budget, options, variant, page_size) for budget in self.budgets)
        return out

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def cell_key(cell: dict) -> tuple:
    return (cell["task"], cell["length"], cell["policy"], cell["budget"])


def task_groups(task_names: list[str], samples: int, length: int,
                limit: int = PREFILL_GROUP_ELEMENTS) -> list[list[str]]:
    """Consecutive tasks packed into groups that share one prefill batch: ``rows * length**2`` at most
    ``limit`` per group (``samples`` rows per task), every task in a group of its own at least."""
    groups: list[list[str]] = []
    for task in task_names:
        if groups and (len(groups[-1]) + 1) * samples * length**2 <= limit:
            groups[-1].append(task)
        else:
            groups.append([task])
    return groups


def run_sweep(
    model,
    tokenizer,
    spec: SweepSpec,
    done: Iterable[dict] = (),
    on_cell: Optional[Callable[[dict], None]] = None,
    progress: bool = True,
    engine: Optional[engine_backend.EngineSource] = None,
) -> list[dict]:
    """Run every cell of ``spec`` not in ``done``; returns all cells (``done`` ones first).

    The engine's cells run first, length by length, each engine closed before the next is built; then the
    HF path's. With ``progress``, tqdm bars on stderr: one over the cells (its postfix says what runs), and below
    it one over each batch of engine requests (a request per setting and sample) or HF decode steps.

    Args:
        model: a causal LM that :func:`questkv.enable` supports (enabled here, left enabled), or a function
            that loads it, called once if an HF cell is pending, after the engines are closed.
        tokenizer: the model's tokenizer (it makes the prompts of both paths).
        done: cells of an earlier run with the same shared settings; not rerun.
        on_cell: called with every new cell as soon as it exists (e.g. to save progress).
        engine: how to build the engines (needed when a pending setting runs on the engine).

    Raises:
        ValueError: an engine cell is pending and ``engine`` is ``None``.
    """
    from tqdm.auto import tqdm

    cells = list(done)
    finished = {cell_key(cell) for cell in cells}
    with tqdm(total=len(pending_settings(spec, cells)), desc="eval", unit="cell", disable=not progress) as bar:

        def emit(cell: dict) -> None:
            cells.append(cell)
            finished.add(cell_key(cell))
            bar.update(1)
            if on_cell is not None:
                on_cell(cell)

        _run_engine_cells(tokenizer, spec, finished, emit, engine, bar)
        _run_hf_cells(model, tokenizer, spec, finished, emit, bar)
    return cells


def _run_engine_cells(tokenizer, spec: SweepSpec, finished: set, emit, engine, bar) -> None:
    settings = [s for s in spec.settings() if spec.backend(s) == "engine"]
    todo = {length: [(task, s) for task in spec.tasks for s in settings
                     if (task, length, s.name, s.budget) not in finished] for length in spec.lengths}
    if not any(todo.values()):
        return
    if engine is None:
        raise ValueError("cells on the engine backend are pending but no engine was given (run_sweep(engine=...)); "
                         "or use eval_backend='hf'")
    if spec.quantization is not None:
        engine = dataclasses.replace(engine, engine_kwargs={**engine.engine_kwargs, "quantization": spec.quantization,
                                                            "quantize_lm_head": spec.quantize_lm_head})
    if spec.kv_cache_dtype != "auto":
        engine = dataclasses.replace(engine, engine_kwargs={**engine.engine_kwargs,
                                                            "kv_cache_dtype": spec.kv_cache_dtype})
    tasks_due = {task for pairs in todo.values() for task, _ in pairs}
    ppl_text = perplexity.load_text(spec.text_file) if PPL in tasks_due else None
    texts = {task: agreement.load_text(task, spec.code_commit)[0] for task in agreement.TASKS if task in tasks_due}
    for length, pairs in todo.items():
        if not pairs:
            continue
        inputs = engine_backend.Inputs(tokenizer, length, spec.samples, spec.seed, spec.score_tokens,
                                       spec.agreement_tokens, ppl_text, texts)

        def add(task, setting, result, seconds, shape, page_size, length=length):
            emit({"task": task, "length": length, "policy": setting.name, "budget": setting.budget, **result,
                  **kv_bytes(setting, length, page_size, spec.dense_layers, shape, result["mean_tokens_attended"],
                             result["selection_rate"]),
                  "seconds": seconds, "backend": "engine"})

        engine_backend.run_length(engine, inputs, pairs, spec.page_size, spec.dense_layers, add,
                                  tokenizer.eos_token_id, None if bar.disable else bar.set_postfix_str)


def _run_hf_cells(model, tokenizer, spec: SweepSpec, finished: set, emit, bar) -> None:
    plan = []  # (length, task group, page size, pending settings of that page size)
    settings = [s for s in spec.settings() if spec.backend(s) == "hf"]
    accuracy_tasks = [task for task in spec.tasks if task in tasks.TASKS]
    for length in spec.lengths:
        groups = task_groups(accuracy_tasks, spec.samples, length) + ([[PPL]] if PPL in spec.tasks else [])
        for group in groups:
            pending = [s for s in settings if any((t, length, s.name, s.budget) not in finished for t in group)]
            for page_size in dict.fromkeys(s.page_size or spec.page_size for s in pending):
                same = [s for s in pending if (s.page_size or spec.page_size) == page_size]
                plan.append((length, group, page_size, same))
    if not plan:
        return
    if callable(model) and not isinstance(model, torch.nn.Module):
        model = model()
    text = perplexity.load_text(spec.text_file) if any(group == [PPL] for _, group, _, _ in plan) else None
    shape = model_shape(model)
    for length, group, page_size, pending in plan:
        bar.set_postfix_str(f"length={length} tasks={','.join(group)}: prefill")
        runner = _PplBatch(model, tokenizer, spec, length, text) if group == [PPL] else _TaskBatch(
            model, tokenizer, spec, length, group
        )
        needs_attention = any(POLICIES[s.policy].uses_prefill_attention for s in pending)
        harness.enable_setting(model, Setting("full", None), page_size, spec.dense_layers)
        prefilled, next_positions = harness.prefill(model, runner.contexts, page_size, needs_attention)
        for setting in pending:
            bar.set_postfix_str(f"length={length} tasks={','.join(group)} {setting.label}")
            harness.enable_setting(model, setting, page_size, spec.dense_layers)
            cache = harness.snapshot(prefilled)
            start = time.perf_counter()
            results = runner.run(cache, next_positions, progress=not bar.disable)
            if torch.device(model.device).type == "cuda":
                torch.cuda.synchronize()
            seconds = round(time.perf_counter() - start, 3)
            for task, result in results.items():
                if (task, length, setting.name, setting.budget) in finished:
                    continue
                emit({
                    "task": task,
                    "length": length,
                    "policy": setting.name,
                    "budget": setting.budget,
                    **result,
                    **kv_bytes(setting, length, page_size, spec.dense_layers, shape, result["mean_tokens_attended"]),
                    "seconds": seconds,
                    "backend": "hf",
                })
            del cache  # frees its page pool now (a QuestCache holds no reference cycle)
            _release_cuda_memory(model)
        del prefilled
        _release_cuda_memory(model)


def _release_cuda_memory(model) -> None:
    """Hand the CUDA caching allocator's free blocks back to the driver, so that sweeps sharing one GPU
    (each a process) see each other's freed memory."""
    if torch.device(model.device).type == "cuda":
        torch.cuda.empty_cache()


class _TaskBatch:
    """Every accuracy task's samples of one length, as one batch."""

    def __init__(self, model, tokenizer, spec: SweepSpec, length: int, task_names: list[str]) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.samples = [
            sample for task in task_names for sample in tasks.make_samples(task, tokenizer, length, spec.samples, spec.seed)
        ]
        self.contexts = [list(sample.context_ids) for sample in self.samples]

    def run(self, cache, next_positions, progress: bool = False) -> dict[str, dict]:
        generated = harness.decode_greedy(
            self.model, cache, next_positions, [list(s.tail_ids) for s in self.samples],
            [s.max_new_tokens for s in self.samples], self.tokenizer.eos_token_id, progress,
        )
        attended = _mean_tokens_attended(cache)
        by_task: dict[str, dict] = {}
        for row, (sample, ids) in enumerate(zip(self.samples, generated)):
            output = self.tokenizer.decode(ids, skip_special_tokens=True)
            entry = by_task.setdefault(sample.task, {"metric": "accuracy", "scores": [], "outputs": [], "rows": []})
            entry["scores"].append(tasks.score(sample.task, output, sample.answers))
            entry["outputs"].append(output)
            entry["rows"].append(row)
        for entry in by_task.values():
            rows = entry.pop("rows")
            entry["samples"] = len(entry["scores"])
            entry["value"] = sum(entry["scores"]) / entry["samples"]
            entry["mean_tokens_attended"] = None if attended is None else sum(attended[r] for r in rows) / len(rows)
        return by_task


class _PplBatch:
    """``spec.samples`` windows of one length: prefill all but the last ``score_tokens + 1`` tokens."""

    def __init__(self, model, tokenizer, spec: SweepSpec, length: int, text: perplexity.Text) -> None:
        self.model = model
        ids = perplexity.windows(tokenizer, text.text, length, spec.samples)
        split = length - spec.score_tokens - 1
        self.contexts = ids[:, :split].tolist()
        self.targets = ids[:, split:].to(model.device)

    def run(self, cache, next_positions, progress: bool = False) -> dict[str, dict]:
        nll = harness.score_tokens(self.model, cache, next_positions, self.targets, progress)
        per_window = [round(float(torch.exp(row.mean())), 4) for row in nll]
        attended = _mean_tokens_attended(cache)
        return {
            PPL: {
                "metric": "ppl", "value": harness.perplexity(nll), "samples": len(per_window), "scores": per_window,
                "mean_tokens_attended": None if attended is None else sum(attended) / len(attended),
            }
        }


def model_shape(model) -> dict:
    """What :func:`kv_bytes` needs of an HF causal LM: ``num_layers``, ``num_kv_heads``,
    ``num_q_heads``, ``head_dim`` and ``dtype_bytes`` (its parameters' dtype, the KV cache's)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {
        "num_layers": config.num_hidden_layers, "num_kv_heads": config.num_key_value_heads,
        "num_q_heads": config.num_attention_heads, "head_dim": head_dim, "dtype_bytes": model.dtype.itemsize,
    }


def kv_bytes(setting: Setting, length: int, page_size: int, dense_layers: int, shape: dict,
             tokens_attended: Optional[float], selection_rate: Optional[float] = None) -> dict:
    """``{"kv_bytes_per_step", "kv_bytes_fraction"}`` of a cell: one sequence's decode step at a
    context of ``length`` tokens, over every layer (:func:`questkv.policies.cost.model_kv_bytes_per_step`;
    ``shape``: :func:`model_shape`), the attended tokens the measured ``tokens_attended`` (its
    mean per sparse layer and step; ``None`` under full attention) and the bounds read at the measured
    ``selection_rate`` (the engine's; ``None``: one step in ``selection_interval``)."""
    layers = {"num_layers": shape["num_layers"], "dense_layers": dense_layers}
    layer = {key: shape[key] for key in ("num_kv_heads", "num_q_heads", "head_dim", "dtype_bytes")}
    layer.update(context=length, page_size=page_size)
    read = model_kv_bytes_per_step(policy=setting.policy, token_budget=setting.budget, options=dict(setting.options),
                                   tokens_attended=tokens_attended, selection_rate=selection_rate, **layers, **layer)
    dense = model_kv_bytes_per_step(policy="full", token_budget=None, **layers, **layer)
    return {"kv_bytes_per_step": read, "kv_bytes_fraction": read / dense}


def _mean_tokens_attended(cache) -> Optional[list[float]]:
    """Mean tokens attended per sparse layer and decode step, per row (``None`` under full attention)."""
    per_sequence = cache.mean_tokens_attended_per_sequence
    return None if per_sequence is None else per_sequence.tolist()


def pending_settings(spec: SweepSpec, done: Iterable[dict]) -> list[tuple[int, str, Setting]]:
    """``(length, task, setting)`` of every cell of ``spec`` not in ``done``."""
    finished = {cell_key(cell) for cell in done}
    return [
        (length, task, setting)
        for length in spec.lengths
        for task in spec.tasks
        for setting in spec.settings()
        if (task, length, setting.name, setting.budget) not in finished
    ]


def document(model_name: str, spec: SweepSpec, cells: list[dict], runs: list[dict], text: Optional[dict] = None,
             agreement_texts: Optional[dict] = None) -> dict:
    """The JSON document of a sweep: ``{"model", "spec", "text", "runs", "cells"}``, plus
    ``"agreement_texts"`` (each agreement task's text record: source, SHA-256, the code's commit) when it has
    agreement tasks. ``runs`` holds the provenance (command, commit, machine, date) of every invocation that
    added cells; a cell's ``"run"`` is its index there."""
    out = {"model": model_name, "spec": spec.to_dict(), "text": text, "runs": runs, "cells": cells}
    if agreement_texts:
        out["agreement_texts"] = agreement_texts
    return out


def load_document(path: Path, model_name: str, spec: SweepSpec) -> Optional[dict]:
    """The document of an earlier run at ``path`` (``None`` if there is none), to resume; its grid
    may differ from ``spec``.

    Raises:
        ValueError: that run used another model or other shared settings (``samples``, ``page_size``, ...).
    """
    if not path.exists():
        return None
    with open(path) as handle:
        previous = json.load(handle)
    old = previous.get("spec", {})
    defaults = {field.name: field.default for field in dataclasses.fields(SweepSpec)} | _LEGACY
    mismatched = [name for name in _SHARED if old.get(name, defaults[name]) != getattr(spec, name)]
    if previous.get("model") != model_name or mismatched:
        raise ValueError(
            f"{path} holds a run with other settings (model={previous.get('model')!r}"
            + "".join(f", {name}={old.get(name, defaults[name])!r}" for name in mismatched)
            + "); use another --json path or the same settings"
        )
    return previous


def resume_sweep(
    path: Optional[Path],
    model_name: str,
    spec: SweepSpec,
    load_model: Callable[[], tuple[Any, Any]],
    run_info: Callable[[], dict],
    fresh: bool = False,
    progress: bool = True,
    engine: Optional[engine_backend.EngineSource] = None,
    load_tokenizer: Optional[Callable[[], Any]] = None,
) -> dict:
    """Run the cells of ``spec`` that the document at ``path`` lacks, saving it after every new cell.

    An existing ``path`` (unless ``fresh``) must hold a run of ``model_name`` with ``spec``'s shared
    settings (:func:`load_document`); its grid may differ. Its cells are kept and not rerun, its
    ``runs`` and ppl ``text`` record kept; new cells are appended. Only when a cell is pending is
    this invocation's provenance (``run_info()``) appended to ``runs`` and the model loaded: the HF model
    (``load_model()`` returns ``(model, tokenizer)``) only if an HF cell is pending, after the engine's cells
    (``engine``) have run; the prompts' tokenizer from ``load_tokenizer()`` when given (else from
    ``load_model``). Every new cell's ``"run"`` is its index there. With ``path=None`` every cell runs and
    nothing is saved.

    Returns:
        The :func:`document` of every cell, the earlier ones first.

    Raises:
        ValueError: ``path`` holds a run with another model or other shared settings, or an agreement text
            that is not the one this run would score (the code text of another commit).
    """
    previous = None if path is None or fresh else load_document(path, model_name, spec)
    cells = list(previous["cells"]) if previous else []
    runs = list(previous["runs"]) if previous else []
    text = previous.get("text") if previous else None
    texts = dict(previous.get("agreement_texts") or {}) if previous else {}
    if cells and progress:
        print(f"resuming: {len(cells)} cells found in {path}", file=sys.stderr)
    if PPL in spec.tasks and text is None:
        loaded = perplexity.load_text(spec.text_file)
        text = {"source": loaded.source, "sha256": loaded.sha256, "python": loaded.python,
                "characters": len(loaded.text)}
    pending = pending_settings(spec, cells)
    for task in dict.fromkeys(task for _, task, _ in pending if task in agreement.TASKS):
        record = agreement.load_text(task, spec.code_commit)[1]
        if task in texts and texts[task]["sha256"] != record["sha256"]:
            raise ValueError(f"{path} scored another {task} text ({texts[task]}) than this run would ({record}); "
                             "use its --code-commit or another --json path")
        texts.setdefault(task, record)
    if pending:
        loaded_model: list = []

        def hf_model():
            if not loaded_model:
                loaded_model.extend(load_model())
            return loaded_model[0]

        if load_tokenizer is not None:
            tokenizer = load_tokenizer()
        else:
            hf_model()
            tokenizer = loaded_model[1]
        run = len(runs)
        runs.append(run_info())

        def save_cell(cell: dict) -> None:
            cells.append({**cell, "run": run})
            if path is not None:
                save(path, document(model_name, spec, cells, runs, text, texts))

        run_sweep(hf_model, tokenizer, spec, done=list(cells), on_cell=save_cell, progress=progress, engine=engine)
    return document(model_name, spec, cells, runs, text, texts)


def save(path: Path, document: dict) -> None:
    """Write the JSON atomically (a partial file never replaces a good one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as handle:
        json.dump(document, handle, indent=1)
    tmp.replace(path)
