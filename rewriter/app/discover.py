"""File discovery: paths -> de-duplicated ``.py`` files in a deterministic order, and what was
skipped and why.

- **Ignore rules, git's meaning.** Inside a git work tree the files come from git itself
  (``git ls-files --cached --others --exclude-standard``): tracked files are processed even under a
  folder ``.gitignore`` lists (ignore rules concern untracked files only), untracked ones unless
  ignored. Outside one (or without git), ``.gitignore`` files met on the way down are applied, with
  git's pattern rules (``pathspec``).
- **Excludes.** The default excludes (VCS, virtualenv, cache and build folders) and ``--exclude``
  globs (matched against the path relative to the given folder and every trailing part of it, so
  ``sub/*`` and ``*_pb2.py`` match at any depth) apply to every file found in a folder.
- **Links.** Every file is resolved to its real file and listed once (symbolic and hard links alike),
  under its own path when the walk meets it and otherwise under the link's (a write goes through the
  link). A link whose real file lies outside the paths given, a broken link and a link loop are
  skipped with a notice; symlinked folders are not followed (their files are reached through the
  real folder, if given).
- **Odd files.** Only regular files are read: a FIFO, socket or device named ``*.py`` is skipped
  with a notice (nothing blocks on it); a folder named ``x.py`` is walked like any folder.

Files named explicitly are always included (a link named explicitly is followed wherever it points).
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import fnmatch
import os
import stat
import subprocess
from collections.abc import Iterator

import pathspec

from flashport.rewriter.app.writes import BACKUP_SUFFIX
from flashport.rewriter.source.files import kind_of, read_regular

# Why a path was skipped (the summary counts each; a folder skipped as a whole counts once).
IGNORED = "ignored (.gitignore)"
EXCLUDED = "excluded"
NOT_PYTHON = "not Python"
LINK_OUTSIDE = "link outside the given paths"
BROKEN_LINK = "broken link or link loop"
NOT_REGULAR = "not a regular file"
UNREADABLE = "unreadable"
REASONS = (IGNORED, EXCLUDED, NOT_PYTHON, LINK_OUTSIDE, BROKEN_LINK, NOT_REGULAR, UNREADABLE)

DEFAULT_EXCLUDES = (
    ".git",
    ".hg",
    ".svn",
    ".bzr",
    ".venv",
    "venv",
    ".tox",
    ".nox",
    ".eggs",
    "__pycache__",
    "node_modules",
    "site-packages",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
    "build",
    "dist",
)


class GitIgnore:
    """The ``.gitignore`` files met on the way down, matched with git's own rules (``pathspec``); a
    deeper file's matching pattern wins, like git."""

    def __init__(self):
        self.specs: list[tuple[str, pathspec.GitIgnoreSpec]] = []  # (folder, its patterns)

    def add_file(self, directory: str) -> None:
        """Read ``directory/.gitignore`` if present."""
        path = os.path.join(directory, ".gitignore")
        try:
            lines = read_regular(path).decode("utf-8", "replace").splitlines()  # a FIFO never blocks
        except OSError:
            return
        self.specs.append((directory, pathspec.GitIgnoreSpec.from_lines(lines)))

    def ignored(self, path: str, is_dir: bool) -> bool:
        """True when the last matching pattern ignores ``path``."""
        verdict = False
        for base, spec in self.specs:
            rel = os.path.relpath(path, base).replace(os.sep, "/")
            if rel.startswith("../"):
                continue
            include = spec.check_file(rel + "/" if is_dir else rel).include
            if include is not None:
                verdict = include
        return verdict


def _excluded(rel: str, name: str, globs: tuple[str, ...]) -> bool:
    """True when a glob matches the relative path, any trailing part of it, or the name."""
    if not globs:
        return False
    parts = rel.split("/")
    tails = ["/".join(parts[i:]) for i in range(len(parts))]
    return any(
        fnmatch.fnmatchcase(tail, g) or fnmatch.fnmatchcase(tail, g.rstrip("/") + "/*")
        for g in globs
        for tail in tails
    )


