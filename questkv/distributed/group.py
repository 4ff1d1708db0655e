"""One tensor-parallel group: this process's rank, the group size and the collectives the sharded model runs.

:class:`TensorParallel` is built before the model (the layers read ``rank`` and ``size`` to size their shards)
and connected once every rank's process exists (:meth:`TensorParallel.connect`: a file store for the rendezvous,
then a gloo backend on CPU or an NCCL one on CUDA, each collective bounded by ``timeout``); a rank that can tell
when another has died (rank 0 watches the workers' processes) passes ``watch`` and stops waiting at once. It holds
the backend object itself, not torch's global default group, so that several engines (and the caller's own
``torch.distributed`` use) can live in one process. A model built without it (``tp=None``) runs no collective.
"""

from __future__ import annotations

import datetime
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from questkv.validation import check_int

__all__ = ["TensorParallel"]

_JOIN_POLL_S = 0.1  # how often a rank with a ``watch`` re-reads the store while it waits for the others to join


class TensorParallel:
    """This process's place in a tensor-parallel group of ``size`` ranks.

    Args:
        rank: this process's rank, in ``[0, size)``; rank 0 runs the scheduler and samples.
        size: the number of ranks (``EngineConfig.tensor_parallel_size``), at least 2 (one rank needs none).
    """

    def __init__(self, rank: int, size: int) -> None:
        check_int("TensorParallel.size", size, minimum=2)
        check_int("TensorParallel.rank", rank, minimum=0, maximum=size - 1)
        self.rank, self.size = rank, size
        self._backend: Optional[dist.ProcessGroup] = None

    def connect(self, store_path: str, device: torch.device, timeout: float,
                watch: Optional[Callable[[float], None]] = None) -> None:
        """Join the group: rendezvous in the file ``store_path`` (shared by every rank) and open a gloo
        (``device`` CPU) or NCCL (CUDA) backend whose collectives raise after ``timeout`` seconds.
        Blocks until every rank has joined (or raises after ``timeout``).

        ``watch(seconds)``, when given, waits up to ``seconds`` for a reason to stop waiting for the other ranks
        and raises it (rank 0: a worker process that died). It is called between reads of the store while the
        ranks join, and once more before the first collective, so a rank that dies before joining fails this
        call at once instead of after ``timeout``.
        """
        delta = datetime.timedelta(seconds=timeout)
        store = dist.FileStore(store_path, self.size)
        store.set_timeout(delta)
        self._join(store, timeout, watch)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = delta
            self._backend = dist.ProcessGroupNCCL(store, self.rank, self.size, options)
        else:
            self._backend = dist.ProcessGroupGloo(store, self.rank, self.size, delta)
        if watch is not None:
            watch(0.0)  # a death while the backend was built found nothing to abort: the barrier would wait for it
        self.barrier(device)

    def _join(self, store: dist.Store, timeout: float, watch: Optional[Callable[[float], None]]) -> None:
        """Mark this rank joined in ``store`` and wait until every rank has, calling ``watch`` between reads."""
        keys = [f"questkv/joined/{rank}" for rank in range(self.size)]
        store.set(keys[self.rank], b"1")
        if watch is None:
            store.wait(keys)  # the store's timeout
            return
        deadline = time.monotonic() + timeout
        while not store.check(keys):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [rank for rank, key in enumerate(keys) if not store.check([key])]
                raise RuntimeError(f"tensor-parallel rank {self.rank}: ranks {missing} did not join the group "
                                   f"within {timeout} s")
            watch(min(_JOIN_POLL_S, remaining))

    def set_timeout(self, timeout: float) -> None:
        """Bound every later collective by ``timeout`` seconds (after a start that may take longer)."""
        self._require().set_timeout(datetime.timedelta(seconds=timeout))

    def _require(self) -> dist.ProcessGroup:
        if self._backend is None:
            raise RuntimeError(f"tensor-parallel rank {self.rank} is not connected: call TensorParallel.connect first")
        return self._backend

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x`` (row-parallel outputs, the vocab-parallel embedding)."""
        self._require().allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., n]`` of every rank, concatenated in rank order along the last dim: ``[..., size * n]``."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._require().allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Overwrite ``x`` with rank 0's ``x`` (the sampled tokens), in place; returns ``x``."""
        self._require().broadcast(x, 0).wait()
        return x

    def all_min(self, value: int, device: torch.device) -> int:
        """The smallest ``value`` over the ranks (the page count every rank's pool can hold)."""
        x = torch.tensor([value], dtype=torch.int64, device=device)
        return int(self._reduce(x, dist.ReduceOp.MIN).item())

    def all_max(self, x: torch.Tensor) -> torch.Tensor:
        """The element-wise maximum of ``x`` over the ranks, in place; returns ``x``."""
        return self._reduce(x, dist.ReduceOp.MAX)

    def _reduce(self, x: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
        options = dist.AllreduceOptions()
        options.reduceOp = op
        self._require().allreduce([x], options).wait()
        return x

    def barrier(self, device: torch.device) -> None:
        """Wait until every rank gets here (an all-reduce of one element: both backends have it)."""
        self.all_reduce(torch.zeros(1, device=device))

    def close(self) -> None:
        """Drop the backend (its sockets or communicators); the group is unusable afterwards."""
        backend, self._backend = self._backend, None
        if backend is not None and hasattr(backend, "shutdown"):
            try:
                backend.shutdown()
            except RuntimeError:  # a peer already gone
                pass

    def abort(self) -> None:
        """Make the collectives in flight on this rank raise now (another rank died: waiting for it is futile).
        Safe from another thread; the group is unusable afterwards."""
        backend = self._backend
        if backend is not None and hasattr(backend, "abort"):
            try:
                backend.abort()
            except RuntimeError:
                pass

    def split(self, owner: str, value: int) -> int:
        """``value // size``: one rank's share of ``owner`` (heads, features); ``ValueError`` unless ``size``
        divides ``value``."""
        if value % self.size:
            raise ValueError(f"{owner}={value} is not divisible by tensor_parallel_size={self.size}; "
                             f"tensor parallelism shards it evenly over the ranks")
        return value // self.size

    def __repr__(self) -> str:
        return f"TensorParallel(rank={self.rank}, size={self.size})"
