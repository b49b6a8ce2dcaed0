"""The codemod on ordinary trees: symbolic and hard links, owners and modes, files that cannot be
written (EACCES, EROFS, ENOSPC, by fault injection and for real), ignore rules inside and outside a
git work tree, and odd files (encodings, line endings, NUL bytes, long lines, FIFOs, sockets, link
loops). Each case: a clear message, nothing lost."""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import subprocess
import sys
import tempfile

import pytest

from flashport import rules as registry
from flashport.rewriter.app import cli, interactive, writes
from flashport.rewriter.app.runner import run
from flashport.rewriter.engine.pipeline import transform_source
from flashport.rules.base import RuleOptions

FA = "from flash_attn import flash_attn_func\n\n\ndef f(q, k, v):\n    return flash_attn_func(q, k, v, causal=True)\n"
# what the CLI writes in a temporary folder (formatted at the default line length: no project config)
PORTED = transform_source(
    FA.encode(),
    os.path.join(tempfile.gettempdir(), "x.py"),
    registry.all_rules(),
    RuleOptions(format_rewrites=True),
).new
assert PORTED is not None


def main(capsys, *argv):
    """``flashport *argv`` in this process; (exit code, JSON document, stderr)."""
    code = cli.main([*map(str, argv), "--format", "json", "--isolated", "--jobs", "1"])
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err


def text_run(capsys, *argv):
    code = cli.main([*map(str, argv), "--isolated", "--jobs", "1", "--no-color"])
    return code, capsys.readouterr().out


def paths_of(doc, key="files"):
    return sorted(os.path.basename(f["path"]) for f in doc[key])


# --- symbolic links -------------------------------------------------------------------------------


def test_symlinked_file_is_written_through_and_ported_once(tmp_path, capsys):
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "a.py").write_text(FA)
    os.symlink("a.py", root / "pkg" / "alias.py")  # relative link, in the same tree
    (root / "shared").mkdir()
    (root / "shared" / "impl.py").write_text(FA)
    os.symlink("../shared/impl.py", root / "pkg" / "impl_link.py")
    code, doc, _ = main(capsys, "rewrite", root, "--write")
    assert code == 0
    assert paths_of(doc) == ["a.py", "impl.py"]  # each real file once, under its own path
    assert (root / "pkg" / "a.py").read_bytes() == PORTED
    assert (root / "shared" / "impl.py").read_bytes() == PORTED
    for link, target in (("alias.py", "a.py"), ("impl_link.py", "../shared/impl.py")):
        assert os.readlink(root / "pkg" / link) == target  # still the same link
    assert main(capsys, "rewrite", root, "--check")[0] == 0  # a second run finds nothing


def test_a_link_named_explicitly_is_written_through(tmp_path, capsys):
    (tmp_path / "real.py").write_text(FA)
    os.symlink("real.py", tmp_path / "link.py")
    code, doc, _ = main(capsys, "rewrite", tmp_path / "link.py", "--write")
    assert code == 0 and [f["written"] for f in doc["files"]] == [True]
    assert os.path.islink(tmp_path / "link.py") and (tmp_path / "real.py").read_bytes() == PORTED


def test_link_outside_the_given_paths_is_reported_and_left_alone(tmp_path, capsys):
    root, outside = tmp_path / "repo", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "o.py").write_text(FA)
    os.symlink(outside / "o.py", root / "o_link.py")
    os.symlink(outside, root / "dir_link")
    code, doc, _ = main(capsys, "rewrite", root, "--write")
    assert code == 0 and doc["files"] == []
    assert (outside / "o.py").read_text() == FA and os.path.islink(root / "o_link.py")
    reported = {os.path.basename(p["path"]): p["reason"] for p in doc["summary"]["skipped_paths"]}
    assert set(reported) == {"o_link.py", "dir_link"}
    assert all("outside the given paths; left alone" in why for why in reported.values())
    assert doc["summary"]["skipped"]["link outside the given paths"] == 2
    _, out = text_run(capsys, "rewrite", root)
    assert "skipped: 2 link outside the given paths" in out and "o_link.py: link to" in out


