"""The coverage table: every rule documents what it rewrites and refuses; docs/rules.md and CLI show it."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

from flashport.rules import all_rules
from flashport.rules import coverage as cov

ROOT = pathlib.Path(__file__).resolve().parents[1]
RULES_PAGE = ROOT / "docs" / "rules.md"


@pytest.mark.parametrize("rule", all_rules(), ids=lambda r: r.CODE)
def test_every_rule_has_coverage_metadata(rule):
    row = cov.coverage(rule)
    assert row.rewrites and row.refuses and row.api and row.framework in ("torch", "jax")
    assert "\n" not in row.rewrites + row.refuses


def test_sections_parser_reads_indented_paragraphs_only():
    doc = "Title.\n\nWhat it rewrites:\n  a b\n  c.\n\nWhat it refuses:\n  x.\n\nExample::\n\n    code\n"
    assert cov.sections(doc) == {"What it rewrites": "a b c.", "What it refuses": "x."}


def test_missing_sections_are_an_error(monkeypatch):
    rule = all_rules()[0]
    monkeypatch.setattr(sys.modules[rule.__module__], "__doc__", "No sections here.")
    with pytest.raises(ValueError, match="What it refuses"):
        cov.coverage(rule)


def test_rules_page_section_matches_the_generator():
    text = RULES_PAGE.read_text(encoding="utf-8")
    assert cov.START in text, "docs/rules.md lacks the rule coverage section"
    assert cov.update(text) == text, (
        "docs/rules.md is stale: python -m flashport.rules.coverage --update docs/rules.md"
    )
    assert text.count("\n| FPA") == len(all_rules())


def test_cli_rules_json_has_rewritten_and_refused():
    out = subprocess.run(
        [sys.executable, "-m", "flashport", "rules", "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    listed = {row["code"]: row for row in json.loads(out)}
    assert set(listed) == {rule.CODE for rule in all_rules()}
    assert "base-2" in listed["FPA203"]["refused"] and listed["FPA901"]["rewrites"] is False


@pytest.mark.parametrize("rule", all_rules(), ids=lambda r: r.CODE)
def test_rule_docs_name_only_existing_files_and_rules(rule):
    """Paths and rule codes a rule's documentation points readers to must exist (no stale promises)."""
    root = ROOT
    doc = rule.doc()
    for path in re.findall(
        r"\b((?:tests|rules|rewriter|kernels|docs|benchmarks|examples)/[\w/.-]+\.(?:py|md))", doc
    ):
        assert (root / path).is_file(), f"{rule.CODE} names {path}, which does not exist"
    codes = {r.CODE for r in all_rules()}
    for code in re.findall(r"\bFPA\d{3}\b", doc):
        assert code in codes, f"{rule.CODE} names {code}, which is not a rule"
    assert "later rule" not in doc, f"{rule.CODE} promises a later rule: name the rule that does it"
