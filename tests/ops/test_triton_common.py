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
