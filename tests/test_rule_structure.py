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


def tree_reads(source: str) -> list[int]:
    """Lines of ``source`` that reach a file's tree other than through :class:`RuleContext`'s
    accessors: ``semantic.of(...)``, ``ast.walk(...)`` or an attribute ``.tree``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "tree":
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Name) and (owner.id, node.func.attr) in {
                ("semantic", "of"),
                ("ast", "walk"),
            }:
                lines.append(node.lineno)
    return lines


def test_the_tree_check_sees_a_tree_read():
    assert tree_reads("names = semantic.of(ctx.tree).imports") == [1, 1]
    assert tree_reads("for node in ast.walk(tree):\n    pass") == [1]
    assert tree_reads("names = ctx.imports()\nline = ctx.first_comparison(names)") == []


@pytest.mark.parametrize("path", sorted(RULES.rglob("*.py")), ids=lambda p: str(p.relative_to(RULES)))
def test_rules_read_the_file_through_the_context(path: pathlib.Path):
    if path.relative_to(RULES) == pathlib.Path("site.py"):
        return  # RuleContext itself: its accessors ask the file's semantic model
    assert not tree_reads(path.read_text(encoding="utf-8")), (
        f"{path.name} reads the file's tree: ask the RuleContext's accessors (qualified_names, "
        "module_constant, imports, mentions, parent, enclosing, ...), in settle too (its ctx)"
    )
