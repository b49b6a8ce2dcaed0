"""Regenerate docs/walkthrough.svg: the rich output of ``flashport scan examples/`` and
``flashport rewrite examples/jax_flax_model.py`` (dry run), recorded with rich's SVG export.

Run from the repository root::

    python docs/make_walkthrough_svg.py            # writes docs/walkthrough.svg
    python docs/make_walkthrough_svg.py OUT.svg

Nothing is written under examples/ (a dry run); only the SVG file changes.
"""

from __future__ import annotations

import io
import os
import sys

from rich.console import Console

from flashport import rules as registry
from flashport.rewriter.app import report as rep
from flashport.rewriter.app.discover import discover
from flashport.rewriter.app.runner import run
from flashport.rules.base import RuleOptions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDTH = 120


def record() -> Console:
    """Run scan over examples/ and a dry-run rewrite of the JAX example into a recording console."""
    os.chdir(ROOT)
    console = Console(record=True, force_terminal=True, width=WIDTH, file=io.StringIO(), highlight=False)
    text = rep.TextReport(color=True)
    text.console = console
    rules = registry.all_rules()
    console.print("[bold]$ flashport scan examples/[/]")
    text.scan(list(run(discover(["examples"]), rules, RuleOptions(), jobs=1)))
    console.print("\n[bold]$ flashport rewrite examples/jax_flax_model.py[/]")
    results = list(run(["examples/jax_flax_model.py"], rules, RuleOptions(format_rewrites=True), jobs=1))
    text.diffs(results)
    text.refusals(results)
    text.summary(results)
    return console


def main(argv: list[str] | None = None) -> int:
    """Write the SVG (default docs/walkthrough.svg)."""
    argv = sys.argv[1:] if argv is None else argv
    out = os.path.abspath(argv[0]) if argv else os.path.join(ROOT, "docs", "walkthrough.svg")
    record().save_svg(out, title="flashport: scan and review")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
