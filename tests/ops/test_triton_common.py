"""The Triton launchers' shared helpers."""

import pytest
import torch

pytest.importorskip("triton")

from questkv.ops.triton import _common  # noqa: E402


@pytest.mark.parametrize("enabled", [False, True])
def test_programmatic_dependent_launch_is_never_used_off_a_cuda_gpu(monkeypatch, enabled):
    monkeypatch.setattr(_common, "PDL", enabled)
    assert _common.use_pdl(torch.device("cpu")) is False


def test_programmatic_dependent_launch_is_off_under_the_interpreter(monkeypatch):
    monkeypatch.setattr(_common, "PDL", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _common.use_pdl(torch.device("cuda")) is False
