"""Rendering results: unified diffs, the JSON document (versioned schema) and rich text tables.

The engine returns values (:mod:`flashport.rewriter.engine.results`); everything user-facing is built here,
so other front ends (an HTML report, an interactive review) can reuse :func:`summarize`,
:func:`unified_diff` and :func:`to_json`.

JSON schema ``flashport.report/1`` (``--format json``; fields are only ever added within a major
version)::

    {
      "schema": "flashport.report/1",
      "command": "scan" | "rewrite",
      "mode": "scan" | "dry-run" | "write" | "check",
      "sites": [                                  # every finding, file order then line order
        {"path": str, "line": int (1-based), "column": int (0-based), "end_line": int,
         "rule": "FPA001", "api": str (qualified source API or config value),
         "kind": "call" | "reference" | "string",
         "status": "rewrite" | "as_is" | "refused" | "suppressed",   # as_is: runs unchanged on TPU
         "reason": str ("" for rewrites), "notes": [str]}     # notes: what a rewrite dropped
      ],
      "files": [                                  # files that were parsed, changed or failed
        {"path": str, "status": "unchanged" | "changed" | "error", "error": str | null,
         "written": bool, "imports_added": [str], "imports_removed": [str],
         "imports_kept": [str],                   # GPU imports left in place, "<module> (line N): <why>"
         "diff": str | null}                      # unified diff (rewrite only), a/ b/ prefixes
      ],
      "summary": {"files_scanned": int, "files_parsed": int, "files_changed": int,
                  "files_failed": int, "sites": {"rewrite": int, "as_is": int, "refused": int, "suppressed": int},
                  "rules": {"FPA001": {"rewrite": int, "as_is": int, ...}, ...},
                  "refused_reasons": [{"rule": str, "reason": str, "count": int}],
                  "skipped": {reason: int},          # paths left out by discovery, per reason
                  "skipped_paths": [{"path": str, "reason": str}]},   # the ones named (links, FIFOs...)
      "exit_code": int
    }
"""

from __future__ import annotations

import collections
import difflib
import os
from collections.abc import Sequence

from flashport.rewriter.engine.results import (
    AS_IS,
    CHANGED,
    ERROR,
    REFUSED,
    REWRITE,
    SITE_STATUSES,
    STATUS_LABELS,
    SUPPRESSED,
    FileResult,
)
from flashport.rewriter.source import text as src

SCHEMA = "flashport.report/1"


def display_path(path: str) -> str:
    """``path`` as ruff and git print it: relative to the current directory, ``/``-separated, without
    ``./`` (absolute when it lies outside the current directory)."""
    relative = os.path.relpath(path)
    if relative == os.pardir or relative.startswith(os.pardir + os.sep):
        relative = os.path.abspath(path)
    return relative.replace(os.sep, "/")


def unified_diff(result: FileResult) -> str:
    """``git apply``-able unified diff of a changed file (``a/``/``b/`` prefixes and the
    :func:`display_path` of the file, so ``git apply`` and ``patch -p1`` take it from the current
    directory); "" otherwise."""
    if result.status != CHANGED or result.old is None or result.new is None:
        return ""
    old = _text(result.old)
    new = _text(result.new)
    shown = display_path(result.path)
    lines = difflib.unified_diff(src.split_lines(old), src.split_lines(new), f"a/{shown}", f"b/{shown}", n=3)
    out = []
    for line in lines:
        out.append(line if line.endswith(("\n", "\r")) else line + "\n\\ No newline at end of file\n")
    return "".join(out)


def _text(data: bytes) -> str:
    try:
        return src.decode(data)[0]
    except (SyntaxError, UnicodeDecodeError, LookupError):
        return data.decode("utf-8", "replace")


def summarize(results: Sequence[FileResult]) -> dict:
    """Counts for the summary table and JSON ``summary``."""
    sites: collections.Counter[str] = collections.Counter()
    rules: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    reasons: collections.Counter[tuple[str, str]] = collections.Counter()
    for result in results:
        for site in result.sites:
            sites[site.status] += 1
            rules[site.rule][site.status] += 1
            if site.status == REFUSED:
                reasons[(site.rule, site.reason)] += 1
    return {
        "files_scanned": len(results),
        "files_parsed": sum(r.parsed for r in results),
        "files_changed": sum(r.status == CHANGED for r in results),
        "files_failed": sum(r.status == ERROR for r in results),
        "sites": {status: sites[status] for status in SITE_STATUSES},
        "rules": {
            code: {status: counts[status] for status in SITE_STATUSES}
            for code, counts in sorted(rules.items())
        },
        "refused_reasons": [
            {"rule": rule, "reason": reason, "count": count}
            for (rule, reason), count in sorted(reasons.items(), key=lambda item: (-item[1], item[0]))
        ],
    }


def to_json(
    command: str, mode: str, results: Sequence[FileResult], written: set[str], exit_code: int
) -> dict:
    """The ``flashport.report/1`` document."""
    files = []
    for result in results:
        if not (result.parsed or result.status != "unchanged"):
            continue
        files.append(
            {
                "path": result.path,
                "status": result.status,
                "error": result.error,
                "written": result.path in written,
                "imports_added": list(result.imports_added),
                "imports_removed": list(result.imports_removed),
                "imports_kept": list(result.imports_kept),
                "diff": (unified_diff(result) or None) if command == "rewrite" else None,
            }
        )
    return {
        "schema": SCHEMA,
        "command": command,
        "mode": mode,
        "sites": [
            {
                "path": s.path,
                "line": s.line,
                "column": s.column,
                "end_line": s.end_line,
                "rule": s.rule,
                "api": s.api,
                "kind": s.kind,
                "status": s.status,
                "reason": s.reason,
                "notes": list(s.notes),
            }
            for r in results
            for s in r.sites
        ],
        "files": files,
        "summary": summarize(results),
        "exit_code": exit_code,
    }


