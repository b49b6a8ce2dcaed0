"""Machine-readable outputs of ``scan``/``rewrite`` besides the rich text and the JSON document:
``--output-format concise`` (one line a site), ``github`` (workflow annotations), ``sarif`` (SARIF
2.1.0, the format code-scanning services read) and ``--diff`` (one patch for ``git apply``).

Every format lists every site with its exact status: ``rewrite`` (to be ported), ``as_is`` (runs
unchanged on a TPU host), ``refused`` (left unchanged, with the reason) and ``suppressed`` (a
``# flashport: ignore`` comment or the interactive review skipped it; only SARIF shows these, as
suppressed results), plus the findings about the suppression comments themselves
(:mod:`flashport.rewriter.engine.suppression_comments`).
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence

from flashport.rewriter.app.report import display_path
from flashport.rewriter.engine.results import AS_IS, ERROR, REFUSED, REWRITE, SUPPRESSED, FileResult, Site
from flashport.rewriter.engine.suppression_comments import Finding

FORMATS = ("full", "concise", "json", "github", "sarif")
ALIASES = {"text": "full"}  # the ``--format`` spelling of earlier releases
SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
INFORMATION_URI = "https://pypi.org/project/flashport/"


def message(site: Site) -> str:
    """One line saying what happens to ``site``."""
    if site.status == REWRITE:
        text = f"`{site.api}` can be rewritten to flashport (run `flashport rewrite --write`)"
        return text + (f"; {'; '.join(site.notes)}" if site.notes else "")
    if site.status == AS_IS:
        return f"`{site.api}` {site.reason}"
    if site.status == REFUSED:
        return f"`{site.api}` not rewritten: {site.reason}"
    return f"`{site.api}` {site.reason}"


def _reported(results: Sequence[FileResult]) -> list[Site]:
    return [site for result in results for site in result.sites if site.status != SUPPRESSED]


def concise(results: Sequence[FileResult], findings: Sequence[Finding]) -> str:
    """``path:line:col: CODE message`` (1-based column), one line per unsuppressed site, per
    suppression finding and per file that failed."""
    rows = [
        (display_path(s.path), s.line, s.column + 1, f"{s.rule} [{s.status}] {message(s)}")
        for s in _reported(results)
    ]
    rows += [(display_path(f.path), f.line, f.column + 1, f"{f.code} {f.message}") for f in findings]
    rows += [(display_path(r.path), 1, 1, f"error {r.error}") for r in results if r.status == ERROR]
    return "".join(f"{path}:{line}:{column}: {text}\n" for path, line, column, text in sorted(rows))


_GITHUB_LEVEL = {REWRITE: "warning", REFUSED: "warning", AS_IS: "notice"}


def github(results: Sequence[FileResult], findings: Sequence[Finding]) -> str:
    """GitHub Actions workflow commands (``::warning file=…,line=…::…``), one per site/finding."""
    lines = []
    for site in _reported(results):
        lines.append(
            _annotation(
                _GITHUB_LEVEL[site.status],
                display_path(site.path),
                site.line,
                site.column + 1,
                site.end_line,
                f"flashport {site.rule}",
                message(site),
            )
        )
    for finding in findings:
        path = display_path(finding.path)
        lines.append(
            _annotation(
                "warning", path, finding.line, finding.column + 1, finding.line, finding.code, finding.message
            )
        )
    for result in results:
        if result.status == ERROR:
            lines.append(
                _annotation("error", display_path(result.path), 1, 1, 1, "flashport", str(result.error))
            )
    return "".join(line + "\n" for line in lines)


def _annotation(level, path, line, column, end_line, title, text) -> str:
    def prop(value) -> str:
        return (
            str(value)
            .replace("%", "%25")
            .replace("\r", "%0D")
            .replace("\n", "%0A")
            .replace(":", "%3A")
            .replace(",", "%2C")
        )

    body = str(text).replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    return (
        f"::{level} file={prop(path)},line={line},col={column},endLine={end_line},title={prop(title)}::{body}"
    )


def sarif(
    results: Sequence[FileResult], findings: Sequence[Finding], rules: Sequence, version: str, summary: dict
) -> dict:
    """A SARIF 2.1.0 log: one run, the rules as ``tool.driver.rules``, one result per site (as is:
    ``kind: pass``; refused: ``kind: review``; suppressed: an ``inSource`` suppression), one per
    suppression finding, failed files as tool notifications, and ``summary`` (the JSON document's
    exact counts) in the run's properties."""
    descriptors = [
        {
            "id": rule.CODE,
            "name": rule.NAME,
            "shortDescription": {"text": rule.summary() or rule.API},
            "fullDescription": {"text": rule.doc()},
            "properties": {"api": rule.API, "framework": rule.FRAMEWORK, "target": rule.TARGET},
        }
        for rule in rules
    ]
    index = {rule.CODE: i for i, rule in enumerate(rules)}
    out = []
    for site in (site for result in results for site in result.sites):
        entry: dict[str, object] = {
            "ruleId": site.rule,
            "message": {"text": message(site)},
            "locations": [_location(site.path, site.line, site.column, site.end_line)],
            "properties": {"status": site.status, "api": site.api, "notes": list(site.notes)},
        }
        if site.rule in index:
            entry["ruleIndex"] = index[site.rule]
        if site.status == AS_IS:
            entry |= {"kind": "pass", "level": "none"}
        elif site.status == REFUSED:
            entry |= {"kind": "review", "level": "none"}
        else:
            entry |= {"kind": "fail", "level": "warning"}
        if site.status == SUPPRESSED:
            entry["suppressions"] = [{"kind": "inSource", "justification": site.reason}]
        out.append(entry)
    for finding in findings:
        out.append(
            {
                "ruleId": finding.code,
                "kind": "fail",
                "level": "warning",
                "message": {"text": finding.message},
                "locations": [_location(finding.path, finding.line, finding.column, finding.line)],
            }
        )
    notifications = [
        {
            "level": "error",
            "message": {"text": str(result.error)},
            "locations": [_location(result.path, 1, 0, 1)],
        }
        for result in results
        if result.status == ERROR
    ]
    return {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "flashport",
                        "version": version,
                        "informationUri": INFORMATION_URI,
                        "rules": descriptors,
                    }
                },
                "originalUriBaseIds": {"%SRCROOT%": {"uri": pathlib.Path.cwd().as_uri() + "/"}},
                "invocations": [
                    {"executionSuccessful": not notifications, "toolExecutionNotifications": notifications}
                ],
                "results": out,
                "properties": {"summary": summary},
            }
        ],
    }


def _location(path: str, line: int, column: int, end_line: int) -> dict:
    shown = display_path(path)
    artifact = (
        {"uri": pathlib.Path(shown).as_uri()}
        if os.path.isabs(shown)
        else {"uri": shown, "uriBaseId": "%SRCROOT%"}
    )
    return {
        "physicalLocation": {
            "artifactLocation": artifact,
            "region": {"startLine": line, "startColumn": column + 1, "endLine": max(end_line, line)},
        }
    }
