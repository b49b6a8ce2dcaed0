"""File discovery: paths -> sorted, de-duplicated ``.py`` files.

Directories are walked recursively without following symlinked directories (so nothing outside the
tree is reached); symlinked files are kept only when they resolve inside the walked root; every
file is listed once (by resolved path). Skipped: the default excludes (VCS, virtualenv, cache and
build folders), ``--exclude`` globs (matched against the path relative to the walked root and
every trailing part of it, so ``sub/*`` and ``*_pb2.py`` match at any depth), and paths ignored by ``.gitignore`` files (the root's and nested ones; the
patterns of git's own syntax: ``*``, ``?``, ``**``, ``[...]``, anchoring ``/``, trailing ``/`` for
directories, ``!`` negation). Files named explicitly are always included.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Iterable, Iterator

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
    """Patterns of the ``.gitignore`` files met on the way down (later files win, like git)."""

    def __init__(self):
        self.rules: list[tuple[str, re.Pattern[str], bool, bool]] = []  # (base, regex, negate, dir_only)

    def add_file(self, directory: str) -> None:
        """Read ``directory/.gitignore`` if present."""
        path = os.path.join(directory, ".gitignore")
        try:
            with open(path, encoding="utf-8", errors="replace") as handle:
                lines = handle.read().splitlines()
        except OSError:
            return
        for raw in lines:
            line = raw.rstrip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            if negate:
                line = line[1:]
            dir_only = line.endswith("/")
            line = line.rstrip("/")
            if not line:
                continue
            anchored = "/" in line
            line = line.lstrip("/")
            regex = _glob_regex(line)
            if not anchored:
                regex = r"(?:.*/)?" + regex
            self.rules.append((directory, re.compile(regex + r"\Z"), negate, dir_only))

    def ignored(self, path: str, is_dir: bool) -> bool:
        """True when the last matching pattern ignores ``path``."""
        verdict = False
        for base, regex, negate, dir_only in self.rules:
            if dir_only and not is_dir:
                continue
            rel = os.path.relpath(path, base).replace(os.sep, "/")
            if rel.startswith("../"):
                continue
            if regex.match(rel):
                verdict = not negate
        return verdict


def _glob_regex(pattern: str) -> str:
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append(r"(?:.*/)?")
            i += 3
        elif pattern.startswith("/**", i) and i + 3 == len(pattern):
            out.append(r"/.*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(r".*")
            i += 2
        elif c == "*":
            out.append(r"[^/]*")
            i += 1
        elif c == "?":
            out.append(r"[^/]")
            i += 1
        elif c == "[":
            end = pattern.find("]", i + 1)
            if end == -1:
                out.append(re.escape(c))
                i += 1
            else:
                body = pattern[i + 1 : end].replace("\\", "\\\\")
                if body.startswith("!"):
                    body = "^" + body[1:]
                out.append(f"[{body}]")
                i = end + 1
        else:
            out.append(re.escape(c))
            i += 1
    return "".join(out)


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


def _git_root(start: str) -> str | None:
    current = start
    while True:
        if os.path.exists(os.path.join(current, ".git")):
            return current
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent


def discover(paths: list[str], exclude: tuple[str, ...] = (), respect_gitignore: bool = True) -> list[str]:
    """Every Python file under ``paths``, in a deterministic order, each once.

    Raises:
      FileNotFoundError: for a path that does not exist.
    """
    seen: set[str] = set()
    found: list[str] = []
    for given in paths:
        candidates: Iterable[str]
        if os.path.isfile(given):
            candidates = [given]
        elif os.path.isdir(given):
            candidates = _walk_tree(given, exclude, respect_gitignore)
        else:
            raise FileNotFoundError(f"no such file or directory: {given}")
        for path in candidates:
            real = os.path.realpath(path)
            if real not in seen:
                seen.add(real)
                found.append(path)
    return found


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


def _walk_tree(root: str, exclude: tuple[str, ...], respect_gitignore: bool) -> Iterator[str]:
    """The Python files under directory ``root``, sorted per directory, minus excluded and ignored
    paths and links that leave the tree."""
    root_real = os.path.realpath(root)
    ignore = _tree_ignores(root_real, respect_gitignore)
    for directory, dirnames, filenames in os.walk(root, followlinks=False):
        if respect_gitignore:
            ignore.add_file(directory)
        dirnames[:] = [
            name
            for name in sorted(dirnames)
            if _keep_dir(directory, name, root, root_real, exclude, ignore if respect_gitignore else None)
        ]
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            full = os.path.join(directory, name)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            if _excluded(rel, name, exclude):
                continue
            if respect_gitignore and ignore.ignored(_abs(full, root, root_real), False):
                continue
            if os.path.islink(full):
                target = os.path.realpath(full)
                if not (target == root_real or target.startswith(root_real + os.sep)) or not os.path.isfile(
                    target
                ):
                    continue
            yield full


def _keep_dir(directory, name, root, root_real, exclude, ignore: GitIgnore | None) -> bool:
    """Whether the walk descends into ``directory/name`` (``ignore`` None: .gitignore not consulted)."""
    full = os.path.join(directory, name)
    rel = os.path.relpath(full, root).replace(os.sep, "/")
    if name in DEFAULT_EXCLUDES or name.endswith(".egg-info") or os.path.islink(full):
        return False
    if _excluded(rel, name, exclude):
        return False
    return ignore is None or not ignore.ignored(_abs(full, root, root_real), True)


def _abs(path: str, root: str, root_real: str) -> str:
    """``path`` (under ``root``) expressed under the resolved root, without resolving the leaf."""
    return os.path.join(root_real, os.path.relpath(path, root))
