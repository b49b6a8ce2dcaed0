"""Running the engine over many files: byte prefilter in the parent, parsing in worker processes,
results in input order (deterministic output), and atomic writes.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Literal

from flashport.rewriter.cache import ResultCache, from_environment
from flashport.rewriter.engine import transform_source, trigger_pattern
from flashport.rewriter.results import ERROR, FileResult
from flashport.rules.base import Rule, RuleOptions

_WORKER_STATE: dict = {}


def _init_worker(codes: tuple[str, ...], options: RuleOptions) -> None:
    from flashport import rules as registry

    chosen = [registry.get(code) for code in codes]
    _WORKER_STATE["rules"] = chosen
    _WORKER_STATE["options"] = options
    _WORKER_STATE["pattern"] = trigger_pattern(chosen)


def _work(item: tuple[str, bytes]) -> FileResult:
    path, data = item
    return _timed(data, path, _WORKER_STATE["rules"], _WORKER_STATE["options"], _WORKER_STATE["pattern"])


def _timed(data, path, rules, options, pattern) -> FileResult:
    """:func:`transform_source`, with its duration in ``seconds`` (for the slowest-files summary)."""
    started = time.perf_counter()
    result = transform_source(data, path, rules, options, pattern)
    result.seconds = time.perf_counter() - started
    return result


def run(
    paths: Sequence[str],
    rules: Sequence[type[Rule]],
    options: RuleOptions,
    jobs: int | None = None,
    progress: Callable[[FileResult], None] | None = None,
    cache: ResultCache | Literal[False] | None = None,
    done: Callable[[str], None] | None = None,
) -> Iterator[FileResult]:
    """Yield one :class:`FileResult` per path, in the order of ``paths``.

    Files are read in this process and checked with the byte prefilter; only files that pass are
    sent to ``jobs`` worker processes (inline when there are few), largest first so that one big
    file does not finish alone at the end.

    Args:
      cache: a :class:`~flashport.rewriter.cache.ResultCache` to reuse and fill; None: the one the
        ``FLASHPORT_CACHE`` environment variable asks for (default: none); False: no cache.
      done: called with each path as soon as its result is known, in completion order (from the
        pool's result thread when there are workers), for a progress bar.
    """
    done = done or (lambda path: None)
    pattern = trigger_pattern(rules)
    jobs = max(1, jobs or os.cpu_count() or 1)
    if cache is None:
        cache = from_environment(rules, options)
    slots: list[FileResult | None] = []
    todo: list[tuple[int, str, bytes]] = []
    for index, path in enumerate(paths):
        try:
            with open(path, "rb") as handle:
                data = handle.read()
        except OSError as err:
            slots.append(FileResult(path, ERROR, error=f"cannot read: {err.strerror or err}"))
            continue
        if not pattern.search(data):
            slots.append(FileResult(path, size=len(data)))
            done(path)
            continue
        cached = cache.get(path, data) if cache else None
        slots.append(cached)
        if cached is None:
            todo.append((index, path, data))
        else:
            done(path)
    try:
        yield from _compute(slots, todo, rules, options, pattern, jobs, cache, progress, done)
    finally:
        if cache:
            cache.save()


def _compute(slots, todo, rules, options, pattern, jobs, cache, progress, done) -> Iterator[FileResult]:
    def remember(computed):
        for (_, path, data), result in zip(todo, computed, strict=False):
            if cache:
                cache.put(path, data, result)
            yield result

    if jobs == 1 or len(todo) <= 1:
        computed = (_inline(data, path, rules, options, pattern, done) for _, path, data in todo)
        yield from _merge(slots, todo, remember(computed), progress)
        return
    codes = tuple(rule.CODE for rule in rules)
    # fork is cheapest, but unsafe once a multithreaded runtime (jax, torch) is loaded in this
    # process (e.g. when the engine is called from a library or a test session): spawn then.
    threaded = any(name in sys.modules for name in ("jax", "torch"))
    context = multiprocessing.get_context("spawn" if threaded else "fork")
    with ProcessPoolExecutor(
        max_workers=min(jobs, len(todo)),
        mp_context=context,
        initializer=_init_worker,
        initargs=(codes, options),
    ) as pool:
        futures: dict[int, Future[FileResult]] = {}
        for position in sorted(range(len(todo)), key=lambda i: -len(todo[i][2])):
            _, path, data = todo[position]
            futures[position] = pool.submit(_work, (path, data))
            futures[position].add_done_callback(functools.partial(_finished, done, path))
        computed = (futures[position].result() for position in range(len(todo)))
        yield from _merge(slots, todo, remember(computed), progress)


def _finished(done: Callable[[str], None], path: str, _future: Future) -> None:
    done(path)


def _inline(data, path, rules, options, pattern, done) -> FileResult:
    result = _timed(data, path, rules, options, pattern)
    done(path)
    return result


def _merge(slots, todo, computed, progress) -> Iterator[FileResult]:
    pending = iter(todo)
    next_todo = next(pending, None)
    for index, slot in enumerate(slots):
        if slot is None:
            assert next_todo is not None and next_todo[0] == index
            slot = next(computed)
            next_todo = next(pending, None)
        if progress is not None:
            progress(slot)
        yield slot


class StaleFile(RuntimeError):
    """The file changed on disk after it was read; it is not overwritten."""


def atomic_write(path: str, old: bytes, new: bytes) -> None:
    """Replace ``path``'s content ``old`` with ``new``: a temp file in the same folder, fsync,
    the original mode bits, then ``os.replace`` (readers see the old or the new file, never a mix).

    Raises:
      StaleFile: when the file no longer holds ``old``.
      OSError: from the filesystem (the temp file is removed).
    """
    with open(path, "rb") as handle:
        if handle.read() != old:
            raise StaleFile(f"{path} changed since it was read; not written")
    mode = os.stat(path).st_mode & 0o7777
    directory, name = os.path.split(os.path.abspath(path))
    fd, temp = tempfile.mkstemp(prefix=f".{name}.", suffix=".flashport-tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(new)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temp, mode)
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise
