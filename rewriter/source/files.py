"""Reading a source file's bytes: never blocking on a FIFO or a device, never following a non-file.

The runner, discovery and the run-wide pre-pass read through :func:`read_regular`; the file writes
(:mod:`flashport.rewriter.app.writes`) share its checks.
"""

from __future__ import annotations

import errno
import os
import stat


def read_regular(path: str) -> bytes:
    """The bytes of ``path`` (links followed), without ever blocking on a FIFO or a device.

    Raises:
      OSError: unreadable, or not a regular file (``EINVAL`` with the file's kind in the message).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        require_regular(fd, path)
        return read_all(fd)
    finally:
        os.close(fd)


def kind_of(mode: int) -> str:
    """A word for a file type (``FIFO``, ``socket``, ``directory``...) from ``st_mode``."""
    for test, word in (
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(mode):
            return word
    return "special file"


def require_regular(fd: int, path: str) -> int:
    """The file's ``st_mode``; OSError unless it is a regular file."""
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        raise OSError(errno.EINVAL, f"not a regular file ({kind_of(mode)})", path)
    return mode


def read_all(fd: int) -> bytes:
    """Every byte of the open file ``fd``, read from offset 0 (the descriptor's position is left alone)."""
    chunks = []
    offset = 0
    while chunk := os.pread(fd, 1 << 20, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def read_if_file(path: str) -> bytes | None:
    """The bytes of a regular file, or None (gone, unreadable, not a regular file)."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError:
        return None
