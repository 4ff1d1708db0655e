"""Quest decode-step kernels against dense baselines on one GPU, in one run.

For each (model, batch, context) point, after checking every kernel against the torch reference on
random data, this script times under CUDA graphs (medians of many graph replays after warm-up):

* the questkv Quest step (estimate + select + attend) and each part alone, plus a ``torch.topk``
  selection for comparison with the Triton top-K;
* the Quest step amortized over ``C`` decode steps (selection reuse, ``QuestConfig.selection_interval``) for
  each ``C`` of ``--selection-intervals``: a window of ``C`` steps as the engine runs them, step 0 with every
  sequence active, steps 1..C-1 the attend alone over the last selection plus the pages begun since (the engine's
  graph of a step where no row selects; :func:`time_amortized`);
* questkv dense paged decode (the same attention kernel over every page);
* the attention kernel (dense, and the Quest step's attend) over a head-major copy of the same pools
  (storage ``[num_pages, num_kv_heads, page_size, head_dim]``, :func:`head_major`): what a head-major page
  pool would gain, measured before the cache adopts one;
* FlashInfer dense paged decode (``BatchDecodeWithPagedKVCacheWrapper``), with and without tensor
  cores where both are asked for; the faster one is the baseline;
* torch SDPA (``enable_gqa=True``) over contiguous K/V.

Each graph runs the op once per *layer* over ``n_layers`` independent page pools (a model's decode
step does the same), so a call never finds its data left in L2 by the previous one; times are per
call. Achieved bandwidth is the bytes that must move divided by the time, against a measured
device-to-device copy. Writes ``kernels-<tag>.json`` and ``kernels-<tag>.md`` and prints a table last.

Usage (on the GPU machine)::

    python benchmarks/kernels_bench.py --out-dir benchmarks/results --tag h200
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import math
import platform
import statistics
import sys
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F

if __name__ == "__main__":  # run as a file: the checkout importable (questkv, benchmarks.*)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.graph_timing import graph_replay_us  # noqa: E402
from questkv.ops import LayerPages  # noqa: E402
from questkv.config import QuestConfig  # noqa: E402
from questkv.ops import reference  # noqa: E402
from questkv.ops import triton as kernels  # noqa: E402
from questkv.ops.triton import _common as triton_common  # noqa: E402
from questkv.decode import QuestDecodeStep  # noqa: E402
from questkv.eval.provenance import git_commit  # noqa: E402

MODELS = {  # name: (num_q_heads, num_kv_heads, head_dim)
    "llama3.1-8b": (32, 8, 128),
    "llama2-7b": (32, 32, 128),
    "qwen2.5-1.5b": (12, 2, 128),  # lossless Quest's real model: a group of 6 query heads per KV head
}
PAGE_SIZE = 16
DEVICE = "cuda"
DTYPE = torch.bfloat16
ROTATE_BYTES = 512 * 2**20  # bytes touched per graph replay at least (about 8x the H200's L2)
MAX_LAYERS = 32
# Calls per graph replay at least (whole cycles over the layers): a replay of one short kernel (the select at
# B=32/32k, ~16 us, n_layers=1) is shorter than the host's replay + event records, so the GPU idles between
# replays and start -> end includes the graph's launch latency (27.4 us measured vs 15.7 with n_layers=2).
MIN_CALLS_PER_REPLAY = 8
TARGETS = [  # (label, model, batch, context, budget, minimum speedup vs FlashInfer dense)
    ("B=1, L=32k, budget 2048", "llama3.1-8b", 1, 32768, 2048, 5.0),
    ("B=1, L=128k, budget 4096", "llama3.1-8b", 1, 131072, 4096, 8.0),
    ("B=32, L=32k, budget 2048", "llama3.1-8b", 32, 32768, 2048, 6.5),
]
DENSE_TARGET = 1.15  # questkv dense time / FlashInfer dense time, at most
AMORTIZED_TARGETS = [  # (label, model, batch, context, budget, µs per step at most, Quest step µs before reuse)
    ("B=1, L=128k, budget 4096", "llama3.1-8b", 1, 131072, 4096, 20.0, 43.4),
    ("B=1, L=32k, budget 2048", "llama3.1-8b", 1, 32768, 2048, 12.0, 23.8),
    ("B=32, L=32k, budget 2048", "llama3.1-8b", 32, 32768, 2048, 110.0, 159.3),
]


# ----------------------------------------------------------------------------------------------
# timing


def time_graph(enqueue: Callable[[int], object], n_layers: int, reps: int, warmup: int) -> float:
    """Median GPU time in microseconds of ``enqueue(layer)``, captured in a CUDA graph once per layer,
    the layers cycled ``ceil(MIN_CALLS_PER_REPLAY / n_layers)`` times (so that a replay outlasts the host's
    launch of it), and replayed ``reps`` times after ``warmup`` replays (per-call time = replay / calls)."""
    return time_steps(lambda step, layer: enqueue(layer), 1, n_layers, reps, warmup)


def time_steps(enqueue: Callable[[int, int], object], steps: int, n_layers: int, reps: int, warmup: int) -> float:
    """:func:`time_graph` of a window of ``steps`` decode steps: ``enqueue(step, layer)`` captured in the
    engine's order (every layer of step 0, then every layer of step 1, ...), the window cycled
    ``ceil(MIN_CALLS_PER_REPLAY / (steps * n_layers))`` times; the median time per call, which is the window's
    time per layer over ``steps``."""
    calls = [functools.partial(enqueue, step, layer) for step in range(steps) for layer in range(n_layers)]
    return graph_replay_us(calls, reps, warmup, cycles=-(-MIN_CALLS_PER_REPLAY // len(calls)))


def graph_equals_eager(fn: Callable[[], torch.Tensor]) -> bool:
    """Whether one replay of ``fn`` captured in a CUDA graph writes what an eager call returns (bit for bit):
    a check that the launch attributes graph capture keeps (programmatic dependent launch) order the kernels."""
    eager = fn().clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return bool(torch.equal(out, eager))


def copy_bandwidth(reps: int = 50) -> float:
    """Device-to-device copy bandwidth in TB/s (eager ``copy_``, bytes read plus bytes written;
    a graph-captured copy becomes a copy-engine node, which is slower)."""
    src = torch.randn(2**31 // 2, dtype=DTYPE, device=DEVICE)  # 2 GiB
    dst = torch.empty_like(src)
    for _ in range(10):  # warm-up lets the clocks ramp
        dst.copy_(src)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        dst.copy_(src)
        end.record()
    torch.cuda.synchronize()
    millis = statistics.median(s.elapsed_time(e) for s, e in events)
    return 2 * src.numel() * src.element_size() / (millis * 1e-3) / 1e12


def count_launches(fn: Callable[[], object]) -> Optional[int]:
    """Kernels one eager call of ``fn`` launches (torch profiler), or None if it cannot tell."""
    try:
        from torch.profiler import ProfilerActivity, profile

        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception:  # noqa: BLE001 - the profiler is optional here
        return None


@contextlib.contextmanager
def programmatic_launch(enabled: bool) -> Iterator[None]:
    """The Quest kernels launched with (or without) programmatic dependent launch, restored after."""
    saved = triton_common.PDL
    triton_common.PDL = enabled
    try:
        yield
    finally:
        triton_common.PDL = saved


# ----------------------------------------------------------------------------------------------
# correctness on the GPU


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any():
        return float("nan")
    return ((out - ref).norm() / ref.norm()).item()


def check_correctness() -> list[dict]:
    """Every kernel against the torch reference (float32 math) on random bf16 data, ragged lengths,
    with and without programmatic dependent launch."""
    results = []
    for pdl in (False, True):
        with programmatic_launch(pdl):
            for check in _check_kernels():
                results.append({**check, "check": f"{check['check']}{' (PDL)' if pdl else ''}"})
    return results


def _check_kernels() -> list[dict]:
    gen = torch.Generator(device=DEVICE).manual_seed(1234)
    results = []

    def record(name: str, err: float, tol: float) -> None:
        results.append({"check": name, "rel_err": err, "tol": tol, "ok": bool(err <= tol)})

    for model, (hq, hkv, d) in MODELS.items():
        lens = torch.tensor([3001, 1777, 16, 2048], dtype=torch.int32, device=DEVICE)
        batch, max_pages = lens.numel(), 200
        num_pages = batch * max_pages
        k_pages = torch.randn(num_pages, PAGE_SIZE, hkv, d, device=DEVICE, generator=gen).to(DTYPE)
        v_pages = torch.randn_like(k_pages)
        kmin, kmax = k_pages.amin(1), k_pages.amax(1)
        table = torch.randperm(num_pages, device=DEVICE, generator=gen)[: batch * max_pages].view(batch, max_pages).int()
        q = torch.randn(batch, hq, d, device=DEVICE, generator=gen).to(DTYPE)

        # append: a prefill chunk ending mid-page, decode tokens, a restarted page
        pools = (k_pages.clone(), v_pages.clone(), kmin.clone(), kmax.clone())
        ref_pools = tuple(t.clone() for t in pools)
        slots = torch.cat([torch.arange(160, 160 + 70), torch.tensor([16 * 40 + 9, 16 * 41]), torch.arange(0, 5)]).to(DEVICE)
        keys = torch.randn(slots.numel(), hkv, d, device=DEVICE, generator=gen).to(DTYPE)
        values = torch.randn_like(keys)
        kernels.append_kv(*pools, slots, keys, values)
        reference.append_kv(*ref_pools, slots, keys, values)
        record(f"{model} append_kv (exact)", float(not all(torch.equal(a, b) for a, b in zip(pools, ref_pools))), 0.0)

        for selection, reduction in (("kv_head", "sum"), ("kv_head", "max"), ("q_head", "sum")):
            want = reference.page_scores(q, kmin, kmax, table, lens, PAGE_SIZE, selection, reduction)
            got = kernels.page_scores(q, kmin, kmax, table, lens, PAGE_SIZE, selection, reduction)
            finite = torch.isfinite(want)
            same_mask = torch.equal(finite, torch.isfinite(got))
            record(f"{model} page_scores {selection}/{reduction}", _rel_err(got[finite], want[finite]) if same_mask else 1.0, 1e-5)
            for budget, sink, recent in ((64, 1, 2), (128, 0, 0)):
                sel_ref = reference.select_pages(got, lens, PAGE_SIZE, budget, sink, recent)
                sel = kernels.select_pages(got, lens, PAGE_SIZE, budget, sink, recent)
                record(f"{model} select_pages {selection} budget {budget} (exact)", float(not torch.equal(sel, sel_ref)), 0.0)
            out_ref = reference.paged_decode_attention(q, k_pages, v_pages, table, lens, sel)
            out = kernels.paged_decode_attention(q, k_pages, v_pages, table, lens, sel)
            record(f"{model} sparse attention {selection}", _rel_err(out, out_ref), 1e-2)
            out_hm = kernels.paged_decode_attention(q, head_major(k_pages), head_major(v_pages), table, lens, sel)
            record(f"{model} sparse attention {selection}, head-major pool == page-major (exact)",
                   float(not torch.equal(out_hm, out)), 0.0)
        out_ref = reference.paged_decode_attention(q, k_pages, v_pages, table, lens)
        out = kernels.paged_decode_attention(q, k_pages, v_pages, table, lens)
        record(f"{model} dense attention", _rel_err(out, out_ref), 1e-2)
        out_hm = kernels.paged_decode_attention(q, head_major(k_pages), head_major(v_pages), table, lens)
        record(f"{model} dense attention, head-major pool == page-major (exact)", float(not torch.equal(out_hm, out)), 0.0)
        for name, err, tol in active_flag_checks(q, kmin, kmax, table, lens, gen):
            record(f"{model} {name}", err, tol)
        config = QuestConfig(token_budget=1024, sink_pages=1, recent_pages=1, backend="triton")
        step = QuestDecodeStep(config, batch, hq, hkv, d, max_pages, DTYPE, DEVICE)
        layer = LayerPages(k_pages, v_pages, kmin, kmax)
        got = step(q, layer, table, lens)
        want = reference.paged_decode_attention(
            q, k_pages, v_pages, table, lens,
            reference.select_pages(step.scores, lens, PAGE_SIZE, config.budget_pages, 1, 1),
        )
        record(f"{model} QuestDecodeStep budget 1024", _rel_err(got, want), 1e-2)
    return results


def active_flag_checks(q, kmin, kmax, table, lens, gen) -> list[tuple[str, float, float]]:
    """(name, error, tolerance) of the ``active`` flags of ``page_scores_into`` and ``select_pages_into``
    (selection reuse) against the reference, into outputs full of random sentinels, for mixed, all-zero and
    all-nonzero flags: the estimate's scores (flagged rows to 1e-5, the others' sentinels exactly, ``-inf`` at
    the same places) and both select paths (split over chunks of 64 pages) with per-row budgets into an output
    3 columns wider than the budget, exactly; the split scratch left zeroed."""
    batch, max_pages = table.shape
    hkv = kmin.shape[1]
    budget_pages, sink, recent = 64, 1, 2
    budgets = torch.tensor([64, 16, 48, 32], dtype=torch.int32, device=DEVICE)[:batch] * PAGE_SIZE
    buffers = kernels.select_buffers(batch, hkv, max_pages, DEVICE, chunk_pages=64)
    flags = {"mixed": torch.tensor([1, 0, 3, 0], dtype=torch.int32, device=DEVICE)[:batch],
             "all-zero": torch.zeros(batch, dtype=torch.int32, device=DEVICE),
             "all-one": torch.ones(batch, dtype=torch.int32, device=DEVICE)}
    checks = []
    for kind, active in flags.items():
        sentinel = torch.randn(batch, hkv, max_pages, device=DEVICE, generator=gen)
        got, want = sentinel.clone(), sentinel.clone()
        kernels.page_scores_into(got, q, kmin, kmax, table, lens, PAGE_SIZE, active=active)
        reference.page_scores_into(want, q, kmin, kmax, table, lens, PAGE_SIZE, active=active)
        finite = torch.isfinite(want)
        same = torch.equal(finite, torch.isfinite(got)) and torch.equal(got[active == 0], sentinel[active == 0])
        checks.append((f"page_scores_into active {kind}", _rel_err(got[finite], want[finite]) if same else 1.0, 1e-5))
        for split in (False, True):
            sel_sentinel = torch.randint(-(2**31), 2**31 - 1, (batch, hkv, budget_pages + 3), device=DEVICE,
                                         dtype=torch.int32, generator=gen)
            sel, sel_ref = sel_sentinel.clone(), sel_sentinel.clone()
            kernels.select_pages_into(sel, want, lens, PAGE_SIZE, budget_pages, sink, recent, budgets, buffers,
                                      split=split, active=active)
            reference.select_pages_into(sel_ref, want, lens, PAGE_SIZE, budget_pages, sink, recent, budgets,
                                        active=active)
            exact = torch.equal(sel, sel_ref) and not buffers.hist.any() and not buffers.counters.any()
            checks.append((f"select_pages_into active {kind}, {'split' if split else 'one-program'} path (exact)",
                           float(not exact), 0.0))
    return checks


# ----------------------------------------------------------------------------------------------
# baselines


def torch_topk_select(scores: torch.Tensor, seq_lens: torch.Tensor, budget_pages: int) -> torch.Tensor:
    """Selection through ``torch.topk`` (current page forced, ascending, -1-padded): the
    alternative the Triton select kernel is measured against."""
    max_pages = scores.shape[-1]
    num_pages = (seq_lens.long() + PAGE_SIZE - 1) // PAGE_SIZE
    index = torch.arange(max_pages, device=scores.device)
    key = scores.masked_fill((index == (num_pages - 1)[:, None])[:, None, :], float("inf"))
    top = key.topk(budget_pages, dim=-1, sorted=False)
    chosen = torch.where(torch.isneginf(top.values), max_pages, top.indices).sort(dim=-1).values
    return torch.where(chosen == max_pages, -1, chosen).int()


def flashinfer_wrappers(batch, hq, hkv, d, table, tensor_core_modes, kv_dtype=DTYPE):
    """Planned CUDA-graph FlashInfer decode wrappers keyed by ``use_tensor_cores``, for pages of ``kv_dtype``
    (``torch.float8_e4m3fn``: FlashInfer's fp8 KV decode, bf16 queries)."""
    import flashinfer

    max_pages = table.shape[1]
    indptr = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE) * max_pages
    indices = table.flatten().contiguous()
    last = torch.full((batch,), PAGE_SIZE, dtype=torch.int32, device=DEVICE)
    wrappers = {}
    for tc in tensor_core_modes:
        workspace = torch.zeros(128 * 2**20, dtype=torch.uint8, device=DEVICE)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tc,
            paged_kv_indptr_buffer=indptr.clone(), paged_kv_indices_buffer=indices.clone(),
            paged_kv_last_page_len_buffer=last.clone(),
        )
        wrapper.plan(indptr, indices, last, hq, hkv, d, PAGE_SIZE, q_data_type=DTYPE, kv_data_type=kv_dtype)
        wrappers[tc] = wrapper
    return wrappers


