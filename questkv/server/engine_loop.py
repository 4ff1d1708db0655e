"""The only owner of the :class:`~questkv.engine.llm_engine.LLMEngine`: one thread that steps it while requests
exist, fed by a thread-safe command queue, answering through one ``asyncio.Queue`` per request.

The asyncio side calls :meth:`EngineLoop.submit` (refused with :class:`QueueFull` beyond ``max_waiting`` queued
requests, or :class:`ShuttingDown`) and reads the returned :class:`RequestStream`; :meth:`RequestStream.close`
before the request finished (a client that went away, a timeout) aborts it, which frees its pages at the
engine thread's next turn (after the step in flight). The engine thread alone calls the engine, so the engine
needs no lock; it reports, through ``loop.call_soon_threadsafe`` (once per step for all requests), per request:

1. :data:`ACCEPTED`, or the ``ValueError`` of ``LLMEngine.add_request`` (a refused request, engine unchanged);
2. then a :class:`~questkv.engine.sequence.RequestOutput` for each step that touched it (text so far), the last
   one ``finished``; or an :class:`EngineFailure` when a step that ran it raised, after which it is aborted;
   or :class:`ShuttingDown` when the loop stops under it.

An exception in a step fails the requests of that step only and the loop keeps serving, except a fatal one (a
:class:`~questkv.engine.tp_workers.TensorParallelError`: a tensor-parallel rank died or hung, so no step can run
again): then every request is answered :class:`ShuttingDown` (503), the loop takes no new request, records the error
in :attr:`EngineLoop.fatal_error`, calls ``on_fatal`` (the server exits non-zero) and its thread ends. Text, protocol
and HTTP are :mod:`questkv.server.serving`'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Callable, Optional, Union

from questkv.engine.llm_engine import LLMEngine
from questkv.engine.sampling_params import SamplingParams
from questkv.engine.scheduler import ROW_KINDS, STEP_KINDS
from questkv.engine.sequence import RequestOutput, Sequence
from questkv.engine.tp_workers import TensorParallelError
from questkv.server.metrics import ServerMetrics
from questkv.validation import check_int

__all__ = ["ACCEPTED", "EngineFailure", "EngineLoop", "QueueFull", "RequestStream", "ShuttingDown"]

logger = logging.getLogger("questkv.server")

ACCEPTED = "accepted"
_STOP = object()


class QueueFull(Exception):
    """More than ``max_waiting`` requests are already waiting for admission (HTTP 503 with ``Retry-After``)."""


class ShuttingDown(Exception):
    """The server is stopping: it takes no new request, and this one was aborted or refused (HTTP 503)."""


class EngineFailure(Exception):
    """A step that ran this request raised; the request was aborted and the engine keeps serving (HTTP 500)."""


Event = Union[str, RequestOutput, Exception]


@dataclasses.dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: RequestStream


@dataclasses.dataclass
class _Live:
    """The engine thread's record of one admitted request."""

    stream: RequestStream
    seq: Sequence
    arrival: float
    queued: bool = True  # counted in the waiting bound until its first output
    tokens_seen: int = 0
    last_token_time: float = 0.0
    attended_sum: float = 0.0
    decode_steps: int = 0
    verify_steps: int = 0  # the sequence's verify counters already added to the metrics
    drafted: list[int] = dataclasses.field(default_factory=list)  # by draft position
    accepted: list[int] = dataclasses.field(default_factory=list)


class RequestStream:
    """The asyncio side of one request: :meth:`get` its events, :meth:`close` it when done or abandoned."""

    def __init__(self, owner: EngineLoop, request_id: str) -> None:
        self.owner = owner
        self.request_id = request_id
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.finished = False

    async def get(self, timeout: Optional[float] = None) -> Event:
        """The next event (outputs that piled up are merged into the newest: each carries the text so far).

        Raises:
            asyncio.TimeoutError: nothing came within ``timeout`` seconds (the request is still live).
        """
        event = await asyncio.wait_for(self.queue.get(), timeout)
        while isinstance(event, RequestOutput) and not event.finished and not self.queue.empty():
            event = self.queue.get_nowait()
        if isinstance(event, Exception) or (isinstance(event, RequestOutput) and event.finished):
            self.finished = True
            self.owner._release(self)
        return event

    def close(self) -> None:
        """Done with the request: abort it in the engine unless it finished (idempotent, never raises)."""
        if not self.finished:
            self.finished = True
            self.owner.abort(self.request_id)
            self.owner._release(self)


