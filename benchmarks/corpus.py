"""Corpus run: the codemod over real third-party model code, with its guarantees checked.

Run:  /work/venv/bin/python benchmarks/corpus.py [--packages transformers,flax] [--jobs N] [--json out.json]

For each pinned package (PyTorch and JAX model code), the wheel is fetched once with
``pip download --no-deps`` into a cache outside the repository (``$FLASHPORT_BENCH_CACHE`` or
``~/.cache/flashport-bench``, subfolder ``corpus/``) and unpacked there. Each run copies the tree to a
temp dir and runs the real CLI (``python -m flashport``, ``--format json``):

1. ``scan``, 2. ``rewrite --write``, 3. ``rewrite --check``,

and checks: zero crashes (the CLI exits 0/1/3 with a valid ``flashport.report/1`` document and no file
reports an *internal error*; syntax errors in the package's own files are counted separately),
every rewritten file compiles, the second run changes nothing, and every changed line belongs to a
reported rewrite site or an import statement. It prints one summary table (files, sites, rewritten,
refused, seconds, crashes, checks) and, per package, the sites per API and the refusals by reason.
Exit status 0 only when every check passes.
"""

from __future__ import annotations

import argparse
import ast
import collections
import dataclasses
import difflib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile

# name, version, framework, top-level folder(s) inside the wheel that hold the code
PACKAGES = (
    ("transformers", "4.46.3", "torch", ("transformers",)),
    ("diffusers", "0.31.0", "torch", ("diffusers",)),
    ("timm", "1.0.11", "torch", ("timm",)),
    ("easydel", "0.3.0", "jax", ("easydel",)),
    ("praxis", "1.4.0", "jax", ("praxis",)),
    # controls: JAX/Keras model code that defines its own `dot_product_attention` (no GPU sites expected)
    ("keras-hub", "0.17.0", "jax/keras", ("keras_hub",)),
    ("flax", "0.10.2", "jax", ("flax",)),
)


