"""The decode graphs' key policy: batch sizes and page-table widths that get a graph (CPU: no capture here;
benchmarks/e2e_bench.py checks the captured CUDA path against the eager one)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from questkv.engine.cuda_graphs import graph_batch_sizes, graph_widths, table_width


@pytest.mark.parametrize("max_num_seqs,sizes", [
    (1, (1,)),
    (3, (1, 2, 3)),
    (16, (1, 2, 4, 8, 16)),
    (40, (1, 2, 4, 8, 16, 32, 40)),
    (64, (1, 2, 4, 8, 16, 32, 48, 64)),
])
def test_graph_batch_sizes_are_powers_of_two_then_multiples_of_sixteen_up_to_max_num_seqs(max_num_seqs, sizes):
    assert graph_batch_sizes(max_num_seqs) == sizes


@settings(max_examples=50, deadline=None)
@given(limit=st.integers(1, 5000))
def test_startup_capture_covers_the_width_of_every_sequence_length(limit):
    widths = graph_widths(limit)
    assert widths == sorted(set(widths), reverse=True) and max(widths) == limit
    for pages in range(1, limit + 1):
        width = table_width(pages, limit)
        assert width in widths and pages <= width <= limit


def test_latest_picks_the_last_graph_of_a_route():
    import torch

    from questkv.decode.route import StepRoute
    from questkv.engine.cuda_graphs import DecodeGraphs

    graphs = DecodeGraphs((), 8, torch.device("cpu"))  # no batch sizes: no pool, nothing captured
    with pytest.raises(LookupError, match="VERIFY"):
        graphs.latest(StepRoute.VERIFY)
    first, verify, last = object(), object(), object()  # stand-ins for captured graphs, in capture order
    graphs._graphs = {(1, 8, StepRoute.DENSE, True): (first, None), (1, 8, StepRoute.VERIFY, 5): (verify, None),
                      (2, 8, StepRoute.DENSE, True): (last, None)}
    assert graphs.latest() is last
    assert graphs.latest(StepRoute.DENSE) is last
    assert graphs.latest(StepRoute.VERIFY) is verify


@pytest.mark.parametrize("verify_lengths", [(), (2, 3, 4, 5)])
def test_a_lossless_startup_capture_lists_every_round_lengths_verify_and_dense_and_mixed_steps_at_every_width(
        monkeypatch, verify_lengths):
    import torch

    from questkv.decode.route import StepRoute
    from questkv.engine.cuda_graphs import DecodeGraphs

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)  # the keys only: no pool on a CPU machine
    sizes, limit = graph_batch_sizes(16), 300
    graphs = DecodeGraphs(sizes, limit, torch.device("cpu"), sparse=True, dense_pages=40,
                          verify_lengths=verify_lengths)
    keys = graphs.missing()
    verify = {key for key in keys if key[2] == StepRoute.VERIFY}
    assert verify == {(b, w, StepRoute.VERIFY, q) for b in sizes for w in graph_widths(limit) for q in verify_lengths}
    assert len(keys) == len(set(keys))
    # a Quest engine's dense steps up to the width of 40 pages; a lossless one's at every width (its policy's)
    dense_widths = graph_widths(limit) if verify_lengths else [64]
    mixed_widths = graph_widths(limit) if verify_lengths else []  # rows joining a lossless batch while others draft
    assert {key for key in keys if key[2] != StepRoute.VERIFY} == {
        *((b, w, StepRoute.SPARSE, True) for b in sizes for w in graph_widths(limit)),
        *((b, w, StepRoute.DENSE, True) for b in sizes for w in dense_widths),
        *((b, w, StepRoute.MIXED, True) for b in sizes for w in mixed_widths)}
    assert [key[0] for key in keys] == sorted((key[0] for key in keys), reverse=True)  # largest batch first


def test_a_capture_on_first_use_runs_it_and_logs_the_key_it_waited_for(caplog):
    import logging

    import torch

    from questkv.decode.route import StepRoute
    from questkv.engine.cuda_graphs import DecodeGraphs

    graphs = DecodeGraphs((), 8, torch.device("cpu"))
    ran = []
    with caplog.at_level(logging.INFO, logger="questkv.engine.cuda_graphs"):
        graphs.capture_late((16, 2048, StepRoute.MIXED, False), lambda: ran.append(True))
    assert ran == [True]
    assert "(batch 16, width 2048, mixed, False)" in caplog.text and "waited" in caplog.text
