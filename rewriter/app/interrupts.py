"""Stopping a run cleanly on Ctrl-C (SIGINT) and SIGTERM.

While :func:`stop_on_signals` is active, either signal raises :class:`Interrupted` in the main
thread (instead of a ``KeyboardInterrupt`` traceback or an abrupt SIGTERM death), so the command can
stop its workers, print what it did and exit with ``128 + signal number`` (130 for SIGINT, 143 for
SIGTERM, the shell convention). Inside :func:`held` (the few system calls that write one file) the
signal is only noted, and raised when the section ends: a file is never left half-written by it.
Worker processes ignore SIGINT (:func:`ignore_in_worker`); the parent stops them.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """The run was asked to stop by ``signum`` (a BaseException, like KeyboardInterrupt, so that
    ``except Exception`` handlers on the way do not swallow it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        """``SIGINT`` or ``SIGTERM``."""
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """``128 + signum``: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + self.signum


class _State:
    depth = 0  # nesting of held() sections
    pending: int | None = None  # a signal that arrived inside one


def _handler(signum: int, _frame) -> None:
    if _State.depth:
        _State.pending = signum
        return
    raise Interrupted(signum)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Turn SIGINT and SIGTERM into :class:`Interrupted` for the duration (main thread only;
    elsewhere the process's handlers are left as they are)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _handler) for signum in SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _State.pending = None


def stoppable(body: Callable[[], int], summary: Callable[[Interrupted], str]) -> int:
    """``body()``'s exit code, or, when SIGINT/SIGTERM stops it, ``128 + signum`` after writing
    ``summary(stop)`` to stderr (further signals are ignored while it is written)."""
    with stop_on_signals():
        try:
            return body()
        except Interrupted as stop:
            with _ignoring():
                with contextlib.suppress(OSError):  # a closed pipe must not hide the summary
                    sys.stdout.flush()
                sys.stderr.write(summary(stop))
                sys.stderr.flush()
            return stop.exit_code


@contextlib.contextmanager
def _ignoring() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Defer SIGINT/SIGTERM until the block is done (then raise :class:`Interrupted`)."""
    _State.depth += 1
    try:
        yield
    finally:
        _State.depth -= 1
        if _State.depth == 0 and _State.pending is not None:
            signum, _State.pending = _State.pending, None
            raise Interrupted(signum)


@contextlib.contextmanager
def blocked() -> Iterator[None]:
    """Block SIGINT/SIGTERM at the OS level while starting worker processes (they inherit the mask,
    so none dies with a traceback before :func:`ignore_in_worker` runs); a signal that arrives
    meanwhile is delivered when the block ends."""
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def ignore_in_worker() -> None:
    """In a worker process: ignore SIGINT (the terminal sends it to the whole process group; the
    parent decides) and die quietly on SIGTERM (how the parent stops it), then unblock both."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
