"""Run ``flashport scan`` over real PyPI packages and print what it finds per package.

Each package is fetched with ``pip download --no-deps`` into a cache outside the repository
(``~/.cache/flashport-bench`` or ``$FLASHPORT_BENCH_CACHE``), unpacked once, and scanned with the
CLI (``python -m flashport scan --format json``) in a subprocess. Per package it prints: files
scanned/parsed, sites per source API and status, rewritable sites, refusals grouped by reason, files
that failed to parse (e.g. Python 2 or template files) and **crashes** (internal engine errors or a
CLI that did not produce a report): crashes make the script exit non-zero.

Usage::

    python benchmarks/scan_packages.py                       # the default package set
    python benchmarks/scan_packages.py praxis==1.4.0 flax    # any pip requirement specifiers
    python benchmarks/scan_packages.py --json out.json       # also save the full per-package reports
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import subprocess
import sys
import tarfile
import zipfile

DEFAULT_PACKAGES = (
    "transformers==4.46.3",  # PyTorch: flash-attn 2 / SDPA call sites, attn_implementation strings
    "diffusers==0.32.2",  # PyTorch: SDPA, flash-attn, xformers
    "keras-hub==0.32.0",  # keras.ops.dot_product_attention (flash_attention=...)
    "praxis==1.4.0",  # Pallas GPU mha through the old module path, TE wrappers
    "flax==0.12.8",  # jax.nn / flax attention (decoys for the JAX rules)
)
CACHE = pathlib.Path(
    os.environ.get("FLASHPORT_BENCH_CACHE", pathlib.Path.home() / ".cache" / "flashport-bench")
)


def fetch(requirement: str) -> pathlib.Path:
    """Download ``requirement`` (no dependencies) and unpack it; returns the unpacked directory."""
    downloads = CACHE / "downloads" / requirement.replace("/", "_")
    downloads.mkdir(parents=True, exist_ok=True)
    archives = sorted(p for p in downloads.iterdir() if p.suffix in (".whl", ".zip", ".gz"))
    if not archives:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(downloads), requirement],
            check=True,
        )
        archives = sorted(p for p in downloads.iterdir() if p.suffix in (".whl", ".zip", ".gz"))
    archive = archives[0]
    target = CACHE / "src" / archive.name
    if not (target / ".unpacked").exists():
        target.mkdir(parents=True, exist_ok=True)
        if archive.suffix in (".whl", ".zip"):
            with zipfile.ZipFile(archive) as bundle:
                bundle.extractall(target)
        else:
            with tarfile.open(archive) as bundle:
                bundle.extractall(target, filter="data")
        (target / ".unpacked").touch()
    return target


def scan(directory: pathlib.Path) -> dict:
    """The CLI's JSON report for ``directory`` (raises when the CLI crashed without a report)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flashport",
            "scan",
            "--format",
            "json",
            "--isolated",
            "--no-gitignore",
            str(directory),
        ],
        capture_output=True,
        text=True,
    )
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError as err:
        raise RuntimeError(f"flashport scan crashed (exit {proc.returncode}): {proc.stderr[-2000:]}") from err


def digest(requirement: str, report: dict) -> dict:
    """Per-package numbers from a ``flashport.report/1`` document."""
    summary = report["summary"]
    per_api = collections.defaultdict(collections.Counter)
    for site in report["sites"]:
        per_api[f"{site['rule']} {site['api'] if site['kind'] != 'string' else repr(site['api'])}"][
            site["status"]
        ] += 1
    failed = [f for f in report["files"] if f["status"] == "error"]
    crashes = [f for f in failed if (f["error"] or "").startswith("internal error")]
    return {
        "package": requirement,
        "files_scanned": summary["files_scanned"],
        "files_parsed": summary["files_parsed"],
        "sites": summary["sites"],
        "per_api": {api: dict(counts) for api, counts in sorted(per_api.items())},
        "refused_reasons": summary["refused_reasons"],
        "parse_failures": [f"{f['path']}: {f['error']}" for f in failed if f not in crashes],
        "crashes": [f"{f['path']}: {f['error']}" for f in crashes],
    }


def render(numbers: dict, top: int) -> str:
    """A plain-text block for one package."""
    sites = numbers["sites"]
    lines = [
        f"== {numbers['package']}: {numbers['files_scanned']} files, {numbers['files_parsed']} parsed; "
        f"sites: {sum(sites.values())} (rewritable {sites['rewrite']}, refused {sites['refused']}, suppressed {sites['suppressed']}); "
        f"crashes: {len(numbers['crashes'])}; unparsable files: {len(numbers['parse_failures'])}",
    ]
    for api, counts in numbers["per_api"].items():
        lines.append(
            f"   {api}: " + ", ".join(f"{status} {count}" for status, count in sorted(counts.items()))
        )
    if numbers["refused_reasons"]:
        lines.append("   refused by reason:")
        for item in numbers["refused_reasons"][:top]:
            lines.append(f"     {item['count']:4d}  {item['rule']}  {item['reason'][:160]}")
        rest = numbers["refused_reasons"][top:]
        if rest:
            lines.append(f"     ... {len(rest)} more reasons ({sum(i['count'] for i in rest)} sites)")
    for crash in numbers["crashes"]:
        lines.append(f"   CRASH {crash}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Fetch, scan and report each package; exit 1 if any file crashed the engine."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "packages", nargs="*", default=list(DEFAULT_PACKAGES), help="pip requirement specifiers"
    )
    parser.add_argument("--top", type=int, default=12, help="refusal reasons shown per package")
    parser.add_argument("--json", metavar="PATH", help="write all per-package numbers here")
    args = parser.parse_args(argv)
    everything, crashed = [], 0
    for requirement in args.packages:
        numbers = digest(requirement, scan(fetch(requirement)))
        everything.append(numbers)
        crashed += len(numbers["crashes"])
        print(render(numbers, args.top), flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(everything, indent=1))
    return 1 if crashed else 0


if __name__ == "__main__":
    raise SystemExit(main())
