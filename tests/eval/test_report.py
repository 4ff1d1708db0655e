"""Sweep reports: the PNG plot and the markdown table."""

import random

import pytest

from questkv.eval import report

BUDGETS = [64, 128, 256]
POLICIES = ["quest", "quest-topp", "oracle", "streaming"]


def sweep(rng: random.Random) -> list[dict]:
    """Cells of two accuracy tasks at two lengths and a perplexity task, random values."""
    cells = []
    for task, metric in [("niah_single", "accuracy"), ("vt", "accuracy"), ("ppl", "ppl")]:
        score = (lambda: rng.uniform(0.05, 1.0)) if metric == "accuracy" else (lambda: rng.uniform(5.0, 40.0))
        for length in [2048, 4096]:
            cells.append(dict(task=task, length=length, policy="full", budget=None, metric=metric,
                              value=score(), samples=10, mean_tokens_attended=None, seconds=1.0))
            for policy in POLICIES:
                for budget in BUDGETS:
                    used = rng.uniform(0.3, 0.9) * budget if policy == "quest-topp" else float(budget)
                    cells.append(dict(task=task, length=length, policy=policy, budget=budget, metric=metric,
                                      value=score(), samples=10, mean_tokens_attended=used, seconds=1.0))
    return cells


@pytest.fixture()
def cells():
    return sweep(random.Random())


def lines_by_label(axes):
    return {line.get_label(): line for line in axes.get_lines()}


def test_plot_writes_a_png(cells, tmp_path):
    path = report.plot_sweep(cells, tmp_path / "nested" / "sweep.png", title="sweep")
    assert path == tmp_path / "nested" / "sweep.png"
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 1000


def test_one_panel_per_task_and_length_in_order(cells):
    figure = report._build_figure(cells, None)
    titles = [axes.get_title() for axes in figure.axes]
    assert titles == ["niah_single @ 2k", "niah_single @ 4k", "vt @ 2k", "vt @ 4k", "ppl @ 2k", "ppl @ 4k"]
    assert [axes.get_ylabel() for axes in figure.axes] == ["accuracy"] * 4 + ["perplexity (lower is better)"] * 2
    assert figure.axes[0].get_ylim() == (0, 1.05)
    assert [tick for tick in figure.axes[0].get_xticks()] == BUDGETS
    assert [label.get_text() for label in figure.axes[0].get_xticklabels()] == ["64", "128", "256"]
    assert figure.axes[0].get_xscale() == "log"


def test_quest_topp_is_plotted_at_its_mean_tokens_attended(cells):
    figure = report._build_figure(cells, None)
    first_panel = [c for c in cells if (c["task"], c["length"], c["policy"]) == ("niah_single", 2048, "quest-topp")]
    line = lines_by_label(figure.axes[0])["quest-topp (at mean tokens attended)"]
    expected = sorted((c["mean_tokens_attended"], c["value"]) for c in first_panel)
    assert list(zip(line.get_xdata(), line.get_ydata())) == expected
    assert list(lines_by_label(figure.axes[0])["quest"].get_xdata()) == BUDGETS


def test_quest_topp_without_mean_falls_back_to_its_budget(cells):
    for cell in cells:
        cell["mean_tokens_attended"] = None
    line = lines_by_label(report._build_figure(cells, None).axes[0])["quest-topp (at mean tokens attended)"]
    assert list(line.get_xdata()) == BUDGETS


def test_full_is_a_horizontal_line_at_its_value(cells):
    figure = report._build_figure(cells, None)
    full = next(c for c in cells if (c["task"], c["length"], c["policy"]) == ("vt", 4096, "full"))
    line = lines_by_label(figure.axes[3])["full"]
    assert list(line.get_ydata()) == [full["value"]] * 2 and line.get_linestyle() == "--"


def test_one_legend_and_one_colour_per_policy(cells):
    figure = report._build_figure(cells, None)
    assert len(figure.legends) == 1 and all(axes.get_legend() is None for axes in figure.axes)
    labels = [text.get_text() for text in figure.legends[0].get_texts()]
    assert labels == ["full", "quest", "quest-topp (at mean tokens attended)", "oracle", "streaming"]
    for label in labels:
        colours = {lines_by_label(axes)[label].get_color() for axes in figure.axes}
        assert len(colours) == 1
    other = report._build_figure([dict(cells[1], policy="zeta"), dict(cells[2], policy="zeta")], None)
    assert report._policy_color("zeta") == lines_by_label(other.axes[0])["zeta"].get_color()


def test_format_table():
    cells = [
        dict(task="niah_single", length=4096, policy="quest", budget=128, metric="accuracy", value=0.9),
        dict(task="niah_single", length=4096, policy="quest-topp", budget=128, metric="accuracy", value=0.8,
             mean_tokens_attended=111.6),
        dict(task="niah_single", length=4096, policy="full", budget=None, metric="accuracy", value=1.0),
        dict(task="niah_single", length=4096, policy="quest", budget=64, metric="accuracy", value=0.5),
        dict(task="ppl", length=2048, policy="oracle", budget=64, metric="ppl", value=12.3456),
        dict(task="ppl", length=2048, policy="full", budget=None, metric="ppl", value=11.0),
    ]
    lines = report.format_table(cells).splitlines()
    assert lines[0] == "| task | length | policy | full | 64 | 128 |"
    assert lines[1] == "| --- | --- | --- | ---: | ---: | ---: |"
    assert lines[2:] == [
        "| niah_single | 4096 | full | 100% |  |  |",
        "| niah_single | 4096 | quest |  | 50% | 90% |",
        "| niah_single | 4096 | quest-topp |  |  | 80% (112) |",
        "| ppl | 2048 | full | 11.00 |  |  |",
        "| ppl | 2048 | oracle |  | 12.35 |  |",
    ]


