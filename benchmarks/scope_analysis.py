"""Where the fast mode still runs libcst's scope analysis, over the cached real-code corpus.

Run:  python benchmarks/scope_analysis.py [--limit N] [--list]

The engine's semantic model (``rewriter/source/semantic.py``) answers the libcst pass's name
questions; ``ScopeProvider`` runs only for a question the model leaves undecided. This ports, in
the fast mode, every Python file that mentions a trigger under the caches that
``benchmarks/corpus.py`` and ``benchmarks/real_repos.py`` fill (``$FLASHPORT_BENCH_CACHE`` or
``~/.cache/flashport-bench``, subfolders ``corpus/`` and ``real_repos/``; run those first), and
prints how many files ran the scope analysis, how many of those have sites, which question asked
first (the engine's method), and the engine's CPU seconds. ``--list`` prints those files.
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import sys
import time
import traceback

from libcst.metadata import MetadataWrapper, ScopeProvider

from flashport import rules as registry
from flashport.rewriter.engine import pipeline


def corpus_files() -> list[pathlib.Path]:
    """Every ``.py`` file under the corpus caches, sorted."""
    base = os.environ.get("FLASHPORT_BENCH_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "flashport-bench"
    )
    roots = [pathlib.Path(base, "corpus"), pathlib.Path(base, "real_repos")]
    return sorted(p for root in roots if root.is_dir() for p in root.rglob("*.py") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    """Port the corpus in the fast mode and report where ``ScopeProvider`` ran."""
    parser = argparse.ArgumentParser(prog="benchmarks/scope_analysis.py", description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=0, help="only the first N files that mention a trigger")
    parser.add_argument("--list", action="store_true", help="print the files that ran the scope analysis")
    args = parser.parse_args(argv)
    rules = registry.all_rules()
    pattern = pipeline.trigger_pattern(rules)
    asked: dict[str, str] = {}  # file -> the engine method that first asked
    current = [""]
    resolve = MetadataWrapper.resolve

    def counting(wrapper, provider):
        if provider is ScopeProvider and current[0] not in asked:
            frames = [f.name for f in traceback.extract_stack()[:-1]]
            asked[current[0]] = next(
                (n for n in reversed(frames) if n not in ("_scope", "_scope_names")), "?"
            )
        return resolve(wrapper, provider)

    MetadataWrapper.resolve = counting  # type: ignore[method-assign]
    files = sites = with_sites = 0
    seconds = 0.0
    scoped_with_sites = 0
    for path in corpus_files():
        data = path.read_bytes()
        if not pattern.search(data):
            continue
        files += 1
        current[0] = str(path)
        start = time.process_time()
        result = pipeline.transform_source(data, str(path), rules, reference=False, pattern=pattern)
        seconds += time.process_time() - start
        sites += len(result.sites)
        with_sites += bool(result.sites)
        scoped_with_sites += bool(result.sites) and str(path) in asked
        if args.limit and files >= args.limit:
            break
    MetadataWrapper.resolve = resolve  # type: ignore[method-assign]
    if not files:
        print("no cached corpus files: run benchmarks/corpus.py and benchmarks/real_repos.py first")
        return 1
    print(
        f"files mentioning a trigger: {files} ({with_sites} with sites, {sites} sites); engine CPU {seconds:.1f} s"
    )
    print(f"ScopeProvider ran (fast mode): {len(asked)} files, {scoped_with_sites} of them with sites")
    for question, count in collections.Counter(asked.values()).most_common():
        print(f"  first asked by {question}: {count}")
    if args.list:
        for path_name, question in sorted(asked.items()):
            print(f"  {path_name}  ({question})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
