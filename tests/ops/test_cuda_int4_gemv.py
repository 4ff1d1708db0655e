"""The CUDA C++ int4 GEMV (questkv.ops.cuda.int4_gemv) against the torch reference.

On a GPU it is built and compared with :func:`questkv.ops.quant_reference.int4_matmul` for both zero-point dtypes,
bf16 and fp16, with and without a bias, every stage count, one and several blocks per output tile (a last split
shorter than the others included); on a CPU (CI) only what needs no GPU runs: which products it takes, how a launch
is planned, the dispatch's routing and the refusals of bad input (its sm_90 compile: ``test_cuda_int4_mma.py``).
"""

import itertools

import pytest
import torch

from questkv.ops import quant_reference as ref
from questkv.ops.cuda import int4_gemv as gemv
from tests.helpers import int4_words_weight

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")




def test_fits_takes_one_row_of_group_128_with_outputs_in_32s():
    words = torch.zeros((512 // 8, 96), dtype=torch.int32)
    s = torch.rand((4, 96)).to(torch.bfloat16)
    z8 = torch.randint(0, 16, (4, 96), dtype=torch.uint8)

    def fits(x, w=words, scales=s, zeros=z8, group=128):
        return gemv.fits(x, w, scales, zeros, group)

    assert fits(torch.randn(1, 512).to(torch.bfloat16))
    assert fits(torch.randn(1, 512).to(torch.bfloat16), zeros=z8.to(torch.bfloat16))
    assert not fits(torch.randn(2, 512).to(torch.bfloat16))
    assert not fits(torch.randn(1, 512))  # float32
    assert not fits(torch.randn(1, 512).to(torch.bfloat16), group=64)
    assert not fits(torch.randn(1, 512).to(torch.bfloat16), w=torch.zeros((64, 80), dtype=torch.int32))
    assert not fits(torch.randn(1, 513).to(torch.bfloat16)[:, 1:])  # not 16-byte aligned
    assert not fits(torch.randn(1, 512).to(torch.float16))  # scales in another dtype


def test_plan_fills_the_sms_without_idle_warps_or_too_much_shared_memory():
    for (n, k), sms in itertools.product(((4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (128256, 4096),
                                          (1536, 8960), (96, 512)), (None, torch.device("cpu"))):
        cfg = gemv.plan_int4_gemv_cuda(n, k, sms)
        groups = k // 128
        per_split = -(-groups // cfg.split)
        assert cfg.stages in gemv.GEMV_STAGES and 1 <= cfg.warps <= gemv.GEMV_MAX_WARPS
        assert gemv.smem_bytes(per_split, cfg.warps) <= gemv.GEMV_MAX_SMEM
        assert cfg.split == 1 or per_split >= cfg.warps
    assert gemv.plan_int4_gemv_cuda(4096, 4096) == gemv.CudaGemvConfig(16, 1, 2)  # 128 tiles of 32 outputs
    assert gemv.plan_int4_gemv_cuda(6144, 4096).warps == 8 and gemv.plan_int4_gemv_cuda(28672, 4096).warps == 4
    assert gemv.plan_int4_gemv_cuda(96, 40_960).split == 2  # 320 groups' x would not fit one block


def test_the_dispatch_takes_up_to_two_tiles_per_sm():
    cpu = torch.device("cpu")  # an H200's 132 SMs
    assert gemv.takes(4096, cpu) and gemv.takes(6144, cpu) and gemv.takes(32 * 264, cpu)
    assert not gemv.takes(32 * 265, cpu) and not gemv.takes(28672, cpu) and not gemv.takes(128256, cpu)


def test_int4_matmul_sends_one_row_here_where_the_tiles_are_few_and_it_fits(monkeypatch):
    """The dispatch's routing, with every kernel replaced by a recorder (no GPU): one bf16 row of a product with at
    most two 32-output tiles per SM goes to the CUDA GEMV, a wider one or a float32 row to the Triton GEMV, two rows
    to the tensor-core kernel; without the extension, one row goes to the Triton GEMV."""
    from questkv.ops.cuda import int4_mma as mma
    from questkv.ops.triton import quant_ops

    calls = []
    for module, name in ((gemv, "int4_gemv_cuda"), (quant_ops, "int4_gemv"), (mma, "int4_mma")):
        monkeypatch.setattr(module, name, lambda *args, name=name, **kw: calls.append(name))
    built = {"yes": True}
    monkeypatch.setattr(mma, "available", lambda device: built["yes"])
    monkeypatch.setattr(quant_ops.mma, "fits", lambda *args: True)

    def route(n: int, m: int = 1, dtype=torch.bfloat16) -> str:
        words = torch.zeros((128 // 8, n), dtype=torch.int32)
        scales = torch.rand((1, n)).to(dtype)
        zeros = torch.randint(0, 16, (1, n), dtype=torch.uint8)
        calls.clear()
        quant_ops.int4_matmul(torch.randn(m, 128).to(dtype), words, scales, zeros, 128)
        return calls[0]

    assert route(4096) == route(6144) == "int4_gemv_cuda"  # 128 and 192 tiles for 132 SMs
    assert route(28672) == route(128256) == "int4_gemv"
    assert route(4096, dtype=torch.float32) == "int4_gemv"
    assert route(4096, m=2) == "int4_mma"
    built["yes"] = False
    assert route(4096) == "int4_gemv"


def test_bad_input_is_refused_before_any_build_or_launch():
    words = torch.zeros((512 // 8, 96), dtype=torch.int32)
    scales = torch.rand((4, 96)).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (4, 96), dtype=torch.uint8)
    x = torch.randn(1, 512).to(torch.bfloat16)
    cases = [
        (dict(x=torch.randn(2, 512).to(torch.bfloat16)), r"takes one contiguous"),
        (dict(x=torch.randn(512).to(torch.bfloat16)), r"x must be \[M, K\]"),
        (dict(bias=torch.randn(96)), r"bias must be \[96\] in x's dtype"),
        (dict(config=gemv.CudaGemvConfig(17, 1)), r"1 to 16 warps"),
        (dict(config=gemv.CudaGemvConfig(8, 0)), r"split of at least 1"),
        (dict(config=gemv.CudaGemvConfig(8, 1, 4)), r"stages in \(2, 3\)"),
        ({}, r"runs on CUDA tensors, got x on cpu"),
    ]
    for change, message in cases:
        args = {"x": x, "bias": None, "config": None, **change}
        with pytest.raises(ValueError, match=message):
            gemv.int4_gemv_cuda(args["x"], words, scales, zeros, 128, args["bias"], config=args["config"])
    big = torch.zeros((40_960 // 8, 96), dtype=torch.int32)
    with pytest.raises(ValueError, match=r"320 groups per block need .* split K further"):
        gemv.int4_gemv_cuda(torch.randn(1, 40_960).to(torch.bfloat16), big, torch.rand((320, 96)).to(torch.bfloat16),
                            torch.randint(0, 16, (320, 96), dtype=torch.uint8), config=gemv.CudaGemvConfig(8, 1))


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("zeros_u8", [True, False])
def test_matches_the_reference(dtype, zeros_u8):
    device = torch.device("cuda")
    from questkv.ops.cuda.int4_mma import available

    assert available(device)
    torch.manual_seed(int(torch.randint(0, 2**31, ()).item()))
    for n, k in ((96, 1536), (4096, 3072)):
        words, scales, zeros, _ = int4_words_weight(n, k, dtype, zeros_u8, device)
        bias = torch.randn(n, device=device).to(dtype)
        x = torch.randn((1, k), device=device).to(dtype)
        want = ref.int4_matmul(x.float(), words, scales.float(), zeros.float(), 128)
        configs = [gemv.CudaGemvConfig(w, s, st) for w, s, st in itertools.product((1, 4, 16), (1, 5), (2, 3))]
        for cfg in configs + [None]:  # 5 blocks asked for 12 groups: 4 of 3; 16 warps: most idle
            for b in (None, bias):
                got = gemv.int4_gemv_cuda(x, words, scales, zeros, 128, b, config=cfg).float()
                expect = want if b is None else want + b.float()
                err = (got - expect).norm() / expect.norm()
                assert err < 1e-2, (n, k, cfg, b is None, float(err))


def _product(n: int, k: int, warps: int, split: int):
    words, scales, zeros, _ = int4_words_weight(n, k, torch.bfloat16, True, torch.device("cuda"))
    x = torch.randn((1, k), device="cuda").to(torch.bfloat16)
    return x, lambda: gemv.int4_gemv_cuda(x, words, scales, zeros, config=gemv.CudaGemvConfig(warps, split))


@cuda
def test_split_launches_are_deterministic_and_leave_the_tickets_zero():
    from questkv.ops.triton._common import ticket_counters

    _, product = _product(128, 4096, 4, 8)
    first = product()
    for _ in range(3):
        assert torch.equal(product(), first)
    assert int(ticket_counters(torch.device("cuda"), 4)[:4].abs().sum()) == 0


@cuda
def test_more_than_48_kib_of_shared_memory():
    assert gemv.smem_bytes(112, 8) > 48 * 1024  # 112 groups (K = 14336) in one block: 61 KiB
    words, scales, zeros, _ = int4_words_weight(64, 14336, torch.bfloat16, False, torch.device("cuda"))
    x = torch.randn((1, 14336), device="cuda").to(torch.bfloat16)
    want = ref.int4_matmul(x.float(), words, scales.float(), zeros.float(), 128)
    got = gemv.int4_gemv_cuda(x, words, scales, zeros, config=gemv.CudaGemvConfig(8, 1)).float()
    assert ((got - want).norm() / want.norm()) < 1e-2


@cuda
def test_captured_in_a_cuda_graph():
    x, product = _product(256, 2048, 4, 2)
    want = product()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = product()
    x.copy_(torch.randn((1, 2048), device="cuda").to(torch.bfloat16))
    graph.replay()
    assert torch.equal(out, product())
    assert not torch.equal(out, want)
