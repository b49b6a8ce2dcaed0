"""The layers of ``flashport.kernels`` import downwards only: no import cycle, counting imports inside
functions, and no module the backends load reaches the contract's entry points.

Edges come from ``ast`` (every ``import`` statement, module level or not); ``from pkg import sub``
counts as importing the submodule ``pkg.sub`` only.
"""

from __future__ import annotations

from import_graph import import_cycles, import_graph, product_modules

from flashport.kernels.contract import registry

PACKAGE = "flashport.kernels"
# The contract's entry points: they route to the ring and dispatch, so nothing below may import them.
ENTRY_POINTS = {f"{PACKAGE}.contract.api", f"{PACKAGE}.contract.backward", f"{PACKAGE}.contract.varlen"}


def kernels_graph() -> dict[str, set[str]]:
    """``{module: modules of flashport.kernels it imports}``, imports inside functions included."""
    files = {
        name: path
        for name, path in product_modules().items()
        if name == PACKAGE or name.startswith(f"{PACKAGE}.")
    }
    return import_graph(files, everywhere=True)


def reachable(graph: dict[str, set[str]], roots) -> set[str]:
    """Every module ``roots`` import, directly or not (roots included)."""
    seen, todo = set(), list(roots)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph.get(module, ()))
    return seen


def test_flashport_kernels_has_no_import_cycle():
    graph = kernels_graph()
    assert f"{PACKAGE}.contract.api" in graph and len(graph) > 40
    assert import_cycles(graph) == []


def test_backends_never_reach_the_contract_entry_points():
    graph = kernels_graph()
    backends = [m for m in registry.BACKEND_MODULES if m in graph]
    assert len(backends) == len(registry.BACKEND_MODULES)
    assert not reachable(graph, backends) & ENTRY_POINTS


def test_semantics_import_only_semantics_and_the_spec():
    graph = kernels_graph()
    allowed = f"{PACKAGE}.contract.spec"
    for module, edges in graph.items():
        if module.startswith(f"{PACKAGE}.semantics."):
            outside = {e for e in edges if not e.startswith(f"{PACKAGE}.semantics")} - {allowed}
            assert not outside, (module, outside)
