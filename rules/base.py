"""The rule interface: what one source-API rule declares and how it answers for one call site.

A rule is a small class, instantiated **fresh for every file** (no state leaks between files), that
the engine asks about each libcst node whose *qualified name* (resolved by libcst's
``QualifiedNameProvider``, never a bare name) is one of the rule's :attr:`Rule.SOURCES`:

* :meth:`Rule.check_call` for calls ``src(...)``: return :class:`Rewrite` (a replacement node plus the
  imports it needs) or :class:`Report` (scan-only finding that is not a rewrite candidate, e.g. a
  backend selector), or refuse.
* :meth:`Rule.check_reference` for a source passed as a value (``attention_fn=flash_attn_func``).
* :meth:`Rule.check_string` for string literals listed in :attr:`Rule.STRINGS` (config switches).

One way to refuse: ``raise Refuse(reason)``, from the rule or from any helper it calls; the site is
left byte-identical and reported with ``reason`` (one line). The engine records it as a
:class:`Refusal`, the site status rules never build themselves.

A decision that spans sites is made in the engine's per-file phase, from every site's *final*
status (rewritten, refused, suppressed, left out by ``--ignore``, declined interactively): a rewrite
names the other calls it is only correct with (:attr:`Rewrite.requires`), and :meth:`Rule.settle`
may refuse all of a rule's rewrites in a file. No rule asks or imports another rule.

Rules never touch imports or files themselves; the engine adds ``import flashport`` once, drops GPU
imports that became unused (:attr:`Rule.GPU_MODULES`, :mod:`flashport.rewriter.imports.dead_imports`),
points names left only probed or re-exported at flashport's drop-ins and pins ``flash_attn.__version__``
reads (:mod:`flashport.rewriter.imports.drop_in_imports`), and reports why each GPU import it keeps stays
(:mod:`flashport.rewriter.imports.kept_imports`).

Adding a rule::

    # rules/<family>/fpa0NN_my_api.py
    from flashport.rules.base import Refuse, Rewrite, Rule, register
    from flashport.rules.common.binding import Signature
    @register
    class MyApi(Rule):
        '''What it rewrites / Semantics mapping / What it refuses / Example.'''
        CODE, NAME = "FPA0NN", "my-api"
        SOURCES = ("pkg.my_api",)  # API, FRAMEWORK, TRIGGERS... derived (register)
        def check_call(self, call, ctx): ...
    # discovery finds it (rules/__init__.py walks the family packages); add tests/fixtures/codemod/FPA0NN/ and
    # regenerate the docs (python -m flashport.rules.coverage --update docs/rules.md;
    # python -m flashport.rewriter.app.porting_guide --write docs/porting_guide.md). CONTRIBUTING.md has the steps.

Helpers for rule bodies live in :mod:`flashport.rules.common` (``binding``: signatures and argument
checks; ``literals``: reading literal arguments; ``calls``: building the new call) and beside each
family (``rules/flash_attn/arguments.py``, ``rules/jax/shared.py``, ...).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import libcst as cst

from flashport.rules.common import values
from flashport.rules.site import (
    RUNS_AS_IS,
    Outcome,
    Patch,
    Refusal,
    Refuse,
    Report,
    Rewrite,
    RuleContext,
    RuleOptions,
    runs_as_is,
)

if TYPE_CHECKING:  # the engine's record of a site; results imports nothing from the rules at run time
    from flashport.rewriter.engine.results import Site

__all__ = [
    "REGISTRY",
    "RUNS_AS_IS",
    "Outcome",
    "Patch",
    "Refusal",
    "Refuse",
    "Report",
    "Rewrite",
    "Rule",
    "RuleContext",
    "RuleOptions",
    "register",
    "runs_as_is",
]

# ----------------------------------------------------------------------------------- the base class


class Rule:
    """Base class of every rule; subclasses set the class attributes and override ``check_*``.

    Class attributes (:func:`register` fills the ones marked *derived* that a rule leaves unset):
      CODE: stable id (``FPA001``); selection matches prefixes (``FPA0``).
      NAME: kebab-case name (``flash-attn-func``).
      API: the source API, for tables (``flash_attn.flash_attn_func``); derived: the first of
        :attr:`SOURCES` (the canonical import path).
      FRAMEWORK: ``"torch"`` or ``"jax"``; derived: the family's (:data:`FAMILY_FRAMEWORKS`).
      SOURCES: fully qualified names that match (every public import path).
      TRIGGERS: byte strings; a file containing none of them is never parsed for this rule; derived:
        the last component of each of :attr:`SOURCES`, then :attr:`STRINGS`.
      STRINGS: string literal values reported by :meth:`check_string`.
      GPU_MODULES: module prefixes whose imports may be dropped once unused after a rewrite;
        derived in the families of GPU-only packages (:data:`GPU_FAMILIES`): the top-level
        packages of :attr:`SOURCES`.
      TARGET: what rewrites produce (docs only).
      REWRITES: False for scan-only rules (they only ever report or refuse).
    """

    CODE: ClassVar[str] = ""
    NAME: ClassVar[str] = ""
    API: ClassVar[str] = ""
    FRAMEWORK: ClassVar[str] = ""
    SOURCES: ClassVar[tuple[str, ...]] = ()
    TRIGGERS: ClassVar[tuple[bytes, ...]] = ()
    STRINGS: ClassVar[tuple[str, ...]] = ()
    GPU_MODULES: ClassVar[tuple[str, ...]] = ()
    TARGET: ClassVar[str] = ""
    REWRITES: ClassVar[bool] = True

    def check_call(self, call: cst.Call, ctx: RuleContext) -> Outcome:
        """Answer for ``call`` (whose ``func`` resolved to one of :attr:`SOURCES`)."""
        raise Refuse("no rewrite implemented for this API")

    def check_reference(self, node: cst.BaseExpression, ctx: RuleContext) -> Outcome:
        """Answer for a source API used as a value (callback, mapping entry, ``functools.partial``,
        attribute): a rewrite to flashport's drop-in of the same name where one replicates the API
        exactly, else a report whose reason names the context (feature probe, comparison, version,
        no drop-in; :func:`flashport.rules.common.values.answer`)."""
        return values.answer(node, ctx)

    def check_string(self, node: cst.SimpleString, value: str, ctx: RuleContext) -> Outcome:
        """Answer for a string literal whose value is in :attr:`STRINGS`."""
        return None

    def settle(self, sites: Sequence[Site], ctx: RuleContext) -> str | None:
        """Per-file phase, after every site of the file has its final status (rewritten, refused,
        suppressed by a comment or by the interactive review; rules left out by ``--ignore`` have
        no sites). Return a reason to refuse *all* of this rule's rewrites in the file (their
        meaning depends on other sites), or None to keep them.

        A rewrite that depends on particular other calls names them instead (:attr:`Rewrite.requires`):
        the engine then refuses that one site when one of them is not rewritten. Both run in the
        same phase, repeated until no new refusal appears (a refusal may break another rewrite's
        requirement or change what a ``settle`` sees); a rule never asks another rule, nor imports it.

        Args:
          sites: every :class:`~flashport.rewriter.engine.results.Site` of the file, all rules.
          ctx: the file's :class:`RuleContext` (:meth:`RuleContext.for_file`: no site); its
            accessors answer from the file's semantic model.
        """
        return None

    @classmethod
    def doc(cls) -> str:
        """The rule's user documentation: its module docstring plus the class docstring."""
        import sys

        module_doc = inspect.getdoc(sys.modules[cls.__module__]) or ""
        class_doc = inspect.getdoc(cls) or ""
        return "\n\n".join(part for part in (module_doc, class_doc) if part)

    @classmethod
    def summary(cls) -> str:
        """First line of the rule's docstring."""
        return (cls.doc().splitlines() or [""])[0]


