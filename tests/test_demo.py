import json

import pytest

from questkv.cli import main


def test_demo_finds_the_planted_pages_and_full_budget_is_exact(tmp_path, capsys):
    path = tmp_path / "demo.json"
    assert main(["demo", "--context", "1024", "--budgets", "256,full", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())
    sparse, full = rows
    assert full["budget"] is None and full["rel_error_vs_dense"] == 0.0
    assert sparse["kv_read"] == 0.25 and sparse["attention_mass"] > 0.9
    assert "budget" in capsys.readouterr().out


def test_bad_budget_is_rejected(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["demo", "--budgets", "64,abc"])
    assert exit.value.code == 2
    assert "budget 'abc' is not a positive integer or 'full'" in capsys.readouterr().err