@dataclasses.dataclass
class Discovery:
    """What :func:`find_files` found.

    Attributes:
      files: the files to process, each real file once.
      skipped: reason (one of the module's constants) -> how many paths were skipped for it.
      notices: ``(path, message)`` for skips the user should see by name (links, odd files,
        unreadable folders).
    """

    files: list[str] = dataclasses.field(default_factory=list)
    skipped: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    notices: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def skip(self, reason: str, path: str | None = None, message: str | None = None) -> None:
        """Count a skipped path; with ``message``, also name it in the notices."""
        self.skipped[reason] += 1
        if path is not None and message is not None:
            self.notices.append((path, message))

    def counts(self, unreadable: int = 0) -> collections.Counter[str]:
        """Skipped paths per reason; ``unreadable``: files the run could not read, added to the
        folders the walk could not list."""
        return self.skipped + collections.Counter({UNREADABLE: unreadable})

    def skipped_line(self, unreadable: int = 0) -> str:
        """``skipped: 3 ignored (.gitignore), 12 not Python`` (see :meth:`counts`)."""
        counts = self.counts(unreadable)
        parts = [f"{counts[reason]} {reason}" for reason in REASONS if counts[reason]]
        return "skipped: " + (", ".join(parts) if parts else "nothing")


def discover(paths: list[str], exclude: tuple[str, ...] = (), respect_gitignore: bool = True) -> list[str]:
    """Every Python file under ``paths``, in a deterministic order, each once (see :func:`find_files`).

    Raises:
      FileNotFoundError: for a path that does not exist.
    """
    return find_files(paths, exclude, respect_gitignore).files


def find_files(paths: list[str], exclude: tuple[str, ...] = (), respect_gitignore: bool = True) -> Discovery:
    """The files under ``paths`` and the paths skipped (module docstring).

    Raises:
      FileNotFoundError: for a path that does not exist (a broken link named explicitly included).
    """
    found = Discovery()
    roots = [os.path.realpath(given) for given in paths]
    candidates: list[tuple[str, bool]] = []  # (path, reached through a link)
    for given in paths:
        if os.path.isdir(given):
            listed = _git_listing(given, found) if respect_gitignore else None
            walk = (
                listed if listed is not None else _walk_tree(given, exclude, respect_gitignore, roots, found)
            )
            for path in walk:
                checked = _checked(path, given, exclude, roots, found)
                if checked is not None:
                    candidates.append(checked)
        elif os.path.lexists(given):
            candidates.append((given, os.path.islink(given)))
        else:
            raise FileNotFoundError(f"no such file or directory: {given}")
    found.files = _once_per_real_file(candidates)
    return found


def _once_per_real_file(candidates: list[tuple[str, bool]]) -> list[str]:
    """One path per real file (same device and inode: symbolic and hard links alike): the first one
    that is not a symbolic link, else the first link; in the order the chosen paths were found."""
    chosen: dict[object, tuple[int, str, bool]] = {}
    for index, (path, linked) in enumerate(candidates):
        try:
            info = os.stat(path)
            key: object = (info.st_dev, info.st_ino)
        except OSError:  # the read will report it
            key = os.path.realpath(path)
        if key not in chosen or (chosen[key][2] and not linked):
            chosen[key] = (index, path, linked)
    return [path for _, path, _ in sorted(chosen.values())]


def _checked(
    path: str, given: str, exclude: tuple[str, ...], roots: list[str], found: Discovery
) -> tuple[str, bool] | None:
    """``(path, is_link)`` for a ``.py`` path found under folder ``given``, or None (counted)."""
    rel = os.path.relpath(path, given).replace(os.sep, "/")
    parts = rel.split("/")
    if any(_default_excluded(part) for part in parts[:-1]) or _excluded(rel, parts[-1], exclude):
        found.skip(EXCLUDED)
        return None
    try:
        mode = os.lstat(path).st_mode
    except OSError:  # listed by git but deleted from the work tree
        return None
    linked = stat.S_ISLNK(mode)
    if linked:
        try:
            real = os.path.realpath(path, strict=True)
            mode = os.stat(real).st_mode
        except OSError as err:
            why = "link loop" if err.errno == errno.ELOOP else "broken link"
            found.skip(BROKEN_LINK, path, f"{why}; skipped")
            return None
        if not _inside(real, roots):
            found.skip(LINK_OUTSIDE, path, f"link to {real}, outside the given paths; left alone")
            return None
    if stat.S_ISDIR(mode):  # a folder named like a module: reached by the walk itself, if at all
        return None
    if not stat.S_ISREG(mode):
        found.skip(NOT_REGULAR, path, f"not a regular file ({kind_of(mode)}); skipped")
        return None
    return path, linked


def _inside(real: str, roots: list[str]) -> bool:
    return any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


def _default_excluded(name: str) -> bool:
    return name in DEFAULT_EXCLUDES or name.endswith(".egg-info")


