"""The package's imports go one way: no two modules of ``bigmem_train`` import each other, directly or
through others, counting imports inside functions too (a deferred import hides a circle, it does not
remove it)."""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "src"


def module_files(source: Path) -> dict[str, Path]:
    modules = {}
    for path in source.rglob("*.py"):
        name = ".".join(path.relative_to(source).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                member = f"{base}.{alias.name}"
                found.add(member if member in modules else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {module for module in found if module in modules and module != name}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_finds_a_circle_through_a_deferred_import(tmp_path):
    package = tmp_path / "bigmem_train"
    (package / "verdict").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "verdict" / "__init__.py").write_text("")
    (package / "verdict" / "report.py").write_text("from bigmem_train.verdict.tables import table\n")
    (package / "verdict" / "tables.py").write_text(
        "def table():\n    from bigmem_train.verdict import report\n"
    )
    modules = module_files(tmp_path)
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert circles(graph) == [["bigmem_train.verdict.report", "bigmem_train.verdict.tables"]]


def test_no_import_circles():
    modules = module_files(SOURCE)
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert "bigmem_train.verdict.report" in graph  # the walk found the package
    assert circles(graph) == []