def test_format_table_orders_policies(cells):
    rows = [line.split(" | ")[2] for line in report.format_table(cells).splitlines()[2:]]
    assert rows[:5] == ["full", "quest", "quest-topp", "oracle", "streaming"]
    assert len(rows) == 3 * 2 * (1 + len(POLICIES))


@pytest.mark.parametrize("function", [report.format_table, lambda cells: report.plot_sweep(cells, "unused.png")])
def test_invalid_cells(function, cells):
    with pytest.raises(ValueError, match="no cells"):
        function([])
    broken = dict(cells[1])
    del broken["budget"]
    with pytest.raises(ValueError, match="'budget'"):
        function([cells[0], broken])
    with pytest.raises(ValueError, match="metric 'bleu'"):
        function([dict(cells[1], metric="bleu")])
    with pytest.raises(ValueError, match="no budget"):
        function([dict(cells[1], budget=None)])


def test_policy_variants_are_rows_and_lines_of_their_own(cells):
    variant = "quest-topp:min_budget=64"
    extra = [dict(cell, policy=variant, value=random.uniform(0.05, 1.0))
             for cell in cells if cell["policy"] == "quest-topp"]
    extra += [dict(cell, policy="quest:selection=q_head") for cell in cells if cell["policy"] == "quest"]
    rows = [line.split(" | ")[2] for line in report.format_table(cells + extra).splitlines()[2:]]
    assert rows[:7] == ["full", "quest", "quest:selection=q_head", "quest-topp", variant, "oracle", "streaming"]
    first_panel = [c for c in extra if (c["task"], c["length"], c["policy"]) == ("niah_single", 2048, variant)]
    line = lines_by_label(report._build_figure(cells + extra, None).axes[0])[variant + " (at mean tokens attended)"]
    assert list(zip(*line.get_data())) == sorted((c["mean_tokens_attended"], c["value"]) for c in first_panel)


def test_bytes_table_and_markdown():
    fraction = random.uniform(0.01, 0.5)
    cells = [
        dict(task="vt", length=4096, policy="full", budget=None, metric="accuracy", value=1.0, kv_bytes_fraction=1.0),
        dict(task="vt", length=4096, policy="quest", budget=64, metric="accuracy", value=0.5,
             kv_bytes_fraction=fraction),
        dict(task="vt", length=4096, policy="oracle", budget=64, metric="accuracy", value=0.7),  # an older cell
    ]
    lines = report.format_bytes_table(cells).splitlines()
    assert lines[2:] == ["| vt | 4096 | full | 100.0% |  |", f"| vt | 4096 | quest |  | {fraction:.1%} |",
                         "| vt | 4096 | oracle |  |  |"]
    document = {"model": "m", "runs": [], "spec": {}, "cells": cells}
    assert report.format_bytes_table(cells) in report.markdown(document)
    older = {**document, "cells": [{k: v for k, v in c.items() if k != "kv_bytes_fraction"} for c in cells]}
    assert "KV bytes" not in report.markdown(older)


def test_selection_rate_table_and_markdown():
    rate = random.uniform(0.1, 0.9)
    cells = [
        dict(task="ppl", length=4096, policy="full", budget=None, metric="ppl", value=3.0, selection_rate=None),
        dict(task="ppl", length=4096, policy="quest:selection_interval=8", budget=64, metric="ppl", value=3.5,
             selection_rate=rate),
        dict(task="ppl", length=4096, policy="quest:selection_interval=4", budget=64, metric="ppl", value=3.6),
    ]
    lines = report.format_selection_rate_table(cells).splitlines()
    assert lines[2:] == ["| ppl | 4096 | full |  |  |",
                         "| ppl | 4096 | quest:selection_interval=4 |  |  |",
                         f"| ppl | 4096 | quest:selection_interval=8 |  | {rate:.1%} |"]
    document = {"model": "m", "runs": [], "spec": {}, "cells": cells}
    assert "Selection rate:" in report.markdown(document)
    assert report.format_selection_rate_table(cells) in report.markdown(document)
    older = {**document, "cells": [{k: v for k, v in c.items() if k != "selection_rate"} for c in cells]}
    assert "Selection rate" not in report.markdown(older)


def test_a_results_file_of_the_removed_adaptive_reuse_still_reports():
    """Its policy strings (``quest:reselect_similarity=0.9:selection_interval=8``) are rows like any other."""
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks/results/eval-adaptive-qwen2.5-coder-1.5b-16k.json"
    document = json.loads(path.read_text())
    adaptive = {cell["policy"] for cell in document["cells"] if "reselect_similarity" in cell["policy"]}
    text = report.markdown(document)
    assert adaptive and all(f"| {policy} |" in text for policy in adaptive) and "Selection rate:" in text
