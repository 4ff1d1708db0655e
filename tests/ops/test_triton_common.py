"""The Triton launchers' shared helpers."""

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from questkv.ops.triton import _common  # noqa: E402


@pytest.mark.parametrize("enabled", [False, True])
def test_programmatic_dependent_launch_is_never_used_off_a_cuda_gpu(monkeypatch, enabled):
    monkeypatch.setattr(_common, "PDL", enabled)
    assert _common.use_pdl(torch.device("cpu")) is False


def test_programmatic_dependent_launch_is_off_under_the_interpreter(monkeypatch):
    monkeypatch.setattr(_common, "PDL", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _common.use_pdl(torch.device("cuda")) is False


@pytest.mark.parametrize(("value", "expected"), [("0", False), ("1", True)])
def test_questkv_pdl_environment_variable_sets_the_default(monkeypatch, value, expected):
    monkeypatch.setenv("QUESTKV_PDL", value)
    assert _common._pdl_from_env() is expected


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_questkv_pdl_environment_variable_rejects_other_values(monkeypatch, value):
    monkeypatch.setenv("QUESTKV_PDL", value)
    with pytest.raises(ValueError, match="QUESTKV_PDL"):
        _common._pdl_from_env()


def test_programmatic_dependent_launch_is_on_by_default(monkeypatch):
    monkeypatch.delenv("QUESTKV_PDL", raising=False)
    assert _common._pdl_from_env() is True


@triton.jit
def _split_rows(q_ptr, parts_ptr, scale_ptr, M: tl.constexpr, D: tl.constexpr):
    m, d = tl.arange(0, M), tl.arange(0, D)
    q = tl.load(q_ptr + m[:, None] * D + d[None, :])
    parts, scale = _common.split_query_e4m3(q, m < M // 2, False)
    tl.store(parts_ptr + m[:, None] * D + d[None, :], parts.to(tl.float32))
    tl.store(scale_ptr + m, scale)


def test_a_query_split_in_two_e4m3_parts_holds_bfloat16s_precision():
    """Rows 0..7 of the kernel's input are a bf16 query's heads, rows 8..15 the same heads again: the first come
    back as hi, the second as lo, both e4m3 values, hi a neighbour of the scaled row (its nearest e4m3 value, up to
    the scaling's last bit); hi + lo / 16, scaled back, is the query within bfloat16's rounding (hi alone is not).
    A row of zeros stays zero."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    q = (torch.randn(8, 64, generator=gen) * torch.logspace(-3, 2, 8)[:, None]).bfloat16()
    q[5] = 0
    parts, scale = torch.empty(16, 64), torch.empty(16)
    _split_rows[(1,)](torch.cat([q, q]), parts, scale, 16, 64)
    assert torch.equal(parts, parts.to(torch.float8_e4m3fn).float())
    rows = [r for r in range(8) if r != 5]
    scaled = (q.float() * (448 / q.float().abs().amax(1).clamp_min(1e-30))[:, None])[rows]
    below = scaled.to(torch.float8_e4m3fn).float()
    spacing = 2.0 ** (torch.floor(torch.log2(below.abs().clamp_min(2 ** -6))) - 3)
    assert ((parts[rows] - scaled).abs() <= spacing).all()
    back = parts[:8] * scale[:8, None] + parts[8:] * scale[8:, None]
    error = (back - q.float()).abs() / q.float().abs().amax(1, keepdim=True).clamp_min(1e-30)
    assert error[rows].max() <= 2 ** -8 and torch.equal(back[5], torch.zeros(64))
    assert ((parts[:8] * scale[:8, None] - q.float()).abs() / q.float().abs().amax(1, keepdim=True)
            .clamp_min(1e-30))[rows].max() > 2 ** -6  # hi alone keeps 4 bits
