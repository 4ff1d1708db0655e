"""Reports of an evaluation sweep: a PNG plot and a markdown table of its cells.

A sweep evaluates tasks × context lengths × KV-selection policies × token budgets; each result is
one cell, a dict with at least these keys (extra keys are ignored):

========================  ========================================================================
key                       meaning
========================  ========================================================================
``task``                  task name, e.g. ``"niah_single"``, or ``"ppl"`` for perplexity
``length``                context length in tokens
``policy``                KV-selection policy, e.g. ``"quest"``; ``"full"`` is dense attention
``budget``                token budget (``None`` for ``"full"``); the cap for ``"quest-topp"``
``metric``                ``"accuracy"`` (a fraction in [0, 1]), ``"ppl"`` (lower is better) or
                          ``"agreement"`` (a fraction in [0, 1]: top-1 agreement with dense)
``value``                 mean score over the samples, the perplexity, or the agreement
``mean_tokens_attended``  optional: mean tokens attended per decode step (``None`` for ``"full"``)
``kv_bytes_fraction``     optional: KV bytes one decode step reads, over full attention's
``selection_rate``        optional (engine): fraction of (decode step, sparse layer, head) that selected pages
``backend``               optional: ``"engine"`` or ``"hf"`` (cells without it: ``"hf"``)
``ppl``                   optional, agreement cells: the perplexity of dense's tokens
========================  ========================================================================

A policy may be a policy string with options (``"quest:selection=q_head"``, see
:func:`questkv.eval.harness.parse_policy`): each string is its own row and line, and sorts after
its base policy. ``"quest-topp"`` (with options or not) picks its budget per step, below its cap:
the plot puts its points at its ``mean_tokens_attended`` and the table appends that mean in
parentheses. Agreement reads as a percentage with one decimal (``"97.7%"``). :func:`markdown` adds the
backend of each policy, a table of the agreement cells' perplexities when there are any, the KV bytes
per step as a share of full attention (:func:`format_bytes_table`), to compare settings at equal bytes, and the
selection rates (:func:`format_selection_rate_table`), how often each setting selected pages (selection reuse
lowers it).
"""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # matplotlib is imported when a plot is drawn: tables need no plotting library
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

REQUIRED_KEYS = ("task", "length", "policy", "budget", "metric", "value")
METRICS = ("accuracy", "ppl", "agreement")
FULL = "full"
ADAPTIVE = "quest-topp"
ADAPTIVE_SUFFIX = " (at mean tokens attended)"
POLICY_ORDER = (FULL, "quest", ADAPTIVE, "oracle")
POLICY_COLORS = {
    "quest": "tab:blue",
    ADAPTIVE: "tab:cyan",
    "oracle": "tab:green",
    "streaming": "tab:orange",
    "h2o": "tab:red",
    "tova": "tab:purple",
    # selection reuse every C steps: blues darkening with C, beside plain Quest's
    "quest:selection_interval=2": "#4f8fd0",
    "quest:selection_interval=4": "#2a5f9e",
    "quest:selection_interval=8": "#123a6b",
    "quest:selection_interval=16": "#071d3a",
}
OTHER_COLORS = ("tab:brown", "tab:pink", "tab:olive", "darkblue", "darkgoldenrod", "teal")
FULL_COLOR = "tab:gray"
PPL_LABEL = "perplexity (lower is better)"
AGREEMENT_LABEL = "top-1 agreement with dense"
COLUMNS = 4
PANEL_SIZE = (4.0, 3.2)
DPI = 120


def plot_sweep(cells: Sequence[dict], path: str | Path, title: str | None = None) -> Path:
    """Plot score against token budget, one panel per (task, length), and save it as a PNG.

    Each policy is one line (``"quest-topp"`` at its mean tokens attended); ``"full"`` is a dashed
    horizontal line at its value. Panels are ordered by task (first seen) then length, 4 per row.

    Args:
        cells: sweep cells (see the module docstring).
        path: the PNG file to write (always PNG, whatever the suffix); parent dirs are created.
        title: optional figure title.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: if ``cells`` is empty or a cell is malformed.
    """
    figure = _build_figure(cells, title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=DPI)
    return path


def format_table(cells: Sequence[dict]) -> str:
    """A markdown table of the sweep: one row per (task, length, policy), one column per budget.

    Rows are ordered by task (first seen), length, then policy (full, quest, quest-topp, oracle,
    the rest alphabetically). The ``"full"`` row fills only the ``full`` column; other rows fill
    the budget columns (ascending). Accuracy reads as a whole percentage (``"90%"``), perplexity
    with 2 decimals; ``"quest-topp"`` appends its mean tokens attended (``"90% (112)"``). Missing
    cells are empty.

    Args:
        cells: sweep cells (see the module docstring).

    Returns:
        The table, one line per row, without a trailing newline.

    Raises:
        ValueError: if ``cells`` is empty or a cell is malformed.
    """
    return _table(cells, _format_cell)


