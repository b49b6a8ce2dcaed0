"""``flashport rewrite PATHS --interactive``: review the proposed rewrites one site at a time.

For every site the engine would rewrite, the review shows the diff hunk that holds it and asks::

    y  accept this site          n  skip this site
    a  accept this and the rest of this file
    d  skip this and the rest of this file
    q  quit: skip everything not yet accepted (accepted sites are still written)
    ?  help

Answers are read one line at a time (type the letter, then Enter); end of input counts as ``q``.
Each file with at least one accepted site is rewritten **once**, as soon as its last site is
answered (in place and never half-written: :func:`flashport.rewriter.app.writes.write_in_place`), with
only the accepted sites: the engine runs again
with the declined sites suppressed (``transform_source(..., skip=...)``), so import edits follow
exactly what was accepted (a GPU import stays while a declined call still uses it). If a declined
site cannot be separated from an accepted one (same rule on a shared line), the file is not written
and the review says so. An accepted site that the engine's per-file phase then refuses (an xformers
bias constructor whose ``memory_efficient_attention`` was declined, an SDPA backend selector one of
whose SDPA calls was declined) is kept as it was, counted as declined, and the review prints why.
A file that changed on disk since the diff was shown is not written, with a message.

Interrupted (Ctrl-C, SIGTERM) at a prompt, the answers given so far are applied: files already
reviewed were written as they went, and the file under review is written with the sites accepted
so far; unanswered sites stay as they were, so running the review again resumes with them.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Sequence
from typing import TextIO

from flashport.rewriter.app import interrupts
from flashport.rewriter.app.interrupts import Interrupted
from flashport.rewriter.app.report import display_path
from flashport.rewriter.app.writes import StaleFile, WriteLog, reason, write_in_place
from flashport.rewriter.engine.pipeline import transform_source
from flashport.rewriter.engine.results import (
    CHANGED,
    ERROR,
    REFUSED,
    REWRITE,
    SUPPRESSED,
    UNCHANGED,
    FileResult,
    Site,
)
from flashport.rewriter.source import text as src
from flashport.rules.base import Rule, RuleOptions

HELP = (
    "y - accept this site\n"
    "n - skip this site\n"
    "a - accept this site and the rest of this file\n"
    "d - skip this site and the rest of this file\n"
    "q - quit: skip every site not yet accepted (accepted ones are written)\n"
    "? - this help\n"
)
PROMPT = "Apply this rewrite [y,n,a,d,q,?]? "


@dataclasses.dataclass
class Outcome:
    """What the review did.

    Attributes:
      accepted: sites the user accepted.
      declined: sites skipped (explicitly, by ``d``, or by ``q``).
      written: paths written.
      failed: ``(path, reason)`` for files that were not written.
    """

    accepted: list[Site] = dataclasses.field(default_factory=list)
    declined: list[Site] = dataclasses.field(default_factory=list)
    written: list[str] = dataclasses.field(default_factory=list)
    failed: list[tuple[str, str]] = dataclasses.field(default_factory=list)


def review(
    results: Sequence[FileResult],
    rules: Sequence[type[Rule]],
    options: RuleOptions,
    *,
    ask: Callable[[str], str | None],
    console=None,
    log: WriteLog | None = None,
) -> Outcome:
    """Walk every proposed rewrite in ``results``, ask about each, write the accepted ones.

    Args:
      results: the engine's results (a dry run); only ``changed`` files are reviewed.
      rules, options: what produced ``results`` (used again to apply a subset of sites).
      ask: returns the user's answer to a prompt, or None at end of input.
      console: a rich ``Console`` for the hunks and messages (a plain one on stdout by default).
      log: kept up to date with the files written (read by the summary of an interrupted run).

    Returns:
      An :class:`Outcome`.
    """
    if console is None:
        from rich.console import Console

        console = Console(highlight=False)
    outcome = Outcome()
    log = log if log is not None else WriteLog()
    pending = [r for r in results if r.status == CHANGED and r.old is not None and r.new is not None]
    log.planned, log.stage = [r.path for r in pending], "review"
    total = sum(1 for r in pending for s in r.sites if s.status == REWRITE)
    number, quitting = 0, False
    for result in pending:
        sites = [s for s in result.sites if s.status == REWRITE]
        file_choice: str | None = None
        accepted: list[Site] = []
        try:
            for site in sites:
                number += 1
                choice = "n" if quitting else file_choice
                if choice is None:
                    _show(console, result, site, number, total)
                    choice = _answer(ask, console)
                    if choice == "q":
                        quitting, choice = True, "n"
                    elif choice in ("a", "d"):
                        file_choice = "y" if choice == "a" else "n"
                        choice = file_choice
                (accepted if choice == "y" else outcome.declined).append(site)
        except Interrupted:
            if accepted:  # apply the answers given so far; the unanswered sites stay as they are
                outcome.accepted.extend(accepted)
                _apply(result, sites, accepted, rules, options, outcome, console, log)
            raise
        outcome.accepted.extend(accepted)
        if accepted:
            _apply(result, sites, accepted, rules, options, outcome, console, log)
        if result.path not in outcome.written:
            log.settled.append(result.path)
    console.print(
        f"{len(outcome.accepted)} of {total} rewrites accepted; "
        f"{len(outcome.written)} file(s) written"
        + (f", {len(outcome.failed)} not written" if outcome.failed else "")
    )
    return outcome


DECLINED = "declined in the interactive review"
UNANSWERED = "not answered in the interactive review (interrupted)"


def record(results: Sequence[FileResult], outcome: Outcome) -> None:
    """Make ``results`` say what the review did, so every report counts exactly: a declined site
    becomes ``suppressed`` (reason :data:`DECLINED`), an accepted site the per-file phase then
    refused becomes ``refused`` with its reason, the sites of a file that was not written are
    ``refused`` with the file's reason, a site never answered (Ctrl-C) is ``suppressed`` (reason
    :data:`UNANSWERED`), and a reviewed file nothing was written to is ``unchanged``."""
    declined = {(s.path, *_key(s)): s for s in outcome.declined}
    failed = dict(outcome.failed)
    written = set(outcome.written)
    for result in results:
        if result.status != CHANGED:
            continue
        sites = []
        for site in result.sites:
            if site.status == REWRITE:
                other = declined.get((site.path, *_key(site)))
                if result.path in failed:
                    site = dataclasses.replace(
                        site, status=REFUSED, reason=f"not written: {failed[result.path]}"
                    )
                elif other is not None and other.status == REFUSED:
                    site = dataclasses.replace(site, status=REFUSED, reason=other.reason)
                elif other is not None:
                    site = dataclasses.replace(site, status=SUPPRESSED, reason=DECLINED)
                elif result.path not in written:  # never answered: the review was interrupted
                    site = dataclasses.replace(site, status=SUPPRESSED, reason=UNANSWERED)
            sites.append(site)
        result.sites = sites
        if result.path in failed:
            result.status, result.error = ERROR, failed[result.path]
        elif result.path not in written:
            result.status = UNCHANGED


def _answer(ask, console) -> str:
    while True:
        reply = ask(PROMPT)
        if reply is None:
            console.print()
            return "q"
        reply = reply.strip().lower()[:1]
        if reply in ("y", "n", "a", "d", "q"):
            return reply
        console.print(HELP, end="")


def _show(console, result: FileResult, site: Site, number: int, total: int) -> None:
    """Print the site's header, its notes and the diff hunk(s) that cover its lines."""
    console.print(f"\n[bold]({number}/{total}) {site.path}:{site.line}[/] {site.rule} {site.api}")
    if site.notes:
        console.print(f"  note: {'; '.join(site.notes)}")
    hunk = site_hunk(result, site)
    if console.no_color or not console.is_terminal:
        console.file.write(hunk)
    else:
        from rich.syntax import Syntax

        console.print(Syntax(hunk, "diff", theme="ansi_dark", background_color="default"))


