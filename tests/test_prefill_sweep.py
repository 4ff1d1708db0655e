"""benchmarks/prefill_sweep.py's data, check and baseline on tiny CPU shapes (the kernel under the interpreter)."""


import pytest
import torch

pytest.importorskip("triton")

from benchmarks import prefill_sweep  # noqa: E402


@pytest.mark.parametrize("cached", [0, 9])
def test_the_point_checks_and_its_baseline_is_the_reference(cached):
    data = prefill_sweep.point_data(2, cached, 5, heads=(8, 2, 16), page_size=prefill_sweep.PAGE_SIZE,
                                    dtype=torch.float32, device="cpu", seed=cached)
    assert prefill_sweep.check(data) < 1e-5
    want = prefill_sweep.reference.paged_prefill_attention(*prefill_sweep.args_of(data))
    torch.testing.assert_close(prefill_sweep.gathered_sdpa(data), want, rtol=1e-5, atol=1e-5)


def test_constants_are_restored_and_the_table_names_the_best_config():
    before = prefill_sweep.kernel._BLOCK_M
    with prefill_sweep.constants(_BLOCK_M=16):
        assert prefill_sweep.kernel._BLOCK_M == 16
    assert prefill_sweep.kernel._BLOCK_M == before
    result = {"point": (1, 2, 3), "rel_err": 1e-3, "baseline_ms": 2.0, "default_ms": 1.0,
              "configs": [{"block_m": 64, "ms": 0.5}, {"split_programs_per_sm": 2, "ms": 0.7}]}
    md = prefill_sweep.markdown([result], {"command": "prefill_sweep.py", "commit": "abc", "machine": "FakeGPU"})
    assert "| block_m=64 | 0.500 |" in md and "- commit: `abc`" in md
    result["configs"] = []  # --no-sweep
    assert "| defaults (not swept) | 1.000 |" in prefill_sweep.markdown([result], {})
