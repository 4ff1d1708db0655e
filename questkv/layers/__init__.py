"""Building blocks of questkv's own models: attention, rotary embeddings, norms, fused linears, activations.

Each module takes flat token-major tensors (``[T, ...]``, all sequences of a step back to back) and holds no
per-step state; per-step metadata arrives as a ``StepContext`` argument (``questkv.decode.context``).
"""
