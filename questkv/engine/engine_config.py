"""The engine's configuration: one frozen, validated object that every component takes at construction.

Values found at run time (how many pages fit the memory budget) are not written here: the runner
returns them as a :class:`CacheSpec`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import torch

from questkv.config import QuestConfig, SpeculativeConfig
from questkv.validation import check_bool, check_choice, check_float, check_int, check_optional_int

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
"""vLLM's names: ``auto`` stores K/V in the model's dtype; ``fp8`` (``fp8_e4m3``) in float8 e4m3, one byte each."""
LOAD_FORMATS = ("auto", "dummy")
DEVICES = ("cpu", "cuda")
GRAPH_CAPTURE = ("lazy", "startup")
QUANTIZATIONS = ("int4", "int8", "gguf", "awq", "gptq", "compressed-tensors")
ROUND_TO_NEAREST = ("int4", "int8")
"""The :data:`QUANTIZATIONS` that round a float checkpoint at load (the others name packed checkpoint formats)."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model.

    Attributes:
        model: what :func:`questkv.load_model` takes (alias, HF folder, ``.gguf``), or a
            ``transformers.PretrainedConfig`` with ``load_format="dummy"`` (random weights).
        quest: Quest sparsity on decode steps, or ``None`` for the same engine dense.
        dtype: weights and KV cache: ``"bfloat16"``, ``"float16"`` or ``"float32"``; ``"float64"`` on CPU (the
            reference: batch and chunk rounding too small to flip a near tie, for exactness tests).
        device: ``"cuda"`` or ``"cpu"``; ``None`` picks CUDA when available.
        max_num_seqs: the most sequences decoded together.
        max_model_len: the most tokens (prompt and output) per sequence; ``None``: the model's
            ``max_position_embeddings``.
        max_num_batched_tokens: with chunked prefill, the most tokens of one step, decode tokens and prefill
            chunks together (at least ``max_num_seqs``: every decode fits); ``None``: ``max(8192, max_num_seqs)``
            (vLLM's online-serving default: a step of 8192 tokens keeps the matrix products of an 8B model
            compute-bound, so prefill loses little to chunking). Without chunking, the most prompt tokens per
            prefill step, a longer prompt running alone; ``None``: ``max(max_model_len, 8192)``.
        kv_cache_memory: bytes of KV cache; ``None``: what ``gpu_memory_utilization`` leaves (CUDA) or 1 GiB (CPU).
            With tensor parallelism, per rank (each holds its KV heads' share of every page).
        gpu_memory_utilization: fraction in (0, 1] of the GPU's whole memory this engine may occupy: weights,
            activations and KV cache (vLLM's meaning; not a fraction of what is free). The KV cache never takes
            more than is free when the engine starts, so that engines in one process or on one GPU can share
            it by their fractions.
        enforce_eager: never capture CUDA graphs (always true on CPU).
        compile_elementwise: with CUDA graphs, run RMSNorm (with its residual add) and SiLU-and-multiply as one
            Triton kernel each (:mod:`questkv.ops.triton.elementwise`) instead of eager torch's several; ``False``
            keeps eager torch's ops (RoPE is part of the K/V append either way).
        graph_capture: when the decode graphs (one per batch size of ``cuda_graphs.graph_batch_sizes`` and
            power-of-two page-table width) are captured and their kernels compiled: ``"lazy"``, at the first
            step that needs one (quick to start; that step waits seconds), or ``"startup"``, all of them
            when the engine starts (what a server wants: no request waits for a capture), with
            ``speculative_config`` also the verify graphs of every round length and the dense and mixed steps at
            every width, and then the eager prefill attention over cached pages in every launch configuration
            (:func:`questkv.layers.attention.prepare_prefill`). A dense request inside a Quest batch uses graphs
            of its own, captured lazily either way.
        async_scheduling: schedule and launch step N+1 before reading step N's tokens, so that the host's work
            (scheduling, staging, detokenising, stop checks) overlaps the device's; the next step's input tokens
            stay on the device. ``None``: on with CUDA graphs, off otherwise (the CPU runs each step to its end
            anyway). Same tokens as the synchronous loop; a request that stops on a token or a stop string costs
            at most one discarded step.
        quantization: weight-only quantization of the linear layers after loading: ``"int4"`` (groups of 128,
            asymmetric, round to nearest), ``"int8"`` (per output row), or ``None`` (the checkpoint's dtype).
            Embeddings and the LM head stay in ``dtype`` (see ``quantize_lm_head``). On CPU the torch reference,
            on CUDA the Triton kernels and, for 2 to 32 rows of int4, a CUDA C++ kernel built at first use; an int4
            layer holds its codes once, K-major (every device, any batch).
            A packed checkpoint loads packed instead (``questkv.models.engine_model``): ``"gguf"`` for a GGUF file
            or alias (without it, a GGUF is dequantized to ``dtype``); an HF folder with a ``quantization_config``
            is detected, and ``"awq"``, ``"gptq"``, ``"compressed-tensors"`` may name it (any other value is refused).
        quantize_lm_head: with ``quantization="int4"`` or ``"int8"``, round the LM head too (as GPTQ's
            ``lm_head=True``): at batch 1 the bf16 LM head of llama3.1-8b is 1.05 GB, about a tenth of an int4
            decode step (int4 dense at B=1/8k: 2.76 -> 2.62 ms); its rounding error lands on the logits directly
            (Qwen2.5-Coder-0.5B perplexity: +3.1 % over int4 without it, +0.1 % over int8; a tied head gets its own
            quantized copy, the embedding stays in ``dtype``). Off by default, as GPTQ, AWQ and GGUF's Q4_K_M keep
            it in more bits.
        enable_prefix_caching: automatic prefix caching (as vLLM's): full KV pages are named by a hash chain of
            their tokens and shared read-only by every request whose tokens start with them, and kept (evictable,
            least recently used first) after their requests finish, so that a repeated prefix (a document, the
            earlier turns of a conversation) is not prefilled again; a hit leaves at least the prompt's last
            token to compute. Pages written by a prefill are cached, and those of decode steps when they attend
            densely (a dense engine or request): a Quest decode step attends part of the context, so its K/V are
            not what a prefill of the same tokens computes. Same tokens as without it, up to the float rounding of
            the prefill that attends the cached pages (:func:`~questkv.ops.paged_prefill_attention`).
        enable_chunked_prefill: split a prefill into chunks of at most ``max_num_batched_tokens`` tokens (as vLLM's
            ``--enable-chunked-prefill``), so that a long prompt never stalls running decodes for seconds: each step
            carries one token of every running decode and fills the rest of ``max_num_batched_tokens`` with prefill
            chunks (a mixed step, run eagerly; decode-only steps keep their CUDA graphs), a chunk attends the
            sequence's earlier chunks in the pool (as a prefix-cache hit does), and the pages of each chunk are
            offered to the prefix cache as they fill. Same tokens as unchunked, up to the float rounding of the
            chunks' paged attention over the pool (see :class:`~questkv.engine.scheduler.Scheduler`).
        tensor_parallel_size: ranks (devices) the model is sharded over by attention heads
            (:mod:`questkv.layers.parallel`): this process is rank 0 (scheduler, sampling, its own shard) and spawns
            ranks 1..N-1 (:mod:`questkv.engine.tp_workers`); on CUDA rank ``r`` runs on ``cuda:r`` with NCCL, on CPU
            any N runs with gloo. The attention and KV heads and the intermediate size must be divisible by it
            (KV heads are not replicated). 1: the single-device engine, no process and no collective.
        speculative_config: lossless Quest (:class:`~questkv.config.SpeculativeConfig`, or vLLM's dict form
            ``{"method": "quest", "num_speculative_tokens": k}``): every Quest request drafts with Quest and verifies
            with dense attention, so its output is dense attention's; needs ``quest``. The engine picks the drafts
            per round from the step times and acceptance it measures (:mod:`questkv.engine.speculation`; 0: dense
            steps where drafting would not pay). Under ``async_scheduling`` a round's draft steps and its verify are
            launched one ahead of their update, as decode steps are, and so is the next round's first draft (the
            device follows what the verify keeps); the engine waits for the update of the step before only where a
            round could not start whatever its verify keeps (``Scheduler.waits_for``) and before a round starts
            from a dense step. ``None``: Quest's steps are the output (lossy).
        kv_cache_dtype: ``"auto"`` (K/V in ``dtype``) or ``"fp8"`` / ``"fp8_e4m3"`` (vLLM's names): K and V pages in
            float8 e4m3 (one byte per element, half of bf16's), written with a scale of 1 as vLLM does without
            calibrated scales (values beyond ±448 saturate); each page's key min and max are fp8 too, the min and max
            of the stored fp8 keys, so they bound exactly the keys attention multiplies. CPU, or CUDA compute
            capability >= 8.9 (Ada, Hopper).
        seed: seeds the dummy weights and requests without a seed of their own.
        load_format: ``"auto"`` (weights from the checkpoint) or ``"dummy"`` (random weights at the real shapes).
    """

    model: Any
    quest: Optional[QuestConfig] = None
    dtype: str = "bfloat16"
    device: Optional[str] = None
    max_num_seqs: int = 32
    max_model_len: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None
    kv_cache_memory: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    compile_elementwise: bool = True
    graph_capture: str = "lazy"
    async_scheduling: Optional[bool] = None
    quantization: Optional[str] = None
    quantize_lm_head: bool = False
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    tensor_parallel_size: int = 1
    speculative_config: Optional[SpeculativeConfig] = None
    kv_cache_dtype: str = "auto"
    seed: int = 0
    load_format: str = "auto"

    def __post_init__(self) -> None:
        if self.quest is not None and not isinstance(self.quest, QuestConfig):
            raise ValueError(f"EngineConfig.quest must be a QuestConfig or None, got {type(self.quest).__name__}")
        check_choice("EngineConfig.dtype", self.dtype, DTYPES)
        if self.device is not None:
            check_choice("EngineConfig.device", self.device, DEVICES)
            if self.device == "cuda" and not torch.cuda.is_available():
                raise ValueError("EngineConfig.device='cuda' but no CUDA device is available; use 'cpu'")
        if self.dtype == "float64" and self.torch_device.type != "cpu":
            raise ValueError("EngineConfig.dtype='float64' runs on the CPU only (the Triton kernels take 16- and "
                             f"32-bit floats), got device {self.torch_device.type!r}")
        check_int("EngineConfig.max_num_seqs", self.max_num_seqs, minimum=1)
        check_optional_int("EngineConfig.max_model_len", self.max_model_len, minimum=2)
        check_optional_int("EngineConfig.max_num_batched_tokens", self.max_num_batched_tokens, minimum=1)
        check_optional_int("EngineConfig.kv_cache_memory", self.kv_cache_memory, minimum=1)
        check_float("EngineConfig.gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, low_open=True)
        check_bool("EngineConfig.enforce_eager", self.enforce_eager)
        check_bool("EngineConfig.compile_elementwise", self.compile_elementwise)
        check_choice("EngineConfig.graph_capture", self.graph_capture, GRAPH_CAPTURE)
        if self.async_scheduling is not None:
            check_bool("EngineConfig.async_scheduling", self.async_scheduling)
        if self.quantization is not None:
            check_choice("EngineConfig.quantization", self.quantization, QUANTIZATIONS)
        check_bool("EngineConfig.quantize_lm_head", self.quantize_lm_head)
        if self.quantize_lm_head and self.quantization not in ROUND_TO_NEAREST:
            raise ValueError(f"EngineConfig.quantize_lm_head=True rounds the LM head at load: it needs quantization "
                             f"one of {ROUND_TO_NEAREST}, got {self.quantization!r}")
        check_bool("EngineConfig.enable_prefix_caching", self.enable_prefix_caching)
        check_bool("EngineConfig.enable_chunked_prefill", self.enable_chunked_prefill)
        if (self.enable_chunked_prefill and self.max_num_batched_tokens is not None
                and self.max_num_batched_tokens < self.max_num_seqs):
            raise ValueError(
                f"EngineConfig.max_num_batched_tokens={self.max_num_batched_tokens} must be >= max_num_seqs="
                f"{self.max_num_seqs} with chunked prefill (a step carries one token of every decoding sequence); "
                "raise it, lower max_num_seqs or turn chunked prefill off"
            )
        check_int("EngineConfig.tensor_parallel_size", self.tensor_parallel_size, minimum=1)
        if self.torch_device.type == "cuda" and self.tensor_parallel_size > torch.cuda.device_count():
            raise ValueError(f"EngineConfig.tensor_parallel_size={self.tensor_parallel_size} needs as many CUDA "
                             f"devices, but {torch.cuda.device_count()} are visible")
        speculative = SpeculativeConfig.from_value(self.speculative_config, "EngineConfig.speculative_config")
        object.__setattr__(self, "speculative_config", speculative)
        if speculative is not None and (self.quest is None or self.quest.is_dense):
            raise ValueError("EngineConfig.speculative_config drafts with Quest's sparse attention: it needs "
                             "quest=QuestConfig(token_budget=...)")
        check_choice("EngineConfig.kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.kv_cache_dtype != "auto" and self.torch_device.type == "cuda":
            capability = torch.cuda.get_device_capability(self.torch_device)
            if capability < (8, 9):
                raise ValueError(f"EngineConfig.kv_cache_dtype={self.kv_cache_dtype!r} needs a GPU of compute "
                                 "capability >= 8.9 (Ada, Hopper) for float8 e4m3, this one has "
                                 f"{capability[0]}.{capability[1]}; use 'auto'")
        check_int("EngineConfig.seed", self.seed, minimum=0)
        check_choice("EngineConfig.load_format", self.load_format, LOAD_FORMATS)
        is_config = hasattr(self.model, "model_type") and hasattr(self.model, "to_dict")
        if self.load_format == "dummy" and not (is_config or isinstance(self.model, str)):
            raise ValueError(f"EngineConfig.model must be a name, a path or a transformers config, got {self.model!r}")
        if is_config and self.load_format != "dummy":
            raise ValueError("EngineConfig.model is a transformers config: it has no weights, pass load_format='dummy'")
        if not is_config and not isinstance(self.model, str):
            raise ValueError(f"EngineConfig.model must be a name, a path or a transformers config, got {self.model!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        """The dtype of the K and V pages (:attr:`kv_cache_dtype` resolved); the key bounds stay in
        :attr:`torch_dtype`."""
        return self.torch_dtype if self.kv_cache_dtype == "auto" else torch.float8_e4m3fn

    @property
    def torch_device(self) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    @property
    def page_size(self) -> int:
        """The KV page size: Quest's, or 16 for a dense engine."""
        return 16 if self.quest is None else self.quest.page_size

    def prefill_tokens_per_step(self, max_model_len: int) -> int:
        """:attr:`max_num_batched_tokens`, its default resolved for an engine of ``max_model_len``."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return max(8192, self.max_num_seqs) if self.enable_chunked_prefill else max(max_model_len, 8192)

    @property
    def use_cuda_graphs(self) -> bool:
        return self.torch_device.type == "cuda" and not self.enforce_eager

    def prefix_cache_salt(self) -> bytes:
        """What the prefix cache's hash chain starts from: the model's identity (name or config), dtype, weight
        quantization and Quest page layout, so that pages are only ever shared by the same computation."""
        model = self.model if isinstance(self.model, str) else repr(sorted(self.model.to_dict().items()))
        seed = self.seed if self.load_format == "dummy" else None
        return repr((model, self.dtype, self.quantization, self.quantize_lm_head, self.load_format, seed,
                     self.page_size)).encode()

    @property
    def use_async_scheduling(self) -> bool:
        """:attr:`async_scheduling`, its default resolved."""
        return self.use_cuda_graphs if self.async_scheduling is None else self.async_scheduling


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """What the runner found fits: pages in the pool (``page_size`` tokens of K, V and key bounds in every layer,
    ``page_bytes`` each) and per sequence, the sequence limit, and the bytes of weights the budget was planned
    around (``weight_bytes``: every parameter and buffer the model holds on its device, packed copies included)."""

    num_pages: int
    max_pages_per_seq: int
    max_model_len: int
    page_size: int
    page_bytes: int
    weight_bytes: int
    kv_dtype: str = "bfloat16"
    model_dtype_layers: tuple[int, ...] = ()  # an fp8 pool's layers kept in the model dtype

    @property
    def kv_tokens(self) -> int:
        """Tokens of KV the pool holds for requests (one page is the padding rows' scratch)."""
        return (self.num_pages - 1) * self.page_size

    def describe(self) -> str:
        """One line for people: weights, KV-cache size, tokens of KV and full-length sequences that fit."""
        wide = f", layers {list(self.model_dtype_layers)} in the model dtype" if self.model_dtype_layers else ""
        return (f"weights {self.weight_bytes / 2**30:.2f} GiB; KV cache ({self.kv_dtype}{wide}) "
                f"{self.num_pages * self.page_bytes / 2**30:.2f} GiB: {self.num_pages} pages of {self.page_size} "
                f"tokens, {self.kv_tokens:,} tokens of KV, room for "
                f"{self.kv_tokens // self.max_model_len:,} sequences of max_model_len={self.max_model_len:,}")


def dtype_name(dtype: Union[str, torch.dtype]) -> str:
    """``"bfloat16"`` for ``torch.bfloat16`` or ``"bfloat16"``; anything else is an error."""
    if isinstance(dtype, torch.dtype):
        for name, value in DTYPES.items():
            if value == dtype:
                return name
    if dtype in DTYPES:
        return dtype
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
