"""Writing a port back into its file, in place, and never half-written.

The file is rewritten through a descriptor opened on it (as black and ruff do), so its inode, hard
links, owner, group and mode stay as they were and a symbolic link is written through, never
replaced by a regular file. What makes that safe:

- **Stale check.** The bytes are read again through the same descriptor; if they are no longer the
  ones the port was computed from, the file is refused (:class:`StaleFile`) and not touched.
- **Backup first.** Before the first byte changes, a copy of the original is written and fsynced
  next to the real file (``.NAME.XXXX.flashport-backup``, mode 0600) and removed once the new
  content is on disk. A crash of the machine, or SIGKILL, in the middle of the write leaves that copy
  behind, holding the original. (When the folder is not writable the write goes ahead without it; the
  guarantees below still hold.)
- **Errors roll back.** If a write fails part-way (disk full, quota, I/O error), the original bytes
  are written back from memory and the length restored before the error is reported; the backup is
  kept only if that too fails, and the error names it.
- **Signals wait.** SIGINT and SIGTERM are held while the file is written
  (:func:`flashport.rewriter.app.interrupts.held`): an interrupted run leaves every file old or new.
- Opening is non-blocking and anything but a regular file is refused, so a FIFO never blocks.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import sys
import tempfile
from collections.abc import Callable, Sequence

from flashport.rewriter.app import interrupts
from flashport.rewriter.engine import suppression_comments as comments
from flashport.rewriter.engine.results import CHANGED, ERROR, REFUSED, UNCHANGED, FileResult
from flashport.rewriter.source import text as src
from flashport.rewriter.source.files import read_all, read_if_file, require_regular

BACKUP_SUFFIX = ".flashport-backup"


class StaleFile(RuntimeError):
    """The file changed on disk after it was read; it is not overwritten."""


def write_in_place(path: str, old: bytes, new: bytes) -> None:
    """Replace ``path``'s content ``old`` with ``new`` in place (see the module docstring).

    Raises:
      StaleFile: the file no longer holds ``old``.
      OSError: the file cannot be written (permissions, read-only file system, disk full...); the
        file holds ``old``.
    """
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = require_regular(fd, path)
        if read_all(fd) != old:
            raise StaleFile("changed on disk since it was read; not written")
        backup = _backup(path, old)
        with interrupts.held():
            try:
                _put(fd, new)
            except OSError as err:
                try:
                    _put(fd, old)
                except OSError:
                    kept = f"; the original is kept in {backup}" if backup else ""
                    raise OSError(err.errno, f"{err.strerror}{kept}") from err
                _remove(backup)
                raise
            _remove(backup)
            _keep_mode(fd, mode)
    finally:
        os.close(fd)


def _keep_mode(fd: int, mode: int) -> None:
    """Put back setuid/setgid bits the kernel clears when someone without CAP_FSETID writes a file."""
    if os.fstat(fd).st_mode != mode:
        try:
            os.fchmod(fd, stat.S_IMODE(mode))
        except OSError:
            pass


def _put(fd: int, data: bytes) -> None:
    """Write ``data`` from offset 0, cut the file to its length, fsync."""
    view = memoryview(data)
    offset = 0
    while offset < len(data):
        offset += os.pwrite(fd, view[offset:], offset)
    os.ftruncate(fd, len(data))
    os.fsync(fd)


def _backup(path: str, old: bytes) -> str | None:
    """A fsynced copy of ``old`` beside the real file; None when its folder is not writable."""
    real = os.path.realpath(path)
    directory, name = os.path.split(real)
    try:
        fd, backup = tempfile.mkstemp(prefix=f".{name}.", suffix=BACKUP_SUFFIX, dir=directory)
    except PermissionError:
        return None
    try:
        _put(fd, old)
    except BaseException:
        os.close(fd)
        _remove(backup)
        raise
    os.close(fd)
    return backup


def _remove(backup: str | None) -> None:
    if backup is not None:
        try:
            os.unlink(backup)
        except OSError:
            pass


@dataclasses.dataclass
class WriteLog:
    """What a run wrote and meant to write, kept up to date so that an interrupted run can say so.

    Attributes:
      stage: ``"scan"`` until writing starts, then ``"write"`` (or ``"review"`` for --interactive).
      planned: the files the run means to write (known once the scan is done).
      written: the files written so far, in order.
      settled: planned files dealt with that needed no write (every site declined in the review).
    """

    stage: str = "scan"
    planned: list[str] = dataclasses.field(default_factory=list)
    written: list[str] = dataclasses.field(default_factory=list)
    settled: list[str] = dataclasses.field(default_factory=list)

    def not_reached(self) -> list[str]:
        """Planned files neither written nor settled (yet)."""
        done = set(self.written) | set(self.settled)
        return [path for path in self.planned if path not in done]

    def interrupted(self, signal_name: str) -> str:
        """The summary an interrupted run prints: where it stopped, the files written and the files
        not reached (every file is either untouched or completely written)."""
        if self.stage == "scan":
            return f"flashport: interrupted by {signal_name} during the scan; no file was written\n"
        lines = [
            f"flashport: interrupted by {signal_name} during the {self.stage}: "
            f"{len(self.written)} file(s) written, {len(self.not_reached())} not reached; "
            "each file is either untouched or completely written"
        ]
        if self.stage == "review":
            lines.append(
                "  the answers given so far were applied (declined and unanswered sites are left as "
                "they were); run the same command again to review the rest"
            )
        lines += [f"  written: {path}" for path in self.written]
        lines += [f"  not reached: {path}" for path in self.not_reached()]
        return "\n".join(lines) + "\n"


def write_results(
    results: Sequence[FileResult], log: WriteLog, done: Callable[[str], None] | None = None
) -> None:
    """Write every changed result in place; a file that cannot be written becomes an error result
    (``write failed: <reason>``) and the others are still written. ``done(path)`` follows each file
    (a progress bar)."""
    todo = [r for r in results if r.status == CHANGED and r.old is not None and r.new is not None]
    log.planned = [r.path for r in todo]
    log.stage = "write"
    for result in todo:
        assert result.old is not None and result.new is not None
        with interrupts.held():  # a signal during the write waits until the log says so
            try:
                write_in_place(result.path, result.old, result.new)
            except (OSError, StaleFile) as err:
                result.status, result.error = ERROR, f"write failed: {reason(err)}"
            else:
                log.written.append(result.path)
        if done is not None:
            done(result.path)


def reason(err: Exception) -> str:
    """A one-line reason for a failed read or write (``Permission denied``, ``No space left on
    device``, ``changed since it was read``...)."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    return str(err)


