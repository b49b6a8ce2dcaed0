"""The product's module import graph, read from source: which modules each module imports when it
is executed, the package-dir map of pyproject.toml applied (``rewriter/`` is ``flashport.rewriter``...),
and the import cycles in it."""

from __future__ import annotations

import ast
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def product_modules() -> dict[str, pathlib.Path]:
    """Every module of the installed package, dotted name -> file, from pyproject's package-dir map."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    files: dict[str, pathlib.Path] = {}
    for package, folder in config["tool"]["setuptools"]["package-dir"].items():
        base = ROOT / folder
        for path in base.rglob("*.py"):
            parts = path.relative_to(base).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join((package, *parts))] = path
    return files


def import_graph(files: dict[str, pathlib.Path], *, everywhere: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of ``files`` it imports at module level (``everywhere``: in functions
    too)."""
    known = set(files)
    return {
        name: module_imports(path, name, known, everywhere=everywhere) - {name}
        for name, path in files.items()
    }


def module_imports(path: pathlib.Path, name: str, known: set[str], *, everywhere: bool = False) -> set[str]:
    """The modules of ``known`` that module ``name`` (file ``path``) imports when it is executed: its
    module-level imports (not those in functions, nor under ``if TYPE_CHECKING``; ``everywhere``:
    every import statement of the file). ``from pkg import sub`` counts as importing the submodule
    ``pkg.sub`` only; ``from pkg import name`` as ``pkg``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    module = f"{base}.{node.module}" if node.module else base
                else:
                    module = node.module or ""
                for alias in node.names:
                    found.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module)
            elif isinstance(node, ast.If):
                test = node.test
                if not (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)

    tree = ast.parse(path.read_text(encoding="utf-8"))
    if everywhere:
        visit([node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))])
    else:
        visit(tree.body)
    return found & known


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module, or one that imports
    itself (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return cycles
