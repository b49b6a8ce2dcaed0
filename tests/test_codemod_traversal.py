"""Engine speed-ups inside the libcst pass must not change results: the statement and leaf
skipping of :class:`~flashport.rewriter.engine.transform.SiteTransformer` (compared with a full traversal)
and :class:`~flashport.rewriter.source.positions.LinePositionProvider` (compared with libcst's own
``PositionProvider``)."""

from __future__ import annotations

import pathlib
import textwrap

import libcst as cst
import pytest
from libcst.metadata import MetadataWrapper, PositionProvider

from flashport import rules as registry
from flashport.rewriter.engine import pipeline as engine
from flashport.rewriter.engine import transform
from flashport.rewriter.engine.pipeline import transform_source
from flashport.rewriter.source.positions import LinePositionProvider
from flashport.rules.base import RuleOptions

RULES = registry.all_rules()
ROOT = pathlib.Path(__file__).parent
FIXTURE_INPUTS = sorted((ROOT / "fixtures" / "codemod").glob("*/*.py"))
EXAMPLES = sorted((ROOT.parent / "examples").rglob("*.py"))

# Calls that carry no trigger text in their own statement: through a function-local import
# alias, a value alias of an import alias, an attribute alias and a dispatch table; plus a
# watched config string and an SDPA call through a module alias.
TRICKY = textwrap.dedent("""\
    import torch.nn.functional as F
    from flash_attn import flash_attn_func as fa


    def local(q, k, v):
        from flash_attn import flash_attn_varlen_func as fv
        x = q + 1
        y = fv(x, k, v, cu, cu, 4, 4)
        return y


    def value_alias(q, k, v):
        g = fa
        out = g(q, k, v, causal=True)
        return out


    class M:
        def __init__(self):
            self.fn = fa
            self.cfg = dict(attn_implementation="flash_attention_2")

        def forward(self, q, k, v):
            h = q * 2
            return self.fn(h, k, v)


    TABLE = {"fa": fa}


    def dispatch(q, k, v):
        z = TABLE["fa"]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True), z
    """)


def _full_traversal(monkeypatch, data: bytes, path: str):
    """The engine with every node visited (no statement or leaf skipping)."""
    with monkeypatch.context() as patch:
        patch.setattr(engine, "_relevant_pattern", lambda *args: None)
        patch.setattr(transform, "_NO_SITES", frozenset())
        return transform_source(data, path, RULES, RuleOptions())


def _same(a, b) -> None:
    assert (a.status, a.sites, a.new, a.error, a.imports_added, a.imports_removed) == (
        b.status,
        b.sites,
        b.new,
        b.error,
        b.imports_added,
        b.imports_removed,
    )


@pytest.mark.parametrize("path", FIXTURE_INPUTS + EXAMPLES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_skipping_statements_changes_nothing_on_fixtures_and_examples(monkeypatch, path):
    data = path.read_bytes()
    _same(
        transform_source(data, str(path), RULES, RuleOptions()), _full_traversal(monkeypatch, data, str(path))
    )


def test_skipping_statements_keeps_calls_through_aliases_and_watched_strings(monkeypatch):
    data = TRICKY.encode()
    skipped = transform_source(data, "m.py", RULES, RuleOptions())
    full = _full_traversal(monkeypatch, data, "m.py")
    _same(skipped, full)
    lines = {s.line for s in skipped.sites}
    # statements without trigger text that hold sites: fv(...), g(...), the watched string
    assert {8, 14, 21} <= lines, sorted(lines)


def test_relevant_pattern_names_what_calls_go_through():
    tree = engine.ast.parse(TRICKY)
    units = engine.src.top_level_units(tree)
    text_pattern, _ = engine._site_pattern(tree, units, [u for u in units if u.importish], RULES)
    relevant = engine._relevant_pattern(tree, text_pattern, RULES)
    for mention in ("y = fv(x, k, v)", "out = g(q)", "self.fn(h)", '"flash_attention_2"', "fa"):
        assert relevant.search(mention), mention
    for unrelated in ("x = q + 1", "h = q * 2", "return y", "gfv = 1"):
        assert not relevant.search(unrelated), unrelated


@pytest.mark.parametrize("path", FIXTURE_INPUTS[:12] + [ROOT / "test_codemod_traversal.py"], ids=str)
def test_line_positions_equal_libcst_positions(path):
    module = cst.parse_module(path.read_text())
    ours = MetadataWrapper(module, unsafe_skip_copy=True).resolve(LinePositionProvider)
    theirs = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    assert ours.keys() == theirs.keys()
    for node, span in theirs.items():
        assert ours[node] == ((span.start.line, span.start.column), (span.end.line, span.end.column))
