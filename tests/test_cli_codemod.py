"""The ``flashport`` CLI: verbs, exit codes, JSON schema, config, discovery, and the write guarantees
(dry run / --check never write, even on a read-only tree; --write is atomic under SIGKILL)."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time

import pytest

from flashport import rules as registry
from flashport.rewriter.app import cli, writes
from flashport.rewriter.engine.pipeline import transform_source
from flashport.rules.base import RuleOptions

FA = "from flash_attn import flash_attn_func\n\n\ndef f(q, k, v):\n    return flash_attn_func(q, k, v, causal=True)\n"
SDPA = "import torch.nn.functional as F\n\n\ndef g(q, k, v):\n    return F.scaled_dot_product_attention(q, k, v, is_causal=True)\n"
PLAIN = "def h():\n    return 1\n"


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "repo"
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "a.py").write_text(FA)
    (root / "pkg" / "sub" / "b.py").write_text(SDPA)
    (root / "pkg" / "plain.py").write_text(PLAIN)
    return root


def run_json(capsys, *argv):
    jobs = [] if "--jobs" in argv else ["--jobs", "1"]  # worker pools are covered by test_jobs_*
    code = cli.main([*argv, "--format", "json", "--isolated", *jobs])
    out = capsys.readouterr().out
    return code, json.loads(out)


def test_version_and_help(capsys):
    assert cli.main(["--version"]) == 0
    assert "flashport" in capsys.readouterr().out
    assert cli.main([]) == cli.EXIT_USAGE


def test_help_states_the_real_version_defaults(capsys):
    """The defaults ``rewrite --help`` advertises are the ones RuleOptions binds signatures against."""
    from flashport.rewriter.app.config import parse_version
    from flashport.rules.base import RuleOptions

    assert cli.main(["rewrite", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    defaults = RuleOptions()
    for flag, field in (
        ("--flash-attn-version", "flash_attn_version"),
        ("--torch-version", "torch_version"),
        ("--jax-version", "jax_version"),
    ):
        match = re.search(re.escape(flag) + r" X\.Y(?:\.Z)? [^()]*\([^)]*default ([0-9.]+)\)", text)
        assert match, f"{flag} help names no default"
        assert parse_version(match.group(1)) == getattr(defaults, field), flag


def test_scan_json_schema(tree, capsys):
    code, doc = run_json(capsys, "scan", str(tree))
    assert (
        code == 0
        and doc["schema"] == "flashport.report/1"
        and doc["command"] == "scan"
        and doc["mode"] == "scan"
    )
    assert [(os.path.basename(s["path"]), s["line"], s["rule"], s["status"]) for s in doc["sites"]] == [
        ("a.py", 5, "FPA001", "rewrite"),
        ("b.py", 5, "FPA101", "rewrite"),
    ]
    site = doc["sites"][0]
    assert set(site) == {
        "path",
        "line",
        "column",
        "end_line",
        "rule",
        "api",
        "kind",
        "status",
        "reason",
        "notes",
    }
    assert site["api"] == "flash_attn.flash_attn_func" and site["column"] == 11
    assert doc["summary"]["files_scanned"] == 3 and doc["summary"]["files_parsed"] == 2
    assert all(f["diff"] is None for f in doc["files"])


def test_rewrite_dry_run_check_and_write(tree, capsys):
    a = tree / "pkg" / "a.py"
    os.chmod(a, 0o640)
    code, doc = run_json(capsys, "rewrite", str(tree))
    assert code == 0 and doc["mode"] == "dry-run" and a.read_text() == FA
    diff = next(f["diff"] for f in doc["files"] if f["path"].endswith("a.py"))
    assert (
        diff.startswith(f"--- a/{a}")
        and "+import flashport" in diff
        and "+    return flashport.torch.attention(" in diff
    )
    assert run_json(capsys, "rewrite", str(tree), "--check")[0] == cli.EXIT_CHANGES
    code, doc = run_json(capsys, "rewrite", str(tree), "--write")
    assert code == 0 and sorted(
        os.path.basename(p) for f in doc["files"] if f["written"] for p in [f["path"]]
    ) == ["a.py", "b.py"]
    # formatted at the default line length (no pyproject.toml with ruff/black settings above the tree)
    assert (
        '    return flashport.torch.attention(\n        q, k, v, causal=True, align="bottom_right"'
        in a.read_text()
    )
    assert stat.S_IMODE(os.stat(a).st_mode) == 0o640
    assert run_json(capsys, "rewrite", str(tree), "--check")[0] == 0  # idempotent
    assert not list(tree.rglob("*.flashport-tmp"))


def test_text_output_plain_when_no_color(tree, capsys, monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    assert cli.main(["rewrite", str(tree), "--isolated", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "\x1b[" not in out and "+import flashport" in out and "summary" in out
    assert cli.main(["scan", str(tree), "--isolated", "--no-color"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.endswith("a.py:5:11 FPA001 rewritable flash_attn.flash_attn_func") for line in lines)


def test_broken_file_is_reported_others_processed(tree, capsys):
    (tree / "pkg" / "broken.py").write_text("import flash_attn\ndef f(:\n")
    code, doc = run_json(capsys, "rewrite", str(tree), "--write")
    assert code == cli.EXIT_ERRORS
    broken = next(f for f in doc["files"] if f["path"].endswith("broken.py"))
    assert broken["status"] == "error" and "syntax error at line 2" in broken["error"]
    assert (tree / "pkg" / "broken.py").read_text() == "import flash_attn\ndef f(:\n"
    assert "flashport" in (tree / "pkg" / "a.py").read_text()


@pytest.mark.parametrize(
    "argv",
    [
        ["scan", "--select", "FPX999"],
        ["scan", "does/not/exist"],
        ["rewrite", "--write", "--check"],
        ["scan", "--jobs", "0"],
        ["rules", "FPA999"],
        ["scan", "--flash-attn-version", "two"],
    ],
)
def test_usage_errors_exit_2(tree, argv, capsys):
    argv = [a if a != "does/not/exist" else str(tree / "missing") for a in argv]
    assert (
        cli.main(argv + ([str(tree)] if argv[0] != "rules" and "missing" not in argv[-1] else []))
        == cli.EXIT_USAGE
    )


def test_select_ignore_and_config(tree, capsys):
    assert [s["rule"] for s in run_json(capsys, "scan", str(tree), "--select", "FPA1")[1]["sites"]] == [
        "FPA101"
    ]
    assert [
        s["rule"] for s in run_json(capsys, "scan", str(tree), "--ignore", "FPA101,FPA102")[1]["sites"]
    ] == ["FPA001"]
    (tree / "pyproject.toml").write_text('[tool.flashport]\nignore = ["FPA001"]\nexclude = ["sub/*"]\n')
    assert cli.main(["scan", str(tree), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["sites"] == []
    (tree / "pyproject.toml").write_text("[tool.flashport]\nbogus = 1\n")
    assert cli.main(["scan", str(tree)]) == cli.EXIT_USAGE
    assert "unknown [tool.flashport] key" in capsys.readouterr().err


def test_discovery_gitignore_exclude_symlinks_each_file_once(tree, tmp_path, capsys):
    (tree / ".git").mkdir()
    (tree / ".gitignore").write_text("generated/\n*_pb2.py\n!keep_pb2.py\n")
    for name in ("generated/x.py", "pkg/y_pb2.py", "pkg/keep_pb2.py", ".venv/lib.py", "build/z.py"):
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(FA)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "o.py").write_text(FA)
    os.symlink(outside, tree / "pkg" / "link_dir")
    os.symlink(outside / "o.py", tree / "pkg" / "link_file.py")
    os.symlink(tree / "pkg" / "a.py", tree / "pkg" / "alias.py")
    _code, doc = run_json(capsys, "scan", str(tree), str(tree / "pkg" / "a.py"), "--exclude", "sub")
    paths = sorted(os.path.relpath(s["path"], tree) for s in doc["sites"])
    assert paths == ["pkg/a.py", "pkg/keep_pb2.py"]
    _code, doc = run_json(capsys, "scan", str(tree), "--no-gitignore")
    assert "generated/x.py" in {os.path.relpath(s["path"], tree) for s in doc["sites"]}


def test_jobs_output_is_deterministic(tree, capsys):
    for i in range(6):
        (tree / "pkg" / f"m{i}.py").write_text(FA if i % 2 else SDPA)
    one = run_json(capsys, "rewrite", str(tree), "--jobs", "1")[1]
    two = run_json(capsys, "rewrite", str(tree), "--jobs", "2")[1]
    assert one == two


def test_rules_verb(capsys):
    assert cli.main(["rules", "--format", "json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {"FPA001", "FPA004", "FPA101", "FPA201"} <= {r["code"] for r in listed}
    assert cli.main(["rules", "fpa004"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("FPA004 flash-attn-varlen-func") and "What it refuses" in out


def test_cli_does_not_import_jax_or_torch(tree):
    code = (
        "import sys; from flashport.rewriter.app.cli import main; "
        f"rc = main(['rewrite', {str(tree)!r}, '--format', 'json', '--jobs', '1', '--isolated']); "
        "bad = [m for m in ('jax', 'torch') if m in sys.modules]; assert not bad, bad; sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_dry_run_and_check_never_write_on_a_read_only_tree(tree, capsys, monkeypatch):
    files = sorted(tree.rglob("*.py"))
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in files}

    def refuse(*args, **kwargs):
        raise AssertionError("wrote in a dry run")

    monkeypatch.setattr(writes, "write_in_place", refuse)
    monkeypatch.setattr(writes, "_put", refuse)
    for path in [tree, *tree.rglob("*")]:
        os.chmod(path, stat.S_IMODE(os.stat(path).st_mode) & ~0o222)
    try:
        assert (
            cli.main(["rewrite", str(tree), "--isolated", "--no-color"]) == 0
        )  # default --jobs: workers too
        assert cli.main(["rewrite", str(tree), "--isolated", "--check", "--jobs", "1"]) == cli.EXIT_CHANGES
        assert cli.main(["scan", str(tree), "--isolated", "--jobs", "1"]) == 0
    finally:
        for path in [tree, *tree.rglob("*")]:
            os.chmod(path, stat.S_IMODE(os.stat(path).st_mode) | 0o200)
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in files} == before
    assert sorted(tree.rglob("*")) == sorted(set(tree.rglob("*")))  # nothing new


def test_sigkill_mid_write_leaves_each_file_old_or_new(tmp_path):
    root = tmp_path / "big"
    root.mkdir()
    body = FA + "\n\n" + "\n".join(f"def pad{i}(x):\n    return x + {i}\n" for i in range(60))
    for i in range(80):
        (root / f"m{i:03d}.py").write_text(body.replace("def f(", f"def f{i}("))
    old = {p: p.read_bytes() for p in root.glob("*.py")}
    options = RuleOptions(format_rewrites=True)  # what the CLI writes
    new = {p: transform_source(data, str(p), registry.all_rules(), options).new for p, data in old.items()}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flashport",
            "rewrite",
            str(root),
            "--write",
            "--jobs",
            "1",
            "--isolated",
            "--format",
            "json",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    killed_mid_run = False
    while time.time() < deadline and proc.poll() is None:
        if any(p.read_bytes() != data for p, data in old.items()):
            os.kill(proc.pid, signal.SIGKILL)
            killed_mid_run = True
            break
        time.sleep(0.002)
    proc.wait()
    states = []
    for p, data in old.items():
        now = p.read_bytes()
        assert now in (data, new[p]), f"{p.name} is neither the old nor the new file"
        states.append(now == new[p])
    assert any(states)
    if killed_mid_run:
        assert proc.returncode == -signal.SIGKILL
    assert not [p for p in root.iterdir() if p.suffix == ".py" and p not in old]