@dataclasses.dataclass
class Outcome:
    """What happened to one package."""

    name: str
    version: str
    framework: str
    files: int = 0
    sites_by_api: dict = dataclasses.field(default_factory=dict)
    rewritten: int = 0
    refused_by_reason: dict = dataclasses.field(default_factory=dict)
    files_changed: int = 0
    unparseable: list = dataclasses.field(default_factory=list)
    crashes: list = dataclasses.field(default_factory=list)
    not_compiling: list = dataclasses.field(default_factory=list)
    second_run_changes: int = 0
    stray_lines: list = dataclasses.field(default_factory=list)
    seconds: dict = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Every guarantee held."""
        return not (self.crashes or self.not_compiling or self.second_run_changes or self.stray_lines)


def cache_dir() -> str:
    """The corpus cache folder (outside the repository)."""
    base = os.environ.get("FLASHPORT_BENCH_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "flashport-bench"
    )
    return os.path.join(base, "corpus")


def fetch(name: str, version: str, cache: str) -> str:
    """Download (once) and unpack (once) ``name==version``; return the unpacked folder.

    Raises:
      RuntimeError: when pip cannot fetch it.
    """
    os.makedirs(cache, exist_ok=True)
    stem = f"{name.replace('-', '_')}-{version}"
    unpacked = os.path.join(cache, f"{name}-{version}")
    if os.path.isfile(os.path.join(unpacked, ".complete")):
        return unpacked
    archives = [
        f
        for f in os.listdir(cache)
        if f.lower().startswith(stem.lower()) and f.endswith((".whl", ".tar.gz", ".zip"))
    ]
    if not archives:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"{name}=={version}", "-d", cache]
        done = subprocess.run(cmd, capture_output=True, text=True)
        archives = [
            f
            for f in os.listdir(cache)
            if f.lower().startswith(stem.lower()) and f.endswith((".whl", ".tar.gz", ".zip"))
        ]
        if done.returncode != 0 or not archives:
            raise RuntimeError(f"pip download {name}=={version} failed: {done.stderr.strip()[-500:]}")
    archive = os.path.join(cache, sorted(archives)[0])
    shutil.rmtree(unpacked, ignore_errors=True)
    if archive.endswith((".whl", ".zip")):
        with zipfile.ZipFile(archive) as handle:
            handle.extractall(unpacked)
    else:
        with tarfile.open(archive) as handle:
            handle.extractall(unpacked, filter="data")
    open(os.path.join(unpacked, ".complete"), "w").close()
    return unpacked


def cli(args: list[str], jobs: int | None) -> tuple[int, dict | None, str, float]:
    """Run ``python -m flashport ARGS --format json --isolated``; return (exit, document, stderr, seconds).

    ``--no-format``: the stray-line check judges the rules' own edits line by line; reflowing a
    rewritten statement to the line length (tests/test_rewrite_formatting.py) is checked apart.
    """
    cmd = [sys.executable, "-m", "flashport", *args, "--format", "json", "--isolated", "--no-gitignore"]
    if args and args[0] == "rewrite":
        cmd.append("--no-format")
    if jobs:
        cmd += ["--jobs", str(jobs)]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    try:
        doc = json.loads(done.stdout)
    except json.JSONDecodeError:
        doc = None
    return done.returncode, doc, done.stderr, seconds


def run_package(name: str, version: str, framework: str, folders, jobs: int | None, cache: str) -> Outcome:
    """Fetch, copy, scan, write, check and verify one package."""
    out = Outcome(name, version, framework)
    source = fetch(name, version, cache)
    with tempfile.TemporaryDirectory(prefix=f"flashport-corpus-{name}-") as tmp:
        roots = []
        for folder in folders:
            shutil.copytree(os.path.join(source, folder), os.path.join(tmp, folder))
            roots.append(os.path.join(tmp, folder))
        originals = {p: open(p, "rb").read() for p in _py_files(roots)}
        out.files = len(originals)

        code, scan, err, out.seconds["scan"] = cli(["scan", *roots], jobs)
        if not _sane(code, scan, out, "scan", err):
            return out
        apis = collections.Counter(s["api"] for s in scan["sites"])
        out.sites_by_api = dict(sorted(apis.items(), key=lambda kv: (-kv[1], kv[0])))
        out.unparseable = sorted(
            f["path"] for f in scan["files"] if f["status"] == "error" and not _internal(f["error"])
        )

        code, write, err, out.seconds["write"] = cli(["rewrite", "--write", *roots], jobs)
        if not _sane(code, write, out, "rewrite --write", err):
            return out
        out.rewritten = write["summary"]["sites"]["rewrite"]
        out.files_changed = write["summary"]["files_changed"]
        reasons = collections.Counter()
        for site in write["sites"]:
            if site["status"] == "refused":
                reasons[f"{site['rule']}: {site['reason']}"] += 1
        out.refused_by_reason = dict(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])))
        _verify_changes(write, originals, out)

        code, check, err, out.seconds["check"] = cli(["rewrite", "--check", *roots], jobs)
        if _sane(code, check, out, "rewrite --check", err):
            out.second_run_changes = check["summary"]["files_changed"]
    return out


def _py_files(roots):
    for root in roots:
        for folder, _, names in os.walk(root):
            for name in sorted(names):
                if name.endswith(".py"):
                    yield os.path.join(folder, name)


def _internal(error: str | None) -> bool:
    return bool(error) and error.startswith("internal error")


def _sane(code: int, doc: dict | None, out: Outcome, step: str, stderr: str) -> bool:
    """Record a crash when the CLI did not answer with a valid document and a documented exit code."""
    if doc is None or doc.get("schema") != "flashport.report/1" or code not in (0, 1, 3):
        out.crashes.append(f"{step}: exit {code}, {stderr.strip()[-300:] or 'no JSON on stdout'}")
        return False
    for entry in doc["files"]:
        if _internal(entry["error"]):
            out.crashes.append(f"{step}: {entry['path']}: {entry['error']}")
    return True


def _verify_changes(doc: dict, originals: dict, out: Outcome) -> None:
    """Every written file compiles; every changed line is inside a rewritten site or an import."""
    sites = collections.defaultdict(list)
    for site in doc["sites"]:
        if site["status"] == "rewrite":
            sites[site["path"]].append((site["line"], site["end_line"]))
    for entry in doc["files"]:
        if not entry["written"]:
            continue
        path = entry["path"]
        new = open(path, "rb").read()
        try:
            compile(new, path, "exec", dont_inherit=True)
        except SyntaxError as err:
            out.not_compiling.append(f"{path}: {err}")
            continue
        old = originals[path]
        old_lines = old.decode("utf-8", "replace").splitlines()
        new_lines = new.decode("utf-8", "replace").splitlines()
        imports, guards = _import_lines(old)
        allowed = {line for start, end in sites[path] for line in range(start, end + 1)} | imports
        for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(
            None, old_lines, new_lines, autojunk=False
        ).get_opcodes():
            if tag == "equal":
                continue
            # a guarded import block may go as a whole once its imports are dead, or collapse to the
            # flag assignments of its success path (rewriter/imports/dead_imports.py)
            guard_texts = {old_lines[i].strip() for i in range(i1, i2) if i + 1 in guards}
            only_imports = all(
                not t.strip() or t.strip().startswith(("import ", "from ")) or t.strip() in guard_texts
                for t in new_lines[j1:j2]
            )
            removable = allowed | guards if only_imports else allowed
            stray = [i + 1 for i in range(i1, i2) if i + 1 not in removable and old_lines[i].strip()]
            if tag == "insert" or (i2 - i1) < (j2 - j1):
                added = new_lines[j1 + (i2 - i1) : j2] if tag != "insert" else new_lines[j1:j2]
                stray += [
                    f"+{text.strip()}"
                    for text in added
                    if text.strip()  # blank lines around an import group
                    and not text.strip().startswith(("import ", "from "))
                    and not _inside_site(i1, sites[path])
                ]
            if stray:
                out.stray_lines.append(f"{os.path.basename(path)}: {stray[:5]}")


def _inside_site(index: int, spans) -> bool:
    return any(start - 1 <= index <= end for start, end in spans)


def _import_lines(data: bytes) -> tuple[set[int], set[int]]:
    """1-based line numbers covered by import statements (any nesting level), and those of the
    ``try``/``if`` blocks that directly hold an import (guarded imports and their fallbacks)."""
    lines: set[int] = set()
    guards: set[int] = set()
    for node in ast.walk(ast.parse(data)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
        elif isinstance(node, (ast.Try, ast.If)):
            blocks = [node.body, node.orelse, *(h.body for h in getattr(node, "handlers", []))]
            if any(isinstance(s, (ast.Import, ast.ImportFrom)) for block in blocks for s in block):
                guards.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return lines, guards


def print_report(outcomes) -> None:
    """The summary table, then per package the sites per API and refusals by reason."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(140, Console().width), highlight=False)
    table = Table(title="flashport corpus run")
    for column in (
        "package",
        "framework",
        ".py files",
        "sites",
        "rewritten",
        "refused",
        "files changed",
        "unparseable",
        "scan s",
        "write s",
        "check s",
        "crashes",
        "checks",
    ):
        table.add_column(column, justify="left" if column in ("package", "framework", "checks") else "right")
    for o in outcomes:
        checks = "ok" if o.ok else "FAILED"
        table.add_row(
            f"{o.name}=={o.version}",
            o.framework,
            str(o.files),
            str(sum(o.sites_by_api.values())),
            str(o.rewritten),
            str(sum(o.refused_by_reason.values())),
            str(o.files_changed),
            str(len(o.unparseable)),
            *(f"{o.seconds.get(k, 0):.1f}" for k in ("scan", "write", "check")),
            str(len(o.crashes)),
            checks,
        )
    console.print(table)
    for o in outcomes:
        detail = Table(title=f"{o.name}=={o.version}: sites per API", show_header=True)
        detail.add_column("sites", justify="right")
        detail.add_column("api", overflow="fold")
        for api, count in o.sites_by_api.items():
            detail.add_row(str(count), api)
        console.print(detail)
        if o.refused_by_reason:
            refused = Table(title=f"{o.name}: refused, by reason")
            refused.add_column("count", justify="right")
            refused.add_column("rule: reason", overflow="fold")
            for reason, count in o.refused_by_reason.items():
                refused.add_row(str(count), reason)
            console.print(refused)
        for label, items in (
            ("CRASH", o.crashes),
            ("does not compile", o.not_compiling),
            ("changed lines outside sites/imports", o.stray_lines),
        ):
            for item in items:
                console.print(f"[red]{label}[/] {item}")
        if o.second_run_changes:
            console.print(f"[red]second run would change {o.second_run_changes} file(s)[/]")


def main(argv: list[str] | None = None) -> int:
    """Run the corpus; exit 0 when every package passes every check."""
    parser = argparse.ArgumentParser(prog="benchmarks/corpus.py", description=__doc__.splitlines()[0])
    parser.add_argument("--packages", help="comma-separated subset of: " + ", ".join(p[0] for p in PACKAGES))
    parser.add_argument("--jobs", type=int, help="worker processes for the CLI (default: its own default)")
    parser.add_argument("--json", metavar="PATH", help="also write the outcomes as JSON")
    args = parser.parse_args(argv)
    wanted = set(args.packages.split(",")) if args.packages else None
    chosen = [p for p in PACKAGES if wanted is None or p[0] in wanted]
    if wanted and len(chosen) != len(wanted):
        parser.error(f"unknown package in {args.packages!r}")
    outcomes = []
    for name, version, framework, folders in chosen:
        print(f"== {name}=={version}", file=sys.stderr, flush=True)
        outcomes.append(run_package(name, version, framework, folders, args.jobs, cache_dir()))
    print_report(outcomes)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump([dataclasses.asdict(o) | {"ok": o.ok} for o in outcomes], handle, indent=1)
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