def test_symlink_loops_are_reported_and_never_hang(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    (root / "ok.py").write_text(FA)
    os.symlink("loop_b.py", root / "loop_a.py")
    os.symlink("loop_a.py", root / "loop_b.py")
    os.symlink(".", root / "self_dir")
    os.symlink("missing.py", root / "broken.py")
    done = subprocess.run(
        [sys.executable, "-m", "flashport", "rewrite", str(root), "--isolated", "--jobs", "1", "--no-color"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "skipped: 3 broken link or link loop" in done.stdout
    assert done.stdout.count("link loop; skipped") == 2 and "broken.py: broken link; skipped" in done.stdout
    assert "ok.py" in done.stdout
    named = subprocess.run(
        [sys.executable, "-m", "flashport", "scan", str(root / "loop_a.py"), "--isolated", "--no-color"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert named.returncode == cli.EXIT_ERRORS and "Too many levels of symbolic links" in named.stdout


# --- hard links, owner, mode ----------------------------------------------------------------------


def test_hard_links_owner_and_mode_are_kept(tmp_path, capsys):
    root = tmp_path / "repo"
    root.mkdir()
    target = root / "a.py"
    target.write_text(FA)
    os.link(target, root / "hard.py")  # the same file twice in the tree: ported once
    os.link(target, tmp_path / "elsewhere.py")
    if os.geteuid() == 0:  # a file owned by someone else, as a root-run tool meets it
        os.chown(target, 1234, 5678)
    os.chmod(target, 0o2754)  # (after chown, which clears the setgid bit)
    before = os.stat(target)
    code, doc, _ = main(capsys, "rewrite", root, "--write")
    assert code == 0 and len(doc["files"]) == 1
    after = os.stat(target)
    assert (after.st_ino, after.st_nlink, after.st_uid, after.st_gid) == (
        before.st_ino,
        3,
        before.st_uid,
        before.st_gid,
    )
    assert stat.S_IMODE(after.st_mode) == 0o2754
    assert (tmp_path / "elsewhere.py").read_bytes() == PORTED == (root / "hard.py").read_bytes()
    assert sorted(p.name for p in root.iterdir()) == ["a.py", "hard.py"]  # no backup left behind


# --- files that cannot be written -----------------------------------------------------------------


def _tree_of_three(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    for name in ("a.py", "b.py", "c.py"):
        (root / name).write_text(FA)
    return root


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (errno.EACCES, "Permission denied"),
        (errno.EROFS, "Read-only file system"),
        (errno.ENOSPC, "No space left on device"),
    ],
)
def test_a_file_that_cannot_be_opened_for_writing_is_reported_and_the_run_goes_on(
    tmp_path, capsys, monkeypatch, code, words
):
    root = _tree_of_three(tmp_path)
    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):
        if str(path).endswith("b.py") and flags & os.O_RDWR:
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(writes.os, "open", refusing_open)
    exit_code, doc, _ = main(capsys, "rewrite", root, "--write")
    assert exit_code == cli.EXIT_ERRORS
    state = {os.path.basename(f["path"]): (f["status"], f["error"], f["written"]) for f in doc["files"]}
    assert state["b.py"] == ("error", f"write failed: {words}", False)
    assert state["a.py"][2] and state["c.py"][2]
    assert (root / "b.py").read_text() == FA and (root / "c.py").read_bytes() == PORTED
    assert sorted(p.name for p in root.iterdir()) == ["a.py", "b.py", "c.py"]


def test_a_read_only_file_for_real(tmp_path, capsys, monkeypatch):
    """chmod a-w: refused with the reason. Root may write any file, so there the refusal the kernel
    would give is injected at the same call."""
    root = _tree_of_three(tmp_path)
    os.chmod(root / "b.py", 0o444)
    if os.geteuid() == 0:
        real_open = os.open

        def as_the_kernel_would(path, flags, *args, **kwargs):
            if flags & os.O_RDWR and not flags & os.O_CREAT and not os.stat(path).st_mode & 0o222:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(writes.os, "open", as_the_kernel_would)
    exit_code, out = text_run(capsys, "rewrite", root, "--write")
    assert exit_code == cli.EXIT_ERRORS
    assert "write failed: Permission denied" in out and "2 written" in out
    assert (root / "b.py").read_text() == FA and stat.S_IMODE(os.stat(root / "b.py").st_mode) == 0o444


def test_disk_full_part_way_through_a_write_puts_the_original_back(tmp_path, capsys, monkeypatch):
    root = _tree_of_three(tmp_path)
    inode = os.stat(root / "b.py").st_ino
    real_pwrite = os.pwrite

    def half_then_full(fd, data, offset):
        if os.fstat(fd).st_ino == inode and bytes(data) == PORTED[offset:]:
            real_pwrite(fd, bytes(data[: len(data) // 2]), offset)  # half the new bytes land
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(writes.os, "pwrite", half_then_full)
    exit_code, doc, _ = main(capsys, "rewrite", root, "--write")
    assert exit_code == cli.EXIT_ERRORS
    failed = [f for f in doc["files"] if f["status"] == "error"]
    assert [(os.path.basename(f["path"]), f["error"]) for f in failed] == [
        ("b.py", "write failed: No space left on device")
    ]
    assert (root / "b.py").read_text() == FA and os.stat(root / "b.py").st_ino == inode
    assert (root / "a.py").read_bytes() == PORTED == (root / "c.py").read_bytes()
    assert sorted(p.name for p in root.iterdir()) == ["a.py", "b.py", "c.py"]


def test_when_even_the_rollback_fails_the_backup_is_kept_and_named(tmp_path, capsys, monkeypatch):
    path = tmp_path / "a.py"
    path.write_text(FA)
    inode = os.stat(path).st_ino
    real_pwrite = os.pwrite

    def broken_disk(fd, data, offset):
        if os.fstat(fd).st_ino == inode:
            real_pwrite(fd, b"#", offset)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(writes.os, "pwrite", broken_disk)
    with pytest.raises(OSError, match="the original is kept in") as caught:
        writes.write_in_place(str(path), FA.encode(), PORTED)
    backup = str(caught.value).split("the original is kept in ")[1]
    assert backup.endswith(writes.BACKUP_SUFFIX) and open(backup).read() == FA
    monkeypatch.undo()
    _, doc, _ = main(capsys, "scan", tmp_path)  # the next run names the backup
    assert [p["path"] for p in doc["summary"]["skipped_paths"]] == [backup]


def test_a_file_changed_after_the_interactive_diff_is_refused(tmp_path):
    path = tmp_path / "a.py"
    path.write_text(FA)
    rules, options = registry.all_rules(), RuleOptions()
    results = list(run([str(path)], rules, options, jobs=1, cache=False))

    def edit_then_accept(_prompt):
        path.write_text(FA + "# edited meanwhile\n")
        return "y"

    import io

    from rich.console import Console

    shown = io.StringIO()
    outcome = interactive.review(
        results, rules, options, ask=edit_then_accept, console=Console(file=shown, no_color=True)
    )
    assert outcome.written == [] and outcome.failed == [
        (str(path), "write failed: changed on disk since it was read; not written")
    ]
    assert "not written" in shown.getvalue() and path.read_text() == FA + "# edited meanwhile\n"


# --- ignore rules ---------------------------------------------------------------------------------


def _git(root, *args):
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True, capture_output=True
    )


def test_inside_git_tracked_files_under_an_ignored_folder_are_processed(tmp_path, capsys):
    root = tmp_path / "repo"
    (root / "vendor").mkdir(parents=True)
    _git(root, "init", "-q")
    (root / ".gitignore").write_text("vendor/\n*_gen.py\n")
    (root / "vendor" / "tracked.py").write_text(FA)
    (root / "vendor" / "untracked.py").write_text(FA)
    (root / "tracked_gen.py").write_text(FA)
    (root / "untracked_gen.py").write_text(FA)
    (root / "new.py").write_text(FA)
    (root / "README.md").write_text("hello\n")
    _git(root, "add", "-f", "vendor/tracked.py", "tracked_gen.py", ".gitignore")
    _git(root, "commit", "-qm", "init")
    code, doc, _ = main(capsys, "scan", root)
    assert code == 0
    assert sorted(os.path.relpath(s["path"], root) for s in doc["sites"]) == [
        "new.py",
        "tracked_gen.py",
        "vendor/tracked.py",
    ]
    assert doc["summary"]["skipped"] == {"ignored (.gitignore)": 2, "not Python": 2}  # vendor/, *_gen.py
    _, out = text_run(capsys, "scan", root)
    assert "skipped: 2 ignored (.gitignore), 2 not Python" in out
    code, doc, _ = main(capsys, "scan", root / "vendor")  # a folder inside the work tree
    assert [os.path.basename(s["path"]) for s in doc["sites"]] == ["tracked.py"]


def test_outside_git_the_gitignore_patterns_apply_and_skips_are_counted(tmp_path, capsys):
    root = tmp_path / "plain"
    (root / "gen").mkdir(parents=True)
    (root / ".gitignore").write_text("gen/\n")
    (root / "gen" / "x.py").write_text(FA)
    (root / "a.py").write_text(FA)
    (root / "skip_me.py").write_text(FA)
    (root / "notes.txt").write_text("x\n")
    (root / ".venv").mkdir()
    code, doc, _ = main(capsys, "scan", root, "--exclude", "skip_*")
    assert code == 0 and [os.path.basename(s["path"]) for s in doc["sites"]] == ["a.py"]
    assert doc["summary"]["skipped"] == {"ignored (.gitignore)": 1, "excluded": 2, "not Python": 2}
    code, doc, _ = main(capsys, "scan", root, "--no-gitignore")
    assert sorted(os.path.basename(s["path"]) for s in doc["sites"]) == ["a.py", "skip_me.py", "x.py"]


# --- odd files ------------------------------------------------------------------------------------

LATIN1 = "# -*- coding: latin-1 -*-\n# Autor: José\n" + FA


@pytest.mark.parametrize(
    ("name", "data", "ported"),
    [
        ("latin1_cookie.py", LATIN1.encode("latin-1"), True),
        ("crlf.py", FA.replace("\n", "\r\n").encode(), True),
        ("form_feed.py", (FA + "\x0c\n\ndef g():\n    return 2\n").encode(), True),
        ("long_line.py", (FA + "X = '" + "a" * 50_000 + "'\n").encode(), True),
        (
            "latin1_no_cookie.py",
            ("# José\n" + FA).encode("latin-1"),
            "cannot decode: not valid utf-8 at line 1, column 5 (byte 0xe9); the file declares no encoding",
        ),
        ("utf16.py", FA.encode("utf-16"), "encoded as UTF-16 (byte-order mark)"),
        ("utf32.py", FA.encode("utf-32"), "encoded as UTF-32 (byte-order mark)"),
        ("nul.py", FA.encode() + b"X = 1\x00\n", "null bytes"),
    ],
)
def test_odd_files_are_ported_byte_faithfully_or_refused_with_a_reason(tmp_path, capsys, name, data, ported):
    path = tmp_path / name
    path.write_bytes(data)
    code, doc, _ = main(capsys, "rewrite", path, "--write")
    [entry] = doc["files"]
    if ported is True:
        assert code == 0 and entry["written"]
        new = path.read_bytes()
        compile(new, name, "exec")
        assert b"flash_attn_func(" not in new.split(b"def f", 1)[1]
        if b"\r\n" in data:
            assert new.count(b"\n") == new.count(b"\r\n")
        if b"coding: latin-1" in data:
            assert new.startswith(b"# -*- coding: latin-1 -*-\n") and "José".encode("latin-1") in new
        if b"\x0c" in data:
            assert b"\x0c" in new
    else:
        assert code == cli.EXIT_ERRORS and ported in entry["error"] and path.read_bytes() == data


def test_fifo_socket_folder_named_like_a_module_and_unreadable_file(tmp_path, monkeypatch):
    """None of them blocks or stops the run; each is named with what it is."""
    root = tmp_path / "repo"
    (root / "pkg.py").mkdir(parents=True)  # a folder named like a module: walked
    (root / "pkg.py" / "inner.py").write_text(FA)
    os.mkfifo(root / "fifo.py")
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(root / "sock.py"))
    locked = root / "locked.py"
    locked.write_text(FA)
    os.chmod(locked, 0)
    try:
        argv = [sys.executable, "-c", _UNREADABLE_AS_ROOT, str(root), str(locked)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        named = subprocess.run(
            argv[:3] + [str(root / "fifo.py"), str(locked)], capture_output=True, text=True, timeout=60
        )
    finally:
        server.close()
        os.chmod(locked, 0o644)
    assert done.returncode == cli.EXIT_ERRORS, done.stderr
    assert "fifo.py: not a regular file (FIFO); skipped" in done.stdout
    assert "sock.py: not a regular file (socket); skipped" in done.stdout
    assert "cannot read: Permission denied" in done.stdout
    assert "skipped: 2 not a regular file, 1 unreadable" in done.stdout
    assert (root / "pkg.py" / "inner.py").read_bytes() == PORTED and locked.read_text() == FA
    assert named.returncode == cli.EXIT_ERRORS and "cannot read: not a regular file (FIFO)" in named.stdout


# Runs the CLI with reads of one file refused (EACCES) even for root, who may read any file.
_UNREADABLE_AS_ROOT = """
import os, sys
from flashport.rewriter.app import cli, writes
locked = sys.argv[2]
real_open = os.open
def refusing(path, flags, *args, **kwargs):
    if os.path.abspath(path) == locked:
        raise PermissionError(13, os.strerror(13), path)
    return real_open(path, flags, *args, **kwargs)
writes.os.open = refusing
sys.exit(cli.main(["rewrite", sys.argv[1], "--write", "--isolated", "--jobs", "1", "--no-color"]))
"""