class TextReport:
    """rich rendering on stdout (plain text when colour is off or stdout is not a terminal)."""

    def __init__(self, color: bool, file=None):
        from rich.console import Console

        self.color = color
        self.console = Console(
            file=file,
            no_color=not color,
            highlight=False,
            force_terminal=None if color else False,
            emoji=False,
            width=None if color else 160,
        )

    def scan(self, results: Sequence[FileResult]) -> None:
        """One row per site: location, API, rule, status, reason."""
        from rich.table import Table

        if not self.color:  # concise, grep-able lines
            for result in results:
                for site in result.sites:
                    why = site.reason or "; ".join(site.notes)
                    status = {
                        REWRITE: "rewritable",
                        AS_IS: "as-is",
                        REFUSED: "not-rewritable",
                        SUPPRESSED: SUPPRESSED,
                    }[site.status]
                    self.console.file.write(
                        f"{site.path}:{site.line}:{site.column} {site.rule} {status} {site.api}{': ' + why if why else ''}\n"
                    )
            self.errors(results)
            self.summary(results, scan=True)
            return
        table = Table(title="GPU attention uses", show_lines=False)
        for column in ("location", "api", "rule", "status", "why / notes"):
            table.add_column(column, overflow="fold")
        for result in results:
            for site in result.sites:
                status = {
                    "rewrite": "[green]rewritable[/]",
                    "as_is": "[blue]runs as is[/]",
                    "refused": "[red]not rewritable[/]",
                    "suppressed": "[dim]suppressed[/]",
                }[site.status]
                why = site.reason or "; ".join(site.notes)
                table.add_row(f"{site.path}:{site.line}", site.api, site.rule, status, why)
        if table.row_count:
            self.console.print(table)
        else:
            self.console.print("no GPU attention uses found")
        self.errors(results)
        self.summary(results, scan=True)

    def diffs(self, results: Sequence[FileResult]) -> None:
        """Per changed file: the unified diff (syntax highlighted when colour is on)."""
        from rich.syntax import Syntax

        for result in results:
            diff = unified_diff(result)
            if not diff:
                continue
            if self.color:
                self.console.print(Syntax(diff, "diff", theme="ansi_dark", background_color="default"))
            else:
                self.console.file.write(diff)
            for site in result.sites:
                if site.status == REWRITE and site.notes:
                    self.console.print(f"  note {site.path}:{site.line} {site.rule}: {'; '.join(site.notes)}")

    def errors(self, results: Sequence[FileResult]) -> None:
        """Files that could not be processed, one line each."""
        for result in results:
            if result.status == ERROR:
                self._line(
                    f"[red]error[/] {result.path}: {result.error}", f"error {result.path}: {result.error}"
                )

    def refusals(self, results: Sequence[FileResult]) -> None:
        """Sites left unchanged, ``path:line rule reason``."""
        for result in results:
            for site in result.sites:
                if site.status == REFUSED:
                    plain = f"not rewritten {site.path}:{site.line} {site.rule} {site.api}: {site.reason}"
                    self._line(f"[yellow]not rewritten[/] {plain[len('not rewritten ') :]}", plain)

    def findings(self, findings: Sequence) -> None:
        """Suppression comments that suppress nothing or name unknown rules, ``path:line code message``."""
        from rich.markup import escape

        for finding in findings:
            plain = f"{finding.code} {display_path(finding.path)}:{finding.line}: {finding.message}"
            self._line(f"[yellow]{finding.code}[/] {escape(plain[len(finding.code) + 1 :])}", plain)

    def _line(self, markup: str, plain: str) -> None:
        """One finding per line: never wrapped when piped (grep-able), styled on a terminal."""
        if self.color:
            self.console.print(markup)
        else:
            self.console.file.write(plain + "\n")

    def summary(self, results: Sequence[FileResult], scan: bool = False, written: int | None = None) -> None:
        """Files scanned/changed/failed, sites per rule and status, refusal reasons."""
        from rich.table import Table

        info = summarize(results)
        files = (
            f"{info['files_scanned']} files scanned, {info['files_parsed']} parsed, "
            f"{info['files_changed']} {'would change' if written is None and not scan else 'changed'}, "
            f"{info['files_failed']} failed"
        )
        if written is not None:
            files += f", {written} written"
        if not scan or info["rules"]:
            table = Table(title="summary")
            table.add_column("rule")
            for status in SITE_STATUSES:
                label = "rewritable" if scan and status == REWRITE else STATUS_LABELS[status]
                table.add_column(label, justify="right")
            for code, counts in info["rules"].items():
                table.add_row(code, *(str(counts[s]) for s in SITE_STATUSES))
            self.console.print(table)
            self.console.print(files)
        else:
            self.console.print(files)
        if info["refused_reasons"]:
            reasons = Table(title="not rewritten, by reason")
            reasons.add_column("count", justify="right")
            reasons.add_column("rule")
            reasons.add_column("reason", overflow="fold")
            for row in info["refused_reasons"]:
                reasons.add_row(str(row["count"]), row["rule"], row["reason"])
            self.console.print(reasons)