class EngineLoop:
    """Run ``engine`` in a dedicated thread for an asyncio server.

    Args:
        engine: the engine; from :meth:`start` on, only this loop's thread may call it.
        max_waiting: the most requests queued (submitted, not yet admitted to the running batch); beyond it
            :meth:`submit` raises :class:`QueueFull`.
        metrics: where to count tokens, latencies and the pool (a fresh :class:`ServerMetrics` by default).
        on_fatal: called (from the engine thread) once the engine failed for good (see the module docstring).
    """

    def __init__(self, engine: LLMEngine, max_waiting: int = 256, metrics: Optional[ServerMetrics] = None,
                 on_fatal: Optional[Callable[[], None]] = None) -> None:
        check_int("EngineLoop.max_waiting", max_waiting, minimum=0)
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self._commands: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._num_queued = 0  # under _lock: submitted and not yet admitted, refused or aborted
        self._open: dict[str, RequestStream] = {}  # asyncio side: streams not yet finished
        self._live: dict[str, _Live] = {}  # engine thread side
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._closing = False
        self.on_fatal = on_fatal
        self.fatal_error: Optional[BaseException] = None  # the error that ended the engine, if one did
        self.stats: dict[str, Any] = {}
        self._prefix_counted = (0, 0)  # the scheduler's prefix-cache counters already added to the metrics
        self._steps_counted = dict.fromkeys(STEP_KINDS, 0)  # and its step counters
        self._tokens_counted = dict.fromkeys(ROW_KINDS, 0)
        self._publish()

    # ---- asyncio side ------------------------------------------------------------------------------------------

    def start(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        """Start the engine thread; events are delivered on ``loop`` (default: the running loop)."""
        if self._thread is not None:
            raise RuntimeError("EngineLoop.start: the engine thread is already started")
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="questkv-engine", daemon=True)
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def is_alive(self) -> bool:
        """Whether the engine thread is running (also while shutting down)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closing

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> RequestStream:
        """Queue a request for the engine thread; read its events from the returned stream.

        Raises:
            ShuttingDown: the loop is stopping or not started.
            QueueFull: ``max_waiting`` requests are already queued.
        """
        if self._closing or self._thread is None or not self._thread.is_alive():
            raise ShuttingDown("the server is shutting down and takes no new request")
        with self._lock:
            if self._num_queued >= self.max_waiting:
                raise QueueFull(f"{self._num_queued} requests are already waiting (--max-waiting {self.max_waiting})")
            self._num_queued += 1
        stream = RequestStream(self, request_id)
        self._open[request_id] = stream
        self._commands.put(_Add(request_id, list(prompt_token_ids), params, stream))
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (its pages are freed at the engine thread's next turn); unknown ids are ignored."""
        self._commands.put(("abort", request_id))

    def begin_shutdown(self) -> None:
        """Take no new request from now on (signal-safe: it only sets a flag)."""
        self._closing = True

    def abort_all(self) -> None:
        """Abort every request, each answered with :class:`ShuttingDown` (the end of a shutdown's grace period)."""
        self._commands.put(("abort_all", None))

    async def shutdown(self, grace: float = 0.0) -> None:
        """Take no new request, let open requests finish for up to ``grace`` seconds, abort the rest and stop the
        engine thread."""
        self._closing = True
        if self._thread is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self._open and loop.time() < deadline:
            await asyncio.sleep(0.05)
        self._commands.put(_STOP)
        await loop.run_in_executor(None, self._thread.join, 30.0)
        if self._thread.is_alive():
            logger.error("the engine thread did not stop within 30 s of the stop command")

    def _release(self, stream: RequestStream) -> None:
        self._open.pop(stream.request_id, None)

    def _emit(self, stream: RequestStream, event: Event) -> None:
        self._emit_all([(stream, event)])

    def _emit_all(self, events: list[tuple[RequestStream, Event]]) -> None:
        """Deliver ``(stream, event)`` pairs in order with one wake-up of the event loop (a step's outputs
        for every request at once, not one cross-thread call each)."""
        if not events:
            return

        def deliver() -> None:
            for stream, event in events:
                stream.queue.put_nowait(event)

        try:
            self._loop.call_soon_threadsafe(deliver)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    # ---- engine thread -----------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                commands = self._drain(block=not self.engine.has_unfinished_requests())
                if any(command is _STOP for command in commands):
                    self._stop(commands)
                    return
                for command in commands:
                    if isinstance(command, _Add):
                        self._add(command)
                    elif command[0] == "abort_all":
                        self._abort_all("the server shut down before this request finished")
                    else:
                        self._abort(command[1])
                if self.engine.has_unfinished_requests():
                    self._step()
                if self.fatal_error is not None:
                    return
                self._publish()
            except Exception:  # never let the thread die; the failing request was answered where it failed
                logger.exception("engine loop error (the loop keeps running)")
                time.sleep(0.01)

    def _drain(self, block: bool) -> list:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _unqueue(self) -> None:
        with self._lock:
            self._num_queued -= 1

    def _add(self, command: _Add) -> None:
        arrival = time.perf_counter()
        try:
            self.engine.add_request(command.prompt_token_ids, command.params, request_id=command.request_id)
        except Exception as error:  # ValueError: refused, engine unchanged; anything else: a 500
            self._unqueue()
            self._emit(command.stream, error if isinstance(error, ValueError) else EngineFailure(repr(error)))
            return
        seq = self.engine.scheduler.waiting[-1]  # add_request appended it
        if seq.request_id != command.request_id:
            raise RuntimeError(f"request {command.request_id!r} was added but the newest waiting one is {seq.request_id!r}")
        self._live[command.request_id] = _Live(command.stream, seq, arrival)
        self.metrics.prompt_tokens.inc(len(command.prompt_token_ids))
        self._emit(command.stream, ACCEPTED)

    def _abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is None:
            return
        self.engine.abort_request(request_id)
        if live.queued:
            self._unqueue()
        self._publish()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except TensorParallelError as error:
            self._fail_engine(error)
            return
        except Exception as error:
            self._fail_step(error)
            return
        now = time.perf_counter()
        attended, events = [], []
        for output in outputs:
            live = self._live.get(output.request_id)
            if live is None:
                continue
            if live.queued:
                live.queued = False
                self._unqueue()
            self._observe(live, output, now, attended)
            events.append((live.stream, output))
            if output.finished:
                del self._live[output.request_id]
        if attended:
            self.metrics.mean_tokens_attended.set(sum(attended) / len(attended))
        self._publish()  # before the outputs: a client that saw its request finish sees it gone from the counts
        self._emit_all(events)

    def _observe(self, live: _Live, output: RequestOutput, now: float, attended: list) -> None:
        new = len(output.token_ids) - live.tokens_seen
        if new > 0:
            self.metrics.generation_tokens.inc(new)
            if live.tokens_seen == 0:
                self.metrics.time_to_first_token.observe(now - live.arrival)
            else:
                for _ in range(new):
                    self.metrics.inter_token_latency.observe((now - live.last_token_time) / new)
            live.tokens_seen, live.last_token_time = len(output.token_ids), now
        seq = live.seq
        if seq.decode_steps > live.decode_steps:
            attended.append((seq.tokens_attended_sum - live.attended_sum) / (seq.decode_steps - live.decode_steps))
            live.attended_sum, live.decode_steps = seq.tokens_attended_sum, seq.decode_steps
        if seq.num_verify_steps == live.verify_steps:
            return
        self.metrics.spec_verify_steps.inc(seq.num_verify_steps - live.verify_steps)
        live.verify_steps = seq.num_verify_steps
        for counts, counted, total, by_position in (
                (seq.draft_tokens_by_position, live.drafted, self.metrics.spec_draft_tokens,
                 self.metrics.spec_draft_tokens_by_position),
                (seq.accepted_tokens_by_position, live.accepted, self.metrics.spec_accepted_tokens,
                 self.metrics.spec_accepted_tokens_by_position)):
            counted.extend([0] * (len(counts) - len(counted)))
            for position, (count, before) in enumerate(zip(counts, counted)):
                by_position.labels(position=str(position)).inc(count - before)  # (a new position appears at 0)
            total.inc(sum(counts) - sum(counted))
            counted[:] = counts

    def _fail_step(self, error: Exception) -> None:
        """Fail the requests of the steps that raised or were in flight: those with tokens in flight (the engine
        dropped those steps, see :meth:`LLMEngine.step`) and the one whose chunked prefill is under way (its last
        chunk's K/V may be missing), else every running request (and the head of the waiting queue when nothing
        runs), so that a failure that repeats still drains the queue."""
        logger.error("a step failed: %r; failing its requests", error, exc_info=error)
        scheduler = self.engine.scheduler
        running = list(scheduler.running)
        failed = [seq for seq in running + list(scheduler.waiting) if seq.num_in_flight or seq is scheduler.prefilling]
        if not failed:
            failed = running or list(scheduler.waiting)[:1]
        streams = []
        for seq in failed:
            self.engine.abort_request(seq.request_id)
            live = self._live.pop(seq.request_id, None)
            if live is not None:
                if live.queued:
                    self._unqueue()
                streams.append(live.stream)
        self._publish()
        for stream in streams:
            self._emit(stream, EngineFailure(f"the engine step running this request failed: {error!r}"))

    def _fail_engine(self, error: TensorParallelError) -> None:
        """The engine can run no step any more: refuse new requests, answer every request 503 and call
        ``on_fatal``; the engine thread then ends."""
        logger.critical("the engine failed for good: %s; stopping the server", error)
        self._closing = True
        self.fatal_error = error
        self._abort_all(f"the engine failed and the server is stopping: {error}")
        for command in self._drain(block=False):
            if isinstance(command, _Add):
                self._unqueue()
                self._emit(command.stream, ShuttingDown("the engine failed and the server is stopping"))
        if self.on_fatal is not None:
            self.on_fatal()

    def _stop(self, commands: list) -> None:
        for command in commands:
            if isinstance(command, _Add):
                if command.request_id not in self._live:
                    self._unqueue()
                    self._emit(command.stream, ShuttingDown("the server is shutting down"))
        self._abort_all("the server shut down before this request finished")
        self._publish()

    def _abort_all(self, message: str) -> None:
        for request_id, live in list(self._live.items()):
            self.engine.abort_request(request_id)
            if live.queued:
                self._unqueue()
            self._emit(live.stream, ShuttingDown(message))
        self._live.clear()

    def _publish(self) -> None:
        """Refresh the pool and queue gauges and :attr:`stats` (the engine thread's view, read by ``/health``), under
        the metrics' lock: a scrape sees them all from one publish."""
        with self.metrics.lock:
            self._publish_counts()

    def _publish_counts(self) -> None:
        engine = self.engine
        free, total = engine.cache.num_free_pages, engine.cache.num_pages
        running, waiting = engine.scheduler.num_running, engine.scheduler.num_waiting
        self.metrics.running.set(running)
        self.metrics.waiting.set(waiting)
        self.metrics.pages_free.set(free)
        self.metrics.pages_used.set(total - free)
        scheduler = engine.scheduler
        queried, hit = scheduler.prefix_queried_tokens, scheduler.prefix_hit_tokens
        self.metrics.prefix_cache_queries.inc(queried - self._prefix_counted[0])
        self.metrics.prefix_cache_hits.inc(hit - self._prefix_counted[1])
        self._prefix_counted = (queried, hit)
        for counted, now, counter in ((self._steps_counted, scheduler.step_counts, self.metrics.engine_steps),
                                      (self._tokens_counted, scheduler.step_tokens, self.metrics.step_tokens)):
            for kind, value in now.items():
                counter.labels(kind=kind).inc(value - counted[kind])
                counted[kind] = value
        self.metrics.prefix_cache_pages.set(engine.cache.num_cached_pages)
        self.stats = {"requests_running": running, "requests_waiting": waiting, "kv_pages_free": free,
                      "kv_pages_total": total}
