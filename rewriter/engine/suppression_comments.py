"""The ``# flashport: ignore[...]`` comments themselves: which ones suppress nothing or name an unknown
rule (reported like ruff's RUF100), removing the unused ones (``rewrite --write``), and adding one to
every refused site (``rewrite --add-ignore``, a baseline).

Only real comments count (``tokenize``'s COMMENT tokens): the same words inside a string are text.
A comment suppresses a site when it sits on the site's first or last line
(:func:`flashport.rewriter.engine.suppress.is_suppressed`); a code is *unused* when no site of that rule
was suppressed there. Codes of rules left out by ``--select``/``--ignore`` are never called unused
(the run cannot tell), nor is a bare ``# flashport: ignore`` unless every rule ran.
"""

from __future__ import annotations

import dataclasses
import io
import tokenize
from collections.abc import Callable, Collection, Sequence

from flashport.rewriter.engine import suppress
from flashport.rewriter.engine.results import CHANGED, ERROR, REFUSED, SUPPRESSED, FileResult, Site
from flashport.rewriter.source import text as src
from flashport.rewriter.source.files import read_if_file

UNUSED = "unused-suppression"
UNKNOWN = "unknown-rule-code"
_REASON_CHARS = 72  # an added comment keeps the start of the refusal's reason, so lines stay short


@dataclasses.dataclass(frozen=True)
class Finding:
    """A suppression comment that suppresses nothing (:data:`UNUSED`) or names an unknown rule
    (:data:`UNKNOWN`).

    Attributes:
      path, line, column: where the comment's ``#`` is (1-based line, 0-based column).
      code: :data:`UNUSED` or :data:`UNKNOWN`.
      message: one line for the reports.
      codes: the unused (or unknown) codes; ``("*",)`` for an unused bare comment.
    """

    path: str
    line: int
    column: int
    code: str
    message: str
    codes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class _Directive:
    line: int
    start: int  # column of the directive's "#" in the line
    end: int  # column just past the directive
    token_start: int  # column of the comment token holding it
    token_end: int
    codes: frozenset[str]


def _directives(text: str) -> list[_Directive]:
    """Every suppression directive in a comment token of ``text`` (none when it does not tokenize)."""
    out = []
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type != tokenize.COMMENT or "flashport" not in token.string:
                continue
            match = suppress.PATTERN.search(token.string)
            if match:
                line, column = token.start
                out.append(
                    _Directive(
                        line,
                        column + match.start(),
                        column + match.end(),
                        column,
                        token.end[1],
                        suppress.codes_of(match.group("codes")),
                    )
                )
    except (tokenize.TokenError, SyntaxError):
        return []
    return out


def audit(
    path: str, text: str, sites: Sequence[Site], selected: Collection[str], known: Collection[str]
) -> list[Finding]:
    """The findings about the suppression comments of one file.

    Args:
      path: the file (for the findings).
      text: its text (as decoded).
      sites: the engine's sites for it (suppressed ones carry :data:`flashport.rewriter.engine.suppress.REASON`).
      selected: codes of the rules that ran; known: codes of every rule.
    """
    used: dict[int, set[str]] = {}
    for site in sites:
        if site.status == SUPPRESSED and site.reason == suppress.REASON:
            for line in {site.line, site.end_line}:
                used.setdefault(line, set()).add(site.rule)
    findings = []
    every_rule = set(known) <= set(selected)
    for directive in _directives(text):
        here = used.get(directive.line, set())
        unknown = sorted(code for code in directive.codes if code != suppress.ALL and code not in known)
        if unknown:
            findings.append(
                Finding(
                    path,
                    directive.line,
                    directive.start,
                    UNKNOWN,
                    f"unknown rule code(s) in a suppression comment: {', '.join(unknown)} "
                    "(`flashport rules` lists the codes)",
                    tuple(unknown),
                )
            )
        unused: tuple[str, ...]
        if suppress.ALL in directive.codes:
            unused = () if here or not every_rule else (suppress.ALL,)
        else:
            unused = tuple(sorted(c for c in directive.codes if c in selected and c not in here))
        if unused:
            shown = "# flashport: ignore" + ("" if unused == (suppress.ALL,) else f"[{', '.join(unused)}]")
            findings.append(
                Finding(
                    path,
                    directive.line,
                    directive.start,
                    UNUSED,
                    f"`{shown}` suppresses nothing here (`flashport rewrite --write` removes it)",
                    unused,
                )
            )
    return findings


