"""The engine's shortcuts around libcst's whole-module analyses must give libcst's answers:
:class:`~flashport.rewriter.source.semantic.HeaderNames` (the semantic model's qualified names from the imports) against libcst's
scope analysis (what ``QualifiedNameProvider`` returns), and :func:`~flashport.rewriter.source.pieces.parse` (piece by piece) against
``cst.parse_module`` of the whole text."""

from __future__ import annotations

import ast
import pathlib
import textwrap

import libcst as cst
import pytest
from libcst.helpers import get_full_name_for_node
from libcst.metadata import MetadataWrapper, ScopeProvider

from flashport import rules as registry
from flashport.rewriter.engine import pipeline as engine
from flashport.rewriter.source import pieces, semantic

RULES = registry.all_rules()
ROOT = pathlib.Path(__file__).parent
FIXTURE_INPUTS = sorted((ROOT / "fixtures" / "codemod").glob("*/*.py"))
PARSE = pieces.parse
SOURCES = sorted({s for rule in RULES for s in rule.SOURCES} | {"pkg.mod.fn", "rel.fn", "Holder.fn"})

# Header imports first (the leading import lines; the try block in "fallback"), then the chunks.
SHAPES = {
    "plain": """
        from flash_attn import flash_attn_func
        import torch.nn.functional as F
        import torch
        out = flash_attn_func(q, k, v)
        o2 = F.scaled_dot_product_attention(q, k, v)
        o3 = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        o4 = torch.nn.functional(q).scaled_dot_product_attention
        def f(q):
            return [flash_attn_func(x, x, x) for x in q], len(q), print
    """,
    "aliases_and_dotted": """
        from flash_attn import flash_attn_func as fa, flash_attn_varlen_func
        import flash_attn.flash_attn_interface as fai
        import pkg.mod
        from . import rel
        from .rel import fn as rfn
        y = fa(q) + fai.flash_attn_func(q) + pkg.mod.fn(q) + pkg.mod + pkg + rel.fn() + rfn()
        z = fai(q).flash_attn_func + flash_attn_varlen_func
    """,
    "shadowed": """
        from flash_attn import flash_attn_func
        def f(flash_attn_func, q):
            return flash_attn_func(q)
        class Holder:
            def fn(self):
                return flash_attn_func(self)
            flash_attn_func = None
            g = flash_attn_func
        def h():
            global flash_attn_func
            flash_attn_func = None
        lam = lambda fn: fn(q)
        w = Holder.fn
    """,
    "fallback": """
        try:
            from flash_attn import flash_attn_func
        except ImportError:
            flash_attn_func = None
        out = flash_attn_func(q)
        self.flash_attn_func(q)
    """,
    "imported_helpers": """
        from .modeling_utils import _flash_attention_forward
        from flash_attn import flash_attn_func as fa
        import flash_attn.flash_attn_interface as fai
        class Attn:
            def _flash_attention_forward(self, q):
                return _flash_attention_forward(q) + fa(q) + fai.flash_attn_func(q) + fai(q)
        def g(fai):
            return fai
    """,
    "local_import": """
        import torch
        def f(q):
            from flash_attn import flash_attn_func
            import torch.nn.functional as F
            return flash_attn_func(q), F.scaled_dot_product_attention(q, q, q), torch.nn
        out = flash_attn_func(q)
        for flash_attn_varlen_func in ():
            pass
        flash_attn_varlen_func(q)
    """,
}


def _answers(text: str, header_lines: int) -> list[tuple[str, set[str] | None, set[str]]]:
    tree = ast.parse(text)
    header = [s for s in tree.body if s.end_lineno is not None and s.end_lineno <= header_lines]
    names = semantic.of(tree).header_names(header, [], SOURCES)
    wrapper = MetadataWrapper(cst.parse_module(text), unsafe_skip_copy=True)
    scopes = wrapper.resolve(ScopeProvider)  # every expression has a scope: all candidates are here
    out = []
    for node, scope in scopes.items():
        if isinstance(node, (cst.Name, cst.Attribute)) and scope is not None:
            # what QualifiedNameProvider computes for the node (it asks the same scope)
            theirs = {q.name for q in scope.get_qualified_names_for(node)}
            full_name = get_full_name_for_node(node)
            ours = names.qualified(full_name) if full_name is not None else None
            out.append((wrapper.module.code_for_node(node), ours, theirs))
    return out


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_names_give_libcsts_qualified_names(shape):
    text = textwrap.dedent(SHAPES[shape]).lstrip("\n")
    lines = text.splitlines()
    first_chunk = next(i for i, line in enumerate(lines) if not line.startswith(("from ", "import ")))
    if shape == "fallback":
        first_chunk = 4  # the try/except import block is header
    answered = 0
    for code, ours, theirs in _answers(text, first_chunk):
        if ours is None:
            continue
        answered += 1
        wanted = set(SOURCES)
        assert ours & wanted == theirs & wanted, code
        if ours:
            assert ours == theirs, code
    assert answered > 0


