"""Structure of the rule package: no rule module imports another rule module.

A decision that depends on another rule's sites is made in the engine's per-file phase from those
sites' final statuses (``Rule.settle``, ``Rewrite.requires``), never by importing the other rule and
asking it; what rules share lives in helper modules: the family's own (``rules/torch/selector_body.py``)
or, across families, ``rules/common/``.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

RULES = pathlib.Path(__file__).resolve().parent.parent / "rules"
RULE_MODULES = sorted(RULES.glob("*/fpa*.py"))


def rule_imports(source: str) -> set[str]:
    """The rule modules (``fpa*`` stems) that ``source`` imports, in any spelling: ``import
    flashport.rules.family.fpaX``, ``from flashport.rules.family.fpaX import ...``, ``from
    flashport.rules.family import fpaX``, ``from . import fpaX``, ``from .fpaX import ...``,
    ``from ..family.fpaX import ...``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[:2] == ["flashport", "rules"]:
                    found.update(parts[2:])
        elif isinstance(node, ast.ImportFrom):
            module = node.module.split(".") if node.module else []
            if node.level == 0 and module[:2] == ["flashport", "rules"]:
                inner = module[2:]
            elif node.level >= 1:
                inner = module
            else:
                continue
            found.update(inner)
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("fpa")}


def test_the_check_sees_every_spelling():
    sources = {
        "import flashport.rules.torch.fpa101_torch_sdpa": {"fpa101_torch_sdpa"},
        "from flashport.rules.torch.fpa101_torch_sdpa import TorchSDPA": {"fpa101_torch_sdpa"},
        "from flashport.rules.torch import fpa101_torch_sdpa, selector_body": {"fpa101_torch_sdpa"},
        "from ..flash_attn.fpa001_flash_attn_func import KEYWORDS": {"fpa001_flash_attn_func"},
        "from . import fpa010_fa3_flash_attn_func": {"fpa010_fa3_flash_attn_func"},
        "from .fpa013_fa4_flash_attn_func import KEYWORDS": {"fpa013_fa4_flash_attn_func"},
        "def f():\n    from flashport.rules.flash_attn.fpa007_flash_attn_with_kvcache import X": {
            "fpa007_flash_attn_with_kvcache"
        },
        "from flashport.rules.flash_attn import fa3_fa4": set(),
        "from flashport.rules import base": set(),
        "from flashport.rules.torch.selector_body import neutral_selector": set(),
    }
    for source, expected in sources.items():
        assert rule_imports(source) == expected, source


def test_rule_modules_are_found():
    assert len(RULE_MODULES) > 30
    assert RULES / "torch" / "fpa102_sdpa_backend_selector.py" in RULE_MODULES


def test_discovery_finds_every_rule_module():
    from flashport.rules import rule_modules

    on_disk = {f"flashport.rules.{p.parent.name}.{p.stem}" for p in RULE_MODULES}
    assert set(rule_modules()) == on_disk


@pytest.mark.parametrize("path", RULE_MODULES, ids=lambda p: p.stem)
def test_no_rule_module_imports_another(path: pathlib.Path):
    imported = rule_imports(path.read_text(encoding="utf-8")) - {path.stem}
    assert not imported, (
        f"{path.name} imports rule module(s) {sorted(imported)}: move what they share into a "
        "helper module of the family (or rules/common/ across families), and make decisions that depend on another rule's sites in the "
        "engine's per-file phase (Rule.settle, Rewrite.requires)"
    )


def module_imports(path: pathlib.Path, name: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` (file ``path``) imports when it is executed: its
    module-level imports (not those in functions, nor under ``if TYPE_CHECKING``). ``from pkg import
    sub`` counts as importing the submodule ``pkg.sub`` only; ``from pkg import name`` as ``pkg``."""
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

    visit(ast.parse(path.read_text(encoding="utf-8")).body)
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


def test_the_cycle_check_sees_a_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_rules_package():
    files = {}
    for path in RULES.rglob("*.py"):
        parts = path.relative_to(RULES).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(("flashport", "rules", *parts))] = path
    graph = {name: module_imports(path, name, set(files)) - {name} for name, path in files.items()}
    assert graph["flashport.rules.base"]  # the check reads the imports
    assert import_cycles(graph) == []


def builds_refusal(source: str) -> bool:
    """Whether ``source`` calls ``Refusal(...)`` (by name or as an attribute)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = (
                func.id
                if isinstance(func, ast.Name)
                else func.attr
                if isinstance(func, ast.Attribute)
                else ""
            )
            if name == "Refusal":
                return True
    return False


def test_the_refusal_check_sees_a_refusal():
    assert builds_refusal("def f():\n    return Refusal('no')")
    assert builds_refusal("return_value = base.Refusal(reason)")
    assert not builds_refusal("raise Refuse('no')")


@pytest.mark.parametrize("path", sorted(RULES.rglob("*.py")), ids=lambda p: str(p.relative_to(RULES)))
def test_rules_refuse_one_way(path: pathlib.Path):
    if path.relative_to(RULES) == pathlib.Path("site.py"):
        return  # where Refusal is defined
    assert not builds_refusal(path.read_text(encoding="utf-8")), (
        f"{path.name} builds a Refusal: refuse with `raise Refuse(reason)` (flashport.rules.base), the "
        "one way a rule or a helper refuses; the engine records the Refusal"
    )
