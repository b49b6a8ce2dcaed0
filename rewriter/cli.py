"""The ``flashport`` command line."""

from __future__ import annotations

import argparse
import sys

import flashport


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``flashport`` command."""
    parser = argparse.ArgumentParser(
        prog="flashport",
        description="Port GPU flash-attention code to the portable flashport.attention API.",
    )
    parser.add_argument("--version", action="version", version=f"flashport {flashport.__version__}")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code."""
    parser = build_parser()
    parser.parse_args(argv)
    parser.print_help(sys.stdout)
    return 0
