"""The batch-1 dense GEMV (questkv.ops.triton.gemv) against the torch reference (questkv.ops.reference.linear),
under the Triton interpreter, and its dispatch.

The interpreter truncates float32 → bf16 / fp16 casts where a GPU rounds to nearest, so the 16-bit cases are
checked to a tolerance (a couple of units in the last place of the output); float32 is
checked to 1e-5. Every test draws fresh random inputs.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from questkv import ops  # noqa: E402
from questkv.ops import reference  # noqa: E402
from questkv.ops.triton import gemv as gv  # noqa: E402
from questkv.ops.triton._common import ticket_counters  # noqa: E402
from tests.helpers import INTERPRETER_TOL, fresh_generator, rel_err  # noqa: E402


def _inputs(n: int, k: int, dtype: torch.dtype, bias: bool):
    gen = fresh_generator()
    x = torch.randn(1, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "n, k, bias, config",
    [
        (64, 1024, False, None),  # the launcher's plan: 4 output blocks on 132 SMs, two splits of one 512-wide tile
        (48, 1024, True, gv.GemvConfig(16, 128, 4, 3)),  # three splits of 3 / 3 / 2 tiles, a bias
        (37, 300, True, gv.GemvConfig(16, 128, 4, 2)),  # masked outputs and a K tail (not EVEN)
        (16, 256, False, gv.GemvConfig(16, 256, 4, 1)),  # one split: no ticket
    ],
)
def test_gemv_matches_the_reference(dtype, n, k, bias, config):
    x, w, b = _inputs(n, k, dtype, bias)
    got = gv.gemv(x, w, b, config)
    assert got.shape == (1, n) and got.dtype == dtype
    want = reference.linear(x.double(), w.double(), None if b is None else b.double())
    assert rel_err(got, want) < INTERPRETER_TOL[dtype]
    assert torch.equal(gv.gemv(x, w, b, config), got)  # deterministic: the partials sum in split order
    assert int(ticket_counters(x.device, 1).abs().sum()) == 0  # every ticket reset for the next launch


def test_plan_gemv_splits_k_only_where_the_output_blocks_leave_sms_idle():
    for n, k in ((6144, 4096), (4096, 4096), (4096, 14336), (1000, 900), (8, 40)):
        cfg = gv.plan_gemv(n, k)
        tiles = -(-k // cfg.block_k)
        assert 1 <= cfg.split <= tiles
        assert cfg.block_k <= max(16, 1 << (k - 1).bit_length())
    # on the CPU the plan assumes an H200's 132 SMs: Llama-3.1-8B's qkv and o (384 and 256 blocks of 16) unsplit
    assert gv.plan_gemv(6144, 4096).split == gv.plan_gemv(4096, 4096).split == 1
    assert gv.plan_gemv(1536, 1536).split == 2  # 96 blocks: two ranges of K reach 132 SMs


def test_linear_takes_the_gemv_for_one_row_and_the_reference_otherwise(monkeypatch):
    calls = []
    real = gv.gemv
    monkeypatch.setattr(gv, "gemv", lambda *args: calls.append(args) or real(*args))
    gen = fresh_generator()
    w = torch.randn(32, 64, generator=gen)
    one, many = torch.randn(1, 64, generator=gen), torch.randn(3, 64, generator=gen)
    for x in (one, many):
        want = reference.linear(x.double(), w.double(), None)
        # float32 sums in another order: 1e-5 of the largest output (an element-wise bound fails, now and then,
        # on the outputs that nearly cancel)
        torch.testing.assert_close(ops.linear(x, w, None, backend="triton").double(), want, rtol=0,
                                   atol=1e-5 * want.abs().max().item())
    assert len(calls) == 1 and calls[0][0] is one
    monkeypatch.setattr(gv, "GEMV_MAX_WEIGHT_BYTES", w.numel() * w.element_size() - 1)  # a weight too large
    ops.linear(one, w, backend="triton")
    assert len(calls) == 1
    # a row that is not contiguous is copied first
    strided = torch.randn(1, 64, 2, generator=gen)[..., 0]
    monkeypatch.setattr(gv, "GEMV_MAX_WEIGHT_BYTES", 2**30)
    torch.testing.assert_close(ops.linear(strided, w, backend="triton"), reference.linear(strided, w))
    assert len(calls) == 2 and calls[1][0].stride(-1) == 1


def test_gemv_rejects_bad_arguments_naming_them():
    x, w, b = _inputs(16, 64, torch.float32, True)
    with pytest.raises(ValueError, match=r"gemv: x must be \[1, 64\] for a weight of shape \(16, 64\), got shape \(2, 64\)"):
        gv.gemv(torch.randn(2, 64), w)
    with pytest.raises(ValueError, match=r"gemv: weight must be \[N, K\], got shape \(1024,\)"):
        gv.gemv(x, w.flatten())
    with pytest.raises(ValueError, match=r"gemv: weight and bias must have x's dtype torch.float32, got torch.float16"):
        gv.gemv(x, w.half())
    with pytest.raises(ValueError, match=r"gemv: bias must have shape \(16,\), got \(15,\)"):
        gv.gemv(x, w, b[:15])
    with pytest.raises(ValueError, match=r"gemv: x and weight must be contiguous in their last dimension"):
        gv.gemv(x, torch.randn(64, 16).t())
