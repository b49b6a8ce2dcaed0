"""Thin function chunks (:mod:`flashport.rewriter.engine.thin`): the first libcst pass parses functions
with the statements that mention nothing relevant as placeholders, and falls back to the whole
chunks whenever a rule may have seen one; results equal those of the whole chunks."""

from __future__ import annotations

import ast
import pathlib
import re
import textwrap

import pytest

from flashport import rules as registry
from flashport.rewriter.engine import pipeline as engine
from flashport.rewriter.engine import thin
from flashport.rules.base import RuleOptions

RULES = registry.all_rules()
ROOT = pathlib.Path(__file__).parent
INPUTS = sorted((ROOT / "fixtures" / "codemod").glob("*/*.py")) + sorted(
    (ROOT.parent / "examples").glob("*.py")
)

_FUNCTION = textwrap.dedent("""\
    @decorate
    def test_flash_attn_output(q, k, v):
        \"\"\"Docstring.\"\"\"
        x = torch.randn(
            2, 3,
        )
        for i in range(3):  # a loop with nothing relevant
            x = x + i
        if x is not None:
            y = 1
            out = flash_attn_func(q, k, v)
        z = 1; w = 2
        if x: t = 3
        return out
""")


def _thin(text: str) -> str:
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    return thin.thin_text(lines, 1, len(lines), tree.body, re.compile("flash_attn_func"), lambda nodes: False)


def test_placeholders_span_the_lines_of_what_they_replace():
    want = (
        "@decorate\ndef test_flash_attn_output(q, k, v):\n    pass\n    (\n\n)\n    (\n)\n"
        "    if x is not None:\n        pass\n        out = flash_attn_func(q, k, v)\n"
        "    z = 1; w = 2\n    pass\n    pass\n"
    )
    assert _thin(_FUNCTION) == want  # a statement sharing its line (z = 1; w = 2) stays


def test_a_function_whose_header_may_hold_a_site_stays_whole():
    tree = ast.parse(_FUNCTION)
    lines = _FUNCTION.splitlines(keepends=True)
    kept = thin.thin_text(lines, 1, len(lines), tree.body, re.compile("flash_attn_func"), lambda nodes: True)
    assert kept == _FUNCTION


def test_watched_ancestors_note_reads_above_the_statement():
    notes: list[int] = []
    watched = thin.Watched(("call", "statement", "block", "function"), 1, lambda: notes.append(1))

    def noted(read) -> bool:
        before = len(notes)
        read()
        return len(notes) > before

    assert not noted(lambda: (watched[0], watched[1], watched[:2], watched[-3], len(watched)))
    assert noted(lambda: watched[2])
    assert noted(lambda: watched[-1])
    assert noted(lambda: watched[1:3])
    assert noted(lambda: list(watched))
    assert noted(lambda: [a for a in watched if a == "block"])
    assert noted(lambda: "function" in watched)
    assert noted(lambda: watched.index("function"))
    assert noted(lambda: list(reversed(watched)))
    assert noted(lambda: watched == ("call",))


def _port(data: bytes, share: float, monkeypatch, path: str = "m.py"):
    monkeypatch.setattr(engine, "_THIN_ENOUGH", share)
    return engine.transform_source(data, path, RULES, RuleOptions())


def _same(a, b) -> None:
    assert (a.status, a.error, a.new, a.sites) == (b.status, b.error, b.new, b.sites)
    assert (a.imports_added, a.imports_removed, a.imports_kept) == (
        b.imports_added,
        b.imports_removed,
        b.imports_kept,
    )


@pytest.mark.parametrize("path", INPUTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_thin_first_pass_gives_the_results_of_the_whole_chunks(path, monkeypatch):
    data = path.read_bytes()
    _same(_port(data, 2.0, monkeypatch, str(path)), _port(data, 0.0, monkeypatch, str(path)))


def test_the_thin_pass_is_kept_or_given_up_over_the_fixtures(monkeypatch):
    outcomes = []
    real = engine._port

    def recording(*args, watch=False, **kwargs):
        found = real(*args, watch=watch, **kwargs)
        if watch:
            outcomes.append(found is not None)
        return found

    monkeypatch.setattr(engine, "_port", recording)
    monkeypatch.setattr(engine, "_THIN_ENOUGH", 2.0)
    for path in INPUTS:
        engine.transform_source(path.read_bytes(), str(path), RULES, RuleOptions())
    assert True in outcomes and False in outcomes, outcomes


def test_a_long_test_function_is_ported_from_its_thin_chunk(monkeypatch):
    setup = "".join(f"    x{i} = torch.randn(2, 3, {i})\n" for i in range(40))
    data = (
        "import torch\nfrom flash_attn import flash_attn_func\n\n\n"
        f"def test_flash_attn_output(q, k, v):\n{setup}"
        "    out = flash_attn_func(q, k, v, causal=True)\n    return out\n"
    ).encode()
    outcomes = []
    real = engine._port

    def recording(*args, watch=False, **kwargs):
        found = real(*args, watch=watch, **kwargs)
        outcomes.append((watch, found is not None))
        return found

    monkeypatch.setattr(engine, "_port", recording)
    thin_result = engine.transform_source(data, "m.py", RULES, RuleOptions())
    assert outcomes == [(True, True)]
    _same(thin_result, _port(data, 0.0, monkeypatch))
    assert thin_result.status == "changed"