def test_names_answer_for_every_candidate_of_a_plain_file():
    text = textwrap.dedent(SHAPES["plain"]).lstrip("\n")
    answers = _answers(text, 3)
    matched = [code for code, ours, _ in answers if ours and ours & set(SOURCES)]
    assert all(ours is not None for _, ours, _ in answers)
    assert matched == [
        "flash_attn_func",
        "F.scaled_dot_product_attention",
        "torch.nn.functional.scaled_dot_product_attention",
        "torch.nn.functional(q).scaled_dot_product_attention",  # libcst reads through the call
        "flash_attn_func",
    ]


def test_names_defer_to_the_scope_analysis_where_bindings_vary():
    text = textwrap.dedent(SHAPES["shadowed"]).lstrip("\n")
    deferred = {code for code, ours, _ in _answers(text, 1) if ours is None}
    assert "flash_attn_func" in deferred


def test_dense_file_runs_no_scope_analysis(monkeypatch):
    calls = []
    real = MetadataWrapper.resolve
    monkeypatch.setattr(MetadataWrapper, "resolve", lambda self, p: calls.append(p) or real(self, p))
    text = "from flash_attn import flash_attn_func\n\n" + "".join(
        f"def f{i}(q, k, v):\n    return flash_attn_func(q, k, v, causal=True)\n" for i in range(30)
    )
    result = engine.transform_source(text.encode(), "dense.py", RULES)
    assert result.status == "changed" and len(result.sites) == 30
    assert ScopeProvider not in calls


def test_a_helper_imported_under_a_name_bound_otherwise_needs_no_scope_analysis(monkeypatch):
    """transformers' models import ``_flash_attention_forward`` and define methods of that name:
    no import binds that name to a source, so it cannot be one whatever its bindings."""
    calls = []
    real = MetadataWrapper.resolve
    monkeypatch.setattr(MetadataWrapper, "resolve", lambda self, p: calls.append(p) or real(self, p))
    text = textwrap.dedent("""\
        from flash_attn import flash_attn_func
        from .modeling_flash_attention_utils import _flash_attention_forward

        class FlashAttention2:
            def _flash_attention_forward(self, q, k, v):
                return _flash_attention_forward(q, k, v)

            def forward(self, q, k, v):
                return flash_attn_func(q, k, v, causal=True)
    """)
    result = engine.transform_source(text.encode(), "m.py", RULES)
    assert result.status == "changed" and [s.status for s in result.sites] == ["rewrite"]
    assert ScopeProvider not in calls
    helpers = [
        (ours, theirs) for code, ours, theirs in _answers(text, 2) if code == "_flash_attention_forward"
    ]
    assert helpers and all(ours == set() and not theirs & set(SOURCES) for ours, theirs in helpers)


def _mini_modules(path: pathlib.Path, monkeypatch) -> list[list[str]]:
    seen: list[list[str]] = []
    with monkeypatch.context() as patch:
        patch.setattr(engine.mini_parse, "parse", lambda parts: seen.append(list(parts)) or PARSE(parts))
        engine.transform_source(path.read_bytes(), str(path), RULES)
    return seen


@pytest.mark.parametrize("path", FIXTURE_INPUTS[::3], ids=lambda p: f"{p.parent.name}/{p.name}")
def test_piecewise_parse_equals_whole_parse(path, monkeypatch):
    for parts in _mini_modules(path, monkeypatch):
        joined = pieces.parse(parts)
        whole = cst.parse_module("".join(parts))
        assert joined.deep_equals(whole) and joined.code == whole.code


@pytest.mark.parametrize(
    "parts",
    [
        ["import a\n", "# s\ndef f():\n\tpass\n", "# s\ndef g():\n    pass\n"],  # indents differ
        ["import a\r\n", "# s\ndef f():\n    pass\n"],  # line endings differ
        ["import a\n# trailing\n", "# s\nx = 1\n"],  # a footer before the next piece
        ["# only a comment\n", "x = 1\n"],
    ],
)
def test_piecewise_parse_falls_back_to_the_whole_text(parts):
    joined = pieces.parse(parts)
    whole = cst.parse_module("".join(parts))
    assert joined.deep_equals(whole) and joined.code == whole.code
