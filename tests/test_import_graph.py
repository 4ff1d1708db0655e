"""The import graph of ``questkv`` has no cycle.

Every ``import`` and ``from ... import`` statement of every module counts, those inside functions too (a deferred
import hides a cycle, it does not remove it); those under ``if TYPE_CHECKING:`` do not (they never run). An import
points at the most specific module it names: ``from questkv.engine import llm`` at ``questkv.engine.llm``,
``from questkv.engine.engine_config import EngineConfig`` at ``questkv.engine.engine_config``; the parent packages
that Python imports on the way are not edges (every submodule would otherwise form a cycle with an ``__init__``
that imports it). ``importlib.import_module`` with a computed name is not followed. Run it as a script to print the
cycles.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Iterator

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "questkv"


def module_names(root: pathlib.Path = PACKAGE) -> dict[str, pathlib.Path]:
    """Every module of the package under ``root``: dotted name -> file (a package is its ``__init__.py``)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements under ``node``, in any function or class, skipping ``if TYPE_CHECKING:`` bodies (their
    ``else`` runs)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for statement in child.orelse:
                yield from _imports(ast.Module(body=[statement], type_ignores=[]))
        else:
            yield from _imports(child)


def imported_modules(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The modules of ``modules`` that module ``name`` (its source at ``path``) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for statement in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(statement, ast.Import):
            targets = [alias.name for alias in statement.names]
        else:
            base = statement.module or ""
            if statement.level:  # relative: from the package, up level - 1 packages
                anchor = package.split(".")[:len(package.split(".")) - statement.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # ``from a import b``: the submodule a.b when there is one, else a name defined in a
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in statement.names]
        for target in targets:
            while target and target not in modules:  # ``import a.b.c`` of a name below a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package modules it imports."""
    modules = module_names(root)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative), each sorted, each
    a set of modules that import each other through a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return sorted(components)


def describe(graph: dict[str, set[str]], component: list[str]) -> str:
    """One cycle's modules and the imports among them."""
    members = set(component)
    edges = [f"  {source} -> {target}" for source in component for target in sorted(graph[source] & members)]
    return "\n".join([", ".join(component)] + edges)


def test_the_cycle_finder_finds_a_cycle_and_an_import_inside_a_function(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from pkg.a import A\n")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n"
                                  "def f():\n    from .sub import b\nA = 1\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text("import pkg.a\n")
    (package / "c.py").write_text("from pkg.a import A\n")
    graph = import_graph(package)
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.sub.b"}, "pkg.sub": set(), "pkg.sub.b": {"pkg.a"},
                     "pkg.c": {"pkg.a"}}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b"]]


def test_questkv_has_no_import_cycle():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles among questkv modules:\n" + "\n".join(describe(graph, c) for c in found)


if __name__ == "__main__":
    GRAPH = import_graph()
    print("\n\n".join(describe(GRAPH, component) for component in cycles(GRAPH)) or "no import cycle")
