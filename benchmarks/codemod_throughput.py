"""Codemod throughput on a real third-party tree (transformers 4.46.3, 1,813 files, 44 MB).

Run:  /work/venv/bin/python benchmarks/codemod_throughput.py [--jobs 2] [--naive-budget 60]

Fetches the wheel once with ``pip download --no-deps`` into a cache outside the repository
(``$FLASHPORT_BENCH_CACHE`` or ``~/.cache/flashport-bench``), unpacks it, then times, side by side:

* ``grep -rlE`` over the trigger names: the I/O floor (best of 3);
* ``flashport scan`` and ``flashport rewrite`` (dry run), as subprocesses with ``--format json``:
  cold (no result cache), then warm (``FLASHPORT_CACHE`` pointing at a temporary directory filled
  by one run first; the warm JSON must equal the cold JSON);
* a naive baseline: ``libcst.parse_module`` + ``QualifiedNameProvider`` + a visitor over *every*
  file. It would take many minutes, so it is **time-boxed**: it runs on an evenly spaced sample
  of files until ``--naive-budget`` CPU seconds are spent and is extrapolated by bytes to the whole
  tree and divided by ``--jobs`` (the estimate is labelled as such).

Prints files/s, MB/s and ratios to the grep floor.

Then the cost per site on site-dense files, each ported in a fresh child process that times only
the engine (``transform_source``; medians of ``--repeats`` runs, CPU and wall):

* a generated file of ``--sites`` ``flash_attn_func`` calls, 20 a function (issue goal: <= 1 ms
  a site, 20,000 sites in < 20 s);
* flash-attn 2.8.3's own ``tests/test_flash_attn.py`` (2,525 lines), from the sdist fetched with
  ``pip download --no-deps --no-binary :all: --no-build-isolation`` into the same cache
  (``FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE``: metadata only, nothing is compiled).

``--dense-only`` skips the transformers tree. A child imports ``flashport`` the usual way, so
``PYTHONPATH`` pointing at another checkout's package measures that version side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile

PACKAGE, VERSION = "transformers", "4.46.3"
PATTERN = "flash_attn|scaled_dot_product_attention|dot_product_attention|sdp_kernel|sdpa_kernel|flash_attention_2|flash_attention_3"


def fetch(cache: str) -> str:
    """Download and unpack the wheel once; return the package directory."""
    os.makedirs(cache, exist_ok=True)
    tree = os.path.join(cache, f"{PACKAGE}-{VERSION}")
    if os.path.isdir(os.path.join(tree, PACKAGE)):
        return os.path.join(tree, PACKAGE)
    wheels = [f for f in os.listdir(cache) if f.startswith(f"{PACKAGE}-{VERSION}-") and f.endswith(".whl")]
    if not wheels:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-q",
                f"{PACKAGE}=={VERSION}",
                "-d",
                cache,
            ],
            check=True,
        )
        wheels = [
            f for f in os.listdir(cache) if f.startswith(f"{PACKAGE}-{VERSION}-") and f.endswith(".whl")
        ]
    with zipfile.ZipFile(os.path.join(cache, wheels[0])) as archive:
        archive.extractall(tree)
    return os.path.join(tree, PACKAGE)


def python_files(root: str) -> list[str]:
    """Every .py file under ``root``, sorted."""
    out = []
    for directory, dirs, files in os.walk(root):
        dirs.sort()
        out.extend(os.path.join(directory, f) for f in sorted(files) if f.endswith(".py"))
    return out


CPU: dict[str, float] = {}


def timed(
    cmd: list[str], label: str = "", cache: str | None = None
) -> tuple[float, subprocess.CompletedProcess]:
    """Wall seconds and the completed process; CPU seconds (user+sys of the child and its
    workers) go to ``CPU[label]`` -- on a shared host they are the steadier figure. ``cache``: a
    result-cache directory (``FLASHPORT_CACHE``); without it the run is cold (no cache at all)."""
    env = {k: v for k, v in os.environ.items() if k != "FLASHPORT_CACHE"}
    if cache:
        env["FLASHPORT_CACHE"] = cache
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU[label] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, proc


def naive(files: list[str], budget: float) -> tuple[float, int, int]:
    """libcst parse + QualifiedNameProvider over a spaced sample; returns (cpu s, files, bytes)."""
    import libcst as cst
    from libcst.metadata import MetadataWrapper, QualifiedNameProvider

    class Visit(cst.CSTVisitor):
        METADATA_DEPENDENCIES = (QualifiedNameProvider,)

        def visit_Call(self, node):
            self.get_metadata(QualifiedNameProvider, node.func, set())

    order = []  # interleave so the sample spreads over the tree: 0, n/2, n/4, 3n/4, ...
    step = len(files)
    seen = set()
    while step >= 1 and len(order) < len(files):
        for i in range(0, len(files), step):
            if i not in seen:
                seen.add(i)
                order.append(i)
        step //= 2
    spent, count, size = 0.0, 0, 0
    for i in order:
        data = open(files[i], "rb").read()
        start = time.process_time()
        try:
            MetadataWrapper(cst.parse_module(data)).visit(Visit())
        except Exception:  # noqa: BLE001 - a failing file still costs time
            pass
        spent += time.process_time() - start
        count += 1
        size += len(data)
        if spent >= budget:
            break
    return spent, count, size


FLASH_ATTN = ("flash-attn", "2.8.3", "flash_attn-2.8.3/tests/test_flash_attn.py")


def fetch_flash_attn_test(cache: str) -> str | None:
    """flash-attn's own site-dense test file from its sdist (fetched once); None when unavailable."""
    name, version, member = FLASH_ATTN
    target = os.path.join(cache, "flash_attn-tests", member)
    if os.path.isfile(target):
        return target
    sdist = os.path.join(cache, f"flash_attn-{version}.tar.gz")
    if not os.path.isfile(sdist):
        env = dict(os.environ, FLASH_ATTENTION_SKIP_CUDA_BUILD="TRUE")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        cmd += ["--no-build-isolation", "-q", f"{name}=={version}", "-d", cache]
        if subprocess.run(cmd, env=env, capture_output=True).returncode != 0 or not os.path.isfile(sdist):
            print(f"could not download {name}=={version} (sdist); skipping the real test file")
            return None
    with tarfile.open(sdist) as archive:
        archive.extract(member, os.path.join(cache, "flash_attn-tests"), filter="data")
    return target


