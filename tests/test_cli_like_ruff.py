"""The CLI habits ruff users expect: ``--diff`` for ``git apply``, ``--output-format``
concise/github/sarif, exact counts with the "as is" status, suppression comments (unknown codes,
unused ones, ``--add-ignore``), ``per-file-ignores``/``extend-exclude``, the ``rules`` table, and an
import path without jax."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
from sarif_kit.validate import validation_errors
from test_sdpa_runs_as_is import MATH_SOURCE

from flashport import rules as registry
from flashport.rewriter.app import cli

FA = "from flash_attn import flash_attn_func\n\n\ndef f(q, k, v):\n    return flash_attn_func(q, k, v, causal=True)\n"
SDPA = "import torch.nn.functional as F\n\n\ndef g(q, k, v):\n    return F.scaled_dot_product_attention(q, k, v, is_causal=True)\n"
REFUSED = (
    "from flash_attn.cute import flash_attn_varlen_func\n\n\n"
    "def f(q, k, v):\n    return flash_attn_varlen_func(q, k, v)\n"
)


@pytest.fixture
def repo(tmp_path):
    """A git repository with two files to port, one that runs as is, one refused and one plain."""
    root = tmp_path / "repo"
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "a.py").write_text(FA)
    (root / "pkg" / "sub" / "b.py").write_text(SDPA)
    (root / "pkg" / "as_is.py").write_text(textwrap.dedent(MATH_SOURCE))
    (root / "pkg" / "refused.py").write_text(REFUSED)
    (root / "pkg" / "plain.py").write_text("def h():\n    return 1\n")
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    return root


def _git(root, *argv):
    return subprocess.run(["git", *argv], cwd=root, check=True, capture_output=True, text=True)


def flashport(root, *argv, stdin=None):
    """Run the CLI in a fresh process from ``root`` (as a user would, a relative ``.`` path)."""
    return subprocess.run(
        [sys.executable, "-m", "flashport", *argv, "--isolated", "--jobs", "1"],
        cwd=root,
        capture_output=True,
        text=True,
        input=stdin,
        env={**os.environ, "NO_COLOR": "1"},
    )


# ----------------------------------------------------------------------------------- --diff


def test_diff_is_a_patch_that_git_apply_and_patch_take(repo, tmp_path):
    proc = flashport(repo, "rewrite", ".", "--diff")
    assert proc.returncode == cli.EXIT_CHANGES, proc.stderr
    patch = proc.stdout
    headers = [line for line in patch.splitlines() if line.startswith(("--- ", "+++ "))]
    assert headers == [
        f"{side}/{name}"
        for name in ("pkg/a.py", "pkg/as_is.py", "pkg/sub/b.py")
        for side in ("--- a", "+++ b")
    ]
    assert all(line[:1] in "-+ @\\" for line in patch.splitlines()), "only the patch goes to stdout"
    assert "not rewritten" in proc.stderr and "summary" in proc.stderr  # notes and tables: stderr
    (tmp_path / "fix.patch").write_text(patch)
    _git(repo, "apply", "--check", str(tmp_path / "fix.patch"))
    copy = tmp_path / "copy"
    shutil.copytree(repo, copy)
    subprocess.run(["patch", "-p1", "-s", "-i", str(tmp_path / "fix.patch")], cwd=copy, check=True)
    subprocess.run(["git", "apply"], cwd=repo, input=patch, text=True, check=True)
    # the patch does exactly what --write does
    assert flashport(copy, "rewrite", ".", "--write").returncode == cli.EXIT_OK
    for name in ("pkg/a.py", "pkg/as_is.py", "pkg/sub/b.py"):
        assert (repo / name).read_text() == (copy / name).read_text()
    again = flashport(repo, "rewrite", ".", "--diff")
    assert again.returncode == cli.EXIT_OK and again.stdout == ""


def test_diff_paths_are_relative_without_dot_slash(repo):
    proc = flashport(repo / "pkg", "rewrite", "./sub", "--diff")
    assert proc.stdout.startswith("--- a/sub/b.py\n+++ b/sub/b.py\n")


# ----------------------------------------------------------------------------------- formats


def _sites(root):
    return json.loads(flashport(root, "scan", ".", "--output-format", "json").stdout)["sites"]


def test_concise_one_line_per_site(repo):
    proc = flashport(repo, "scan", ".", "--output-format", "concise")
    lines = proc.stdout.splitlines()
    sites = [s for s in _sites(repo) if s["status"] != "suppressed"]
    assert len(lines) == len(sites) and proc.returncode == 0
    assert "pkg/a.py:5:12: FPA001 [rewrite] `flash_attn.flash_attn_func`" in proc.stdout
    assert any(line.startswith("pkg/refused.py:5:12: FPA014 [refused]") for line in lines)
    assert any("FPA102 [as_is]" in line and "runs as is on a TPU host" in line for line in lines)
    assert flashport(repo, "scan", ".", "--format", "concise").stdout == proc.stdout  # the alias


def test_github_annotations(repo):
    lines = flashport(repo, "scan", ".", "--output-format", "github").stdout.splitlines()
    assert "::warning file=pkg/a.py,line=5,col=12,endLine=5,title=flashport FPA001::" in lines[0]
    assert all(line.startswith(("::warning ", "::notice ")) for line in lines)
    assert sum(line.startswith("::notice ") for line in lines) == sum(
        s["status"] == "as_is" for s in _sites(repo)
    )


def test_sarif_is_valid_and_counts_exactly(repo):
    (repo / "pkg" / "broken.py").write_text("from flash_attn import flash_attn_func\ndef (:\n")
    proc = flashport(repo, "rewrite", ".", "--output-format", "sarif")
    log = json.loads(proc.stdout)
    assert validation_errors(log) == []
    run = log["runs"][0]
    sites = json.loads(flashport(repo, "scan", ".", "--output-format", "json").stdout)["sites"]
    kinds = {"rewrite": "fail", "as_is": "pass", "refused": "review", "suppressed": "fail"}
    assert [(r["ruleId"], r["kind"], r["properties"]["status"]) for r in run["results"]] == [
        (s["rule"], kinds[s["status"]], s["status"]) for s in sites
    ]
    assert sum("suppressions" in r for r in run["results"]) == sum(s["status"] == "suppressed" for s in sites)
    assert {r["id"] for r in run["tool"]["driver"]["rules"]} == {r.CODE for r in registry.all_rules()}
    assert run["invocations"][0]["executionSuccessful"] is False
    assert "broken.py" in json.dumps(run["invocations"][0]["toolExecutionNotifications"])
    summary = run["properties"]["summary"]["sites"]
    assert summary["as_is"] == 2 and summary["refused"] == 1 and summary["rewrite"] == 3


def test_as_is_is_its_own_column_never_refused(repo, tmp_path):
    doc = json.loads(flashport(repo, "scan", ".", "--output-format", "json").stdout)
    as_is = [s for s in doc["sites"] if s["status"] == "as_is"]
    assert [(s["path"], s["line"], s["rule"]) for s in as_is] == [
        ("pkg/as_is.py", 14, "FPA102"),
        ("pkg/as_is.py", 20, "FPA102"),
    ]
    assert all(s["reason"].startswith("runs as is on a TPU host") for s in as_is)
    assert doc["summary"]["sites"] == {"rewrite": 3, "as_is": 2, "refused": 1, "suppressed": 2}
    assert all(r["reason"].startswith("runs as is") is False for r in doc["summary"]["refused_reasons"])
    text = flashport(repo, "rewrite", ".").stdout
    header = next(line for line in text.splitlines() if line.startswith("┃ rule"))
    assert [cell.strip() for cell in header.split("┃")[1:-1]] == [
        "rule",
        "rewritten",
        "as is",
        "refused",
        "suppressed",
    ]
    row = next(line for line in text.splitlines() if line.startswith("│ FPA102"))
    assert [cell.strip() for cell in row.split("│")[1:-1]] == ["FPA102", "0", "2", "0", "0"]
    page = tmp_path / "report.html"
    flashport(repo, "rewrite", ".", "--report", str(page))
    html = page.read_text()
    assert "<th>as is</th>" in html and '<td class="n">2</td>' in html


def test_interactive_counts_only_what_was_accepted(repo):
    proc = flashport(repo, "rewrite", ".", "--interactive", "--output-format", "json", stdin="n\nn\ny\n")
    doc = json.loads(proc.stdout)
    by_file = {s["path"]: s["status"] for s in doc["sites"] if s["rule"] in ("FPA001", "FPA101")}
    assert by_file["pkg/a.py"] == "suppressed" and by_file["pkg/sub/b.py"] == "rewrite"
    assert doc["summary"]["files_changed"] == 1 and doc["summary"]["sites"]["rewrite"] == 1
    assert [f["path"] for f in doc["files"] if f["written"]] == ["pkg/sub/b.py"]
    assert (repo / "pkg" / "a.py").read_text() == FA


# ----------------------------------------------------------------------------------- suppressions


def test_unknown_codes_are_reported_everywhere(repo):
    (repo / "pkg" / "a.py").write_text(
        FA.replace("causal=True)", "causal=True)  # flashport: ignore[FPA999]")
    )
    concise = flashport(repo, "scan", ".", "--output-format", "concise").stdout
    assert "pkg/a.py:5:51: unknown-rule-code unknown rule code(s) in a suppression comment: FPA999" in concise
    bad = flashport(repo, "scan", ".", "--select", "FPA9999")
    assert bad.returncode == cli.EXIT_USAGE and "FPA9999" in bad.stderr
    assert flashport(repo, "scan", ".", "--ignore", "XYZ").returncode == cli.EXIT_USAGE
    for table in (
        'select = ["FPZ"]',
        'ignore = ["FPA77"]',
        '[tool.flashport.per-file-ignores]\n"tests/*" = ["FPA1234"]',
    ):
        (repo / "pyproject.toml").write_text(f"[tool.flashport]\n{table}\n")
        proc = subprocess.run(
            [sys.executable, "-m", "flashport", "scan", "."], cwd=repo, capture_output=True, text=True
        )
        assert proc.returncode == cli.EXIT_USAGE and "matches no rule" in proc.stderr, table
    (repo / "pyproject.toml").write_text("[tool.flashport]\nline_length = 3\n")
    proc = subprocess.run(
        [sys.executable, "-m", "flashport", "scan", "."], cwd=repo, capture_output=True, text=True
    )
    assert proc.returncode == cli.EXIT_USAGE
    assert "line_length" in proc.stderr and "per-file-ignores" in proc.stderr  # names the valid keys


def test_unused_suppressions_are_reported_and_removed(repo):
    source = (
        "import torch.nn.functional as F  # flashport: ignore[FPA101]\n\n\n"
        "def g(q, k, v, m):\n"
        "    kept = F.scaled_dot_product_attention(q, k, v, attn_mask=m)  # flashport: ignore[FPA101, FPA001]\n"
        "    # flashport: ignore\n"
        "    text = '# flashport: ignore[FPA001]'\n"
        "    return kept, text  # noqa: E501  # flashport: ignore[FPA001] -- old reason\n"
    )
    path = repo / "pkg" / "sub" / "b.py"
    path.write_text(source)
    findings = json.loads(flashport(repo, "scan", ".", "--output-format", "json").stdout)[
        "suppression_findings"
    ]
    assert [(f["path"], f["line"], f["code"], f["codes"]) for f in findings] == [
        ("pkg/sub/b.py", 1, "unused-suppression", ["FPA101"]),
        ("pkg/sub/b.py", 5, "unused-suppression", ["FPA001"]),
        ("pkg/sub/b.py", 6, "unused-suppression", ["*"]),
        ("pkg/sub/b.py", 8, "unused-suppression", ["FPA001"]),
    ]
    # a selection that leaves FPA001 out cannot tell whether its codes are used
    narrow = json.loads(flashport(repo, "scan", ".", "--select", "FPA101", "--output-format", "json").stdout)[
        "suppression_findings"
    ]
    assert [f["line"] for f in narrow] == [1]
    assert flashport(repo, "rewrite", "pkg/sub", "--check").returncode == cli.EXIT_CHANGES
    assert flashport(repo, "rewrite", "pkg/sub", "--write").returncode == cli.EXIT_OK
    assert path.read_text() == (
        "import torch.nn.functional as F\n\n\n"
        "def g(q, k, v, m):\n"
        "    kept = F.scaled_dot_product_attention(q, k, v, attn_mask=m)  # flashport: ignore[FPA101]\n"
        "    text = '# flashport: ignore[FPA001]'\n"
        "    return kept, text  # noqa: E501\n"
    )
    assert flashport(repo, "rewrite", "pkg/sub", "--check").returncode == cli.EXIT_OK


def test_per_file_ignores_and_extend_exclude(repo):
    (repo / "pyproject.toml").write_text(
        "[tool.flashport]\n"
        'extend-exclude = ["refused.py"]\n'
        "[tool.flashport.per-file-ignores]\n"
        '"pkg/sub/*" = ["FPA1"]\n'
        '"a.py" = ["FPA001"]\n'
    )
    proc = subprocess.run(
        [sys.executable, "-m", "flashport", "scan", ".", "--output-format", "json", "--jobs", "1"],
        cwd=repo,
        capture_output=True,
        text=True,
    )
    doc = json.loads(proc.stdout)
    assert {s["path"] for s in doc["sites"]} == {"pkg/as_is.py"}
    assert doc["summary"]["files_scanned"] == 4


def test_add_ignore_marks_every_refused_site_with_its_reason(repo):
    path = repo / "pkg" / "refused.py"
    path.write_text(
        REFUSED
        + '\n\ndef g(q, k, v):\n    return flash_attn_varlen_func(q, k, """x""", v)\n'
        + '\n\ndef h(q, k, v):\n    return flash_attn_varlen_func(q, k, """\nx""", v) + \\\n        1\n'
    )
    proc = flashport(repo, "rewrite", ".", "--add-ignore")
    assert proc.returncode == cli.EXIT_OK, proc.stderr
    assert "pkg/refused.py:13" in proc.stderr and "add one by hand" in proc.stderr
    lines = path.read_text().splitlines()
    assert lines[4] == (
        "    return flash_attn_varlen_func(q, k, v)  # flashport: ignore[FPA014] -- "
        "flash_attn.cute.flash_attn_varlen_func call without 'cu_seqlens_q'"
    )
    assert lines[8].endswith(
        "v)  # flashport: ignore[FPA014] -- arguments after v must be passed by keyword: FA4's varlen signature..."
    )
    assert (repo / "pkg" / "a.py").read_text() == FA  # nothing is rewritten
    doc = json.loads(flashport(repo, "scan", ".", "--output-format", "json").stdout)
    statuses = [s["status"] for s in doc["sites"] if s["path"] == "pkg/refused.py"]
    assert statuses == ["suppressed", "suppressed", "refused"] and doc["suppression_findings"] == []


# ----------------------------------------------------------------------------------- rules, imports


def test_rules_table_one_line_per_rule_and_one_rule_docs(capsys):
    assert cli.main(["rules"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rules = registry.all_rules()
    assert len(lines) == len(rules) + 1 and lines[0].split() == ["code", "name", "source", "API", "becomes"]
    for line, rule in zip(lines[1:], rules, strict=True):
        assert line.split()[:3] == [rule.CODE, rule.NAME, rule.API.split()[0]]
    assert cli.main(["rules", "FPA001"]) == 0
    doc = capsys.readouterr().out
    assert doc.startswith("FPA001 flash-attn-func\n") and "What it refuses" in doc


def test_the_cli_import_path_never_imports_jax():
    code = (
        "import sys\n"
        "import flashport.rewriter.app.cli, flashport.rewriter.engine.pipeline, flashport.rewriter.app.runner\n"
        "import flashport.rewriter.app.output_formats, flashport.rewriter.engine.suppression_comments\n"
        "import flashport.rewriter.app.progress, flashport.rewriter.app.html_report, flashport.rewriter.app.interactive\n"
        "from flashport import rules\n"
        "for rule in rules.all_rules(): rule.doc()\n"
        "print(sorted(m for m in ('jax', 'jaxlib', 'torch', 'numpy') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


# ----------------------------------------------------------------------------------- progress


def test_progress_advances_in_completion_order_results_in_path_order(tmp_path):
    from flashport.rewriter.app.runner import run
    from flashport.rules.base import RuleOptions

    big = tmp_path / "a_big.py"
    big.write_text(
        FA + "".join(f"\n\ndef f{i}(q, k, v):\n    return flash_attn_func(q, k, v)\n" for i in range(400))
    )
    small = tmp_path / "b_small.py"
    small.write_text(FA)
    plain = tmp_path / "c_plain.py"
    plain.write_text("x = 1\n")
    finished: list[str] = []
    paths = [str(big), str(small), str(plain)]
    results = list(run(paths, registry.all_rules(), RuleOptions(), jobs=2, cache=False, done=finished.append))
    assert [r.path for r in results] == paths
    assert sorted(finished) == sorted(paths) and len(finished) == 3
    assert finished.index(str(small)) < finished.index(str(big))  # the small file finished first
    assert results[0].seconds > results[1].seconds > 0 and results[2].seconds == 0


def test_progress_and_timings_only_on_a_terminal(repo):
    import pty
    import select

    plain = flashport(repo, "rewrite", ".")
    assert "done in" not in plain.stderr and "scanning" not in plain.stderr
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "flashport", "rewrite", ".", "--isolated", "--jobs", "1"],
        cwd=repo,
        stdout=subprocess.PIPE,
        stderr=slave,
        env={**os.environ, "NO_COLOR": "1"},
    )
    os.close(slave)
    out = proc.stdout.read()
    proc.wait(timeout=60)
    seen = b""
    while select.select([master], [], [], 1)[0]:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    assert b"scanning" in seen and re.search(rb"done in \d+\.\d s", seen)
    assert b"done in" not in out and b"scanning" not in out
