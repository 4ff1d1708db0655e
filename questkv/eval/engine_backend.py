"""The engine backend of ``questkv eval``: Quest's protocol on :class:`questkv.LLM`, many settings per engine.

The protocol is the HF path's (:mod:`questkv.eval.harness`), request by request:

* accuracy tasks: ``prompt = context_ids`` (a dense prefill), ``forced_token_ids = tail_ids`` (each fed back
  through its own decode step, so under Quest through page selection), ``max_tokens = len(tail) +
  max_new_tokens``, greedy; the answer is the outputs after the tail. It stops on the tokenizer's
  ``eos_token_id`` only, as :func:`~questkv.eval.harness.decode_greedy` does (``ignore_eos`` with that id as the
  stop token: the other end ids of a generation config stop neither path), the EOS left out of the answer;
* ``ppl``: ``prompt`` = a window's first ``length - score_tokens - 1`` tokens, ``forced_token_ids`` = the rest;
  the scored log-probabilities are ``forced_logprobs[1:]``, each from the decode step that fed the token before
  (as :func:`~questkv.eval.harness.score_tokens`);
* ``agreement_*`` (:mod:`questkv.eval.agreement`): a dense greedy request, then every setting forced with its
  tokens. The dense reference always runs on the model dtype's K/V pages: on an fp8 cache
  (``kv_cache_dtype`` in the engine options) an engine of its own decodes it first, so that fp8's ``full``
  measures fp8 dense against the model dtype's dense, and each sparse setting the two losses together.

One engine serves every setting of an engine-level config (:func:`engine_configs`: the page size and the page
selection's options; the largest budget and selection interval among them): each (setting, sample) is a request
of its own with the setting's ``token_budget`` and ``selection_interval`` (``dense=True`` for ``full``), sample
after sample, so that one prompt's copies are admitted together and continuous batching decodes the settings
together. The engine's prefix cache (on by default) computes a prompt once: its first copy prefills it, chunk after
chunk with chunked prefill (the engine's default), and the others start on its full pages, computing only the
tokens past them (at most a page each; see :class:`questkv.engine.scheduler.Scheduler`). Those tokens attend the
cached pages, so a copy's K/V of its last page and logits of its last prompt token equal the first's up to float
rounding. With ``enable_prefix_caching=False`` in ``engine_kwargs`` every copy prefills its prompt whole. ``full``
runs in a pass of its own when a setting of the task reuses selections: a dense request in a decode step makes every
row of that step select. Requests go in waves whose pages the pool holds whole, so no request is preempted (a
recomputed request would prefill its forced tokens densely).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Mapping, Optional, Sequence

from tqdm.auto import tqdm

from questkv.config import QuestConfig
from questkv.eval import agreement, perplexity, tasks
from questkv.eval.harness import ENGINE_OPTIONS, Setting

PPL = "ppl"


@dataclasses.dataclass(frozen=True)
class EngineSource:
    """How the evaluation builds its engines: ``LLM(model, quest=..., max_model_len=..., max_num_seqs=...,
    **engine_kwargs)``.

    Attributes:
        model: what :class:`questkv.LLM` takes (an alias, HF folder or ``.gguf``).
        engine_kwargs: other :class:`~questkv.engine.engine_config.EngineConfig` fields (``device``, ``dtype``,
            ``gpu_memory_utilization``, ``kv_cache_memory``, ``enforce_eager``, ...).
        max_num_seqs: the most requests an engine decodes together (fewer when a pass has fewer).
    """

    model: str
    engine_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    max_num_seqs: int = 128

    def build(self, quest: Optional[QuestConfig], max_model_len: int, max_num_seqs: int):
        """An engine for requests of at most ``max_model_len`` tokens, decoding at most ``max_num_seqs`` (and
        :attr:`max_num_seqs`) together.

        Raises:
            ValueError: as :class:`questkv.LLM` does; past the model's positions, with the way out.
        """
        from questkv.engine.llm import LLM

        try:
            return LLM(self.model, quest=quest, max_model_len=max_model_len,
                       max_num_seqs=min(max_num_seqs, self.max_num_seqs),
                       **self.engine_kwargs)
        except ValueError as error:
            if "max_position_embeddings" not in str(error):
                raise
            raise ValueError(f"{error}: the longest request at this length (its prompt, tail and answer) runs past "
                             "the model's positions, which the engine does not extrapolate (the HF path does); "
                             "choose a length that leaves room for the answer (e.g. 32640 for a 32768-position "
                             "model and answers of up to 128 tokens)") from None


def engine_configs(settings: Sequence[Setting], page_size: int, dense_layers: int
                   ) -> list[tuple[Optional[QuestConfig], list[Setting]]]:
    """The engines that run ``settings`` and the settings each serves, in the settings' order.

    Settings of one page size and one page selection (``selection``, ``group_reduction``, ``sink_pages``,
    ``recent_pages``) share an engine with their largest budget and selection interval (each request brings its
    own); ``full`` joins the first engine of the evaluation's ``page_size`` (any engine without one), or gets a
    dense engine alone.
    """
    groups: dict[tuple, list[Setting]] = {}
    for setting in settings:
        if setting.policy != "full":
            options = tuple((k, v) for k, v in setting.options if k not in ENGINE_OPTIONS["quest"])
            groups.setdefault((setting.page_size or page_size, options), []).append(setting)
    out: list[tuple[Optional[QuestConfig], list[Setting]]] = [
        (QuestConfig(token_budget=max(s.budget for s in group), page_size=size, dense_layers=dense_layers,
                     selection_interval=max(s.selection_interval for s in group), dense_context_ratio=1.0,
                     **dict(options)), group)  # Quest's answers at every context, as Setting.config's
        for (size, options), group in groups.items()
    ]
    full = [s for s in settings if s.policy == "full"]
    if full:
        home = next((i for i, (quest, _) in enumerate(out) if quest.page_size == page_size), 0 if out else None)
        if home is None:
            out.append((None, full))
        else:
            out[home] = (out[home][0], full + out[home][1])
    return out


@dataclasses.dataclass(frozen=True)
class Item:
    """One sample's request, whatever the setting: ``prompt`` prefilled, ``forced`` tokens fed back,
    ``max_tokens`` outputs at most; ``sample``: the accuracy task's sample (``None`` otherwise)."""

    prompt: tuple[int, ...]
    forced: tuple[int, ...]
    max_tokens: int
    sample: Optional[tasks.TaskSample] = None


