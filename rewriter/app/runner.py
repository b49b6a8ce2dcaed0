"""Running the engine over many files: byte prefilter in the parent, parsing in worker processes,
results in input order (deterministic output). Workers ignore SIGINT and are stopped by the
parent when the run is interrupted (:mod:`flashport.rewriter.app.interrupts`); writing back is
:mod:`flashport.rewriter.app.writes`.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

from flashport.rewriter.app import interrupts
from flashport.rewriter.app.cache import ResultCache, from_environment
from flashport.rewriter.app.writes import reason
from flashport.rewriter.engine.pipeline import transform_source, trigger_pattern
from flashport.rewriter.engine.results import ERROR, FileResult
from flashport.rewriter.source import text as src
from flashport.rewriter.source.files import read_regular
from flashport.rules.base import Rule, RuleOptions

CANNOT_READ = "cannot read: "  # how an unreadable file's error starts
_WORKER_STATE: dict = {}


def _init_worker(codes: tuple[str, ...], options: RuleOptions) -> None:
    from flashport import rules as registry

    interrupts.ignore_in_worker()
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
      cache: a :class:`~flashport.rewriter.app.cache.ResultCache` to reuse and fill; None: the one the
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
            data = read_regular(path)
        except OSError as err:
            slots.append(FileResult(path, ERROR, error=CANNOT_READ + reason(err)))
            continue
        foreign = src.foreign_encoding(data)
        if foreign:
            slots.append(FileResult(path, ERROR, error=foreign, size=len(data)))
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
    with interrupts.blocked():  # the workers start with SIGINT/SIGTERM blocked, then ignore SIGINT
        pool = context.Pool(min(jobs, len(todo)), initializer=_init_worker, initargs=(codes, options))
    finished = False
    try:
        asked = {}
        for position in sorted(range(len(todo)), key=lambda i: -len(todo[i][2])):
            _, path, data = todo[position]
            finish = functools.partial(_finished, done, path)  # completion order, for progress
            asked[position] = pool.apply_async(_work, ((path, data),), callback=finish, error_callback=finish)
        computed = (asked[position].get() for position in range(len(todo)))
        yield from _merge(slots, todo, remember(computed), progress)
        finished = True
    finally:
        if finished:
            pool.close()
        else:  # interrupted, or the consumer stopped early: stop the workers now
            pool.terminate()
        pool.join()


def _finished(done: Callable[[str], None], path: str, _outcome: object) -> None:
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
