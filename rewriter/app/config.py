"""``[tool.flashport]`` in pyproject.toml: the nearest file (upwards from the first path) wins.

Keys (all optional; command-line flags override them)::

    [tool.flashport]
    select = ["FPA0", "FPA101"]     # rule codes or prefixes; default: all rules
    ignore = ["FPA901"]             # rule codes or prefixes to skip
    exclude = ["tests/fixtures/*"]  # globs (relative path or file name) to skip, besides the defaults
    extend-exclude = ["gen/*"]      # more globs to skip (ruff's spelling; adds to exclude)
    per-file-ignores = {"tests/*" = ["FPA101"]}  # glob -> rule codes/prefixes not run on those files
    respect-gitignore = true        # skip files ignored by .gitignore
    jobs = 4                        # worker processes (default: CPU count)
    inference = false               # drop training-gated dropout (`p if self.training else 0.0`)
    flash-attn-version = "2.8.3"    # signature that positional flash-attn args are bound against
    torch-version = "2.5"           # SDPA signature
    jax-version = "0.10.2"          # jax.nn.dot_product_attention signature
"""

from __future__ import annotations

import os
import tomllib

KEYS = (
    "select",
    "ignore",
    "exclude",
    "extend-exclude",
    "per-file-ignores",
    "respect-gitignore",
    "jobs",
    "inference",
    "flash-attn-version",
    "torch-version",
    "jax-version",
)


class ConfigError(ValueError):
    """A malformed ``[tool.flashport]`` table (exit code 2)."""


def find_pyproject(start: str) -> str | None:
    """The nearest pyproject.toml at or above ``start`` that has a ``[tool.flashport]`` table."""
    current = os.path.abspath(start if os.path.isdir(start) else os.path.dirname(start) or ".")
    while True:
        candidate = os.path.join(current, "pyproject.toml")
        if os.path.isfile(candidate):
            try:
                with open(candidate, "rb") as handle:
                    if "flashport" in tomllib.load(handle).get("tool", {}):
                        return candidate
            except (OSError, tomllib.TOMLDecodeError):
                pass
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent


def load(path: str) -> dict:
    """The validated ``[tool.flashport]`` table of ``path`` (keys as written, kebab-case).

    Raises:
      ConfigError: unreadable TOML, unknown keys or wrong value types.
    """
    try:
        with open(path, "rb") as handle:
            table = tomllib.load(handle).get("tool", {}).get("flashport", {})
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"{path}: cannot read [tool.flashport]: {err}") from err
    unknown = sorted(set(table) - set(KEYS))
    if unknown:
        raise ConfigError(
            f"{path}: unknown [tool.flashport] key(s) {', '.join(unknown)}; known: {', '.join(KEYS)}"
        )
    for key in ("select", "ignore", "exclude", "extend-exclude"):
        if key in table and not _strings(table[key]):
            raise ConfigError(f"{path}: [tool.flashport] {key} must be a list of strings, got {table[key]!r}")
    ignores = table.get("per-file-ignores", {})
    if not (isinstance(ignores, dict) and all(_strings(codes) for codes in ignores.values())):
        raise ConfigError(
            f"{path}: [tool.flashport] per-file-ignores must map globs to lists of rule codes, got {ignores!r}"
        )
    _check_codes(path, table)
    for key in ("respect-gitignore", "inference"):
        if key in table and not isinstance(table[key], bool):
            raise ConfigError(f"{path}: [tool.flashport] {key} must be true or false, got {table[key]!r}")
    if "jobs" in table and (not isinstance(table["jobs"], int) or table["jobs"] < 1):
        raise ConfigError(f"{path}: [tool.flashport] jobs must be a positive integer, got {table['jobs']!r}")
    for key in ("flash-attn-version", "torch-version", "jax-version"):
        if key in table:
            parse_version(str(table[key]), f"{path}: [tool.flashport] {key}")
    return table


def _strings(value) -> bool:
    return isinstance(value, list) and all(isinstance(x, str) for x in value)


def _check_codes(path: str, table: dict) -> None:
    """Every rule code or prefix the table names matches a rule (a typo is an error, not a no-op)."""
    from flashport import rules as registry

    named = list(table.get("select", [])) + list(table.get("ignore", []))
    named += [code for codes in table.get("per-file-ignores", {}).values() for code in codes]
    try:
        registry.select(None, named)
    except ValueError as err:
        raise ConfigError(f"{path}: [tool.flashport]: {err}") from err


def per_file_rules(
    files: list[str], rules: list, ignores: dict[str, list[str]], root: str
) -> dict[str, list]:
    """path -> its rules, for each of ``files`` that a ``per-file-ignores`` glob matches (globs are
    matched like ``exclude``: against the path relative to ``root``, the folder of the pyproject.toml,
    and every trailing part of it)."""
    from flashport import rules as registry
    from flashport.rewriter.app.discover import _excluded

    out = {}
    for path in files:
        relative = os.path.relpath(os.path.abspath(path), root).replace(os.sep, "/")
        codes = [
            code
            for glob, listed in ignores.items()
            if _excluded(relative, os.path.basename(path), (glob,))
            for code in listed
        ]
        if codes:
            dropped = {rule.CODE for rule in registry.select(codes)}
            out[path] = [rule for rule in rules if rule.CODE not in dropped]
    return out


def parse_version(text: str, what: str = "version") -> tuple[int, ...]:
    """``"2.8.3"`` -> (2, 8, 3).

    Raises:
      ConfigError: for anything but dot-separated integers.
    """
    try:
        parts = tuple(int(p) for p in text.strip().split("."))
    except ValueError:
        parts = ()
    if not parts:
        raise ConfigError(f"{what} must look like 2.8.3, got {text!r}")
    return parts