# ----------------------------------------------------------------------------------------------
# one benchmark point


def head_major(pages: torch.Tensor) -> torch.Tensor:
    """``pages`` ``[num_pages, page_size, num_kv_heads, head_dim]`` copied into head-major storage
    ``[num_pages, num_kv_heads, page_size, head_dim]`` and returned as a view of the original shape: the same
    values, so every op reads it unchanged, while one (page, KV head) is one contiguous block."""
    return pages.transpose(1, 2).contiguous().transpose(1, 2)


def cast_layer(layer: LayerPages, dtype: torch.dtype) -> LayerPages:
    """``layer``'s K/V pages in ``dtype`` (``torch.float8_e4m3fn``: an fp8 pool's), with the bounds an fp8 pool
    keeps: the cast keys' min and max per page."""
    k, v = layer.k_pages.to(dtype), layer.v_pages.to(dtype)
    return LayerPages(k, v, k.float().amin(1).to(dtype), k.float().amax(1).to(dtype))


def point_data(model: str, batch: int, context: int, min_budget: int, max_gb: float) -> dict:
    """Random pools for one point: ``n_layers`` independent layers (enough that one graph replay touches
    ``ROTATE_BYTES`` of the smallest Quest step's bytes, within ``max_gb``), a shuffled page table, full
    lengths and one query; plus the byte counts of one layer."""
    hq, hkv, d = MODELS[model]
    npages = context // PAGE_SIZE
    elt = torch.tensor([], dtype=DTYPE).element_size()
    kv_bytes = batch * context * hkv * d * 2 * elt  # K + V of one layer
    bound_bytes = batch * npages * hkv * d * 2 * elt
    min_sparse = bound_bytes + batch * hkv * min_budget * d * 2 * elt
    pool_bytes = kv_bytes + bound_bytes
    n_layers = max(1, min(MAX_LAYERS, math.ceil(ROTATE_BYTES / min_sparse), int(max_gb * 2**30 // (2 * pool_bytes))))
    gen = torch.Generator(device=DEVICE).manual_seed(batch * 1000003 + context)
    shape = (n_layers, batch * npages, PAGE_SIZE, hkv, d)
    k_all = torch.randn(shape, device=DEVICE, dtype=DTYPE, generator=gen)
    v_all = torch.randn(shape, device=DEVICE, dtype=DTYPE, generator=gen)
    return {
        "layers": [LayerPages(k_all[i], v_all[i], k_all[i].amin(1), k_all[i].amax(1)) for i in range(n_layers)],
        "table": torch.randperm(batch * npages, device=DEVICE, generator=gen).view(batch, npages).int(),
        "lens": torch.full((batch,), context, dtype=torch.int32, device=DEVICE),
        "q": torch.randn(batch, hq, d, device=DEVICE, dtype=DTYPE, generator=gen),
        "gen": gen, "n_layers": n_layers, "npages": npages, "elt": elt, "kv_bytes": kv_bytes,
        "bound_bytes": bound_bytes, "pool_bytes": pool_bytes,
    }


def time_head_major(point, dense, dense_out, steps, q, layers, table, lens, timer) -> None:
    """The head-major fields of a point, on :func:`head_major` copies of ``layers`` (skipped, with
    ``head_major_skipped``, when the copies would not fit in free GPU memory): ``questkv_dense_hm_us`` and,
    per budget row (``steps`` in ``point["sparse"]``'s order), ``attend_hm_us`` and ``step_hm_us``; each output
    must equal the page-major one bit for bit (``head_major_equal``: same kernel, same values)."""
    need = sum(2 * layer.k_pages.numel() * layer.k_pages.element_size() for layer in layers)
    if need > 0.9 * torch.cuda.mem_get_info()[0]:
        point["head_major_skipped"] = f"{need / 2**30:.1f} GiB of copies over free memory"
        return
    hm = [LayerPages(head_major(layer.k_pages), head_major(layer.v_pages), layer.kmin, layer.kmax) for layer in layers]
    point["questkv_dense_hm_us"] = timer(lambda i: dense.dense(q, hm[i], table, lens))
    equal = torch.equal(dense.dense(q, hm[0], table, lens), dense_out)
    for row, step in zip(point["sparse"], steps):
        row["attend_hm_us"] = timer(lambda i: step.attend(q, hm[i], table, lens))
        row["step_hm_us"] = timer(lambda i: step(q, hm[i], table, lens))
        want = step(q, layers[0], table, lens).clone()
        equal = equal and torch.equal(step(q, hm[0], table, lens), want)
    point["head_major_equal"] = equal
    del hm


def time_amortized(budget: int, intervals: list[int], q, layers, table, lens,
                   timer: Callable[[Callable[[int, int], object], int], float]) -> dict:
    """The Quest step amortized over ``C`` decode steps, for each ``C`` in ``intervals``: ``{str(C): µs per step
    per layer}``, ``timer(enqueue, C)`` (:func:`time_steps` on the GPU) of a window of ``C`` steps as the engine
    runs them with selection reuse, through :meth:`QuestDecodeStep.sparse` of a step built for
    ``QuestConfig(token_budget=budget, selection_interval=C)`` (its attention planned for ``budget_pages +
    reuse_extra_pages`` columns). Step 0: every sequence active, the estimate and select write the first
    ``budget_pages`` columns of the layer's selection and the attend reads them (the engine's extra columns are
    ``-1`` on a selecting step: the same grid, nothing read there). Steps 1..C-1: the attend alone (the engine's
    step where no row selects, ``selecting=False``, a graph without the estimate and select) over the selection of
    step 0 plus the
    ``reuse_extra_pages`` columns, which hold valid page ids (the sequences' last pages, standing for the pages
    begun since). Each layer keeps its own selection across the window, as the engine's ``SelectionMemory``
    does; the step's other buffers are shared by the layers."""
    batch, npages = table.shape
    hkv = layers[0].kmin.shape[1]
    active = torch.ones(batch, dtype=torch.int32, device=q.device)
    reusing = torch.zeros_like(active)
    results = {}
    for interval in intervals:
        config = QuestConfig(token_budget=budget, selection_interval=interval, backend="triton")
        step = QuestDecodeStep(config, batch, q.shape[1], hkv, q.shape[2], npages, q.dtype, q.device)
        budget_pages, extra = config.budget_pages, config.reuse_extra_pages
        selected = step.selected.new_empty((len(layers), *step.selected.shape))  # [L, B, Hs, budget_pages + extra]
        selected[..., budget_pages:] = torch.arange(npages - extra, npages, dtype=torch.int32, device=q.device)

        def enqueue(when: int, layer: int, step=step, selected=selected, budget_pages=budget_pages) -> None:
            if when == 0:
                step.sparse(q, layers[layer], table, lens, active=active, selected=selected[layer, ..., :budget_pages])
            else:
                step.sparse(q, layers[layer], table, lens, active=reusing, selected=selected[layer], selecting=False)

        results[str(interval)] = timer(enqueue, interval)
        del step, selected
    return results


def amortized_target(amortized: dict, limit: float) -> Optional[tuple[int, float, bool]]:
    """``(C, µs, met)`` of a budget row's ``amortized_step_us`` against ``limit``: the smallest ``C`` whose
    amortized step is at most ``limit``, else the ``C`` with the fastest step; ``None`` when nothing was timed."""
    timed = sorted((int(c), us) for c, us in amortized.items())
    if not timed:
        return None
    met = [(c, us) for c, us in timed if us <= limit]
    c, us = met[0] if met else min(timed, key=lambda item: item[1])
    return c, us, bool(met)


def other_pdl(enqueue: Callable[[int], object], n_layers: int, reps: int, warmup: int) -> float:
    """:func:`time_graph` with programmatic dependent launch switched from its default."""
    with programmatic_launch(not triton_common.PDL):
        return time_graph(enqueue, n_layers, reps, warmup)


def run_point(model, batch, context, budgets, args, flashinfer_ok) -> dict:
    hq, hkv, d = MODELS[model]
    data = point_data(model, batch, context, min(budgets), args.max_gb)
    layers, table, lens, q, gen = data["layers"], data["table"], data["lens"], data["q"], data["gen"]
    n_layers, npages, elt = data["n_layers"], data["npages"], data["elt"]
    kv_bytes, bound_bytes = data["kv_bytes"], data["bound_bytes"]
    with_sdpa = 2 * n_layers * data["pool_bytes"] <= args.max_gb * 2**30
    point = {"model": model, "batch": batch, "context": context, "n_layers": n_layers, "kv_bytes": kv_bytes}
    reps, warmup = args.reps, args.warmup

    dense = QuestDecodeStep(QuestConfig(backend="triton"), batch, hq, hkv, d, npages, DTYPE, DEVICE)
    point["questkv_dense_us"] = time_graph(lambda i: dense.dense(q, layers[i], table, lens), n_layers, reps, warmup)
    point["questkv_dense_other_pdl_us"] = other_pdl(lambda i: dense.dense(q, layers[i], table, lens), n_layers, reps, warmup)
    dense_out = dense.dense(q, layers[0], table, lens).clone()

    point["flashinfer"] = {}
    if flashinfer_ok:
        wrappers = flashinfer_wrappers(batch, hq, hkv, d, table, args.fi_tensor_cores[model])
        fi_out = torch.empty_like(q)
        for tc, wrapper in wrappers.items():
            micros = time_graph(lambda i: wrapper.run(q, (layers[i].k_pages, layers[i].v_pages), out=fi_out), n_layers, reps, warmup)
            wrapper.run(q, (layers[0].k_pages, layers[0].v_pages), out=fi_out)
            point["flashinfer"]["tc" if tc else "no_tc"] = {"us": micros, "rel_err_vs_questkv": _rel_err(fi_out, dense_out)}
        del wrappers
        point["flashinfer_dense_us"] = min(v["us"] for v in point["flashinfer"].values())

    if with_sdpa:
        sdpa_k = torch.randn((n_layers, batch, hkv, context, d), device=DEVICE, dtype=DTYPE, generator=gen)
        sdpa_v = torch.randn_like(sdpa_k)
        q4 = q.unsqueeze(2)
        point["sdpa_dense_us"] = time_graph(
            lambda i: F.scaled_dot_product_attention(q4, sdpa_k[i], sdpa_v[i], enable_gqa=True), n_layers, reps, warmup
        )
        del sdpa_k, sdpa_v


    point["sparse"], steps = [], []
    for budget in budgets:
        if budget >= context:
            continue
        config = QuestConfig(token_budget=budget, backend="triton")
        step = QuestDecodeStep(config, batch, hq, hkv, d, npages, DTYPE, DEVICE)
        steps.append(step)
        step(q, layers[0], table, lens)  # warm-up
        sparse_bytes = bound_bytes + batch * hkv * budget * d * 2 * elt
        row = {
            "budget": budget,
            "ideal_speedup": context / (context / PAGE_SIZE + budget),
            "step_us": time_graph(lambda i: step(q, layers[i], table, lens), n_layers, reps, warmup),
            "step_other_pdl_us": other_pdl(lambda i: step(q, layers[i], table, lens), n_layers, reps, warmup),
            "estimate_us": time_graph(lambda i: step.estimate(q, layers[i], table, lens), n_layers, reps, warmup),
            "select_us": time_graph(lambda i: step.select(lens), n_layers, reps, warmup),
            "select_single_us": time_graph(lambda i: step.select(lens, split=False), n_layers, reps, warmup),
            "select_split_us": time_graph(lambda i: step.select(lens, split=True), n_layers, reps, warmup),
            "select_torch_topk_us": time_graph(
                lambda i: torch_topk_select(step.scores, lens, config.budget_pages), n_layers, reps, warmup
            ),
            "attend_us": time_graph(lambda i: step.attend(q, layers[i], table, lens), n_layers, reps, warmup),
            "step_bytes": sparse_bytes,
            "launches": count_launches(lambda: step(q, layers[0], table, lens)),
            "graph_equals_eager": graph_equals_eager(lambda: step(q, layers[0], table, lens)),
        }
        row["amortized_step_us"] = time_amortized(
            budget, args.intervals, q, layers, table, lens,
            lambda enqueue, interval: time_steps(enqueue, interval, n_layers, reps, warmup))
        row["step_tbps"] = sparse_bytes / (row["step_us"] * 1e-6) / 1e12
        row["estimate_tbps"] = bound_bytes / (row["estimate_us"] * 1e-6) / 1e12
        row["attend_tbps"] = (sparse_bytes - bound_bytes) / (row["attend_us"] * 1e-6) / 1e12
        if "flashinfer_dense_us" in point:
            row["speedup_vs_flashinfer"] = point["flashinfer_dense_us"] / row["step_us"]
        point["sparse"].append(row)
    time_head_major(point, dense, dense_out, steps, q, layers, table, lens, lambda enqueue: time_graph(enqueue, n_layers, reps, warmup))
    for key in ("questkv_dense_us", "flashinfer_dense_us", "sdpa_dense_us"):
        if key in point:
            point[key.replace("_us", "_tbps")] = kv_bytes / (point[key] * 1e-6) / 1e12
    if "flashinfer_dense_us" in point:
        point["dense_ratio_vs_flashinfer"] = point["questkv_dense_us"] / point["flashinfer_dense_us"]
    return point


# ----------------------------------------------------------------------------------------------
# report


def _fmt(value, digits=1):
    return "-" if value is None else f"{value:.{digits}f}"


def table_lines(points: list[dict]) -> list[str]:
    head = (
        "| model | B | L | budget | Quest step µs | step, PDL switched | estimate | select | select single / split "
        "| select torch.topk | attend | "
        "questkv dense µs | dense, PDL switched | FlashInfer dense µs | SDPA µs | speedup vs FI | ideal | step TB/s "
        "| dense/FI | graph = eager |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for p in points:
        ctx = f"{p['context'] // 1024}k"
        dense = [_fmt(p.get("questkv_dense_us")), _fmt(p.get("questkv_dense_other_pdl_us")),
                 _fmt(p.get("flashinfer_dense_us")), _fmt(p.get("sdpa_dense_us"))]
        ratio = _fmt(p.get("dense_ratio_vs_flashinfer"), 2)
        if not p["sparse"]:
            lines.append(f"| {p['model']} | {p['batch']} | {ctx} | - | - | - | - | - | - | - | - | {' | '.join(dense)} "
                         f"| - | - | - | {ratio} | - |")
        for r in p["sparse"]:
            lines.append(
                f"| {p['model']} | {p['batch']} | {ctx} | {r['budget']} | {_fmt(r['step_us'])} "
                f"| {_fmt(r.get('step_other_pdl_us'))} | {_fmt(r['estimate_us'])} | "
                f"{_fmt(r['select_us'])} | {_fmt(r.get('select_single_us'))} / {_fmt(r.get('select_split_us'))} "
                f"| {_fmt(r['select_torch_topk_us'])} | {_fmt(r['attend_us'])} | {' | '.join(dense)} | "
                f"{_fmt(r.get('speedup_vs_flashinfer'), 2)} | {_fmt(r['ideal_speedup'], 2)} | {_fmt(r['step_tbps'], 2)} "
                f"| {ratio} | {r.get('graph_equals_eager', '-')} |"
            )
    return lines


def head_major_lines(points: list[dict]) -> list[str]:
    """The head-major pool table: dense, attend and step times on page-major and head-major pools."""
    lines = ["| model | B | L | dense µs | dense, head-major | budget | attend µs | attend, head-major | step µs "
             "| step, head-major | outputs equal |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        if "questkv_dense_hm_us" not in p:
            continue
        for r in p["sparse"]:
            lines.append(f"| {p['model']} | {p['batch']} | {p['context'] // 1024}k | {_fmt(p['questkv_dense_us'])} "
                         f"| {_fmt(p['questkv_dense_hm_us'])} | {r['budget']} | {_fmt(r['attend_us'])} "
                         f"| {_fmt(r.get('attend_hm_us'))} | {_fmt(r['step_us'])} | {_fmt(r.get('step_hm_us'))} "
                         f"| {p['head_major_equal']} |")
    return lines


def amortized_lines(points: list[dict], intervals: list[int]) -> list[str]:
    """The 'Quest step amortized over C' table: per point and budget, the Quest step (every step selects) and
    the µs per step of a window of ``C`` steps that selects once (:func:`time_amortized`) for each ``C``."""
    head = "| model | B | L | budget | Quest step µs | " + " | ".join(f"C={c} µs/step" for c in intervals) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for p in points:
        for r in p["sparse"]:
            amortized = r.get("amortized_step_us", {})
            cells = " | ".join(_fmt(amortized.get(str(c))) for c in intervals)
            lines.append(f"| {p['model']} | {p['batch']} | {p['context'] // 1024}k | {r['budget']} | {_fmt(r['step_us'])} "
                         f"| {cells} |")
    return lines


def _budget_row(points: list[dict], model: str, batch: int, context: int, budget: int) -> Optional[dict]:
    return next((r for p in points if (p["model"], p["batch"], p["context"]) == (model, batch, context)
                 for r in p["sparse"] if r["budget"] == budget), None)


def target_lines(points: list[dict]) -> list[str]:
    lines = ["| target | required | measured | met |", "|---|---|---|---|"]
    for label, model, batch, context, budget, need in TARGETS:
        got = next(
            (r.get("speedup_vs_flashinfer") for p in points if (p["model"], p["batch"], p["context"]) == (model, batch, context)
             for r in p["sparse"] if r["budget"] == budget),
            None,
        )
        lines.append(f"| {label} ({model}) | ≥ {need}× | {_fmt(got, 2)}× | {'-' if got is None else ('yes' if got >= need else 'NO')} |")
    ratios = [(p["dense_ratio_vs_flashinfer"], p) for p in points if "dense_ratio_vs_flashinfer" in p]
    if ratios:
        worst, p = max(ratios, key=lambda x: x[0])
        where = f"worst {p['model']} B={p['batch']} L={p['context'] // 1024}k"
        lines.append(f"| questkv dense / FlashInfer dense, all points | ≤ {DENSE_TARGET}× | {worst:.2f}× ({where}) | "
                     f"{'yes' if worst <= DENSE_TARGET else 'NO'} |")
    for label, model, batch, context, budget, limit, before in AMORTIZED_TARGETS:
        row = _budget_row(points, model, batch, context, budget)
        found = amortized_target(row.get("amortized_step_us", {}), limit) if row else None
        required = f"≤ {limit:.1f} µs/step (was {before:.1f})"
        if found is None:
            lines.append(f"| amortized Quest step, {label} ({model}) | {required} | - | - |")
            continue
        interval, micros, met = found
        measured = f"{micros:.1f} µs at C={interval}{'' if met else ' (best)'}; every-step {_fmt(row['step_us'])}"
        lines.append(f"| amortized Quest step, {label} ({model}) | {required} | {measured} | {'yes' if met else 'NO'} |")
    return lines


def parse_intervals(parser: argparse.ArgumentParser, text: str) -> list[int]:
    """``--selection-intervals`` as sorted distinct positive ints (``parser.error`` otherwise)."""
    try:
        intervals = sorted({int(c) for c in text.split(",")})
    except ValueError:
        intervals = []
    if not intervals or intervals[0] < 1:
        parser.error(f"--selection-intervals must be positive integers separated by commas, got {text!r}")
    return intervals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--contexts", default="8192,32768,131072")
    parser.add_argument("--budgets", default="1024,2048,4096")
    parser.add_argument("--selection-intervals", default="1,2,4,8",
                        help="C values: the Quest step amortized over C decode steps that select once")
    parser.add_argument("--reps", type=int, default=50, help="timed graph replays per measurement")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--max-gb", type=float, default=100.0, help="GPU memory for pools (+ SDPA copies) per point")
    parser.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--tag", default="h200")
    args = parser.parse_args()
    args.intervals = parse_intervals(parser, args.selection_intervals)
    if not torch.cuda.is_available():
        print("benchmarks/kernels_bench.py needs a CUDA GPU", file=sys.stderr)
        return 2
    # FlashInfer's own guidance: tensor cores for grouped queries; for MHA both are measured
    args.fi_tensor_cores = {"llama3.1-8b": (True,), "llama2-7b": (True, False)}

    info = {
        "command": "python " + " ".join([sys.argv[0], *sys.argv[1:]]),
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "python": platform.python_version(),
        "dtype": str(DTYPE),
        "page_size": PAGE_SIZE,
        "pdl": triton_common.PDL,
        "selection_intervals": args.intervals,
    }
    try:
        import flashinfer

        info["flashinfer"] = flashinfer.__version__
        flashinfer_ok = True
    except Exception as error:  # noqa: BLE001 - the baseline is optional, its absence is recorded
        info["flashinfer"] = f"unavailable: {error}"
        flashinfer_ok = False
    print(json.dumps(info), flush=True)

    checks = check_correctness()
    for c in checks:
        print(f"check {c['check']}: rel_err {c['rel_err']:.2e} (tol {c['tol']:.0e}) {'ok' if c['ok'] else 'FAIL'}", flush=True)
    info["copy_tbps"] = copy_bandwidth()
    print(f"device-to-device copy: {info['copy_tbps']:.2f} TB/s", flush=True)

    points = []
    if all(c["ok"] for c in checks):
        budgets = [int(b) for b in args.budgets.split(",")]
        for model in args.models.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                for context in (int(c) for c in args.contexts.split(",")):
                    hq, hkv, d = MODELS[model]
                    if batch * context * hkv * d * 2 * 2 > args.max_gb * 2**30:
                        print(f"skip {model} B={batch} L={context}: K/V over --max-gb", flush=True)
                        continue
                    point = run_point(model, batch, context, budgets, args, flashinfer_ok)
                    torch.cuda.empty_cache()  # the point's pools are gone: hand their memory back
                    points.append(point)
                    partial = Path(args.out_dir) / f"kernels-{args.tag}.partial.json"
                    partial.parent.mkdir(parents=True, exist_ok=True)
                    partial.write_text(json.dumps({"info": info, "checks": checks, "points": points}, indent=1))
                    steps = ", ".join(f"budget {r['budget']}: {r['step_us']:.1f} (amortized "
                                      + ", ".join(f"C={c} {us:.1f}" for c, us in r["amortized_step_us"].items()) + ")"
                                      for r in point["sparse"])
                    print(f"{model} B={batch} L={context}: dense questkv {point['questkv_dense_us']:.1f} / "
                          f"FlashInfer {point.get('flashinfer_dense_us', float('nan')):.1f} µs; Quest step {steps} µs", flush=True)

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"info": info, "checks": checks, "points": points}
    (out_dir / f"kernels-{args.tag}.json").write_text(json.dumps(result, indent=1))
    md = [
        f"# questkv kernels on {info['gpu']}",
        "",
        f"- command: `{info['command']}`",
        f"- commit: `{info['commit']}`, date: {info['date']}",
        f"- torch {info['torch']}, triton {info['triton']}, flashinfer {info['flashinfer']}; {DTYPE}, page {PAGE_SIZE}",
        f"- device-to-device copy: {info['copy_tbps']:.2f} TB/s (read + write)",
        f"- correctness: {sum(c['ok'] for c in checks)}/{len(checks)} checks passed",
        f"- programmatic dependent launch (PDL) {'on' if info['pdl'] else 'off'} by default; the 'PDL switched' "
        "columns time the same graph with it the other way",
        "- times: median GPU µs per call under CUDA graphs; speedup = FlashInfer dense / Quest step; "
        "ideal = L / (L/16 + budget); step TB/s = (bounds + selected K/V bytes) / step time",
        "",
        "## Targets",
        "",
        *target_lines(points),
        "",
        "## All points",
        "",
        *table_lines(points),
        "",
        "## Quest step amortized over C",
        "",
        "Selection reuse (`QuestConfig.selection_interval` C): a CUDA graph of C consecutive steps per layer, in the "
        "engine's order; step 0 estimates, selects (every sequence active) and attends; steps 1..C-1 attend alone "
        "(the engine's graph of a step where no row selects: no estimate or select launch) the last selection plus "
        f"`reuse_extra_pages` = ceil((C-1)/{PAGE_SIZE}) page columns begun since (`QuestDecodeStep.sparse` with "
        "`active`, `selected` and `selecting=False`, as the engine). µs per step = window time / C (per layer, like "
        "the Quest step column).",
        "",
        *amortized_lines(points, args.intervals),
        "",
        "## Attention over a head-major copy of the pools (storage [num_pages, num_kv_heads, page_size, head_dim])",
        "",
        *head_major_lines(points),
        "",
    ]
    (out_dir / f"kernels-{args.tag}.md").write_text("\n".join(md))
    print("\n".join(["", *target_lines(points), "", *table_lines(points), "", *amortized_lines(points, args.intervals),
                     "", *head_major_lines(points)]))
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
