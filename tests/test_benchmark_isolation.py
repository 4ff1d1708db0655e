"""Benchmark scripts cannot shadow installed packages, and a test that changes ``sys.path`` fails.

``python benchmarks/NAME.py`` puts ``benchmarks/`` first on ``sys.path``, so every script there is importable by its
bare name to all the code that process runs: transformers 5.25 probes the ``kernels`` package when it builds a
model, and imported ``benchmarks/kernels.py`` (now ``kernels_bench.py``) instead.
"""

import importlib.util
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

# PyPI projects whose names benchmark scripts had (``pip index versions NAME`` lists them); the ``NAME_bench``
# names that replaced them were looked up the same way and are not on PyPI.
PYPI_PROJECTS = {"e2e", "kernels", "linear", "memory", "soak"}


def test_no_benchmark_script_is_named_like_an_importable_module_or_a_pypi_project():
    names = sorted(path.stem for path in BENCHMARKS.glob("*.py"))
    assert names, f"no scripts found in {BENCHMARKS}"
    importable = {name: spec.origin for name in names if (spec := importlib.util.find_spec(name)) is not None}
    assert importable == {}, f"benchmark scripts named like modules this process can import: {importable}"
    assert PYPI_PROJECTS.isdisjoint(names)


def test_a_test_module_or_a_test_that_changes_sys_path_fails(pytester):
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(
        test_leaks_on_import="import sys\nsys.path.insert(0, 'somewhere')\n\n\ndef test_nothing():\n    pass\n",
        test_leaks_in_a_test="import sys\n\n\ndef test_appends():\n    sys.path.append('elsewhere')\n\n\n"
                             "def test_prepends_for_itself(monkeypatch, tmp_path):\n"
                             "    monkeypatch.syspath_prepend(tmp_path)\n",
    )
    result = pytester.runpytest("--import-mode=importlib", "--continue-on-collection-errors", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=2)
    out = result.stdout.str()
    assert "test_leaks_on_import.py changed sys.path (added ['somewhere'], removed [])" in out
    assert "test_leaks_in_a_test.py::test_appends changed sys.path (added ['elsewhere'], removed [])" in out