def remove_unused(text: str, findings: Sequence[Finding]) -> str:
    """``text`` without the unused codes of ``findings``: a directive left with no code is removed
    (with the blank before it; a line that held only it goes too); one that keeps codes lists them."""
    unused = {f.line: set(f.codes) for f in findings if f.code == UNUSED}
    if not unused:
        return text
    lines = src.split_lines(text)
    for directive in reversed(_directives(text)):
        drop = unused.get(directive.line)
        if not drop:
            continue
        line = lines[directive.line - 1]
        body = line.rstrip("\r\n")
        ending = line[len(body) :]
        left = sorted(directive.codes - drop)
        if suppress.ALL in drop or not left:
            start = directive.token_start if directive.start == directive.token_start else directive.start
            body = body[:start].rstrip() + body[directive.token_end :]
            if not body.strip():
                lines[directive.line - 1] = ""
                continue
        else:
            body = body[: directive.start] + f"# flashport: ignore[{', '.join(left)}]" + body[directive.end :]
        lines[directive.line - 1] = body + ending
    return "".join(lines)


def add_ignores(text: str, sites: Sequence[Site]) -> tuple[str, list[Site]]:
    """``text`` with a ``# flashport: ignore[CODE] -- reason`` comment on every refused site, and
    the sites no comment could be added to (both of their lines end in a string or a backslash).

    The comment goes at the end of the site's last line (its first when the last cannot hold one);
    codes of several sites on one line share one comment; a line that already has a flashport
    suppression gets the new codes added to it."""
    lines = src.split_lines(text)
    open_ends = _commentable_lines(text)
    wanted: dict[int, dict[str, str]] = {}
    missed = []
    for site in sites:
        if site.status != REFUSED:
            continue
        line = next((n for n in (site.end_line, site.line) if n in open_ends), None)
        if line is None:
            missed.append(site)
            continue
        wanted.setdefault(line, {}).setdefault(site.rule, site.reason)
    existing = {d.line: d for d in _directives(text)}
    for number, by_code in sorted(wanted.items()):
        text_line = lines[number - 1]
        body = text_line.rstrip("\r\n")
        ending = text_line[len(body) :] or ("\n" if number < len(lines) else "")
        directive = existing.get(number)
        if directive is not None:
            if suppress.ALL in directive.codes:
                continue
            codes = sorted(directive.codes | set(by_code))
            body = (
                body[: directive.start] + f"# flashport: ignore[{', '.join(codes)}]" + body[directive.end :]
            )
        else:
            reason = "; ".join(dict.fromkeys(by_code.values()))
            if len(reason) > _REASON_CHARS:
                reason = reason[: _REASON_CHARS - 3].rsplit(" ", 1)[0] + "..."
            body += f"  # flashport: ignore[{', '.join(sorted(by_code))}] -- {reason}"
        lines[number - 1] = body + ending
    return "".join(lines), missed


def _commentable_lines(text: str) -> set[int]:
    """Lines whose end is outside any string and not a backslash continuation: a NEWLINE/NL token
    (or a comment) ends them."""
    out = set()
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type in (tokenize.NEWLINE, tokenize.NL, tokenize.COMMENT):
                out.add(token.start[0])
    except (tokenize.TokenError, SyntaxError):
        return set()
    return out


# ----------------------------------------------------------------------------------- over a run


def audit_run(results: Sequence[FileResult], rules_of: Callable[[str], Sequence]) -> list[Finding]:
    """:func:`audit` for every file of a run that holds a suppression comment (``rules_of(path)``:
    the rules that ran on it)."""
    from flashport import rules as registry

    known = {rule.CODE for rule in registry.all_rules()}
    findings = []
    for result in results:
        data = result.old if result.old is not None else read_if_file(result.path)
        if data is None or b"flashport" not in data:
            continue
        try:
            text = src.decode(data)[0]
        except (SyntaxError, UnicodeDecodeError, LookupError):
            continue
        selected = {rule.CODE for rule in rules_of(result.path)}
        findings += audit(result.path, text, result.sites, selected, known)
    return findings


def remove_unused_in_run(
    results: Sequence[FileResult], findings: Sequence[Finding], rules_of: Callable[[str], Sequence], options
) -> None:
    """Make the rewrite of each file with unused suppression comments also remove them: the engine
    runs again on the file without them (removing them moves no line and changes no site)."""
    from flashport.rewriter.engine.pipeline import transform_source

    by_path: dict[str, list[Finding]] = {}
    for finding in findings:
        if finding.code == UNUSED:
            by_path.setdefault(finding.path, []).append(finding)
    for result in results:
        if result.path not in by_path or result.status == ERROR:
            continue
        data = result.old if result.old is not None else read_if_file(result.path)
        if data is None:
            continue
        text, encoding = src.decode(data)
        cleaned = src.encode(remove_unused(text, by_path[result.path]), encoding)
        again = transform_source(cleaned, result.path, list(rules_of(result.path)), options)
        if again.status == ERROR:
            continue  # the comments stay; the file's first result stands
        result.sites = again.sites
        result.imports_added, result.imports_removed = again.imports_added, again.imports_removed
        result.imports_kept = again.imports_kept
        result.status, result.old, result.new = CHANGED, data, again.new or cleaned