def _git_listing(folder: str, found: Discovery) -> list[str] | None:
    """The ``.py`` paths git lists under ``folder`` (tracked, and untracked unless ignored), or None
    outside a git work tree or without git. Ignored files and other files are counted as skipped."""
    try:
        listed = _git(folder, "--cached", "--others", "--exclude-standard")
        ignored = _git(folder, "--others", "--ignored", "--exclude-standard", "--directory")
    except (OSError, subprocess.CalledProcessError):
        return None
    found.skipped[IGNORED] += sum(1 for p in ignored if p.endswith((".py", "/")))
    out: list[str] = []
    for rel in sorted(set(listed)):
        path = os.path.join(folder, rel)
        if rel.endswith(".py"):
            out.append(path)
        elif os.path.isdir(path) and not os.path.islink(path):  # a submodule: its own listing
            sub = _git_listing(path, found)
            out.extend(sub if sub is not None else [])
        else:
            _not_python(path, found)
    return out


def _not_python(path: str, found: Discovery) -> None:
    """Count a file that is not Python; name a backup an interrupted write left behind."""
    if path.endswith(BACKUP_SUFFIX):
        found.skip(
            NOT_PYTHON,
            path,
            "the original of a file whose write was killed (see docs/cli.md); compare, then delete it",
        )
    else:
        found.skip(NOT_PYTHON)


def _git(folder: str, *flags: str) -> list[str]:
    """``git ls-files`` in ``folder``: paths relative to it."""
    done = subprocess.run(
        ["git", "-c", "core.quotePath=false", "ls-files", "-z", *flags],
        cwd=folder,
        capture_output=True,
        check=True,
    )
    return [os.fsdecode(p) for p in done.stdout.split(b"\0") if p]


def _tree_ignores(root_real: str, respect_gitignore: bool) -> GitIgnore:
    """The ``.gitignore`` rules in force at ``root_real``: its parents' files up to the repository root."""
    ignore = GitIgnore()
    git_root = _git_root(root_real) if respect_gitignore else None
    if git_root is not None:  # parents' .gitignore files between the repo root and the tree
        chain, current = [], root_real
        while True:
            chain.append(current)
            if current == git_root:
                break
            current = os.path.dirname(current)
        for directory in reversed(chain[1:]):
            ignore.add_file(directory)
    return ignore


def _git_root(start: str) -> str | None:
    current = start
    while True:
        if os.path.exists(os.path.join(current, ".git")):
            return current
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent


def _walk_tree(
    root: str, exclude: tuple[str, ...], respect_gitignore: bool, roots: list[str], found: Discovery
) -> Iterator[str]:
    """The ``.py`` paths under folder ``root`` (sorted per folder), minus excluded and ignored
    folders and files (counted in ``found``); links are left to :func:`_checked`."""
    root_real = os.path.realpath(root)
    ignore = _tree_ignores(root_real, respect_gitignore) if respect_gitignore else None

    def unreadable(err: OSError) -> None:
        found.skip(UNREADABLE, err.filename, f"cannot list folder: {err.strerror}; skipped")

    for directory, dirnames, filenames in os.walk(root, onerror=unreadable, followlinks=False):
        if ignore is not None:
            ignore.add_file(directory)
        kept = []
        for name in sorted(dirnames):
            full = os.path.join(directory, name)
            if os.path.islink(full):  # not followed: its files are reached through the real folder
                real = os.path.realpath(full)
                if not _inside(real, roots):
                    found.skip(LINK_OUTSIDE, full, f"link to {real}, outside the given paths; left alone")
                continue
            why = _dir_skip(full, name, root, root_real, exclude, ignore)
            if why is None:
                kept.append(name)
            else:
                found.skip(why)
        dirnames[:] = kept
        for name in sorted(filenames):
            full = os.path.join(directory, name)
            if not name.endswith(".py"):
                _not_python(full, found)
            elif ignore is not None and ignore.ignored(_abs(full, root, root_real), False):
                found.skip(IGNORED)
            else:
                yield full


def _dir_skip(full, name, root, root_real, exclude, ignore: GitIgnore | None) -> str | None:
    """Why the walk does not enter folder ``full``, or None."""
    rel = os.path.relpath(full, root).replace(os.sep, "/")
    if _default_excluded(name) or _excluded(rel, name, exclude):
        return EXCLUDED
    if ignore is not None and ignore.ignored(_abs(full, root, root_real), True):
        return IGNORED
    return None


def _abs(path: str, root: str, root_real: str) -> str:
    """``path`` (under ``root``) expressed under the resolved root, without resolving the leaf."""
    return os.path.join(root_real, os.path.relpath(path, root))