class Inputs:
    """Every task's requests at one length, built once and shared by the engines (and the agreement tasks'
    dense reference, decoded by the first engine that needs it).

    Args:
        tokenizer: the model's tokenizer.
        length: the prompt (or window) length.
        samples, seed, score_tokens, agreement_tokens: the sweep's.
        ppl_text: ``ppl``'s :class:`~questkv.eval.perplexity.Text` (``None`` without ppl).
        agreement_texts: each agreement task's text, by task name.
    """

    def __init__(self, tokenizer, length: int, samples: int, seed: int, score_tokens: int, agreement_tokens: int,
                 ppl_text: Optional[perplexity.Text] = None, agreement_texts: Optional[Mapping[str, str]] = None):
        self.tokenizer, self.length, self.samples, self.seed = tokenizer, length, samples, seed
        self.score_tokens, self.agreement_tokens = score_tokens, agreement_tokens
        self.ppl_text, self.agreement_texts = ppl_text, dict(agreement_texts or {})
        self._items: dict[str, list[Item]] = {}
        self.references: dict[str, list[tuple[int, ...]]] = {}  # agreement task -> dense's greedy tokens

    def items(self, task: str) -> list[Item]:
        if task not in self._items:
            self._items[task] = self._build(task)
        return self._items[task]

    def _build(self, task: str) -> list[Item]:
        if task == PPL:
            ids = perplexity.windows(self.tokenizer, self.ppl_text.text, self.length, self.samples).tolist()
            split = self.length - self.score_tokens - 1
            return [Item(tuple(row[:split]), tuple(row[split:]), self.score_tokens + 1) for row in ids]
        if task in agreement.TASKS:
            contexts = agreement.contexts(self.tokenizer, self.agreement_texts[task], self.length, self.samples,
                                          self.agreement_tokens)
            return [Item(tuple(c), (), self.agreement_tokens + 1) for c in contexts]
        return [Item(s.context_ids, s.tail_ids, len(s.tail_ids) + s.max_new_tokens, s)
                for s in tasks.make_samples(task, self.tokenizer, self.length, self.samples, self.seed)]

    def max_model_len(self, task: str) -> int:
        """The longest request of ``task``: prompt plus outputs."""
        return max(len(item.prompt) + item.max_tokens for item in self.items(task))


