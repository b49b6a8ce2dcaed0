"""The ``flashport`` command line: ``scan``, ``rewrite`` and ``rules``.

Exit codes:
  0  success (``scan``: even with findings; ``rewrite``: dry run shown or files written)
  1  ``rewrite --check`` or ``rewrite --diff``: some file would change
  2  usage or configuration error (bad flag, unknown rule, missing path, bad [tool.flashport])
  3  some file could not be processed (undecodable, syntax error, write failure); it is reported,
     left untouched, and the other files are still processed
  130, 143  interrupted by SIGINT (Ctrl-C) or SIGTERM (128 + the signal number); a summary on
     stderr names the files written and those not reached (:mod:`flashport.rewriter.app.interrupts`)

Results go to stdout in the ``--output-format`` asked for (rich tables and diffs; concise, JSON,
GitHub or SARIF: :mod:`flashport.rewriter.app.output_formats`, :mod:`flashport.rewriter.app.report`), or only
a patch with ``rewrite --diff`` (everything else then goes to stderr); progress goes to stderr, only
when it is a terminal (:mod:`flashport.rewriter.app.progress`). The CLI never imports jax or torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import TYPE_CHECKING, Literal

import flashport
from flashport.rewriter.app.output_formats import ALIASES, FORMATS

if TYPE_CHECKING:
    from flashport.rewriter.app.discover import Discovery
    from flashport.rewriter.engine.results import FileResult
    from flashport.rules.base import RuleOptions

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
        "--diff",
        action="store_true",
        help="print only a unified patch on stdout (for `git apply`; notes go to stderr); exit 1 when "
        "there are changes",
    )
    mode.add_argument(
        "--add-ignore",
        action="store_true",
        help="add a `# flashport: ignore[CODE] -- reason` comment to every refused site (a baseline); "
        "rewrites nothing",
    )
    mode.add_argument(
        "--interactive",
        action="store_true",
        help="review the rewrites one site at a time (y/n/a/d/q), then write only the accepted ones",
    )
    rewrite.add_argument(
        "--no-format",
        action="store_true",
        help="leave rewritten statements as generated (default: formatted with ruff, when installed, at "
        "the project's line length from [tool.ruff]/[tool.black], default 88)",
    )
    rewrite.add_argument(
        "--report",
        metavar="PATH",
        help="also write a self-contained HTML report (summary, diffs, refused sites) to PATH",
    )

    rules = sub.add_parser("rules", help="list the rules, or print one rule's documentation")
    rules.add_argument("rule", nargs="?", help="rule code or name, e.g. FPA001")
    rules.add_argument("--output-format", "--format", dest="format", choices=("text", "json"), default="text")
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
        "--output-format",
        "--format",
        dest="output_format",
        choices=(*FORMATS, *ALIASES),
        default="full",
        help="full (tables and diffs), concise (path:line:col: CODE message), json (schema "
        "flashport.report/1), github (workflow annotations) or sarif (SARIF 2.1.0); --format is an alias",
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
    from flashport.rewriter.app.interrupts import stoppable
    from flashport.rewriter.app.writes import WriteLog

    log = WriteLog()  # what an interrupted run reports
    return stoppable(lambda: _settings_and_run(args, log), lambda stop: log.interrupted(stop.name))


def _settings_and_run(args, log) -> int:
    try:
        settings = _settings(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"flashport: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    return _run(args, log, settings)


def _color(args) -> bool:
    return not args.no_color and "NO_COLOR" not in os.environ and sys.stdout.isatty()


def _settings(args) -> Settings:
    from flashport import rules as registry
    from flashport.rewriter.app import config as cfg
    from flashport.rewriter.app.discover import find_files
    from flashport.rewriter.engine import run_context
    from flashport.rules.base import RuleOptions

    table: dict = {}
    root = os.getcwd()
    if args.config:
        table = cfg.load(args.config)
        root = os.path.dirname(os.path.abspath(args.config))
    elif not args.isolated:
        pyproject = cfg.find_pyproject(args.paths[0] if args.paths else ".")
        if pyproject:
            table = cfg.load(pyproject)
            root = os.path.dirname(pyproject)
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
        format_rewrites=not getattr(args, "no_format", False),
    )
    jobs = args.jobs if args.jobs is not None else table.get("jobs")
    if jobs is not None and jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    exclude = tuple(
        (args.exclude or []) + list(table.get("exclude", [])) + list(table.get("extend-exclude", []))
    )
    gitignore = not args.no_gitignore and table.get("respect-gitignore", True)
    found = find_files(args.paths, exclude=exclude, respect_gitignore=gitignore)
    # normpath: paths print the way the user would type them (``pkg/x.py``, never ``./pkg/x.py``)
    files = [os.path.normpath(path) for path in found.files]
    options = run_context.for_paths(files, options)  # run-time patches of source APIs, run-wide
    per_file = cfg.per_file_rules(files, chosen, table.get("per-file-ignores", {}), root)
    return Settings(files, chosen, per_file, options, jobs, found)


@dataclasses.dataclass
class Settings:
    """What a ``scan``/``rewrite`` run covers.

    Attributes:
      files: the discovered files, in output order.
      chosen: the rules selected for the run.
      per_file: path -> its rules, for the files ``per-file-ignores`` gives fewer rules.
      options: what the rules read.
      jobs: worker processes (None: CPU count).
      found: discovery's account (:class:`~flashport.rewriter.app.discover.FoundFiles`: what it skipped).
    """

    files: list[str]
    chosen: list
    per_file: dict[str, list]
    options: RuleOptions
    jobs: int | None
    found: Discovery

    def rules_of(self, path: str) -> list:
        """The rules that run on ``path``."""
        return self.per_file.get(path, self.chosen)


def _version(text, default, flag):
    from flashport.rewriter.app.config import parse_version

    return default if text is None else parse_version(str(text), flag)


def _run(args, log, settings: Settings) -> int:
    from flashport.rewriter.app import progress as prog
    from flashport.rewriter.app.runner import CANNOT_READ
    from flashport.rewriter.app.writes import add_ignores_in_run, write_results
    from flashport.rewriter.engine import suppression_comments as comments
    from flashport.rewriter.engine.results import CHANGED, ERROR

    fmt = ALIASES.get(args.output_format, args.output_format)
    rewrite = args.command == "rewrite"
    diff_only = rewrite and args.diff
    shown = fmt == "full" and not diff_only  # progress only under the human-readable report
    with prog.Progress(enabled=shown and sys.stderr.isatty()) as progress:
        results = _analyse(args, settings, progress)
        findings = comments.audit_run(results, settings.rules_of)
        if rewrite and not args.add_ignore:
            comments.remove_unused_in_run(results, findings, settings.rules_of, settings.options)
        if rewrite and args.add_ignore:
            add_ignores_in_run(results, log, progress)
        elif rewrite and args.write:
            progress.start("writing", sum(r.status == CHANGED for r in results))
            write_results(results, log, done=progress.done)
            progress.finish()
        interactive = rewrite and args.interactive
        if interactive:
            progress.stop()
            _interactive(args, results, settings.chosen, settings.options, log)
    written = set(log.written)
    unreadable = sum(1 for r in results if r.status == ERROR and (r.error or "").startswith(CANNOT_READ))
    failed = any(r.status == ERROR for r in results)
    changed = any(r.status == CHANGED for r in results)
    code = (
        EXIT_ERRORS
        if failed
        else EXIT_CHANGES
        if (rewrite and (args.check or diff_only) and changed)
        else EXIT_OK
    )
    mode = (
        "scan"
        if not rewrite
        else "add-ignore"
        if args.add_ignore
        else "write"
        if args.write or interactive
        else "check"
        if args.check
        else "diff"
        if diff_only
        else "dry-run"
    )
    if getattr(args, "report", None):
        code = _html_report(args.report, results, written, "interactive" if interactive else mode) or code
    _emit(args, fmt, mode, results, findings, written, code, progress, settings.found, unreadable)
    if code == EXIT_CHANGES and args.check:
        count = sum(r.status == CHANGED for r in results)
        print(
            f"flashport: {count} file(s) would change; run `flashport rewrite --write` to apply the "
            "rewrites (`flashport rewrite --diff` shows them as a patch)",
            file=sys.stderr,
        )
    return code


def _analyse(args, settings: Settings, progress):
    """Run the engine over every file (each group of files that share rules in one runner pass),
    results in the order of ``settings.files``."""
    from flashport.rewriter.app.cache import ResultCache
    from flashport.rewriter.app.runner import run

    groups: dict[tuple[str, ...], list[str]] = {}
    rules_of: dict[tuple[str, ...], list] = {}
    for path in settings.files:
        rules = settings.rules_of(path)
        key = tuple(rule.CODE for rule in rules)
        groups.setdefault(key, []).append(path)
        rules_of[key] = rules
    progress.start("scanning", len(settings.files))
    found: dict[str, FileResult] = {}
    for key, paths in groups.items():
        cache: ResultCache | Literal[False] | None = None  # None: FLASHPORT_CACHE decides
        if args.cache is not None:
            cache = ResultCache.for_run(rules_of[key], settings.options) if args.cache else False
        stream = run(paths, rules_of[key], settings.options, settings.jobs, cache=cache, done=progress.done)
        found.update((result.path, result) for result in stream)
    progress.finish()
    return [found[path] for path in settings.files]


def _emit(args, fmt, mode, results, findings, written, code, progress, found, unreadable) -> None:
    """Print the run's results in the chosen format (``--diff``: only the patch on stdout); what
    discovery skipped goes with the summary (JSON, SARIF, text; stderr for the line formats)."""
    from flashport.rewriter.app import output_formats as out
    from flashport.rewriter.app import report as rep

    skipped = {
        "skipped": dict(found.counts(unreadable)),
        "skipped_paths": [{"path": p, "reason": m} for p, m in found.notices],
    }
    if fmt == "json":
        doc = rep.to_json(args.command, mode, results, written, code)
        doc["summary"] |= skipped
        doc["suppression_findings"] = [dataclasses.asdict(f) for f in findings]
        json.dump(doc, sys.stdout, indent=1)
        sys.stdout.write("\n")
    elif fmt == "concise":
        sys.stdout.write(out.concise(results, findings))
    elif fmt == "github":
        sys.stdout.write(out.github(results, findings))
    elif fmt == "sarif":
        from flashport import rules as registry

        summary = rep.summarize(results) | skipped
        sarif = out.sarif(results, findings, registry.all_rules(), flashport.__version__, summary)
        json.dump(sarif, sys.stdout, indent=1)
        sys.stdout.write("\n")
    if fmt in ("concise", "github"):
        _skipped_lines(found, unreadable, sys.stderr)
    if fmt != "full":
        return
    diff_only = args.command == "rewrite" and args.diff
    if diff_only:
        sys.stdout.write("".join(rep.unified_diff(result) for result in results))
    text = rep.TextReport(_color(args) and not diff_only, file=sys.stderr if diff_only else None)
    if args.command == "scan":
        text.scan(results)
    else:
        if not (args.interactive or diff_only or args.add_ignore):
            text.diffs(results)
        text.refusals(results)
        text.errors(results)
        text.summary(
            results, written=len(written) if args.write or args.interactive or args.add_ignore else None
        )
    text.findings(findings)
    _skipped_lines(found, unreadable, text.console.file)
    progress.report(results)


def _skipped_lines(found, unreadable: int, stream) -> None:
    """How many paths discovery skipped and why, then the ones it names."""
    stream.write(found.skipped_line(unreadable) + "\n")
    for path, message in found.notices:
        stream.write(f"skipped {path}: {message}\n")


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
    rows = [("code", "name", "source API", "becomes")]
    rows += [
        (rule.CODE, rule.NAME, rule.API, rule.TARGET or "(reported, not rewritten)") for rule in all_rules
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    for row in rows:  # one line a rule, never wrapped: grep-able; `flashport rules CODE` has the docs
        sys.stdout.write(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + f"  {row[3]}\n"
        )
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
    """Run the one-site-at-a-time review (:mod:`flashport.rewriter.app.interactive`); ``log`` records
    the files written."""
    from flashport.rewriter.app import report as rep
    from flashport.rewriter.app.interactive import record, review, stdin_asker

    out = sys.stdout if args.output_format in ("full", "text") else sys.stderr  # keep stdout parseable
    console = rep.TextReport(_color(args)).console
    console.file = out
    outcome = review(results, chosen, options, ask=stdin_asker(sys.stdin, out), console=console, log=log)
    record(results, outcome)


def _html_report(path, results, written, mode) -> int:
    """Write the ``--report`` HTML page (:mod:`flashport.rewriter.app.html_report`); EXIT_ERRORS if that fails."""
    from flashport.rewriter.app import html_report

    try:
        html_report.write(path, results, mode=mode, written=written)
    except OSError as err:
        print(f"flashport: error: cannot write report {path}: {err.strerror or err}", file=sys.stderr)
        return EXIT_ERRORS
    return 0
