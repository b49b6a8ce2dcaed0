"""Inline suppressions: ``# flashport: ignore[FPA001, FPA101]`` (or bare ``# flashport: ignore``).

A suppression applies to a site whose first or last line carries the comment.
"""

from __future__ import annotations

import re

PATTERN = re.compile(r"#\s*flashport:\s*ignore(?:\[(?P<codes>[^\]]*)\])?", re.IGNORECASE)
ALL = "*"
REASON = "suppressed by a # flashport: ignore comment"  # the reason of every site a comment suppresses


def parse(lines: list[str]) -> dict[int, frozenset[str]]:
    """Map 1-based line -> suppressed codes (``{"*"}`` for a bare ignore)."""
    found: dict[int, frozenset[str]] = {}
    for number, line in enumerate(lines, 1):
        if "flashport" not in line:
            continue
        match = PATTERN.search(line)
        if match:
            codes = match.group("codes")
            found[number] = codes_of(codes)
    return found


def codes_of(listed: str | None) -> frozenset[str]:
    """The codes of a comment's ``[...]`` list (``{"*"}`` when absent or empty)."""
    codes = frozenset(c.strip().upper() for c in (listed or "").split(",") if c.strip())
    return codes or frozenset({ALL})


def is_suppressed(table: dict[int, frozenset[str]], code: str, start: int, end: int) -> bool:
    """True when line ``start`` or ``end`` suppresses ``code``."""
    for line in {start, end}:
        codes = table.get(line)
        if codes and (ALL in codes or code in codes):
            return True
    return False
