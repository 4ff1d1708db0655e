"""The CUDA C++ int4 tensor-core kernel (questkv.ops.cuda.int4_mma) against the torch reference.

On a GPU it is built and compared with :func:`questkv.ops.quant_reference.int4_matmul` at every row count it takes,
both zero-point dtypes, bf16 and fp16, with and without a bias, one and several blocks per output tile; on a CPU
(CI) only what needs no GPU runs: which products it takes and how a launch is planned.
"""

import itertools
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from questkv.ops import quant_reference as ref
from questkv.ops.cuda import int4_mma as mma
from tests.helpers import int4_words_weight

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")




def test_fits_takes_up_to_sixteen_rows_of_group_128_with_outputs_in_64s():
    words = torch.zeros((512 // 8, 192), dtype=torch.int32)
    s = torch.rand((4, 192)).to(torch.bfloat16)
    z8 = torch.randint(0, 16, (4, 192), dtype=torch.uint8)

    def fits(x, w=words, scales=s, zeros=z8, group=128):
        return mma.fits(x, w, scales, zeros, group)

    for m in (1, 5, 16, 17, 32):
        assert fits(torch.randn(m, 512).to(torch.bfloat16))
    assert fits(torch.randn(3, 512).to(torch.bfloat16), zeros=z8.to(torch.bfloat16))
    assert not fits(torch.randn(33, 512).to(torch.bfloat16))
    assert not fits(torch.randn(2, 512))  # float32
    assert not fits(torch.randn(2, 512).to(torch.bfloat16), group=64)
    assert not fits(torch.randn(2, 512).to(torch.bfloat16), w=torch.zeros((64, 160), dtype=torch.int32))
    assert not fits(torch.randn(2, 1024).to(torch.bfloat16)[:, :512])  # rows not contiguous
    assert not fits(torch.randn(2, 512).to(torch.float16))  # scales in another dtype
    assert not fits(torch.randn(2, 512).to(torch.bfloat16), zeros=z8.float())


def test_plan_splits_groups_over_blocks_without_leaving_a_warp_idle():
    for (n, k), m in itertools.product(((4096, 4096), (6144, 4096), (4096, 14336), (128256, 4096), (192, 512)),
                                       (1, 5, 16, 17, 32)):
        cfg = mma.plan_int4_mma(m, n, k)
        groups = k // 128
        assert cfg.split >= 1 and 1 <= cfg.warps <= mma.max_warps(m)
        assert cfg.split == 1 or groups // cfg.split >= cfg.warps
    assert mma.plan_int4_mma(5, 128256, 4096).split == 1  # enough output tiles already


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("source, kernels", [("int4_mma.cu", 12), ("int4_gemv.cu", 8)])
def test_the_extensions_kernels_compile_for_sm90_without_spilling(tmp_path, source, kernels):
    """Both CUDA C++ int4 kernels (the GEMV's own tests: ``test_cuda_int4_gemv.py``), every instantiation."""
    path = Path(mma.__file__).with_name(source)
    done = subprocess.run(["nvcc", "-O3", "-std=c++17", "-gencode", "arch=compute_90,code=sm_90", "-Xptxas", "-v",
                           "-c", str(path), "-o", str(tmp_path / "kernel.o")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stderr.lower(), done.stderr
    spills = [line for line in done.stderr.splitlines() if "spill" in line]
    assert len(spills) == kernels, spills
    assert all("0 bytes spill stores, 0 bytes spill loads" in line for line in spills), spills


def test_bad_input_is_refused_before_any_build_or_launch():
    words = torch.zeros((512 // 8, 192), dtype=torch.int32)
    scales = torch.rand((4, 192)).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (4, 192), dtype=torch.uint8)
    x = torch.randn(3, 512).to(torch.bfloat16)
    cases = [
        (dict(x=torch.randn(33, 512).to(torch.bfloat16)), r"1 to 32 contiguous"),
        (dict(bias=torch.randn(192)), r"bias must be \[192\] in x's dtype"),
        (dict(bias=torch.randn(191).to(torch.bfloat16)), r"bias must be \[192\]"),
        (dict(config=mma.Int4MmaConfig(9, 1)), r"for 3 rows takes 1 to 8 warps"),
        (dict(x=torch.randn(17, 512).to(torch.bfloat16), config=mma.Int4MmaConfig(8, 1)),
         r"for 17 rows takes 1 to 4 warps"),
        (dict(config=mma.Int4MmaConfig(4, 0)), r"split of at least 1"),
        ({}, r"runs on CUDA tensors, got x on cpu"),
    ]
    for change, message in cases:
        args = {"x": x, "bias": None, "config": None, **change}
        with pytest.raises(ValueError, match=message):
            mma.int4_mma(args["x"], words, scales, zeros, 128, args["bias"], config=args["config"])


def test_a_failed_build_warns_once_and_leaves_the_kernel_unavailable(monkeypatch, caplog):
    def no_compiler(**kwargs):
        raise RuntimeError(f"no nvcc for {kwargs['name']}")

    # a stand-in module: importing torch's own pulls setuptools in, which changes sys.path
    monkeypatch.setitem(sys.modules, "torch.utils.cpp_extension", types.SimpleNamespace(load=no_compiler))
    mma._extension.cache_clear()
    try:
        with caplog.at_level("INFO", logger="questkv.ops"), pytest.warns(RuntimeWarning, match="could not be built"):
            assert mma._extension() is None
        assert mma._extension() is None  # cached: no second build, no second warning
        assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
        assert "building or loading the int4 CUDA kernels" in caplog.records[0].message
    finally:
        mma._extension.cache_clear()


def test_not_available_without_cuda():
    assert not mma.available(torch.device("cpu"))


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("zeros_u8", [True, False])
def test_matches_the_reference_at_every_row_count(dtype, zeros_u8):
    device = torch.device("cuda")
    assert mma.available(device)
    torch.manual_seed(int(torch.randint(0, 2**31, ()).item()))
    n, k = 384, 1536
    words, scales, zeros, qweight = int4_words_weight(n, k, dtype, zeros_u8, device)
    bias = torch.randn(n, device=device).to(dtype)
    for m in range(1, mma.MMA_MAX_M + 1):
        x = torch.randn((m, k), device=device).to(dtype)
        want = ref.int4_matmul(x.float(), words, scales.float(), zeros.float(), 128)
        for cfg in (mma.Int4MmaConfig(4, 1), mma.Int4MmaConfig(2, 3), mma.Int4MmaConfig(mma.max_warps(m), 12), None):
            for b in (None, bias):
                got = mma.int4_mma(x, words, scales, zeros, 128, b, config=cfg).float()
                expect = want if b is None else want + b.float()
                err = (got - expect).norm() / expect.norm()
                assert err < 1e-2, (m, cfg, b is None, float(err))


def _bf16_product(n: int, k: int, m: int, warps: int, split: int):
    """A bf16 int4 weight ``[n, k]`` with uint8 zero points, ``m`` random rows of ``x`` and one launch's call."""
    words, scales, zeros, _ = int4_words_weight(n, k, torch.bfloat16, True, torch.device("cuda"))
    x = torch.randn((m, k), device="cuda").to(torch.bfloat16)
    return x, lambda: mma.int4_mma(x, words, scales, zeros, config=mma.Int4MmaConfig(warps, split))


@cuda
def test_split_launches_are_deterministic_and_leave_the_tickets_zero():
    from questkv.ops.triton._common import ticket_counters

    _, product = _bf16_product(256, 4096, 5, 4, 8)
    first = product()
    for _ in range(3):
        assert torch.equal(product(), first)
    assert int(ticket_counters(torch.device("cuda"), 4)[:4].abs().sum()) == 0


@cuda
def test_captured_in_a_cuda_graph():
    x, product = _bf16_product(512, 2048, 4, 4, 4)
    want = product()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = product()
    x.copy_(torch.randn((4, 2048), device="cuda").to(torch.bfloat16))
    graph.replay()
    assert torch.equal(out, product())
    assert not torch.equal(out, want)
