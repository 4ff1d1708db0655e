import dataclasses
import typing

import pytest

from questkv import QuestConfig
from questkv.config import (
    BACKENDS, GROUP_REDUCTIONS, PAGE_POLICY_OPTIONS, SELECTIONS, Backend, GroupReduction, Selection,
)


def test_defaults_are_dense_paper_settings():
    config = QuestConfig()
    assert config.is_dense and config.page_size == 16 and config.dense_layers == 2
    assert config.selection == "kv_head" and not config.is_sparse_layer(5)


def test_budget_pages_and_sparse_layers():
    config = QuestConfig(token_budget=256, dense_layers=2)
    assert config.budget_pages == 16
    assert [config.is_sparse_layer(i) for i in range(4)] == [False, False, True, True]


def test_frozen():
    with pytest.raises(Exception):
        QuestConfig().page_size = 8


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"page_size": 12}, "page_size must be a power of two, got 12"),
        ({"page_size": 0}, "page_size must be >= 1, got 0"),
        ({"page_size": 16.0}, "page_size must be an int"),
        ({"token_budget": 100}, "token_budget must be a multiple of page_size=16, got 100"),
        ({"token_budget": 0}, "token_budget must be >= 1, got 0"),
        ({"token_budget": -16}, "token_budget must be >= 1, got -16"),
        ({"token_budget": True}, "token_budget must be an int"),
        ({"token_budget": 32, "sink_pages": 1, "recent_pages": 1}, "fewer than the 3 always-kept pages"),
        ({"dense_layers": -1}, "dense_layers must be >= 0, got -1"),
        ({"sink_pages": -1}, "sink_pages must be >= 0, got -1"),
        ({"recent_pages": -2}, "recent_pages must be >= 0, got -2"),
        ({"selection": "query"}, "selection must be one of 'kv_head', 'q_head'; got 'query'"),
        ({"group_reduction": "mean"}, "group_reduction must be one of 'sum', 'max'; got 'mean'"),
        ({"backend": "cuda"}, "backend must be one of 'auto', 'torch', 'triton'; got 'cuda'"),
    ],
)
def test_invalid_values_raise_naming_field_and_value(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        QuestConfig(**kwargs)


def test_choices_are_the_literal_types():
    assert SELECTIONS == typing.get_args(Selection) == ("kv_head", "q_head")
    assert GROUP_REDUCTIONS == typing.get_args(GroupReduction) == ("sum", "max")
    assert BACKENDS == typing.get_args(Backend) == ("auto", "torch", "triton")
    assert PAGE_POLICY_OPTIONS == ("selection", "group_reduction", "sink_pages", "recent_pages")


@pytest.mark.parametrize("field", dataclasses.fields(QuestConfig), ids=lambda field: field.name)
def test_every_field_refuses_what_its_metadata_does_not_allow(field):
    meta = field.metadata
    assert meta["help"] and meta["flag"].startswith("--")
    name = f"QuestConfig.{field.name}"
    if meta["choices"]:
        assert field.default in meta["choices"]
        with pytest.raises(ValueError, match=f"{name} must be one of"):
            QuestConfig(**{field.name: "bogus"})
        return
    if meta["interval"] is not None:  # a float in [low, high]
        low, high = meta["interval"]
        for bad, message in ((low - 0.5, f"{name} must be in \\[{low}, {high}\\]"),
                             (high + 0.5, f"{name} must be in \\[{low}, {high}\\]"),
                             ("0.5", f"{name} must be a finite number"), (True, f"{name} must be a finite number"),
                             (float("nan"), f"{name} must be a finite number")):
            with pytest.raises(ValueError, match=message):
                QuestConfig(**{field.name: bad})
        return
    assert meta["minimum"] in (0, 1)
    for bad, message in ((meta["minimum"] - 1, f"{name} must be >= {meta['minimum']}"), (1.0, f"{name} must be an int"),
                         (True, f"{name} must be an int")):
        with pytest.raises(ValueError, match=message):
            QuestConfig(**{field.name: bad})
    if meta["none"] is None:
        with pytest.raises(ValueError, match=f"{name} must be an int, got None"):
            QuestConfig(**{field.name: None})


def test_budget_exactly_covering_forced_pages_is_allowed():
    assert QuestConfig(token_budget=48, sink_pages=1, recent_pages=1).budget_pages == 3


def test_budget_pages_of_dense_config_raises():
    with pytest.raises(ValueError, match="dense config"):
        QuestConfig().budget_pages
