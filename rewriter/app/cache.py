"""An optional persistent cache of per-file results (like ruff's), keyed so it cannot go stale.

A cached :class:`~flashport.rewriter.engine.results.FileResult` is reused only when all of these match:

* the file's path and the SHA-256 of its bytes;
* the *fingerprint* of the run: flashport's version, the Python and libcst versions, the source
  text of every module of the installed product (:data:`PACKAGES`: the engine, the rules and what
  they read beyond themselves, such as the contract's keyword defaults in
  ``flashport.kernels.contract.keywords``), read from disk without importing it (so editing any of
  it invalidates everything), the selected rule codes in order, and the
  :class:`~flashport.rules.base.RuleOptions`.

Entries live in one pickle per fingerprint under the cache directory (``$FLASHPORT_CACHE_DIR``, else
``$XDG_CACHE_HOME/flashport``, else ``~/.cache/flashport``), written atomically; an unreadable or
corrupt cache file is treated as empty. Only files that pass the byte prefilter are stored (the
others cost nothing to recompute).

The runner uses it when asked (``run(..., cache=ResultCache.for_run(...))``) or when the
environment variable ``FLASHPORT_CACHE`` is ``1`` (default directory) or a directory path.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import os
import pickle
import sys
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI imports this module; rules load only when a run needs them
    from flashport.rules.base import Rule, RuleOptions

_FORMAT = 1


def default_dir() -> str:
    """The cache directory: ``$FLASHPORT_CACHE_DIR``, ``$XDG_CACHE_HOME/flashport`` or ``~/.cache/flashport``."""
    explicit = os.environ.get("FLASHPORT_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "flashport")


def from_environment(rules: Sequence[type[Rule]], options: RuleOptions) -> ResultCache | None:
    """The cache ``FLASHPORT_CACHE`` asks for (``1``: default directory; a path: that one), or None."""
    value = os.environ.get("FLASHPORT_CACHE", "")
    if value in ("", "0"):
        return None
    return ResultCache.for_run(rules, options, None if value == "1" else value)


# Every top-level package of the product (pyproject.toml's package-dir): the key reads them all.
PACKAGES = ("flashport", "flashport.rewriter", "flashport.rules", "flashport.kernels")


def fingerprint(rules: Sequence[type[Rule]], options: RuleOptions) -> str:
    """Hex digest of everything besides the file that a result depends on (see the module doc)."""
    import libcst

    import flashport

    digest = hashlib.sha256()
    libcst_version = getattr(libcst, "__version__", None) or _dist_version("libcst")
    for part in (
        str(_FORMAT),
        flashport.__version__,
        sys.version,
        libcst_version,
        repr(options),
        ",".join(rule.CODE for rule in rules),
    ):
        digest.update(part.encode() + b"\0")
    for package in PACKAGES:
        spec = importlib.util.find_spec(package)  # the folder, without importing the package (jax)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        directory = locations[0] if locations else ""
        digest.update(package.encode() + b"\0")
        for path in _package_sources(directory) if directory else ():
            digest.update(os.path.relpath(path, directory).encode() + b"\0")
            try:
                with open(path, "rb") as handle:
                    digest.update(handle.read())
            except OSError:
                digest.update(b"<unreadable>")
    return digest.hexdigest()


def _package_sources(directory: str) -> list[str]:
    """Every ``.py`` file under ``directory`` (subpackages included), in a stable order.

    The key covers the packages' whole contents, read from disk, so no hand-kept module list can
    drift and a module the run has not imported yet still counts.
    """
    found = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        found += [os.path.join(root, name) for name in sorted(files) if name.endswith(".py")]
    return found


def _dist_version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001 - a missing version only weakens the key, the sources still count
        return "?"


def file_key(path: str, data: bytes) -> str:
    """Key of one file: its path and the SHA-256 of its bytes."""
    return hashlib.sha256(path.encode("utf-8", "surrogateescape") + b"\0" + data).hexdigest()


class ResultCache:
    """Results of one fingerprint, loaded once and saved once (:meth:`save`)."""

    def __init__(self, path: str):
        self.path = path
        self.entries: dict[str, object] = {}
        self.dirty = False
        self.hits = 0
        self.misses = 0
        try:
            with open(path, "rb") as handle:
                loaded = pickle.load(handle)
            if isinstance(loaded, dict):
                self.entries = loaded
        except Exception:  # noqa: BLE001 - missing, truncated or foreign: start empty
            self.entries = {}

    @classmethod
    def for_run(
        cls, rules: Sequence[type[Rule]], options: RuleOptions, directory: str | None = None
    ) -> ResultCache:
        """The cache file for this rule selection and options under ``directory`` (default :func:`default_dir`)."""
        return cls(
            os.path.join(directory or default_dir(), f"results-{fingerprint(rules, options)[:32]}.pickle")
        )

    def get(self, path: str, data: bytes):
        """A copy of the cached result for ``path`` with content ``data``, or None."""
        entry = self.entries.get(file_key(path, data))
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        return copy.deepcopy(entry)

    def put(self, path: str, data: bytes, result) -> None:
        """Remember ``result`` for ``path`` with content ``data``."""
        self.entries[file_key(path, data)] = copy.deepcopy(result)
        self.dirty = True

    def save(self) -> None:
        """Write the entries atomically (a temp file in the same folder, then ``os.replace``); errors are ignored."""
        if not self.dirty:
            return
        directory = os.path.dirname(self.path)
        try:
            os.makedirs(directory, exist_ok=True)
            fd, temp = tempfile.mkstemp(prefix=".results-", suffix=".tmp", dir=directory)
            try:
                with os.fdopen(fd, "wb") as handle:
                    pickle.dump(self.entries, handle, protocol=pickle.HIGHEST_PROTOCOL)
                os.replace(temp, self.path)
            except BaseException:
                try:
                    os.unlink(temp)
                except OSError:
                    pass
                raise
        except OSError:
            return
        self.dirty = False