def format_bytes_table(cells: Sequence[dict]) -> str:
    """:func:`format_table`'s grid holding each cell's ``kv_bytes_fraction`` as a percentage with
    one decimal (``"6.3%"``; empty for a cell without it)."""
    def text_of(cell: dict) -> str:
        fraction = cell.get("kv_bytes_fraction")
        return "" if fraction is None else f"{fraction:.1%}"

    return _table(cells, text_of)


def format_selection_rate_table(cells: Sequence[dict]) -> str:
    """:func:`format_table`'s grid holding each cell's ``selection_rate`` as a percentage with one decimal
    (``"26.3%"``; empty for a cell without it)."""
    def text_of(cell: dict) -> str:
        rate = cell.get("selection_rate")
        return "" if rate is None else f"{rate:.1%}"

    return _table(cells, text_of)


def _table(cells: Sequence[dict], text_of) -> str:
    """The markdown grid of :func:`format_table`, each cell written by ``text_of(cell)``."""
    _validate(cells)
    budgets = sorted({cell["budget"] for cell in cells if cell["policy"] != FULL})
    table: dict[tuple, dict] = {}
    for cell in cells:
        column = FULL if cell["policy"] == FULL else cell["budget"]
        table.setdefault((cell["task"], cell["length"], cell["policy"]), {})[column] = text_of(cell)
    tasks = _first_seen(cell["task"] for cell in cells)
    rows = sorted(table, key=lambda row: (tasks.index(row[0]), row[1], _policy_key(row[2])))
    header = ["task", "length", "policy", FULL, *map(str, budgets)]
    lines = [_markdown_row(header), _markdown_row(["---"] * 3 + ["---:"] * (len(header) - 3))]
    for row in rows:
        values = table[row]
        lines.append(_markdown_row([*map(str, row), *(values.get(column, "") for column in [FULL, *budgets])]))
    return "\n".join(lines)