class EngineRun:
    """The settings of one engine at one length, task after task.

    Args:
        llm: the engine (:meth:`EngineSource.build`).
        inputs: the length's requests.
        eos_token_id: the tokenizer's end-of-sequence id, the accuracy tasks' stop (``None``: none).
        progress: a tqdm bar on stderr over each wave of requests (:meth:`questkv.LLM.generate`'s, its postfix the
            prompt tokens prefilled and the tokens decoded), erased when the wave is done.
    """

    def __init__(self, llm, inputs: Inputs, eos_token_id: Optional[int], progress: bool = False) -> None:
        self.llm, self.inputs, self.eos_token_id = llm, inputs, eos_token_id
        self.use_tqdm = functools.partial(tqdm, leave=False) if progress else False

    def run(self, task: str, settings: Sequence[Setting]) -> list[tuple[Setting, dict, float]]:
        """Score ``settings`` on ``task``: ``(setting, result, seconds)`` each, ``result`` as a sweep cell has
        it (metric, value, samples, scores, mean_tokens_attended, ...), ``seconds`` the wall time of the pass
        that ran it (prefills included, shared by the settings of that pass)."""
        items = self.inputs.items(task)
        if task in agreement.TASKS:
            items = self.with_reference(task, items)
        full = [s for s in settings if s.policy == "full"]
        sparse = [s for s in settings if s.policy != "full"]
        passes = [full, sparse] if any(s.selection_interval > 1 for s in sparse) else [full + sparse]
        results = []
        for group in (g for g in passes if g):
            start = time.perf_counter()
            outputs = self._generate([(item, setting) for item in items for setting in group], group=len(group))
            seconds = round(time.perf_counter() - start, 3)
            for k, setting in enumerate(group):
                mine = outputs[k :: len(group)]
                results.append((setting, self._score(task, items, mine), seconds))
        return results

    def with_reference(self, task: str, items: list[Item]) -> list[Item]:
        """The agreement items forced with dense's greedy tokens (decoded on this engine the first time)."""
        if task not in self.inputs.references:
            outputs = self._generate([(item, Setting("full", None)) for item in items], reference=True)
            self.inputs.references[task] = [out.token_ids for out in outputs]
        return [dataclasses.replace(item, forced=tokens) for item, tokens in zip(items, self.inputs.references[task])]

    def _params(self, item: Item, setting: Setting, reference: bool = False):
        from questkv.engine.sampling_params import SamplingParams

        kwargs: dict[str, Any] = {"temperature": 0.0, "max_tokens": item.max_tokens, "ignore_eos": True,
                                  "forced_token_ids": () if reference else item.forced, "detokenize": False}
        if item.sample is not None and self.eos_token_id is not None:
            kwargs["stop_token_ids"] = (self.eos_token_id,)
        if setting.policy == "full":
            kwargs["dense"] = True
        else:
            kwargs.update(token_budget=setting.budget, selection_interval=setting.selection_interval)
        return SamplingParams(**kwargs)

    def _generate(self, requests: list[tuple[Item, Setting]], reference: bool = False, group: int = 1) -> list:
        """Run ``requests`` in waves whose pages the pool holds whole (none is preempted), of near-equal sizes
        that are multiples of ``group`` (a sample's requests, whose prompt is prefilled once); outputs in order."""
        cache = self.llm.engine.cache
        usable = cache.num_pages - 1  # the runner's scratch page
        need = [cache.pages_for_tokens(len(item.prompt) + item.max_tokens - 1) for item, _ in requests]
        limit = self.llm.config.max_num_seqs
        count = max(-(-len(requests) // limit), -(-sum(need) // usable), 1)
        size = min(limit, -(-len(requests) // count))
        if size >= group:
            size = min(-(-size // group) * group, limit // group * group)
        waves: list[list[tuple[Item, Setting]]] = [[]]
        pages = 0
        for request, pages_of in zip(requests, need):
            if waves[-1] and (pages + pages_of > usable or len(waves[-1]) == size):
                waves.append([])
                pages = 0
            waves[-1].append(request)
            pages += pages_of
        outputs = []
        for wave in waves:
            params = [self._params(item, setting, reference) for item, setting in wave]
            outputs += self.llm.generate([list(item.prompt) for item, _ in wave], params, use_tqdm=self.use_tqdm)
        return outputs

    def _score(self, task: str, items: list[Item], outputs: list) -> dict:
        attended = [out.metrics.mean_sparse_tokens_attended for out in outputs]
        rates = [out.metrics.selection_rate for out in outputs]
        result: dict[str, Any] = {
            "mean_tokens_attended": None if None in attended else sum(attended) / len(attended),
            "selection_rate": None if None in rates else sum(rates) / len(rates),
            "preemptions": sum(out.metrics.num_preemptions for out in outputs),
        }
        if task == PPL:
            nll = [[-lp for lp in out.forced_logprobs[1:]] for out in outputs]
            windows = [agreement.perplexity(row) for row in nll]
            value = agreement.perplexity([x for row in nll for x in row])
            return {"metric": "ppl", "value": value, "samples": len(nll), "scores": [round(w, 4) for w in windows],
                    **result}
        if task in agreement.TASKS:
            scored = [agreement.score(out.forced_choices, out.forced_logprobs, item.forced)
                      for out, item in zip(outputs, items)]
            nll = [x for _, row in scored for x in row]
            return {"metric": "agreement", "value": sum(a for a, _ in scored) / len(scored), "samples": len(scored),
                    "scores": [a for a, _ in scored], "ppl": agreement.perplexity(nll),
                    "ppl_scores": [round(agreement.perplexity(row), 4) for _, row in scored], **result}
        texts, scores = [], []
        for out, item in zip(outputs, items):
            answer = list(out.token_ids[len(item.forced):])
            if answer and out.finish_reason == "stop" and answer[-1] == self.eos_token_id:
                answer.pop()
            texts.append(self.inputs.tokenizer.decode(answer, skip_special_tokens=True))
            scores.append(tasks.score(task, texts[-1], item.sample.answers))
        return {"metric": "accuracy", "value": sum(scores) / len(scores), "samples": len(scores), "scores": scores,
                "outputs": texts, **result}


def engine_shape(llm) -> dict:
    """What :func:`questkv.eval.sweep.kv_bytes` needs of an engine's model (as ``model_shape`` of an HF one)."""
    spec = llm.engine.spec
    return {"num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads, "num_q_heads": spec.num_q_heads,
            "head_dim": spec.head_dim, "dtype_bytes": llm.config.torch_dtype.itemsize}


def decode_references(source: EngineSource, inputs: Inputs, tasks_due: Sequence[str], eos_token_id: Optional[int],
                      say: Callable[[str], None], progress: bool) -> None:
    """Dense's greedy tokens for the agreement tasks among ``tasks_due`` on an engine whose K/V pages are the model
    dtype's, where ``source`` builds engines on other pages (``kv_cache_dtype``; otherwise the first engine that
    runs the task decodes them, on the same pages). Stored in ``inputs.references``."""
    due = [task for task in dict.fromkeys(tasks_due) if task in agreement.TASKS and task not in inputs.references]
    if not due or source.engine_kwargs.get("kv_cache_dtype", "auto") == "auto":
        return
    kwargs = {k: v for k, v in source.engine_kwargs.items() if k != "kv_cache_dtype"}
    say(f"length={inputs.length}: building a dense engine on model-dtype pages for the agreement reference")
    llm = dataclasses.replace(source, engine_kwargs=kwargs).build(
        None, max(inputs.max_model_len(task) for task in due), max(len(inputs.items(task)) for task in due))
    try:
        run = EngineRun(llm, inputs, eos_token_id, progress=progress)
        for task in due:
            run.with_reference(task, inputs.items(task))
    finally:
        llm.close()


def run_length(
    source: EngineSource,
    inputs: Inputs,
    todo: Sequence[tuple[str, Setting]],
    page_size: int,
    dense_layers: int,
    emit: Callable[[str, Setting, dict, float, dict, int], None],
    eos_token_id: Optional[int],
    progress: Optional[Callable[[str], None]] = None,
) -> None:
    """Run the ``(task, setting)`` pairs ``todo`` at ``inputs.length``, one engine per engine-level config
    (each closed before the next is built); ``emit(task, setting, result, seconds, shape, page_size)`` is called
    for every pair as soon as its pass is done. ``progress``: called with a line before each engine and task, and
    each wave of requests shows a tqdm bar (:class:`EngineRun`); ``None``: silent."""
    say = progress or (lambda text: None)
    decode_references(source, inputs, [task for task, _ in todo], eos_token_id, say, progress is not None)
    settings = list(dict.fromkeys(setting for _, setting in todo))
    wanted = set(todo)
    for quest, group in engine_configs(settings, page_size, dense_layers):
        by_task = {task: [s for s in group if (task, s) in wanted] for task in dict.fromkeys(t for t, _ in todo)}
        by_task = {task: chosen for task, chosen in by_task.items() if chosen}
        if not by_task:
            continue
        max_model_len = max(inputs.max_model_len(task) for task in by_task)
        widest = max(len(inputs.items(task)) * len(chosen) for task, chosen in by_task.items())
        say(f"length={inputs.length}: building an engine ({'dense' if quest is None else quest})")
        llm = source.build(quest, max_model_len, max(widest, 1))
        try:
            shape = engine_shape(llm)
            run = EngineRun(llm, inputs, eos_token_id, progress=progress is not None)
            for task, chosen in by_task.items():
                say(f"length={inputs.length} task={task}: {', '.join(s.label for s in chosen)}")
                for setting, result, seconds in run.run(task, chosen):
                    emit(task, setting, result, seconds, shape, llm.config.page_size)
        finally:
            llm.close()