def add_ignores_in_run(results: Sequence[FileResult], log, progress) -> None:
    """``rewrite --add-ignore``: :func:`~flashport.rewriter.engine.suppression_comments.add_ignores` on every file with a refused site, written in
    place (the paths go to ``log.written``, a :class:`WriteLog`).
    Nothing is rewritten: every other file reads unchanged, and a file that cannot be marked is an
    error result."""
    todo = [r for r in results if r.status != ERROR and any(s.status == REFUSED for s in r.sites)]
    progress.start("adding ignores", len(todo))
    for result in results:
        if result.status != ERROR:
            result.status, result.new = UNCHANGED, None
    for result in todo:
        data = result.old if result.old is not None else read_if_file(result.path)
        try:
            if data is None:
                raise OSError("cannot read it again")
            text, encoding = src.decode(data)
            marked, missed = comments.add_ignores(text, result.sites)
            with interrupts.held():  # a signal during the write waits until the log says so
                write_in_place(result.path, data, src.encode(marked, encoding))
                log.written.append(result.path)
            for site in missed:
                print(
                    f"flashport: {site.path}:{site.line}: no comment can end either line of this "
                    f"{site.rule} site (a string or a backslash continues it); add one by hand",
                    file=sys.stderr,
                )
        except (OSError, StaleFile, UnicodeError, SyntaxError) as err:
            result.status, result.error = ERROR, f"write failed: {reason(err)}"
        progress.done(result.path)
    progress.finish()
