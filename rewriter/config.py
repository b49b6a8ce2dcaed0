"""``[tool.flashport]`` in pyproject.toml: the nearest file (upwards from the first path) wins.

Keys (all optional; command-line flags override them)::

    [tool.flashport]
    select = ["FPA0", "FPA101"]     # rule codes or prefixes; default: all rules
    ignore = ["FPA901"]             # rule codes or prefixes to skip
    exclude = ["tests/fixtures/*"]  # globs (relative path or file name) to skip
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
    for key in ("select", "ignore", "exclude"):
        if key in table and not (
            isinstance(table[key], list) and all(isinstance(x, str) for x in table[key])
        ):
            raise ConfigError(f"{path}: [tool.flashport] {key} must be a list of strings, got {table[key]!r}")
    for key in ("respect-gitignore", "inference"):
        if key in table and not isinstance(table[key], bool):
            raise ConfigError(f"{path}: [tool.flashport] {key} must be true or false, got {table[key]!r}")
    if "jobs" in table and (not isinstance(table["jobs"], int) or table["jobs"] < 1):
        raise ConfigError(f"{path}: [tool.flashport] jobs must be a positive integer, got {table['jobs']!r}")
    for key in ("flash-attn-version", "torch-version", "jax-version"):
        if key in table:
            parse_version(str(table[key]), f"{path}: [tool.flashport] {key}")
    return table


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
