"""The offline API, vLLM-style: ``LLM(model, quest=...)`` and ``llm.generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence, Union

from tqdm.auto import tqdm

from questkv.config import QuestConfig
from questkv.engine.engine_config import CacheSpec, EngineConfig, dtype_name
from questkv.engine.llm_engine import LLMEngine, Prompt
from questkv.engine.sampling_params import SamplingParams
from questkv.engine.sequence import RequestOutput


class LLM:
    """Generate from many prompts at once with continuous batching, dense or with Quest.

    Args:
        model: an alias (``"smollm2-135m"``), an HF folder, a ``.gguf`` file, or a transformers config
            with ``load_format="dummy"``.
        quest: Quest on decode steps (``QuestConfig(token_budget=...)``), or ``None``: the same engine dense.
        **kwargs: the other :class:`~questkv.engine.engine_config.EngineConfig` fields (``dtype``, ``device``,
            ``max_num_seqs``, ``max_model_len``, ``kv_cache_memory``, ``gpu_memory_utilization``,
            ``enforce_eager``, ``seed``, ``load_format``, ``max_num_batched_tokens``, ``tensor_parallel_size``).

    Example::

        llm = questkv.LLM("smollm2-135m", quest=questkv.QuestConfig(token_budget=256, page_size=8), device="cpu")
        out = llm.generate(["The capital of France is"], questkv.SamplingParams(temperature=0, max_tokens=8))
        print(out[0].text, out[0].metrics)
    """

    def __init__(self, model, quest: Optional[QuestConfig] = None, **kwargs) -> None:
        unknown = set(kwargs) - {f for f in EngineConfig.__dataclass_fields__ if f not in ("model", "quest")}
        if unknown:
            raise ValueError(f"LLM got unknown arguments {sorted(unknown)}; allowed: {sorted(EngineConfig.__dataclass_fields__)}")
        if "dtype" in kwargs:
            kwargs["dtype"] = dtype_name(kwargs["dtype"])
        self.config = EngineConfig(model=model, quest=quest, **kwargs)
        self._engine: Optional[LLMEngine] = None
        self._engine = LLMEngine(self.config)

    @property
    def engine(self) -> LLMEngine:
        """The engine; ``RuntimeError`` once :meth:`close` has run."""
        if self._engine is None:
            raise RuntimeError("this LLM was closed (LLM.close); build a new one")
        return self._engine

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def cache_spec(self) -> CacheSpec:
        """What fits: weights held, KV pages and tokens (``llm.cache_spec.kv_tokens``; ``describe()`` for people)."""
        return self.engine.runner.cache_spec

    def close(self) -> None:
        """Free this LLM's device memory now: the KV pool, the CUDA graphs and the weights (queued requests are
        aborted). Idempotent; the LLM is unusable afterwards. Dropping the last reference to the LLM (and its
        engine) does the same, and ``with LLM(...) as llm:`` closes it at the end of the block."""
        engine, self._engine = getattr(self, "_engine", None), None
        if engine is not None:
            engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: Union[bool, Callable[..., tqdm]] = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion.

        Args:
            prompts: a text, a list of token ids, or a list of either.
            sampling_params: one for all prompts, or one per prompt (default ``SamplingParams()``).
            use_tqdm: a progress bar on stderr over finished requests, as vLLM's: its postfix counts the prompt
                tokens prefilled and the tokens decoded so far in this call, so that the chunks of a long prompt
                move it before any request finishes; ``False``: none; a callable: what makes the bar instead of
                ``tqdm`` (e.g. ``functools.partial(tqdm, leave=False)``), called with ``total``, ``desc`` and ``unit``.

        Returns:
            One finished :class:`RequestOutput` per prompt, in the prompts' order.

        Raises:
            ValueError: a bad prompt or sampling parameter (no request is queued then), or a ``use_tqdm`` that is
                neither a bool nor callable.
        """
        if not isinstance(use_tqdm, bool) and not callable(use_tqdm):
            raise ValueError(f"LLM.generate use_tqdm must be a bool or a callable making a tqdm bar, got {use_tqdm!r}")
        make_bar = use_tqdm if callable(use_tqdm) else functools.partial(tqdm, disable=not use_tqdm)
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)  # as many as prompts: checked by add_requests
        # Every request is checked before any is queued, so a bad one leaves the engine untouched.
        order = {request_id: i for i, request_id in enumerate(self.engine.add_requests(prompts, params))}
        results: dict[str, RequestOutput] = {}
        counted = self.engine.scheduler.step_tokens  # input tokens of the launched steps, by kind of row
        before = dict(counted)
        with make_bar(total=len(order), desc="generate", unit="req") as bar:
            try:
                while self.engine.has_unfinished_requests():
                    finished = len(results)
                    for output in self.engine.step():
                        if output.finished and output.request_id in order:
                            results[output.request_id] = output
                    bar.set_postfix_str(f"prefill {counted['prefill'] - before['prefill']} tok, "
                                        f"decode {counted['decode'] - before['decode']} tok", refresh=False)
                    bar.update(len(results) - finished)  # redraws the postfix too (at most every 0.1 s)
            except BaseException:  # a failed step (or Ctrl-C): abort this call's requests, leave the engine usable
                for request_id in order:
                    self.engine.abort_request(request_id)
                raise
        return [results[rid] for rid, _ in sorted(order.items(), key=lambda item: item[1])]
