"""Golden fixtures per rule: tests/fixtures/codemod/<RULE>/<case>.py.

For every case: ``<case>.py.out`` is the expected rewrite (absent = the file must stay
byte-identical) and ``<case>.txt`` lists the expected findings as ``line:col RULE status reason``.
Regenerate after an intended change with ``FLASHPORT_UPDATE_FIXTURES=1 pytest tests/test_rules_fixtures.py``
and review the diff. Each case also checks the guarantees: output compiles, a second run changes
nothing, and CRLF / BOM / tab variants come back byte-identical outside the rewritten lines.
"""

from __future__ import annotations

import os
import pathlib

import pytest

from flashport import rules as registry
from flashport.rewriter.engine.pipeline import transform_source
from flashport.rules.base import RuleOptions

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "codemod"
CASES = sorted(FIXTURES.glob("FPA*/*.py"))
UPDATE = os.environ.get("FLASHPORT_UPDATE_FIXTURES") == "1"


def run(data: bytes, path: str = "case.py", **options):
    return transform_source(data, path, registry.all_rules(), RuleOptions(**options))


def findings(result) -> str:
    return "".join(
        f"{s.line}:{s.column} {s.rule} {s.status} {s.kind}{(' ' + s.reason) if s.reason else ''}"
        f"{(' [' + '; '.join(s.notes) + ']') if s.notes else ''}\n"
        for s in result.sites
    )


@pytest.mark.parametrize("case", CASES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_fixture(case: pathlib.Path):
    data = case.read_bytes()
    result = run(data, case.name)
    assert result.status != "error", result.error
    out_path = case.with_suffix(".py.out")
    txt_path = case.with_suffix(".txt")
    got_out = result.new if result.new is not None else data
    if UPDATE:
        if result.new is not None:
            out_path.write_bytes(result.new)
        elif out_path.exists():
            out_path.unlink()
        txt_path.write_text(findings(result))
    expected = out_path.read_bytes() if out_path.exists() else data
    assert got_out == expected
    assert findings(result) == txt_path.read_text()
    assert any(s.rule == case.parent.name for s in result.sites) or case.stem.startswith("no_change"), (
        "fixture exercises its rule"
    )
    if case.stem.startswith("no_change"):
        assert result.new is None and not result.sites


@pytest.mark.parametrize("case", CASES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_fixture_output_compiles_and_is_idempotent(case: pathlib.Path):
    result = run(case.read_bytes(), case.name)
    if result.new is None:
        return
    compile(result.new, case.name, "exec")
    again = run(result.new, case.name)
    assert again.new is None, "a second run must change nothing"
    assert not any(s.status == "rewrite" for s in again.sites)


def _variants(data: bytes):
    yield "crlf", data.replace(b"\n", b"\r\n")
    yield "bom", b"\xef\xbb\xbf" + data
    yield "tabs", data.replace(b"    ", b"\t")
    yield "no-final-newline", data.rstrip(b"\n")


@pytest.mark.parametrize("case", CASES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_fixture_byte_variants(case: pathlib.Path):
    """The variant's rewrite equals the base rewrite put through the same byte transformation."""
    base = run(case.read_bytes(), case.name)
    base_out = base.new if base.new is not None else case.read_bytes()
    for name, data in _variants(case.read_bytes()):
        try:
            compile(data, "v", "exec")
        except SyntaxError:
            continue  # e.g. tabs mixed with spaces in continuation lines
        result = run(data, case.name)
        assert result.status != "error", (name, result.error)
        out = result.new if result.new is not None else data
        expected = dict(_variants(base_out))[name]
        if name == "tabs":  # rewritten lines use spaces between arguments, never indentation
            expected = base_out.replace(b"    ", b"\t")
        assert out == expected, name


CODEMOD_RULES = ("FPA001", "FPA002", "FPA003", "FPA004", "FPA101", "FPA102", "FPA201", "FPA901")


def test_rule_codes_and_names_unique_and_documented():
    rules = registry.all_rules()
    assert len({r.CODE for r in rules}) == len(rules) == len({r.NAME for r in rules})
    for rule in rules:
        assert rule.summary(), rule.CODE
    for code in CODEMOD_RULES:
        rule = registry.get(code)
        doc = rule.doc()
        for section in ("What it", "Semantics mapping", "Example"):
            assert section in doc, (rule.CODE, section)
        assert (FIXTURES / rule.CODE).is_dir(), f"{rule.CODE} has fixtures"
