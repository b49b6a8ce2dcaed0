"""The ``flashport`` command line: ``scan``, ``rewrite`` and ``rules``.

Exit codes:
  0  success (``scan``: even with findings; ``rewrite``: dry run shown or files written)
  1  ``rewrite --check``: some file would change
  2  usage or configuration error (bad flag, unknown rule, missing path, bad [tool.flashport])
  3  some file could not be processed (undecodable, syntax error, write failure); it is reported,
     left untouched, and the other files are still processed
  130, 143  interrupted by SIGINT (Ctrl-C) or SIGTERM (128 + the signal number); a summary on
     stderr names the files written and those not reached (:mod:`flashport.rewriter.interrupts`)

Results go to stdout (rich tables and diffs, or ``--format json``, schema in
:mod:`flashport.rewriter.report`); progress goes to stderr (a progress bar only when stderr is a
terminal). The CLI never imports jax or torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Literal

import flashport

EXIT_OK = 0
EXIT_CHANGES = 1
EXIT_USAGE = 2
EXIT_ERRORS = 3


def _codes(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``flashport`` command."""
    parser = argparse.ArgumentParser(
        prog="flashport",
        description="Port GPU flash-attention code to the portable flashport.attention API.",
        epilog="exit codes: 0 ok, 1 --check found changes, 2 usage/config error, 3 a file failed",
    )
    parser.add_argument("--version", action="version", version=f"flashport {flashport.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{scan,rewrite,rules}")

    common = argparse.ArgumentParser(add_help=False)
    _add_file_arguments(common)
    _add_output_arguments(common)
    _add_rule_option_arguments(common)
    _add_subcommands(sub, common)
    return parser


def _add_subcommands(sub, common: argparse.ArgumentParser) -> None:
    """The ``scan``, ``rewrite`` and ``rules`` subcommands."""
    sub.add_parser(
        "scan", parents=[common], help="list every GPU attention use and whether it can be rewritten"
    )
    rewrite = sub.add_parser(
        "rewrite", parents=[common], help="show (default) or apply the rewrites as a diff"
    )
    mode = rewrite.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="apply the rewrites (atomic per file)")
    mode.add_argument("--check", action="store_true", help="exit 1 when any file would change (CI)")
    mode.add_argument(
        "--interactive",
        action="store_true",
        help="review the rewrites one site at a time (y/n/a/d/q), then write only the accepted ones",
    )
    rewrite.add_argument(
        "--report",
        metavar="PATH",
        help="also write a self-contained HTML report (summary, diffs, refused sites) to PATH",
    )

    rules = sub.add_parser("rules", help="list the rules, or print one rule's documentation")
    rules.add_argument("rule", nargs="?", help="rule code or name, e.g. FPA001")
    rules.add_argument("--format", choices=("text", "json"), default="text")
    rules.add_argument("--no-color", action="store_true")


def _add_file_arguments(common: argparse.ArgumentParser) -> None:
    """Which files and rules a run covers, and how many workers."""
    common.add_argument("paths", nargs="*", default=["."], help="files or directories (default: .)")
    common.add_argument(
        "--select",
        type=_codes,
        action="extend",
        metavar="RULES",
        help="comma-separated rule codes/prefixes to run (default: all)",
    )
    common.add_argument(
        "--ignore",
        type=_codes,
        action="extend",
        metavar="RULES",
        help="comma-separated rule codes/prefixes to skip",
    )
    common.add_argument(
        "--exclude", action="append", metavar="GLOB", help="skip paths matching GLOB (repeatable)"
    )
    common.add_argument("--no-gitignore", action="store_true", help="do not skip files ignored by .gitignore")
    common.add_argument("-j", "--jobs", type=int, metavar="N", help="worker processes (default: CPU count)")


def _add_output_arguments(common: argparse.ArgumentParser) -> None:
    """Output format, colour, result cache and configuration file."""
    common.add_argument(
        "--format",
        choices=("text", "json"),
        default="text",
        help="output format (json: schema flashport.report/1)",
    )
    common.add_argument(
        "--cache",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse per-file results from ~/.cache/flashport (keyed by file bytes, rules, options and versions); default: off unless FLASHPORT_CACHE is set",
    )
    common.add_argument(
        "--no-color",
        action="store_true",
        help="plain output (also when NO_COLOR is set or stdout is not a terminal)",
    )
    common.add_argument(
        "--config",
        metavar="PYPROJECT",
        help="read [tool.flashport] from this file instead of the nearest pyproject.toml",
    )
    common.add_argument("--isolated", action="store_true", help="ignore any [tool.flashport] configuration")


