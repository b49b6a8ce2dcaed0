"""Review tooling: the HTML report (content, links, no network, a real headless-browser render), the
interactive review driven through a pseudo-terminal, the generated porting guide, and the
pre-commit hook definition."""

from __future__ import annotations

import os
import pty
import re
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import pytest
import yaml

from flashport import rules as registry
from flashport.rewriter.app import cli, html_report, interactive, porting_guide
from flashport.rewriter.app.runner import run
from flashport.rewriter.engine.results import REWRITE
from flashport.rules.base import RuleOptions

ROOT = Path(__file__).resolve().parent.parent

TWO_SITES = """import torch
from flash_attn import flash_attn_func


def first(q, k, v):
    return flash_attn_func(q, k, v, causal=True)


def second(q, k, v):
    return flash_attn_func(q, k, v, softmax_scale=0.5)
"""
REFUSED = """from flash_attn import flash_attn_func


def f(q, k, v):
    return flash_attn_func(q, k, v, 0.1, return_attn_probs=True)  # dropout: S_dmask not reproduced
"""
SDPA = """import torch.nn.functional as F


def g(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
"""


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "two.py").write_text(TWO_SITES)
    (root / "pkg" / "refused.py").write_text(REFUSED)
    (root / "pkg" / "sdpa.py").write_text(SDPA)
    (root / "pkg" / "broken.py").write_text("from flash_attn import flash_attn_func\ndef (:\n")
    return root


def results_for(root: Path):
    paths = sorted(str(p) for p in root.rglob("*.py"))
    return list(run(paths, registry.all_rules(), RuleOptions(), jobs=1))


# ----------------------------------------------------------------------------------- HTML


def test_html_report_content_links_and_no_network(tree):
    page = html_report.render(results_for(tree), mode="dry-run")
    ids = set(re.findall(r'id="([^"]+)"', page))
    anchors = re.findall(r'href="#([^"]+)"', page)  # every in-page link target
    assert anchors and all(a in ids for a in anchors), "every summary/refusal link resolves to a section"
    for name in ("two.py", "refused.py", "sdpa.py", "broken.py"):
        assert re.search(rf'<a href="#file-\d+">[^<]*{name}</a>', page), name
    assert "return_attn_probs" in page and "Refused sites" in page  # refusal with its reason
    assert "syntax error" in page  # the broken file is listed with its error
    assert page.count('<tr class="add">') >= 4 and page.count('<tr class="del">') >= 3
    assert '<span class="k">return</span>' in page  # pygments colour classes inside the diff
    plain = re.sub(r"<[^>]+>", "", page)
    assert "flashport.torch.attention(q, k, v, scale=0.5" in plain and "&quot;bottom_right&quot;" in plain
    assert not re.search(r"<script|<link|<img|<iframe|@import|url\(|src=", page), (
        "the page must be self-contained"
    )


def test_cli_report_flag_writes_page_and_keeps_dry_run(tree, tmp_path, capsys):
    out = tmp_path / "report.html"
    before = (tree / "pkg" / "two.py").read_bytes()
    code = cli.main(["rewrite", str(tree), "--report", str(out), "--isolated", "--jobs", "1", "--no-color"])
    capsys.readouterr()
    assert code == cli.EXIT_ERRORS  # broken.py failed to parse; the report still lists it
    assert (tree / "pkg" / "two.py").read_bytes() == before
    page = out.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and "mode: <b>dry-run</b>" in page and "broken.py" in page
    bad = cli.main(
        ["rewrite", str(tree), "--report", str(tmp_path / "missing" / "r.html"), "--isolated", "-j", "1"]
    )
    capsys.readouterr()
    assert bad == cli.EXIT_ERRORS


