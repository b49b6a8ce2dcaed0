"""flashport.rules: one rule module per GPU attention source API, in family packages, plus the registry.

Rule modules are the ``fpaNNN_*`` modules of the family packages (:data:`FAMILIES`); importing them
fills :data:`flashport.rules.base.REGISTRY`, and :func:`rule_modules` finds them by walking the
packages, so a new rule needs no list entry. Rule modules import only libcst (never jax or torch), so
the CLI stays fast.
"""

from __future__ import annotations

import importlib
import pkgutil
import re

from flashport.rules.base import REGISTRY, Rule

FAMILIES = ("flash_attn", "torch", "xformers", "jax", "config")
"""The family packages that hold rule modules, in catalogue order."""

_RULE_MODULE = re.compile(r"fpa\d{3}_\w+")

_loaded = False


def rule_modules() -> list[str]:
    """The dotted names of every rule module (``flashport.rules.<family>.fpaNNN_*``), family by family
    and by code within a family."""
    found: list[str] = []
    for family in FAMILIES:
        package = importlib.import_module(f"{__name__}.{family}")
        names = sorted(
            m.name for m in pkgutil.iter_modules(package.__path__) if _RULE_MODULE.fullmatch(m.name)
        )
        found.extend(f"{package.__name__}.{name}" for name in names)
    return found


def all_rules() -> list[type[Rule]]:
    """Every registered rule class, sorted by code."""
    global _loaded
    if not _loaded:
        for name in rule_modules():
            importlib.import_module(name)
        _loaded = True
    return [REGISTRY[code] for code in sorted(REGISTRY)]


def get(code: str) -> type[Rule]:
    """The rule with this code or kebab name (case-insensitive).

    Raises:
      KeyError: naming the known codes when nothing matches.
    """
    wanted = code.strip().upper()
    for rule in all_rules():
        if rule.CODE == wanted or rule.NAME.upper() == wanted:
            return rule
    raise KeyError(f"unknown rule {code!r}; known: {', '.join(r.CODE for r in all_rules())}")


def select(select: list[str] | None = None, ignore: list[str] | None = None) -> list[type[Rule]]:
    """Rules chosen by code prefixes (``FPA0`` = every flash-attn rule; ``ALL``), minus ``ignore``.

    Raises:
      ValueError: for a selector that matches no rule (likely a typo).
    """
    rules = all_rules()

    def matches(rule, selector):
        selector = selector.strip().upper()
        return selector == "ALL" or rule.CODE.startswith(selector) or rule.NAME.upper() == selector

    for selector in (select or []) + (ignore or []):
        if not any(matches(rule, selector) for rule in rules):
            raise ValueError(
                f"rule selector {selector!r} matches no rule; known: {', '.join(r.CODE for r in rules)}"
            )
    chosen = [r for r in rules if not select or any(matches(r, s) for s in select)]
    return [r for r in chosen if not any(matches(r, s) for s in (ignore or []))]
