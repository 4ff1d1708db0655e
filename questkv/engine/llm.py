"""The offline API, vLLM-style: ``LLM(model, quest=...)`` and ``llm.generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from typing import Optional, Sequence, Union

from tqdm.auto import tqdm

from questkv.config import QuestConfig
from questkv.engine.config import CacheSpec, EngineConfig, dtype_name
from questkv.engine.llm_engine import LLMEngine, Prompt
from questkv.engine.sampling_params import SamplingParams
from questkv.engine.sequence import RequestOutput


class LLM:
    """Generate from many prompts at once with continuous batching, dense or with Quest.

    Args:
        model: an alias (``"smollm2-135m"``), an HF folder, a ``.gguf`` file, or a transformers config
            with ``load_format="dummy"``.
        quest: Quest on decode steps (``QuestConfig(token_budget=...)``), or ``None``: the same engine dense.
        **kwargs: the other :class:`~questkv.engine.config.EngineConfig` fields (``dtype``, ``device``,
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
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion.

        Args:
            prompts: a text, a list of token ids, or a list of either.
            sampling_params: one for all prompts, or one per prompt (default ``SamplingParams()``).
            use_tqdm: show a progress bar over finished requests.

        Returns:
            One finished :class:`RequestOutput` per prompt, in the prompts' order.
        """
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
        with tqdm(total=len(order), desc="generate", disable=not use_tqdm, unit="req") as bar:
            try:
                while self.engine.has_unfinished_requests():
                    for output in self.engine.step():
                        if output.finished and output.request_id in order:
                            results[output.request_id] = output
                            bar.update(1)
            except BaseException:  # a failed step (or Ctrl-C): abort this call's requests, leave the engine usable
                for request_id in order:
                    self.engine.abort_request(request_id)
                raise
        return [results[rid] for rid, _ in sorted(order.items(), key=lambda item: item[1])]
