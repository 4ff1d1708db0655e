"""QuestDecodeStep's fused-select default (``QUESTKV_FUSE_SELECT``)."""

import pytest
import torch

from questkv.config import QuestConfig
from questkv.decode import step


@pytest.mark.parametrize(("value", "expected"), [("0", False), ("1", True)])
def test_questkv_fuse_select_environment_variable_sets_the_default(monkeypatch, value, expected):
    monkeypatch.setenv("QUESTKV_FUSE_SELECT", value)
    assert step._fuse_select_from_env() is expected


@pytest.mark.parametrize("value", ["yes", "2", ""])
def test_questkv_fuse_select_environment_variable_rejects_other_values(monkeypatch, value):
    monkeypatch.setenv("QUESTKV_FUSE_SELECT", value)
    with pytest.raises(ValueError, match="QUESTKV_FUSE_SELECT"):
        step._fuse_select_from_env()


@pytest.mark.parametrize("default", [False, True])
def test_fuse_select_none_takes_the_module_default_and_an_argument_overrides_it(monkeypatch, default):
    monkeypatch.setattr(step, "FUSE_SELECT", default)
    config = QuestConfig(token_budget=8, page_size=4)
    make = lambda **kw: step.QuestDecodeStep(config, 2, 4, 2, 8, 6, torch.float32, "cpu", **kw)  # noqa: E731
    assert make().fuse_select is default
    assert make(fuse_select=not default).fuse_select is (not default)