def _add_rule_option_arguments(common: argparse.ArgumentParser) -> None:
    """Options the rules read (:class:`~flashport.rules.base.RuleOptions`)."""
    common.add_argument(
        "--inference",
        action="store_true",
        default=None,
        help="treat training-gated dropout (`p if self.training else 0.0`) as 0 and drop it; the diff notes say so",
    )
    common.add_argument(
        "--flash-attn-version",
        metavar="X.Y.Z",
        help="flash-attn version the code targets (positional binding, causal alignment; default 2.8.3)",
    )
    common.add_argument(
        "--torch-version", metavar="X.Y", help="torch version for SDPA's signature (default 2.5)"
    )
    common.add_argument(
        "--jax-version",
        metavar="X.Y.Z",
        help="jax version for jax.nn.dot_product_attention's signature (default 0.10.2)",
    )


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0) if not isinstance(exit_.code, str) else EXIT_USAGE
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if args.command == "rules":
        return _rules(args)
    from flashport.rewriter.interrupts import stoppable
    from flashport.rewriter.writes import WriteLog

    log = WriteLog()  # what an interrupted run reports
    return stoppable(lambda: _settings_and_run(args, log), lambda stop: log.interrupted(stop.name))


def _settings_and_run(args, log) -> int:
    try:
        settings = _settings(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"flashport: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    return _run(args, log, *settings)


def _color(args) -> bool:
    return not args.no_color and "NO_COLOR" not in os.environ and sys.stdout.isatty()


def _settings(args):
    from flashport import rules as registry
    from flashport.rewriter import config as cfg
    from flashport.rewriter import run_context
    from flashport.rewriter.discover import find_files
    from flashport.rules.base import RuleOptions

    table: dict = {}
    if args.config:
        table = cfg.load(args.config)
    elif not args.isolated:
        found = cfg.find_pyproject(args.paths[0] if args.paths else ".")
        if found:
            table = cfg.load(found)
    select = args.select or table.get("select")
    ignore = (args.ignore or []) + list(table.get("ignore", []))
    chosen = registry.select(select, ignore)
    defaults = RuleOptions()
    options = RuleOptions(
        inference=bool(args.inference if args.inference is not None else table.get("inference", False)),
        flash_attn_version=_version(
            args.flash_attn_version or table.get("flash-attn-version"),
            defaults.flash_attn_version,
            "--flash-attn-version",
        ),
        torch_version=_version(
            args.torch_version or table.get("torch-version"), defaults.torch_version, "--torch-version"
        ),
        jax_version=_version(
            args.jax_version or table.get("jax-version"), defaults.jax_version, "--jax-version"
        ),
    )
    jobs = args.jobs if args.jobs is not None else table.get("jobs")
    if jobs is not None and jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    exclude = tuple((args.exclude or []) + list(table.get("exclude", [])))
    gitignore = not args.no_gitignore and table.get("respect-gitignore", True)
    found = find_files(args.paths, exclude=exclude, respect_gitignore=gitignore)
    options = run_context.for_paths(found.files, options)  # run-time patches of source APIs, run-wide
    return found, chosen, options, jobs


def _version(text, default, flag):
    from flashport.rewriter.config import parse_version

    return default if text is None else parse_version(str(text), flag)


def _run(args, log, found, chosen, options, jobs) -> int:
    from flashport.rewriter import report as rep
    from flashport.rewriter.cache import ResultCache
    from flashport.rewriter.results import CHANGED, ERROR
    from flashport.rewriter.runner import CANNOT_READ, run
    from flashport.rewriter.writes import write_results

    files = found.files
    cache: ResultCache | Literal[False] | None = None  # None: FLASHPORT_CACHE decides
    if args.cache is not None:
        cache = ResultCache.for_run(chosen, options) if args.cache else False
    results = _collect(run(files, chosen, options, jobs, cache=cache), len(files), args.format == "text")
    if args.command == "rewrite" and args.write:
        write_results(results, log)
    interactive = args.command == "rewrite" and args.interactive
    if interactive:
        _interactive(args, results, chosen, options, log)
    written = set(log.written)
    unreadable = sum(1 for r in results if r.status == ERROR and (r.error or "").startswith(CANNOT_READ))
    failed = any(r.status == ERROR for r in results)
    changed = any(r.status == CHANGED for r in results)
    code = (
        EXIT_ERRORS
        if failed
        else EXIT_CHANGES
        if (args.command == "rewrite" and args.check and changed)
        else EXIT_OK
    )
    mode = (
        "scan"
        if args.command == "scan"
        else "write"
        if args.write or interactive
        else "check"
        if args.check
        else "dry-run"
    )
    if getattr(args, "report", None):
        code = _html_report(args.report, results, written, "interactive" if interactive else mode) or code
    if args.format == "json":
        document = rep.to_json(args.command, mode, results, written, code)
        document["summary"]["skipped"] = dict(found.counts(unreadable))
        document["summary"]["skipped_paths"] = [{"path": p, "reason": m} for p, m in found.notices]
        json.dump(document, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return code
    text = rep.TextReport(_color(args))
    if args.command == "scan":
        text.scan(results)
    else:
        if not interactive:
            text.diffs(results)
        text.refusals(results)
        text.errors(results)
        text.summary(results, written=len(written) if args.write or interactive else None)
    text.console.print(found.skipped_line(unreadable), markup=False)
    for path, message in found.notices:
        text.console.print(f"skipped {path}: {message}", markup=False)
    return code


def _collect(stream, total: int, text: bool):
    """Drain the runner, with a rich progress bar on stderr when it is a terminal."""
    if not (text and sys.stderr.isatty() and total > 20):
        return list(stream)
    from rich.console import Console
    from rich.progress import Progress

    results = []
    with Progress(console=Console(file=sys.stderr), transient=True) as progress:
        task = progress.add_task("scanning", total=total)
        for result in stream:
            results.append(result)
            progress.advance(task)
    return results


def _rules(args) -> int:
    from flashport import rules as registry

    if args.rule:
        try:
            rule = registry.get(args.rule)
        except KeyError as err:
            print(f"flashport: error: {err.args[0]}", file=sys.stderr)
            return EXIT_USAGE
        if args.format == "json":
            json.dump(_rule_json(rule) | {"doc": rule.doc()}, sys.stdout, indent=1)
            sys.stdout.write("\n")
        else:
            sys.stdout.write(f"{rule.CODE} {rule.NAME}\n\n{rule.doc()}\n")
        return EXIT_OK
    all_rules = registry.all_rules()
    if args.format == "json":
        json.dump([_rule_json(rule) for rule in all_rules], sys.stdout, indent=1)
        sys.stdout.write("\n")
        return EXIT_OK
    from rich.console import Console
    from rich.table import Table

    table = Table(title="flashport rules")
    from flashport.rules.coverage import coverage

    for column in (
        "code",
        "name",
        "source API",
        "framework",
        "fix",
        "rewrites to",
        "rewritten",
        "refused (why)",
    ):
        table.add_column(column, overflow="fold")
    for rule in all_rules:
        table.add_row(*dataclasses.astuple(coverage(rule)))  # the README table's row, field by field
    Console(no_color=not _color(args), highlight=False).print(table)
    return EXIT_OK


def _rule_json(rule) -> dict:
    from flashport.rules.coverage import coverage

    row = coverage(rule)
    return {
        "code": rule.CODE,
        "name": rule.NAME,
        "api": rule.API,
        "framework": rule.FRAMEWORK,
        "sources": list(rule.SOURCES),
        "rewrites": rule.REWRITES,
        "target": rule.TARGET,
        "summary": rule.summary(),
        "rewritten": row.rewrites,
        "refused": row.refuses,
    }


def _interactive(args, results, chosen, options, log) -> None:
    """Run the one-site-at-a-time review (:mod:`flashport.rewriter.interactive`); ``log`` records
    the files written."""
    from flashport.rewriter import report as rep
    from flashport.rewriter.interactive import review, stdin_asker
    from flashport.rewriter.results import ERROR

    out = sys.stderr if args.format == "json" else sys.stdout  # keep a JSON document on stdout clean
    console = rep.TextReport(_color(args)).console
    console.file = out
    outcome = review(results, chosen, options, ask=stdin_asker(sys.stdin, out), console=console, log=log)
    failed = dict(outcome.failed)
    for result in results:
        if result.path in failed:
            result.status, result.error = ERROR, failed[result.path]


def _html_report(path, results, written, mode) -> int:
    """Write the ``--report`` HTML page (:mod:`flashport.rewriter.html_report`); EXIT_ERRORS if that fails."""
    from flashport.rewriter import html_report

    try:
        html_report.write(path, results, mode=mode, written=written)
    except OSError as err:
        print(f"flashport: error: cannot write report {path}: {err.strerror or err}", file=sys.stderr)
        return EXIT_ERRORS
    return 0
