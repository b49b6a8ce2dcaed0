"""Rewritten statements are formatted as ruff/black would at the project's line length; no other
line changes; no default-valued keywords; readable windows; never a ``,)`` ending."""

from __future__ import annotations

import difflib
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from flashport import rules as registry
from flashport.rewriter.engine import formatting
from flashport.rewriter.engine.pipeline import transform_source
from flashport.rules.base import RuleOptions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORMATTED = RuleOptions(format_rewrites=True)


def _rewrite(source: str, path: str, options: RuleOptions = FORMATTED) -> str:
    result = transform_source(textwrap.dedent(source).encode(), path, registry.all_rules(), options)
    assert result.new is not None, result
    return result.new.decode()


def _changed_lines(old: str, new: str) -> list[tuple[int, int]]:
    """1-based inclusive line ranges of ``new`` that differ from ``old``."""
    matcher = difflib.SequenceMatcher(None, old.splitlines(), new.splitlines(), autojunk=False)
    return [(j1 + 1, j2) for tag, _, _, j1, j2 in matcher.get_opcodes() if tag in ("replace", "insert")]


@pytest.mark.parametrize("length", [88, 110])
def test_examples_rewritten_lines_fit_and_are_ruff_formatted(tmp_path, length):
    """The CLI over a copy of examples/: every changed line fits the project's line length, and
    `ruff format --check --range` passes on every changed block."""
    tree = tmp_path / "proj"
    shutil.copytree(os.path.join(ROOT, "examples"), tree)
    (tree / "pyproject.toml").write_text(f"[tool.black]\nline-length = {length}\n")
    before = {p: p.read_text() for p in tree.glob("*.py")}
    proc = subprocess.run(
        [sys.executable, "-m", "flashport", "rewrite", ".", "--write", "--isolated", "--jobs", "1"],
        cwd=tree,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    ruff = formatting.ruff_binary()
    checked = 0
    for path, old in before.items():
        new = path.read_text()
        for first, last in _changed_lines(old, new):
            lines = new.splitlines()[first - 1 : last]
            assert all(len(line) <= length for line in lines), (path.name, lines)
            assert not any(re.search(r",\)", line) for line in lines)
            assert not any("scale=None" in line or "causal=False" in line for line in lines)
            check = subprocess.run(
                [ruff, "format", "--check", "--isolated", "--line-length", str(length)]
                + ["--range", f"{first}-{last}", str(path)],
                capture_output=True,
                text=True,
            )
            assert check.returncode == 0, (path.name, first, last, check.stdout, check.stderr)
            checked += 1
    assert checked >= 10


def test_only_changed_statements_are_formatted(tmp_path):
    source = """\
        from flash_attn import flash_attn_func
        x = [1,2,3]


        def f(q, k, v):
            y = {'a':1}
            return flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=0.125, causal=True, window_size=(8, 0))
        """
    new = _rewrite(source, str(tmp_path / "m.py"))
    assert "x = [1,2,3]\n" in new and "    y = {'a':1}\n" in new  # untouched lines keep their style
    assert (
        "    return flashport.torch.attention(\n"
        "        q,\n        k,\n        v,\n        scale=0.125,\n        causal=True,\n"
        '        window=(8, 0),\n        align="bottom_right",\n        layout="BSHD",\n    )\n'
    ) in new


def test_line_length_from_ruff_then_black_then_88(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "pyproject.toml").write_text(
        "[tool.ruff]\nline-length = 120\n[tool.black]\nline-length = 70\n"
    )
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "pyproject.toml").write_text("[tool.black]\nline-length = 70\n")
    (tmp_path / "b" / "sub").mkdir()
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "ruff.toml").write_text("line-length = 100\n")
    assert formatting.line_length(str(tmp_path / "a" / "x.py")) == 120
    assert formatting.line_length(str(tmp_path / "b" / "sub" / "x.py")) == 70
    assert formatting.line_length(str(tmp_path / "c" / "x.py")) == 100
    assert formatting.line_length("/x.py") == 88


def test_other_indentation_is_never_reformatted(tmp_path):
    """ruff would re-indent a 2-space block; then the statement stays as generated."""
    source = "from flash_attn import flash_attn_func\n\ndef f(q, k, v):\n  a = 1\n  return flash_attn_func(q, k, v, causal=True, softmax_scale=0.125, window_size=(8, 0))\n"
    new = _rewrite(source, str(tmp_path / "m.py"))
    assert "\n  a = 1\n" in new
    assert (
        '  return flashport.torch.attention(q, k, v, scale=0.125, causal=True, window=(8, 0), align="bottom_right", layout="BSHD")\n'
        in new
    )


def test_without_ruff_or_with_no_format_statements_stay_as_generated(tmp_path, monkeypatch):
    source = "from flash_attn import flash_attn_func\n\n\ndef f(q, k, v):\n    return flash_attn_func(\n        q, k, v, causal=True)\n"
    generated = _rewrite(source, str(tmp_path / "m.py"), RuleOptions())
    # one argument a line, as the call was laid out; the closing parenthesis stays where it was
    assert generated.endswith('        causal=True,\n        align="bottom_right",\n        layout="BSHD")\n')
    assert ",)" not in generated
    monkeypatch.setattr(formatting, "ruff_binary", lambda: None)
    assert _rewrite(source, str(tmp_path / "m.py")) == generated


def test_windows_read_as_written():
    source = """\
        from flash_attn import flash_attn_func


        def f(q, k, v, left, cfg, sizes):
            a = flash_attn_func(q, k, v, causal=True, window_size=(left, 0))
            b = flash_attn_func(q, k, v, window_size=(cfg.window, cfg.window))
            c = flash_attn_func(q, k, v, window_size=(-1, 4))
            d = flash_attn_func(q, k, v, window_size=sizes)
            return a, b, c, d
        """
    new = _rewrite(source, "m.py", RuleOptions())
    assert "window=(None if left < 0 else left, 0)" in new
    assert "window=(None if cfg.window < 0 else cfg.window, None if cfg.window < 0 else cfg.window)" in new
    assert "window=(None, 4)" in new
    assert "window=tuple(None if w is None or w < 0 else w for w in sizes)" in new  # read once
    namespace: dict = {}
    window = re.search(r"window=(\(None if left.*?, 0\))", new).group(1)
    for left, want in ((-1, (None, 0)), (5, (5, 0))):
        assert eval(window, namespace, {"left": left}) == want
