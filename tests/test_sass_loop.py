"""benchmarks/sass_loop.py's count of the int4 tensor-core kernel's loop (needs nvcc, as the kernel's compile test)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import sass_loop

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "questkv" / "ops" / "cuda" / "int4_mma.cu"
SCRIPT = ROOT / "benchmarks" / "sass_loop.py"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_each_int4_kernel_loop_is_one_group_of_mmas_without_spills():
    """12 instantiations (bf16 / fp16 x, zero points in x's type / uint8, 1 / 2 / 4 column tiles); the loop found is
    the one over groups: a group's 128 features × 64 outputs are 4 steps × 2 MMAs × 4 tiles per column tile, and at
    9-16 rows (2 column tiles) one more MMA per B fragment for the sums of x."""
    kernels = sass_loop.int4_mma_loops(SOURCE)
    assert len(kernels) == 12
    for name, kernel in kernels.items():
        sums = 8 * kernel["tiles"] if kernel["tiles"] == 2 else 0  # 9-16 rows: x's sums, an MMA per B fragment
        assert kernel["hmma"] == 32 * kernel["tiles"] + sums, name
        assert kernel["spill_bytes"] == 0 and 0 < kernel["registers"] <= 255, name
        assert kernel["instructions"] > kernel["hmma"], name



def test_each_gemv_loop_is_one_group_with_a_multiply_add_per_weight_and_row(tmp_path):
    """Triton's sm_90 compile (the bundled ptxas, no GPU; in a subprocess, as kernels built under the interpreter do
    not compile): the loop found is the one over groups, a thread's 128 features × 4 outputs taking one FFMA per
    weight and row of ``x``, for every launch the plan makes at llama3.1-8b's shapes."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    out = tmp_path / "gemv"
    subprocess.run([sys.executable, str(SCRIPT), "--int4-gemv", "--out", str(out)], env=env, check=True,
                   capture_output=True)
    kernels = json.loads(out.with_suffix(".json").read_text())["kernels"]
    assert {kernel["rows"] for kernel in kernels.values()} == {1, 2}
    for name, kernel in kernels.items():
        ffma = dict(kernel["top"])["FFMA"]
        assert 512 * kernel["rows"] <= ffma < 512 * kernel["rows"] + 64, name
        assert kernel["weights"] == 128 * 4 * 32 and kernel["instructions"] > ffma, name
        assert 0 < kernel["registers"] <= 255 and kernel["spill_bytes"] == 0, name


def test_programs_per_sm_counts_registers_in_steps_of_8_and_shared_memory_with_its_reserve():
    """sm_90: 64 K registers and 228 KiB an SM. 128 registers a thread: 4 programs of 4 warps; 190 rounds to 192,
    2 (2.67 whole); 168 gives 3. Shared memory: 1 KiB reserved per program."""
    assert sass_loop.programs_per_sm(128, 0, 4) == (4, 228)
    assert sass_loop.programs_per_sm(190, 81 * 1024, 4) == (2, 2)
    assert sass_loop.programs_per_sm(168, 49 * 1024, 4)[0] == 3
    assert sass_loop.programs_per_sm(161, 56 * 1024, 4) == (3, 4)
    assert sass_loop.programs_per_sm(128, 0, 8)[0] == 2
