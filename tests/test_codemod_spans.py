"""Per-statement positions and splices (:mod:`flashport.rewriter.source.spans`) must give what rendering
the whole mini module gives: the same node positions as libcst's ``PositionProvider`` and the same
rewritten files."""

from __future__ import annotations

import ast
import pathlib
import textwrap
from collections import defaultdict

import pytest

from flashport import rules as registry
from flashport.rewriter.engine import pipeline as engine
from flashport.rewriter.engine.pipeline import transform_source
from flashport.rewriter.source import astindex, spans
from flashport.rewriter.source.positions import line_positions
from flashport.rules.base import RuleOptions

RULES = registry.all_rules()
ROOT = pathlib.Path(__file__).parent
INPUTS = sorted((ROOT / "fixtures" / "codemod").glob("*/*.py")) + sorted(
    (ROOT.parent / "examples").rglob("*.py")
)

# Sites in the places a statement-by-statement pairing with the ``ast`` can get wrong: an elif
# test, decorators with comments between them, one-line suites, semicolons, try/except/else/
# finally, for-else, match, a class member, nested blocks, a module-level call, a last line
# without a line break.
LAYOUTS = textwrap.dedent("""\
    from flash_attn import flash_attn_func, flash_attn_varlen_func
    import functools


    def branches(q, k, v, mode):
        if mode == 0:
            out = flash_attn_func(q, k, v)
        # before elif
        elif flash_attn_func(q, k, v, causal=True) is not None:
            out = 1
        else:
            out = flash_attn_func(q, k, v, softmax_scale=0.5); x = 1
        if mode: return flash_attn_func(q, k, v)
        return out


    @functools.lru_cache
    # between decorators
    @staticmethod
    def decorated(q, k, v):
        try:
            o = flash_attn_func(q, k, v)
        except ValueError:
            o = flash_attn_func(q, k, v, causal=True)
        else:
            o = o + 1
        finally:
            pass
        for _ in range(2):
            o = flash_attn_func(
                q,  # the queries
                k,
                v,
            )
        else:
            o = o * 2
        match mode:
            case 1:
                o = flash_attn_func(q, k, v)
            case _:
                pass
        return o


    class Block:
        scale = 0.5

        def forward(self, q, k, v):
            with torch.no_grad():
                while True:
                    return flash_attn_func(q, k, v, softmax_scale=self.scale)


    OUT = flash_attn_func(Q, K, V)""")


def _cases():
    crlf = LAYOUTS.replace("\n", "\r\n")
    tabs = LAYOUTS.replace("    ", "\t")
    headerless = LAYOUTS.replace("from flash_attn import", "if True:\n    from flash_attn import", 1)
    texts = {"layouts": LAYOUTS, "crlf": crlf, "tabs": tabs, "guarded-import": headerless}
    return [pytest.param(text.encode(), id=name) for name, text in texts.items()] + [
        pytest.param(path.read_bytes(), id=str(path.relative_to(ROOT.parent))) for path in INPUTS
    ]


def _result(data: bytes):
    result = transform_source(data, "m.py", RULES, RuleOptions())
    return (
        result.status,
        result.error,
        result.new,
        result.sites,
        result.imports_added,
        result.imports_removed,
    )


@pytest.mark.parametrize("data", _cases())
def test_statement_positions_equal_whole_module_positions(monkeypatch, data):
    """Every position the engine asks for equals the whole module's, and no render falls back."""
    asked = []
    whole: dict[int, dict] = {}
    original = spans.StatementSpans.position

    def checked(self, node, path):
        found = original(self, node, path)
        assert not self.failed
        full = whole.setdefault(id(self.module), line_positions(self.module))
        assert found == full.get(node)
        asked.append(node)
        return found

    monkeypatch.setattr(spans.StatementSpans, "position", checked)
    _result(data)
    if data.startswith(b"from flash_attn") or b"\tif" in data or b"if True:" in data:
        assert asked  # the layouts have sites: positions were asked for


@pytest.mark.parametrize("data", _cases())
def test_statement_splices_equal_whole_module_render(monkeypatch, data):
    spliced = _result(data)
    with monkeypatch.context() as patch:
        patch.setattr(engine, "_spliced", lambda *args: None)
        whole = _result(data)
    assert spliced == whole


def test_layouts_are_rewritten_statement_by_statement(monkeypatch):
    """The layouts' rewrites are placed without rendering the whole mini module."""
    calls = []
    original = engine._spliced

    def spliced(*args):
        calls.append(original(*args))
        return calls[-1]

    monkeypatch.setattr(engine, "_spliced", spliced)
    result = transform_source(LAYOUTS.encode(), "m.py", RULES, RuleOptions())
    assert result.status == "changed"
    assert calls and calls[0] is not None and len(calls[0]) >= 8, calls
    assert result.new.decode().count("flashport.") >= 8


def test_a_pairing_mismatch_falls_back_to_the_whole_module(monkeypatch):
    """When the ``ast`` and libcst statements do not pair up the result is still the same."""
    expected = _result(LAYOUTS.encode())

    def mismatch(self, *args):
        raise spans._Mismatch

    monkeypatch.setattr(spans.StatementSpans, "_pair", mismatch)
    assert _result(LAYOUTS.encode()) == expected


def test_a_render_mismatch_falls_back_to_the_whole_module(monkeypatch):
    """A statement render that does not reproduce the text switches to whole-module positions."""
    expected = _result(LAYOUTS.encode())
    monkeypatch.setattr(spans.StatementSpans, "_matches", lambda self, start, text: False)
    assert _result(LAYOUTS.encode()) == expected


@pytest.mark.parametrize("path", INPUTS[:20] + [pathlib.Path(__file__)], ids=str)
def test_the_ast_index_walks_in_ast_walk_order(path):
    tree = ast.parse(path.read_text())
    expected = defaultdict(list)
    for node in ast.walk(tree):
        expected[type(node)].append(node)
    index = astindex._walk(tree)
    assert index.keys() == expected.keys()
    for kind, nodes in expected.items():
        assert [id(n) for n in index[kind]] == [id(n) for n in nodes], kind
