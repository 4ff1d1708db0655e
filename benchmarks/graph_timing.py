"""GPU time of small calls, the one way every benchmark here measures it: captured in a CUDA graph, replayed.

A replay holds enough calls to outlast the host's launch of it, so its time over its calls is the calls' GPU time
without launch gaps; the median over many replays (CUDA events) after untimed ones.
"""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

import torch


def graph_replay_us(calls: Sequence[Callable[[], object]], reps: int, warmup: int, cycles: int = 1) -> float:
    """Median GPU microseconds per call of ``calls``.

    Each call runs once eagerly on a side stream first (kernel compilation, autotuning and first-call
    allocations stay out of the capture); then ``cycles`` rounds of all of them are captured in one CUDA graph,
    replayed ``warmup`` times untimed and ``reps`` times between CUDA events. Per call: replay time over
    ``cycles * len(calls)``.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(cycles):
            for call in calls:
                call()
    for _ in range(warmup):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    del graph
    return statistics.median(s.elapsed_time(e) for s, e in events) * 1e3 / (cycles * len(calls))
