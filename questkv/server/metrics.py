"""All of ``/metrics``: the server's Prometheus metrics, on a registry of its own (no globals, so two apps can
share a process).

The engine loop's thread observes tokens, latencies and the pool (``prometheus_client`` is thread-safe);
:mod:`questkv.server.serving` counts finished requests by status. The loop sets a step's pool and queue counts under
:attr:`ServerMetrics.lock`, which a scrape holds too: a scrape that finds nothing running also finds the pages that the
last request freed. Metric names:

* ``questkv_requests_total{status}``: finished requests by how they ended: ``stop``, ``length`` (served),
  ``abort`` (the client went away), ``timeout``, ``error`` (500), ``invalid`` (4xx), ``rejected`` (503).
* ``questkv_prompt_tokens_total``, ``questkv_generation_tokens_total``: tokens of admitted requests.
* ``questkv_requests_running``, ``questkv_requests_waiting``: the engine's running batch and waiting queue.
* ``questkv_kv_pages_used``, ``questkv_kv_pages_free``: the KV pool (``used + free`` is every page).
* ``questkv_mean_tokens_attended``: KV tokens one decode step attended per sequence (mean over the batch,
  layers and heads) in the latest decode step.
* ``questkv_time_to_first_token_seconds``, ``questkv_inter_token_latency_seconds``: histograms.
* ``questkv_engine_steps_total{kind}``: engine steps launched: ``decode`` (decode rows only, under a CUDA graph on
  CUDA), ``prefill`` (prefill rows only), ``mixed`` (decode rows beside prefill chunks: chunked prefill).
* ``questkv_step_tokens_total{kind}``: the launched steps' input tokens by kind of row, ``decode``, ``verify`` (a
  lossless round's dense verify rows: its last token and its drafts) or ``prefill`` (prefix-cache hits are not
  computed, so not counted).
* ``questkv_spec_decode_num_draft_tokens_total``, ``questkv_spec_decode_num_accepted_tokens_total``,
  ``questkv_spec_decode_num_verify_steps_total``: lossless Quest (``--speculative-config``, vLLM's
  ``vllm:spec_decode_num_draft_tokens`` and ``..._num_accepted_tokens``): the draft tokens verify steps scored, those
  they kept (dense attention's own token after them not counted), and the verify steps; accepted / draft is the
  acceptance rate, (accepted + verify steps) / verify steps the tokens per verify step.
* ``questkv_spec_decode_num_draft_tokens_per_pos_total{position}``,
  ``questkv_spec_decode_num_accepted_tokens_per_pos_total{position}``: the same two counts by draft position in a
  round (0: its first draft; vLLM's ``vllm:spec_decode_num_accepted_tokens_per_pos``); accepted / draft at a
  position is its acceptance rate, which says how many drafts per round are worth taking. A position's labels
  appear with its first verify step.
"""

from __future__ import annotations

import threading

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from questkv.engine.scheduler import ROW_KINDS, STEP_KINDS

__all__ = ["REQUEST_STATUSES", "ServerMetrics"]

REQUEST_STATUSES = ("stop", "length", "abort", "timeout", "error", "invalid", "rejected")

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServerMetrics:
    """The server's metrics on ``self.registry`` (a fresh ``CollectorRegistry``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # one step's counts published whole (EngineLoop._publish), one scrape read whole
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("questkv_requests", "finished requests by status", ["status"], registry=registry)
        for status in REQUEST_STATUSES:  # every label present from the start, at 0
            self.requests.labels(status=status)
        self.prompt_tokens = Counter("questkv_prompt_tokens", "prompt tokens of admitted requests", registry=registry)
        self.generation_tokens = Counter("questkv_generation_tokens", "generated tokens", registry=registry)
        self.running = Gauge("questkv_requests_running", "requests in the engine's running batch", registry=registry)
        self.waiting = Gauge("questkv_requests_waiting", "requests waiting for admission", registry=registry)
        self.pages_used = Gauge("questkv_kv_pages_used", "KV-cache pages in use", registry=registry)
        self.pages_free = Gauge("questkv_kv_pages_free", "KV-cache pages free", registry=registry)
        self.prefix_cache_queries = Counter(
            "questkv_prefix_cache_queries", "prefill tokens looked up in the prefix cache", registry=registry
        )
        self.prefix_cache_hits = Counter(
            "questkv_prefix_cache_hits", "prefill tokens found in the prefix cache (not computed)", registry=registry
        )
        self.prefix_cache_pages = Gauge(
            "questkv_prefix_cache_pages", "KV-cache pages holding a cached full page of tokens (shared, in use or "
            "evictable)", registry=registry,
        )
        self.mean_tokens_attended = Gauge(
            "questkv_mean_tokens_attended",
            "KV tokens one decode step attended per sequence (mean over the batch, layers and heads), latest step",
            registry=registry,
        )
        self.time_to_first_token = Histogram(
            "questkv_time_to_first_token_seconds", "arrival to first generated token", buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            "questkv_inter_token_latency_seconds", "time between a request's consecutive tokens", buckets=_ITL_BUCKETS,
            registry=registry,
        )

        self.spec_draft_tokens = Counter(
            "questkv_spec_decode_num_draft_tokens", "lossless Quest: draft tokens scored by verify steps",
            registry=registry,
        )
        self.spec_accepted_tokens = Counter(
            "questkv_spec_decode_num_accepted_tokens", "lossless Quest: draft tokens verify steps kept",
            registry=registry,
        )
        self.spec_verify_steps = Counter(
            "questkv_spec_decode_num_verify_steps", "lossless Quest: verify steps of the requests", registry=registry,
        )
        self.spec_draft_tokens_by_position = Counter(
            "questkv_spec_decode_num_draft_tokens_per_pos",
            "lossless Quest: draft tokens scored by verify steps, by position in the round", ["position"],
            registry=registry,
        )
        self.spec_accepted_tokens_by_position = Counter(
            "questkv_spec_decode_num_accepted_tokens_per_pos",
            "lossless Quest: draft tokens verify steps kept, by position in the round", ["position"],
            registry=registry,
        )

        self.engine_steps = Counter("questkv_engine_steps", "engine steps launched, by kind (decode, prefill, mixed)",
                                    ["kind"], registry=registry)
        self.step_tokens = Counter("questkv_step_tokens", "input tokens of launched engine steps, by kind of row",
                                   ["kind"], registry=registry)
        for kind in STEP_KINDS:
            self.engine_steps.labels(kind=kind)
        for kind in ROW_KINDS:
            self.step_tokens.labels(kind=kind)

    def count_request(self, status: str) -> None:
        """One finished request with ``status`` (one of :data:`REQUEST_STATUSES`)."""
        if status not in REQUEST_STATUSES:
            raise ValueError(f"ServerMetrics.count_request status must be one of {REQUEST_STATUSES}, got {status!r}")
        self.requests.labels(status=status).inc()

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type, read between two publishes of the engine loop."""
        with self.lock:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
