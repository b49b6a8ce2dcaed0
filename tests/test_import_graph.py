"""The product's import structure: no module-level import cycle anywhere in the package, and the
codemod's layers import downward only (app -> engine -> imports -> source), the fusion pass apart."""

from __future__ import annotations

from import_graph import import_cycles, import_graph, product_modules

LAYERS = ("app", "engine", "imports", "source")  # flashport.rewriter's stack, top to bottom


def test_the_cycle_check_sees_a_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"a"}}) == [["a"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_reads_the_package_dir_map():
    graph = import_graph(product_modules())
    assert "flashport.rules.base" in graph and "flashport.kernels" in graph
    assert graph.get("flashport.rewriter.app.cli")
    assert not any(name.startswith(("rewriter.", "rules.", "kernels.")) for name in graph)


def test_no_import_cycle_in_the_product():
    cycles = import_cycles(import_graph(product_modules()))
    assert cycles == [], "module-level import cycles (move the shared part to a lower module):\n" + "\n".join(
        " <-> ".join(cycle) for cycle in cycles
    )


def layer(module: str) -> int | None:
    """The position of ``module``'s layer in :data:`LAYERS`, or None outside them."""
    parts = module.split(".")
    if parts[:2] == ["flashport", "rewriter"] and len(parts) > 2 and parts[2] in LAYERS:
        return LAYERS.index(parts[2])
    return None


def test_codemod_layers_import_downward_only():
    graph = import_graph(product_modules())
    upward = [
        f"{module} -> {other}"
        for module, imported in sorted(graph.items())
        for other in sorted(imported)
        if layer(module) is not None and layer(other) is not None and layer(other) < layer(module)
    ]
    assert upward == []
    fusion = [
        m
        for m, imported in graph.items()
        if m.startswith("flashport.fusion")
        for o in imported
        if o.startswith("flashport.rewriter")
    ]
    assert fusion == []