def generated(sites: int) -> bytes:
    """A file of ``sites`` flash_attn_func calls, 20 a function."""
    lines = ["from flash_attn import flash_attn_func\n\n"]
    for f in range(max(1, sites // 20)):
        lines.append(f"\ndef f{f}(q, k, v):\n")
        lines += [
            f"    o{i} = flash_attn_func(q, k, v, causal=True, softmax_scale=0.{i % 9 + 1})\n"
            for i in range(min(20, sites))
        ]
        lines.append("    return q\n")
    return "".join(lines).encode()


def _dense_child(path: str) -> int:
    """Port one file with every rule and print {sites, changed, cpu, wall} as JSON (child process)."""
    from flashport import rules as registry
    from flashport.rewriter.engine.pipeline import transform_source
    from flashport.rules.base import RuleOptions

    data = open(path, "rb").read()
    rules = registry.all_rules()
    transform_source(generated(20), "warm.py", rules, RuleOptions())  # imports, regex compilation
    wall, cpu = time.perf_counter(), time.process_time()
    result = transform_source(data, path, rules, RuleOptions())
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    doc = {
        "sites": len(result.sites),
        "status": result.status,
        "error": result.error,
        "cpu": cpu,
        "wall": wall,
    }
    print(json.dumps(doc))
    return 0


def dense(label: str, path: str, repeats: int) -> dict | None:
    """Median CPU and wall seconds of ``repeats`` fresh-process ports of ``path``."""
    runs = []
    for _ in range(repeats):
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--dense-child", path],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(path),  # not the repository root: PYTHONPATH decides which flashport
        )
        if proc.returncode != 0:
            print(f"{label}: child failed:\n{proc.stderr[-2000:]}")
            return None
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    if runs[0]["status"] == "error":
        print(f"{label}: {runs[0]['error']}")
        return None
    cpu = statistics.median(r["cpu"] for r in runs)
    wall = statistics.median(r["wall"] for r in runs)
    return {
        "label": label,
        "bytes": os.path.getsize(path),
        "sites": runs[0]["sites"],
        "cpu": cpu,
        "wall": wall,
    }


def dense_report(args) -> None:
    """The per-site table for the generated and the real site-dense file."""
    with tempfile.TemporaryDirectory() as tmp:
        gen_path = os.path.join(tmp, "generated.py")
        with open(gen_path, "wb") as handle:
            handle.write(generated(args.sites))
        rows = [dense(f"generated, {args.sites} flash_attn_func calls", gen_path, args.repeats)]
    real = fetch_flash_attn_test(args.cache)
    if real:
        rows.append(dense("flash-attn 2.8.3 tests/test_flash_attn.py", real, args.repeats))
    print(f"\nsite-dense files (medians of {args.repeats} fresh processes, engine only):")
    print(f"{'file':<48} {'MB':>6} {'sites':>6} {'CPU s':>7} {'wall s':>7} {'ms/site CPU':>12} {'wall':>7}")
    for row in filter(None, rows):
        n = max(row["sites"], 1)
        print(
            f"{row['label']:<48} {row['bytes'] / 1e6:>6.2f} {row['sites']:>6} {row['cpu']:>7.2f} "
            f"{row['wall']:>7.2f} {1000 * row['cpu'] / n:>12.2f} {1000 * row['wall'] / n:>7.2f}"
        )
    print("goal: <= 1 ms a site; the 20,000-site file in < 20 s")


def main(argv=None) -> int:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--naive-budget", type=float, default=60.0, help="CPU seconds for the naive sample")
    parser.add_argument(
        "--cache",
        default=os.environ.get("FLASHPORT_BENCH_CACHE", os.path.expanduser("~/.cache/flashport-bench")),
    )
    parser.add_argument("--sites", type=int, default=20000, help="calls in the generated site-dense file")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per site-dense file (median)")
    parser.add_argument("--dense-only", action="store_true", help="only the site-dense files")
    parser.add_argument("--dense-child", metavar="PATH", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dense_child:
        return _dense_child(args.dense_child)
    if args.dense_only:
        dense_report(args)
        return 0

    root = fetch(args.cache)
    files = python_files(root)
    total_bytes = sum(os.path.getsize(f) for f in files)
    mb = total_bytes / 1e6
    print(f"tree: {root}\nfiles: {len(files)}, {mb:.1f} MB, jobs={args.jobs}, cpus={os.cpu_count()}")

    grep_times = []
    for _ in range(3):
        seconds, proc = timed(["grep", "-rlE", "--include=*.py", PATTERN, root], "grep")
        grep_times.append(seconds)
    grep_s = min(grep_times)
    grep_hits = len(proc.stdout.split())

    cli = [sys.executable, "-m", "flashport"]
    flags = ["--format", "json", "--jobs", str(args.jobs), "--isolated", "--no-gitignore"]
    scan_s, scan = timed(cli + ["scan", root] + flags, "scan")
    rewrite_s, rewrite = timed(cli + ["rewrite", root] + flags, "rewrite")
    with tempfile.TemporaryDirectory() as cache:  # warm: the result cache filled by one run first
        timed(cli + ["scan", root] + flags, "fill", cache)
        warm_scan_s, warm_scan = timed(cli + ["scan", root] + flags, "warm scan", cache)
        warm_rewrite_s, warm_rewrite = timed(cli + ["rewrite", root] + flags, "warm rewrite", cache)
    for name, proc in (
        ("scan", scan),
        ("rewrite", rewrite),
        ("warm scan", warm_scan),
        ("warm rewrite", warm_rewrite),
    ):
        if proc.returncode not in (0, 3):
            print(f"{name} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
            return 1
    scan_doc, rewrite_doc = json.loads(scan.stdout), json.loads(rewrite.stdout)
    if json.loads(warm_scan.stdout) != scan_doc or json.loads(warm_rewrite.stdout) != rewrite_doc:
        print("warm (cached) results differ from cold results")
        return 1

    naive_cpu, naive_files, naive_bytes = naive(files, args.naive_budget)
    naive_est = naive_cpu * total_bytes / max(naive_bytes, 1) / args.jobs

    naive_cpu_est = naive_cpu * total_bytes / max(naive_bytes, 1)
    rows = [
        ("grep -rlE (floor, best of 3)", grep_s, CPU["grep"]),
        ("flashport scan", scan_s, CPU["scan"]),
        ("flashport rewrite (dry run)", rewrite_s, CPU["rewrite"]),
        ("flashport scan, WARM result cache (FLASHPORT_CACHE)", warm_scan_s, CPU["warm scan"]),
        ("flashport rewrite (dry run), WARM result cache", warm_rewrite_s, CPU["warm rewrite"]),
        (
            f"naive libcst+QualifiedName, ESTIMATE from {naive_files} files/{naive_bytes / 1e6:.1f} MB",
            naive_est,
            naive_cpu_est,
        ),
    ]
    print(
        f"\nload average before the runs: {os.getloadavg()[0]:.1f} (wall times inflate when it exceeds the core count)"
    )
    print(f"{'what':<70} {'wall s':>8} {'CPU s':>8} {'files/s':>8} {'MB/s':>7} {'x grep':>7}")
    for name, seconds, cpu in rows:
        print(
            f"{name:<70} {seconds:>8.2f} {cpu:>8.2f} {len(files) / seconds:>8.0f} {mb / seconds:>7.2f} {seconds / grep_s:>7.1f}"
        )
    summary = scan_doc["summary"]
    print(
        f"\ngrep matched {grep_hits} files; flashport parsed {summary['files_parsed']}, "
        f"sites {summary['sites']}, failed files {summary['files_failed']}"
    )
    print(
        f"rewrite: {rewrite_doc['summary']['files_changed']} files would change, sites {rewrite_doc['summary']['sites']}"
    )
    print(
        f"cold: scan / grep = {scan_s / grep_s:.1f}x (target <= 10x); rewrite = {rewrite_s:.1f} s (target < 30 s on 2 cores); "
        f"warm cache: scan / grep = {warm_scan_s / grep_s:.1f}x, rewrite = {warm_rewrite_s:.1f} s; "
        f"naive / rewrite = {naive_est / rewrite_s:.0f}x"
    )
    dense_report(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