def _png_pixels(data: bytes):
    """Decode a non-interlaced 8-bit RGB/RGBA PNG (what chromium writes) into (width, height, rows)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        chunk = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and color in (2, 6) and interlace == 0, header
    bpp = 3 if color == 2 else 4
    raw, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + a) & 255
            elif kind == 2:
                line[i] = (line[i] + b) & 255
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, bpp, rows


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(
    CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install -y chromium)"
)
def test_html_report_renders_in_headless_chromium(tree, tmp_path):
    page = tmp_path / "report.html"
    html_report.write(str(page), results_for(tree))
    shot = tmp_path / "shot.png"
    profile = tempfile.mkdtemp(prefix="flashport-chromium-")
    try:
        subprocess.run(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                f"--user-data-dir={profile}",
                f"--screenshot={shot}",
                "--window-size=1280,1600",
                page.as_uri(),
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    width, height, bpp, rows = _png_pixels(shot.read_bytes())
    assert (width, height) == (1280, 1600)
    colors = {}
    for row in rows[::4]:
        for x in range(0, width * bpp, bpp * 2):
            key = row[x : x + 3]
            colors[key] = colors.get(key, 0) + 1
    assert len(colors) > 20, "a blank or single-colour page"
    assert colors.get(bytes((0xE6, 0xFF, 0xEC)), 0) > 100, "added diff lines are painted green"
    assert colors.get(bytes((0xFF, 0xEB, 0xE9)), 0) > 100, "removed diff lines are painted red"


# ----------------------------------------------------------------------------------- interactive


def _answers(*replies):
    queue = list(replies)
    return lambda prompt: queue.pop(0) if queue else None


def test_review_accepts_subset_and_keeps_needed_imports(tree):
    results = [r for r in results_for(tree) if r.path.endswith("two.py")]
    from rich.console import Console

    console = Console(file=open(os.devnull, "w"), no_color=True)
    outcome = interactive.review(
        results, registry.all_rules(), RuleOptions(), ask=_answers("n", "y"), console=console
    )
    text = (tree / "pkg" / "two.py").read_text()
    assert [s.line for s in outcome.accepted] == [10] and [s.line for s in outcome.declined] == [6]
    assert "return flash_attn_func(q, k, v, causal=True)" in text  # declined: byte-identical
    assert "flashport.torch.attention(q, k, v, scale=0.5" in text
    assert "from flash_attn import flash_attn_func" in text and "import flashport" in text
    compile(text, "two.py", "exec")


def test_review_accept_all_in_file_quit_and_help(tree):
    from rich.console import Console

    sink = open(os.devnull, "w")
    results = results_for(tree)
    outcome = interactive.review(
        results,
        registry.all_rules(),
        RuleOptions(),
        ask=_answers("?", "a", "q"),
        console=Console(file=sink, no_color=True),
    )
    # files come in path order: sdpa.py ("?" shows help, "a" accepts its site), then two.py ("q")
    assert {os.path.basename(p) for p in outcome.written} == {"sdpa.py"}
    assert "scaled_dot_product_attention" not in (tree / "pkg" / "sdpa.py").read_text()
    assert (tree / "pkg" / "two.py").read_text() == TWO_SITES  # quit before it: untouched
    assert [os.path.basename(s.path) for s in outcome.declined] == ["two.py", "two.py"]


def test_site_hunk_shows_only_its_site(tree):
    result = next(r for r in results_for(tree) if r.path.endswith("two.py"))
    second = [s for s in result.sites if s.status == REWRITE][1]
    hunk = interactive.site_hunk(result, second)
    assert "-    return flash_attn_func(q, k, v, softmax_scale=0.5)" in hunk
    assert "+    return flashport.torch.attention(q, k, v, scale=0.5" in hunk
    assert "causal=True" not in hunk  # the other site's rewrite is not part of this hunk
    assert "+import flashport" not in hunk


def _read_until(fd, needle: bytes, buffer: bytearray, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while needle not in buffer:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise AssertionError(f"timed out waiting for {needle!r}; got {bytes(buffer)[-2000:]!r}")
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            chunk = b""
        if not chunk:
            raise AssertionError(f"process ended before {needle!r}; got {bytes(buffer)[-2000:]!r}")
        buffer.extend(chunk)


def test_interactive_cli_through_a_pseudo_terminal(tree):
    target = tree / "pkg" / "two.py"
    env = dict(os.environ, COLUMNS="120", TERM="xterm")
    env.pop("NO_COLOR", None)
    fd, child_tty = pty.openpty()  # the real CLI with a terminal on stdin/stdout (no fork of this process)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flashport",
            "rewrite",
            str(target),
            "--interactive",
            "--isolated",
            "--jobs",
            "1",
        ],
        stdin=child_tty,
        stdout=child_tty,
        stderr=child_tty,
        env=env,
        start_new_session=True,
    )
    os.close(child_tty)
    buffer = bytearray()
    try:
        _read_until(fd, b"[y,n,a,d,q,?]? ", buffer)
        assert b"(1/2)" in buffer and b"flash_attn_func(q, k, v, causal=True)" in buffer
        os.write(fd, b"y\n")
        del buffer[:]
        _read_until(fd, b"[y,n,a,d,q,?]? ", buffer)
        assert b"(2/2)" in buffer
        os.write(fd, b"n\n")
        _read_until(fd, b"written", buffer)
    finally:
        status = proc.wait(timeout=60)
        os.close(fd)
    assert status == 0
    text = target.read_text()
    assert "flashport.torch.attention( q, k, v, causal=True" in " ".join(text.split())
    assert "return flash_attn_func(q, k, v, softmax_scale=0.5)" in text
    assert "from flash_attn import flash_attn_func" in text


# ----------------------------------------------------------------------------------- porting guide


def test_porting_guide_is_generated_and_current():
    committed = (ROOT / "docs" / "porting_guide.md").read_text(encoding="utf-8")
    assert committed == porting_guide.render(), (
        "docs/porting_guide.md is stale: run python -m flashport.rewriter.app.porting_guide --write docs/porting_guide.md"
    )


def test_porting_guide_covers_every_rule_and_backend(tmp_path):
    text = porting_guide.render()
    for rule in registry.all_rules():
        assert f"### {rule.CODE}" in text and f"(#{rule.CODE.lower()})" in text
    import flashport

    for name in flashport.backends():
        assert f"`{name}`" in text
    assert "| FPA101 |" not in text and "top-left" in text and "bottom-right" in text
    stale = tmp_path / "guide.md"
    stale.write_text(text.replace("bottom-right", "bottom right", 1))
    assert porting_guide.main(["--check", str(stale)]) == 1
    stale.write_text(text)
    assert porting_guide.main(["--check", str(stale)]) == 0


# ----------------------------------------------------------------------------------- pre-commit


def test_pre_commit_hooks_check_then_fix(tree, capsys):
    """The check hook fails while a rewrite is pending and says what to run; the fix hook applies it."""
    hooks = {h["id"]: h for h in yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())}
    check, fix = hooks["flashport-check"], hooks["flashport-fix"]
    assert check["entry"].split()[:3] == ["flashport", "rewrite", "--check"]
    assert fix["entry"].split()[:3] == ["flashport", "rewrite", "--write"]
    for hook in (check, fix):
        assert hook["language"] == "python" and hook["types"] == ["python"]
    sdpa = tree / "pkg" / "sdpa.py"
    before = sdpa.read_text()

    def run(hook):
        return cli.main(hook["entry"].split()[1:] + ["--isolated", "--jobs", "1", str(sdpa)])

    assert run(check) == cli.EXIT_CHANGES  # pre-commit fails while a rewrite is pending
    assert "run `flashport rewrite --write`" in capsys.readouterr().err
    assert sdpa.read_text() == before
    assert run(fix) == cli.EXIT_OK and sdpa.read_text() != before  # pre-commit sees the file changed
    assert run(check) == cli.EXIT_OK and run(fix) == cli.EXIT_OK


# ------------------------------------------------------------------------------- walkthrough SVG


def test_walkthrough_svg_script(tmp_path):
    out = tmp_path / "w.svg"
    done = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "make_walkthrough_svg.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    svg = out.read_text(encoding="utf-8")
    assert svg.startswith("<svg") and "flashport&#160;scan&#160;examples/" in svg
    assert "flashport.attention(q,&#160;k,&#160;v" in svg
    assert "walkthrough.svg" in (ROOT / "docs" / "walkthrough.md").read_text()
