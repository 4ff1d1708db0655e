"""Tensor parallelism's processes: rank 0 (the caller's process, which runs the scheduler) starts ranks 1..N-1
(:class:`WorkerPool`), sends each step to them and notices when one dies; each of them runs :func:`worker_main`.

A worker builds the same model shard and :class:`~questkv.engine.model_runner.ModelRunner` as rank 0, then runs
every :class:`~questkv.engine.step_data.StepMessage` that comes down its pipe (pickled once by rank 0, about
2 KB per decode step at batch 32). The pipe, not a collective, carries the steps, so an idle engine waits on nothing
that can time out, and a worker whose rank 0 is gone reads end-of-file and exits (on Linux the kernel also kills it
when rank 0 dies: ``PR_SET_PDEATHSIG``).

Start: rank 0 waits for the workers in the rendezvous (:meth:`WorkerPool.connect`) while it watches their processes,
so a worker that dies while it starts fails ``LLM(...)`` at once, naming the rank, its exit code and its error. The
``spawn`` start method re-imports the main module in each worker before running it: a script whose top level starts
a tensor-parallel engine (no ``if __name__ == "__main__":``) would start one in every worker; the worker exits
instead, and rank 0's error says what the script needs.

Faults: collectives give up after :func:`collective_timeout` seconds (a hung rank); a watchdog thread on rank 0
waits on the workers' process sentinels and, when one exits, aborts the group so that a collective blocked on it
returns at once. Either way the step raises :class:`TensorParallelError` naming the rank (and the worker's own error,
when it reported one), and the engine stays failed: any step that fails part-way leaves the ranks out of step, so
every later one raises too. :meth:`WorkerPool.close` (the engine's ``close``, its ``__del__``, or ``atexit``) stops
the workers, killing those that do not exit within seconds (at once after a failure): none is left behind.
"""

from __future__ import annotations

import atexit
import ctypes
import multiprocessing.connection
import multiprocessing.spawn
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from typing import Optional

import torch
import torch.multiprocessing as mp

from questkv.distributed.group import TensorParallel
from questkv.engine.engine_config import EngineConfig
from questkv.engine.loading import load_shard, quantize_shard
from questkv.engine.model_runner import ModelRunner

__all__ = ["TensorParallelError", "WorkerPool", "collective_timeout", "worker_main"]

_DEFAULT_TIMEOUT_S = 300.0


def collective_timeout() -> float:
    """Seconds a collective (or a rank's start) waits for the other ranks before it raises: the bound on a hung
    rank. ``$QUESTKV_TP_TIMEOUT`` when set (a positive number), else 300: generous, as a rank's first steps may
    compile kernels and its start loads a checkpoint."""
    text = os.environ.get("QUESTKV_TP_TIMEOUT")
    if text is None:
        return _DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"QUESTKV_TP_TIMEOUT must be a positive number of seconds, got {text!r}")
    return value

