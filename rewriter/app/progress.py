"""Progress of a run on a terminal: a bar per phase (scanning, writing) that advances as each file
finishes, in completion order (results are still reported in path order), then the elapsed time and
the slowest files under the summary. All of it goes to stderr, and only when stderr is a terminal:
piped or redirected output never holds a bar or a timing.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

from flashport.rewriter.engine.results import FileResult

SLOWEST = 3  # how many of the slowest files the summary names
_MIN_SECONDS = 0.05  # files faster than this are not worth naming


class Progress:
    """A rich progress bar on stderr, or nothing when ``enabled`` is false.

    Use as a context manager; :meth:`start` a phase with its file count, call :meth:`done` as each
    file finishes (from any thread: the runner calls it from its result thread), :meth:`finish` it.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.started = time.perf_counter()
        self._bar: Any = None  # a rich Progress while shown
        self._task: Any = None

    def __enter__(self) -> Progress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as Bar

            self._bar = Bar(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(file=sys.stderr),
                transient=True,
            )
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, label: str, total: int) -> None:
        """Begin a phase of ``total`` files."""
        if self._bar is not None:
            self._task = self._bar.add_task(label, total=total)

    def done(self, path: str) -> None:
        """One file of the current phase finished."""
        if self._bar is not None and self._task is not None:
            self._bar.advance(self._task)

    def finish(self) -> None:
        """End the current phase (its bar disappears)."""
        if self._bar is not None and self._task is not None:
            self._bar.remove_task(self._task)
            self._task = None

    def stop(self) -> None:
        """Take the bar off the terminal (before a prompt, or at the end)."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def report(self, results: Sequence[FileResult]) -> None:
        """Under the summary, on stderr: the elapsed time and the slowest files."""
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.started
        slow = sorted((r for r in results if r.seconds >= _MIN_SECONDS), key=lambda r: -r.seconds)[:SLOWEST]
        line = f"done in {elapsed:.1f} s"
        if slow:
            line += "; slowest: " + ", ".join(f"{r.path} ({r.seconds:.2f} s)" for r in slow)
        print(line, file=sys.stderr)
