"""benchmarks/sass_loop.py's count of the int4 tensor-core kernel's loop (needs nvcc, as the kernel's compile test)."""

import shutil
from pathlib import Path

import pytest

from benchmarks import sass_loop

SOURCE = Path(__file__).resolve().parents[1] / "questkv" / "ops" / "cuda" / "int4_mma.cu"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_each_int4_kernel_loop_is_one_group_of_mmas_without_spills():
    """12 instantiations (bf16 / fp16 x, zero points in x's type / uint8, 1 / 2 / 4 column tiles); the loop found is
    the one over groups: a group's 128 features × 64 outputs are 4 steps × 2 MMAs × 4 tiles per column tile."""
    kernels = sass_loop.int4_mma_loops(SOURCE)
    assert len(kernels) == 12
    for name, kernel in kernels.items():
        assert kernel["hmma"] == 32 * kernel["tiles"], name
        assert kernel["spill_bytes"] == 0 and 0 < kernel["registers"] <= 255, name
        assert kernel["instructions"] > kernel["hmma"], name