_STOP_GRACE = 10.0  # seconds a worker gets to exit after the stop message before it is killed
_EXIT_WAIT = 2.0  # seconds a failed step waits for a worker's exit that would explain it
START_TIMEOUT_S = 900.0
"""Seconds the ranks wait for each other while they start (each loads its shard of the checkpoint)."""
_WORKER_NAME = "questkv-tp-rank"  # a worker's process name: its rank follows
_MAIN_REIMPORTED = 3  # a worker's exit code: re-importing the main module started a tensor-parallel engine
_NEEDS_MAIN_GUARD = ("A script that starts a tensor-parallel engine needs that code under "
                     'if __name__ == "__main__":, as vLLM\'s do')


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died or stopped answering: the engine cannot run another step (fatal)."""


class WorkerPool:
    """Ranks 1..N-1 of a tensor-parallel engine, as processes of the ``spawn`` start method.

    Args:
        config: the engine's config (``tensor_parallel_size`` ranks in all).
        max_model_len: what rank 0 resolved, for the workers' page pools.
    """

    def __init__(self, config: EngineConfig, max_model_len: int) -> None:
        _refuse_in_worker_bootstrap()
        self.size = config.tensor_parallel_size
        self._device = config.torch_device
        self._main = _main_module()
        self.timeout = collective_timeout()
        self._dir = tempfile.mkdtemp(prefix="questkv-tp-")
        self.store_path = os.path.join(self._dir, "rendezvous")
        context = mp.get_context("spawn")
        self._conns: list[multiprocessing.connection.Connection] = []
        self._procs = []
        self._failure: Optional[str] = None  # why the group failed, set once (under _lock)
        self.dead_rank: Optional[int] = None  # the worker whose exit failed the group, if one did
        self._lock = threading.Lock()
        self._closed = False
        self._group: Optional[TensorParallel] = None
        self._wake_r, self._wake_w = os.pipe()  # close() wakes the watchdog through it
        self._watchdog = threading.Thread(target=self._watch, name="questkv-tp-watchdog", daemon=True)
        atexit.register(self.close)
        try:
            for rank in range(1, self.size):
                ours, theirs = context.Pipe()
                proc = context.Process(target=worker_main,
                                       args=(config, rank, self.store_path, max_model_len, self.timeout, theirs),
                                       name=f"{_WORKER_NAME}{rank}", daemon=True)
                proc.start()
                theirs.close()
                self._conns.append(ours)
                self._procs.append(proc)
        except BaseException:
            self.close()  # the workers started so far
            raise
        self._watchdog.start()

    @property
    def pids(self) -> list[int]:
        """The workers' process ids, rank 1 first."""
        return [proc.pid for proc in self._procs]

    def connect(self, group: TensorParallel) -> None:
        """Connect ``group`` (rank 0's) with the workers' and abort it as soon as a worker exits, so that no
        collective waits on it. :class:`TensorParallelError` naming the worker if one exits before every rank has
        joined (within a poll of the store, :meth:`TensorParallel.connect`'s ``watch``), instead of a wait of
        :data:`START_TIMEOUT_S` seconds."""
        with self._lock:
            self._group = group
        group.connect(self.store_path, self._device, START_TIMEOUT_S, self._wait_for_death)

    def _wait_for_death(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for a worker to exit; :class:`TensorParallelError` naming it if one has."""
        multiprocessing.connection.wait(self._sentinels(), timeout)
        self.check()

    def _watch(self) -> None:
        ready = multiprocessing.connection.wait([*self._sentinels(), self._wake_r])
        if self._wake_r not in ready:
            self._record_death()

    def _sentinels(self) -> list[int]:
        return [proc.sentinel for proc in self._procs]

    def _record_death(self) -> bool:
        """If a worker has exited (its sentinel is ready), record the failure naming it (once, whichever thread
        comes first) and abort the group; returns whether the group has failed."""
        with self._lock:
            if self._failure is None and not self._closed:
                dead = multiprocessing.connection.wait(self._sentinels(), timeout=0)
                if dead:
                    self.dead_rank = self._sentinels().index(dead[0]) + 1
                    self._failure = self._describe(self.dead_rank)
                    if self._group is not None:
                        self._group.abort()
            return self._failure is not None

    def _describe(self, rank: int) -> str:
        """Why worker ``rank`` exited: the error it reported, else what its exit code says."""
        proc, conn = self._procs[rank - 1], self._conns[rank - 1]
        proc.join(timeout=1.0)  # its exit code
        error = None
        try:
            while conn.poll():
                kind, text = conn.recv()
                if kind == "error":
                    error = text
        except (EOFError, OSError):
            pass
        exited = f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
        if error is not None:
            return f"{exited}; its error:\n{error}"
        spawn = f"the spawn start method re-imports the main module {self._main!r} in each worker before running it"
        if proc.exitcode == _MAIN_REIMPORTED:
            return f"{exited}: {spawn}, and there it started a tensor-parallel engine of its own. {_NEEDS_MAIN_GUARD}"
        if proc.exitcode == 1 and self._main is None:  # worker_main reports every error it exits with
            return f"{exited} before it started, in the spawn start method's bootstrap (its traceback is on stderr)"
        if proc.exitcode == 1:
            return (f"{exited} before it started (its traceback is on stderr): {spawn}, and that failed. "
                    f"{_NEEDS_MAIN_GUARD}; a script read from stdin (python -) cannot be re-imported: run a file")
        return exited

    def fail(self, error: BaseException) -> TensorParallelError:
        """Mark the group failed after ``error`` broke a step part-way (the ranks are out of step: every later
        step raises) and return the :class:`TensorParallelError` to raise, naming the dead rank when a worker has
        exited (a rank's death may break the collective before its process has exited: waited for, briefly)."""
        multiprocessing.connection.wait(self._sentinels(), timeout=_EXIT_WAIT)
        if not self._record_death():
            with self._lock:
                self._failure = (f"a tensor-parallel step failed on rank 0 ({type(error).__name__}: {error}); the "
                                 "ranks are out of step")
            if self._group is not None:
                self._group.abort()
        return TensorParallelError(self._failure)

    def check(self) -> None:
        """Raise :class:`TensorParallelError` naming the rank if a worker has exited (or the group failed)."""
        if self._record_death():
            raise TensorParallelError(self._failure)

    def wait_ready(self) -> None:
        """Wait for every worker's "ready" (its shard loaded, its runner built); :class:`TensorParallelError` if one
        fails or dies instead, or none comes within :data:`START_TIMEOUT_S` seconds."""
        for rank, conn in enumerate(self._conns, start=1):
            if not conn.poll(START_TIMEOUT_S):
                self.check()
                raise TensorParallelError(f"tensor-parallel worker rank {rank} did not start within "
                                          f"{START_TIMEOUT_S} s")
            try:
                kind, text = conn.recv()
            except (EOFError, OSError):
                self.check()
                raise
            if kind != "ready":
                with self._lock:
                    self._failure = f"tensor-parallel worker rank {rank} failed to start; its error:\n{text}"
                raise TensorParallelError(self._failure)

    def send(self, message) -> None:
        """Send one step to every worker (pickled once); :class:`TensorParallelError` if one is gone."""
        self.check()
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self._conns:
                conn.send_bytes(payload)
        except OSError:  # a broken pipe: the worker is exiting
            self.check()
            raise

    def close(self) -> None:
        """Stop every worker (the stop message, then a kill for those still alive after a grace period) and
        remove the rendezvous folder. Idempotent; never raises."""
        if self._closed:
            return
        with self._lock:
            self._closed = True
        atexit.unregister(self.close)
        os.write(self._wake_w, b"x")  # the watchdog first: only this thread reaps the workers from here on
        if self._watchdog.is_alive():
            self._watchdog.join(timeout=_STOP_GRACE)
        for conn in self._conns:
            try:
                conn.send_bytes(b"")
            except OSError:
                pass
        for proc in self._procs:
            proc.join(timeout=0 if self._failure is not None else _STOP_GRACE)  # a failed group: hung ranks too
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=_STOP_GRACE)
        for conn in self._conns:
            conn.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        if self._group is not None:
            self._group.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _main_module() -> Optional[str]:
    """The main module that the ``spawn`` start method re-imports in each worker before running it: its name
    (``python -m``) or its file; None when there is none to re-import (an interactive session)."""
    data = multiprocessing.spawn.get_preparation_data(_WORKER_NAME)
    return data.get("init_main_from_name") or data.get("init_main_from_path")


def _refuse_in_worker_bootstrap() -> None:
    """Exit with :data:`_MAIN_REIMPORTED` if this process is a worker re-importing the main module (the ``spawn``
    start method's bootstrap): a main module without ``if __name__ == "__main__":`` is starting an engine in it,
    which would start workers of its own. Rank 0 reads the exit code and explains."""
    name = multiprocessing.current_process().name
    if name.startswith(_WORKER_NAME):
        print(f"questkv: {name} re-imported the main module (the spawn start method does, before running the "
              f"worker), and it starts a tensor-parallel engine. {_NEEDS_MAIN_GUARD}.", file=sys.stderr, flush=True)
        raise SystemExit(_MAIN_REIMPORTED)


def _die_with_parent() -> None:
    """Have the kernel kill this process when its parent dies (Linux; elsewhere the pipe's end-of-file does)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def worker_main(config: EngineConfig, rank: int, store_path: str, max_model_len: int, timeout: float,
                conn: multiprocessing.connection.Connection) -> None:
    """Rank ``rank``'s process: build its shard and runner, report ``("ready", None)`` (or ``("error", text)``
    and exit 1), then run the steps that come down ``conn`` until the stop message or end-of-file."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle; it stops the workers
    try:
        if config.torch_device.type == "cuda":
            torch.cuda.set_device(rank)
        tp = TensorParallel(rank, config.tensor_parallel_size)
        loaded = load_shard(config, tp)
        tp.connect(store_path, config.torch_device, START_TIMEOUT_S)
        quantize_shard(loaded.model, config, tp)
        runner = ModelRunner(config, loaded.model, loaded.spec, max_model_len, tp=tp)
        tp.set_timeout(timeout)
        conn.send(("ready", None))
        with torch.inference_mode():
            while True:
                payload = conn.recv_bytes()
                if not payload:
                    break
                runner.run_step(pickle.loads(payload))
    except EOFError:  # rank 0 is gone
        pass
    except BaseException:  # noqa: BLE001 -- reported to rank 0, then this process exits non-zero
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        sys.exit(1)