def site_hunk(result: FileResult, site: Site, context: int = 3) -> str:
    """A unified diff of just this site's change: the changed blocks of ``result`` that touch the
    site's lines (old-file numbering) applied alone to the old text; other sites' changes and the
    import edits are left out."""
    old = src.split_lines(_decode(result.old))
    new = src.split_lines(_decode(result.new))
    only: list[str] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
        mine = tag != "equal" and i1 < site.end_line and site.line - 1 < max(i2, i1 + 1)
        only += new[j1:j2] if mine else old[i1:i2]
    shown = display_path(result.path)
    lines = difflib.unified_diff(old, only, f"a/{shown}", f"b/{shown}", n=context)
    return "".join(_nl(line) for line in lines)


def _apply(result, sites, accepted, rules, options, outcome: Outcome, console, log: WriteLog) -> None:
    """Write ``result.path`` with only ``accepted`` of its ``sites`` rewritten."""
    new = result.new
    if len(accepted) < len(sites):
        skip: dict[int, set[str]] = {}
        for site in sites:
            if site not in accepted:
                skip.setdefault(site.line, set()).add(site.rule)
        partial = transform_source(
            result.old,
            result.path,
            rules,
            options,
            skip={line: frozenset(codes) for line, codes in skip.items()},
        )
        done = {_key(s) for s in partial.sites if s.status == REWRITE}
        # An accepted site may now be refused by the per-file phase (Rule.settle): e.g. a bias
        # constructor whose consuming call was declined. That is sound; say so and write the rest.
        vetoed = [s for s in partial.sites if s.status == REFUSED and _key(s) in {_key(a) for a in accepted}]
        if partial.status == ERROR or done | {_key(s) for s in vetoed} != {_key(s) for s in accepted}:
            why = partial.error or "an accepted site shares a line and rule with a declined one; not written"
            outcome.failed.append((result.path, why))
            console.print(f"[red]not written[/] {result.path}: {why}")
            return
        for site in vetoed:
            outcome.accepted.remove(next(a for a in outcome.accepted if _key(a) == _key(site)))
            outcome.declined.append(site)
            console.print(f"[yellow]kept[/] {result.path}:{site.line} {site.rule}: {site.reason}")
        new = partial.new
    if new is None or new == result.old:
        return
    with interrupts.held():  # a signal during the write waits until the log says so
        try:
            write_in_place(result.path, result.old, new)
        except (OSError, StaleFile) as err:
            outcome.failed.append((result.path, f"write failed: {reason(err)}"))
            console.print(f"[red]not written[/] {result.path}: {reason(err)}", highlight=False)
            return
        outcome.written.append(result.path)
        log.written.append(result.path)


def _key(site: Site) -> tuple:
    return site.line, site.column, site.rule


def _nl(line: str) -> str:
    return line if line.endswith(("\n", "\r")) else line + "\n\\ No newline at end of file\n"


def _decode(data: bytes | None) -> str:
    data = data or b""
    try:
        return src.decode(data)[0]
    except (SyntaxError, UnicodeDecodeError, LookupError):
        return data.decode("utf-8", "replace")


def stdin_asker(stream: TextIO, out: TextIO) -> Callable[[str], str | None]:
    """An ``ask`` for :func:`review` reading lines from ``stream`` (None at end of input)."""

    def ask(prompt: str) -> str | None:
        out.write(prompt)
        out.flush()
        line = stream.readline()
        return None if line == "" else line

    return ask
