"""questkv's inference engine: requests in, tokens out, with continuous batching over one paged KV cache.

``sampling_params`` (what a request asks for), ``sequence`` (one request's state and its output), ``scheduler``
(who runs each step, preemption, stops; no tensors), ``context`` (per-step metadata for the layers),
``model_runner`` (tensors and CUDA graphs), ``llm_engine`` / ``llm`` (the step loop and the offline API),
``tp_workers`` (the other ranks' processes with tensor parallelism, and their watchdog).
"""