# ----------------------------------------------------------------------------------- registry


REGISTRY: dict[str, type[Rule]] = {}

FAMILY_FRAMEWORKS = {"flash_attn": "torch", "torch": "torch", "xformers": "torch", "jax": "jax"}
"""The framework of every rule in a family package (``config`` rules name their own)."""
GPU_FAMILIES = ("flash_attn", "xformers")
"""Families whose source packages exist only for GPUs: their imports go once unused."""


def _family(cls: type[Rule]) -> str:
    """The family package of a rule module (``flashport.rules.<family>.fpaNNN_*``), else ``""``."""
    parts = cls.__module__.split(".")
    return parts[2] if parts[:2] == ["flashport", "rules"] and len(parts) == 4 else ""


def _derive_manifest(cls: type[Rule]) -> None:
    """Fill the manifest attributes a rule leaves unset from those it sets (:class:`Rule`)."""
    family = _family(cls)
    if not cls.API and cls.SOURCES:
        cls.API = cls.SOURCES[0]
    if not cls.FRAMEWORK:
        cls.FRAMEWORK = FAMILY_FRAMEWORKS.get(family, "")
    if not cls.TRIGGERS:
        names = [source.rsplit(".", 1)[-1] for source in cls.SOURCES] + list(cls.STRINGS)
        cls.TRIGGERS = tuple(dict.fromkeys(name.encode() for name in names))
    if not cls.GPU_MODULES and family in GPU_FAMILIES:
        cls.GPU_MODULES = tuple(dict.fromkeys(source.split(".")[0] for source in cls.SOURCES))


def register(cls: type[Rule]) -> type[Rule]:
    """Class decorator adding a rule to :data:`REGISTRY` (codes and names must be unique) once
    :func:`_derive_manifest` has filled the attributes it leaves unset."""
    if not re.fullmatch(r"FPA\d{3}", cls.CODE):
        raise ValueError(f"rule code must look like FPA001, got {cls.CODE!r}")
    _derive_manifest(cls)
    for other in REGISTRY.values():
        if other is not cls and (other.CODE == cls.CODE or other.NAME == cls.NAME):
            raise ValueError(f"duplicate rule code/name: {cls.CODE} {cls.NAME} vs {other.CODE} {other.NAME}")
    REGISTRY[cls.CODE] = cls
    return cls
