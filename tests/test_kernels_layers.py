"""The layers of ``flashport.kernels`` import downwards only: no import cycle, counting imports inside
functions, and no module the backends load reaches the contract's entry points.

Edges come from ``ast`` (every ``import`` statement, module level or not); ``from pkg import sub``
counts as importing the submodule ``pkg.sub`` only.
"""

from __future__ import annotations

import ast
from pathlib import Path

from flashport.kernels.contract import registry

KERNELS = Path(registry.__file__).resolve().parents[1]
PACKAGE = "flashport.kernels"
# The contract's entry points: they route to the ring and dispatch, so nothing below may import them.
ENTRY_POINTS = {f"{PACKAGE}.contract.api", f"{PACKAGE}.contract.backward", f"{PACKAGE}.contract.varlen"}


def module_files() -> dict[str, tuple[Path, bool]]:
    """``{module name: (file, is_package)}`` for every module of ``flashport.kernels``."""
    out = {}
    for path in KERNELS.rglob("*.py"):
        parts = list(path.relative_to(KERNELS).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        name = ".".join([PACKAGE, *parts[:-1]] if is_package else [PACKAGE, *parts])
        out[name] = (path, is_package)
    return out


def import_graph() -> dict[str, set[str]]:
    """``{module: modules of flashport.kernels it imports}``."""
    modules = module_files()
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in modules:
                        edges.add(sub)
                    elif target in modules:
                        edges.add(target)
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
                    found.append(sorted(component))
    return found


def reachable(graph: dict[str, set[str]], roots) -> set[str]:
    """Every module ``roots`` import, directly or not (roots included)."""
    seen, todo = set(), list(roots)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph.get(module, ()))
    return seen


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e2"}, "e2": set()}
    assert cycles(graph) == [["a", "b", "c"]]


def test_flashport_kernels_has_no_import_cycle():
    graph = import_graph()
    assert f"{PACKAGE}.contract.api" in graph and len(graph) > 40
    assert cycles(graph) == []


def test_backends_never_reach_the_contract_entry_points():
    graph = import_graph()
    backends = [m for m in registry.BACKEND_MODULES if m in graph]
    assert len(backends) == len(registry.BACKEND_MODULES)
    assert not reachable(graph, backends) & ENTRY_POINTS


def test_semantics_import_only_semantics_and_the_spec():
    graph = import_graph()
    allowed = f"{PACKAGE}.contract.spec"
    for module, edges in graph.items():
        if module.startswith(f"{PACKAGE}.semantics."):
            outside = {e for e in edges if not e.startswith(f"{PACKAGE}.semantics")} - {allowed}
            assert not outside, (module, outside)
