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
