"""The rule coverage table: per source API, what is rewritten and what is refused (and why).

Generated from the rules' own documentation, so it cannot drift from them: every rule module's
docstring has a ``What it rewrites:`` (or ``What it reports:`` for scan-only rules) section and a
``What it refuses:`` section. ``flashport rules`` shows the same rows; the "Rule coverage" table of docs/rules.md
section is this module's Markdown output between ``<!-- rule-coverage:start -->`` and
``<!-- rule-coverage:end -->``.

Usage::

    python -m flashport.rules.coverage                  # print the Markdown table
    python -m flashport.rules.coverage --update docs/rules.md  # rewrite the docs section in place
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys

from flashport.rules import all_rules
from flashport.rules.base import Rule

START, END = "<!-- rule-coverage:start -->", "<!-- rule-coverage:end -->"
_HEADING = re.compile(r"^([A-Z][A-Za-z ()-]*):\s*$")


@dataclasses.dataclass(frozen=True)
class Coverage:
    """One row: a rule's source API, what it rewrites (or reports) and what it refuses."""

    code: str
    name: str
    api: str
    framework: str
    fix: str
    target: str
    rewrites: str
    refuses: str


def sections(doc: str) -> dict[str, str]:
    """``{"What it rewrites": text, ...}``: a docstring's ``Heading:`` sections, whitespace-normalised."""
    found: dict[str, list[str]] = {}
    current = None
    for line in doc.splitlines():
        match = _HEADING.match(line)
        if match and not line.startswith(" "):
            current = match.group(1)
            found[current] = []
        elif current is not None and (line.startswith(" ") or not line.strip()):
            found[current].append(line.strip())
        else:
            current = None
    return {key: " ".join(" ".join(lines).split()) for key, lines in found.items()}


def coverage(rule: type[Rule]) -> Coverage:
    """The coverage row of ``rule``.

    Raises:
      ValueError: when the rule's module docstring lacks the sections the table needs.
    """
    doc = sections(inspect.getdoc(sys.modules[rule.__module__]) or "")
    rewrites = doc.get("What it rewrites") or doc.get("What it reports")
    refuses = doc.get("What it refuses")
    if not rewrites or not refuses:
        raise ValueError(
            f"{rule.CODE}: its module docstring needs 'What it rewrites:' (or 'What it reports:') and 'What it refuses:' sections"
        )
    return Coverage(
        rule.CODE,
        rule.NAME,
        rule.API,
        rule.FRAMEWORK,
        "rewrite" if rule.REWRITES else "report",
        rule.TARGET or "-",
        rewrites,
        refuses,
    )


def rows() -> list[Coverage]:
    """Coverage rows of every registered rule, by code."""
    return [coverage(rule) for rule in all_rules()]


def _md(text: str) -> str:
    return text.replace("``", "`").replace("|", "\\|")


def markdown() -> str:
    """The coverage table as Markdown (one row per rule)."""
    lines = [
        "| code | source API | framework | outcome | rewritten (to) | refused (why) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows():
        done = _md(row.rewrites) + ("" if row.fix == "report" else f" → `{row.target}`")
        lines.append(
            f"| {row.code} | `{_md(row.api)}` | {row.framework} | {row.fix} | {done} | {_md(row.refuses)} |"
        )
    return "\n".join(lines) + "\n"


def update(text: str) -> str:
    """``text`` (a Markdown page) with the section between the markers replaced by :func:`markdown`.

    Raises:
      ValueError: when the markers are missing or out of order.
    """
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the page lacks the markers {START} ... {END}")
    return text[: start + len(START)] + "\n" + markdown() + text[end:]


def main(argv: list[str] | None = None) -> int:
    """Print the table, or rewrite a Markdown page's section with ``--update PATH``."""
    parser = argparse.ArgumentParser(
        prog="python -m flashport.rules.coverage", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--update", metavar="PAGE", help="rewrite the section between the markers in this file"
    )
    args = parser.parse_args(argv)
    if args.update:
        with open(args.update, encoding="utf-8") as handle:
            text = handle.read()
        with open(args.update, "w", encoding="utf-8") as handle:
            handle.write(update(text))
        return 0
    sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