def _build_figure(cells: Sequence[dict], title: str | None) -> Figure:
    """The sweep figure (not saved); see :func:`plot_sweep`."""
    _validate(cells)
    panels: dict[tuple, list[dict]] = {}
    for cell in cells:
        panels.setdefault((cell["task"], cell["length"]), []).append(cell)
    tasks = _first_seen(cell["task"] for cell in cells)
    keys = sorted(panels, key=lambda key: (tasks.index(key[0]), key[1]))
    columns = min(len(keys), COLUMNS)
    rows = -(-len(keys) // columns)
    from matplotlib.figure import Figure

    figure = Figure(figsize=(PANEL_SIZE[0] * columns, PANEL_SIZE[1] * rows), layout="constrained")
    legend: dict[str, Line2D] = {}
    for index, (task, length) in enumerate(keys):
        axes = figure.add_subplot(rows, columns, index + 1)
        legend.update(_draw_panel(axes, task, length, panels[(task, length)]))
    labels = sorted(legend, key=lambda label: _policy_key(label.removesuffix(ADAPTIVE_SUFFIX)))
    figure.legend([legend[label] for label in labels], labels, loc="outside right upper")
    if title:
        figure.suptitle(title)
    return figure


def _draw_panel(axes, task: str, length: int, cells: list[dict]) -> dict[str, Line2D]:
    """Draw one (task, length) panel on ``axes``; returns its lines by legend label."""
    lines: dict[str, Line2D] = {}
    by_policy: dict[str, list[dict]] = {}
    for cell in cells:
        by_policy.setdefault(cell["policy"], []).append(cell)
    for policy in sorted(by_policy, key=_policy_key):
        if policy == FULL:
            for cell in by_policy[policy]:
                lines[FULL] = axes.axhline(cell["value"], color=FULL_COLOR, linestyle="--", label=FULL)
            continue
        points = sorted((_plot_x(cell), cell["value"]) for cell in by_policy[policy])
        label = policy + ADAPTIVE_SUFFIX if _base(policy) == ADAPTIVE else policy
        (lines[label],) = axes.plot(*zip(*points), marker="o", color=_policy_color(policy), label=label)
    budgets = sorted({cell["budget"] for cell in cells if cell["policy"] != FULL})
    axes.set_xscale("log", base=2)
    if budgets:
        axes.set_xticks(budgets, labels=[str(int(budget)) for budget in budgets])
    from matplotlib.ticker import NullLocator

    axes.xaxis.set_minor_locator(NullLocator())
    axes.set_xlabel("token budget")
    if cells[0]["metric"] == "ppl":
        axes.set_ylabel(PPL_LABEL)
    else:
        axes.set_ylabel(AGREEMENT_LABEL if cells[0]["metric"] == "agreement" else "accuracy")
        axes.set_ylim(0, 1.05)
    axes.set_title(f"{task} @ {_length_label(length)}")
    axes.grid(alpha=0.3)
    return lines


def _validate(cells: Sequence[dict]) -> None:
    """Raise ValueError if ``cells`` is empty or a cell lacks a key, has an unknown metric, or
    (other than ``"full"``) has no budget."""
    if not cells:
        raise ValueError("no cells to report")
    for index, cell in enumerate(cells):
        missing = [key for key in REQUIRED_KEYS if key not in cell]
        if missing:
            raise ValueError(f"cell {index} lacks required key(s) {', '.join(map(repr, missing))}: {cell}")
        if cell["metric"] not in METRICS:
            raise ValueError(f"cell {index} has metric {cell['metric']!r}, expected one of {METRICS}")
        if cell["policy"] != FULL and cell["budget"] is None:
            raise ValueError(f"cell {index} of policy {cell['policy']!r} has no budget")


def _format_cell(cell: dict) -> str:
    """A cell's value as text: accuracy as ``"90%"``, perplexity as ``"12.34"``, plus the mean
    tokens attended in parentheses for ``"quest-topp"``."""
    metric = cell["metric"]
    text = f"{cell['value']:.0%}" if metric == "accuracy" else f"{cell['value']:.1%}" if metric == "agreement" else (
        f"{cell['value']:.2f}")
    used = cell.get("mean_tokens_attended")
    if _base(cell["policy"]) == ADAPTIVE and used is not None:
        text += f" ({round(used)})"
    return text


def _plot_x(cell: dict) -> float:
    """Where a cell sits on the budget axis: its budget, or for ``"quest-topp"`` its mean tokens
    attended (its budget when that is unknown)."""
    used = cell.get("mean_tokens_attended")
    return used if _base(cell["policy"]) == ADAPTIVE and used is not None else cell["budget"]


def _policy_key(policy: str) -> tuple:
    """Sort key of a policy string: by its base policy (full, quest, quest-topp, oracle, then the
    rest alphabetically), then the plain name before its variants, the variants alphabetically."""
    base = _base(policy)
    natural = tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", policy))
    return (0, POLICY_ORDER.index(base), natural) if base in POLICY_ORDER else (1, 0, natural)


def _base(policy: str) -> str:
    """The policy name of a policy string: ``"quest:selection=q_head"`` -> ``"quest"``."""
    return policy.split(":")[0]


def _policy_color(policy: str) -> str:
    """A fixed colour per policy name, the same in every panel and plot (unknown names are
    hashed onto a spare palette)."""
    return POLICY_COLORS.get(policy) or OTHER_COLORS[zlib.crc32(policy.encode()) % len(OTHER_COLORS)]


def _length_label(length: int) -> str:
    """``4096`` → ``"4k"``; a length not a multiple of 1024 stays as is."""
    return f"{length // 1024}k" if length % 1024 == 0 else str(length)


def _first_seen(values) -> list:
    """``values`` without repeats, in first-seen order."""
    return list(dict.fromkeys(values))


def _markdown_row(values: Sequence[str]) -> str:
    """One markdown table row."""
    return "| " + " | ".join(values) + " |"


def markdown(document: dict, plot_name: str | None = None) -> str:
    """A sweep document (:func:`questkv.eval.sweep.document`) as markdown: the provenance of every
    run that produced cells, the settings, the plot (if ``plot_name``) and :func:`format_table`."""
    lines = [f"# questkv eval: {document['model']}", ""]
    for index, run in enumerate(document["runs"]):
        cells = sum(1 for cell in document["cells"] if cell.get("run") == index)
        lines.append(f"Run {index} ({cells} cells):")
        lines += [f"- {key}: `{value}`" for key, value in run.items()]
        lines.append("")
    lines += [f"Settings: `{json.dumps(document['spec'])}`", ""]
    if document.get("text"):
        lines += [f"Text (ppl): `{json.dumps(document['text'])}`", ""]
    for task, record in (document.get("agreement_texts") or {}).items():
        lines += [f"Text ({task}): `{json.dumps(record)}`", ""]
    backends: dict[str, list[str]] = {}
    for cell in document["cells"]:
        backends.setdefault(cell.get("backend", "hf"), [])
        if cell["policy"] not in backends[cell.get("backend", "hf")]:
            backends[cell.get("backend", "hf")].append(cell["policy"])
    lines += ["Backend: " + "; ".join(f"{name} ({', '.join(sorted(policies, key=_policy_key))})"
                                      for name, policies in sorted(backends.items())), ""]
    if plot_name:
        lines += [f"![accuracy and perplexity by token budget]({plot_name})", ""]
    lines.append(format_table(document["cells"]))
    agreeing = [cell for cell in document["cells"] if cell["metric"] == "agreement" and cell.get("ppl") is not None]
    if agreeing:
        lines += ["", "Perplexity of dense's greedy tokens under each setting (agreement tasks):", "",
                  _table(agreeing, lambda cell: f"{cell['ppl']:.3f}")]
    if any(cell.get("kv_bytes_fraction") is not None for cell in document["cells"]):
        lines += ["", "KV bytes one decode step reads per sequence, all layers, as a share of full attention "
                  "(questkv.policies.cost at each cell's length, with its mean tokens attended):", "",
                  format_bytes_table(document["cells"])]
    if any(cell.get("selection_rate") is not None for cell in document["cells"]):
        lines += ["", "Selection rate: the share of (decode step, sparse layer, head) that estimated and selected "
                  "pages (engine; selection reuse lowers it):", "",
                  format_selection_rate_table(document["cells"])]
    return "\n".join(lines + [""])
