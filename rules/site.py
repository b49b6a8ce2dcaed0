"""What a rule is told about one call site and what it answers: the site outcomes (:class:`Rewrite`,
:class:`Refusal`, :class:`Report`, the :class:`Refuse` exception) and the run's options and context
(:class:`RuleOptions`, :class:`Patch`, :class:`RuleContext`).

Part of the rule interface, re-exported by :mod:`flashport.rules.base`; it stands apart so that the
helpers the base class uses (:mod:`flashport.rules.common.values`) import it without a cycle.
"""

from __future__ import annotations

import ast
import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable

import libcst as cst

from flashport.rewriter.source import semantic
from flashport.rewriter.source.semantic import ImportBinding

# ----------------------------------------------------------------------------------- outcomes


@dataclasses.dataclass(frozen=True)
class Rewrite:
    """Replace the matched node with ``node``.

    Attributes:
      node: the replacement expression.
      imports: top-level modules the replacement needs (``"flashport"``); the engine adds
        ``import <module>`` once per file.
      notes: human notes shown in the report and JSON (e.g. "dropped dropout_p (--inference)").
      requires: the original nodes (``ctx.node`` and its relatives: nodes of the parsed chunk, not
        rebuilt ones) of other calls this rewrite is only correct with when they are rewritten too
        (the SDPA calls under a backend selector made neutral). The engine's per-file phase refuses
        this rewrite when one of them does not end rewritten: refused, suppressed by a comment,
        declined in ``--interactive`` review, left out by ``--select``/``--ignore`` (then it has no
        site at all) or itself refused by the per-file phase.
      otherwise: the reason of that refusal; the engine adds which required call is not rewritten
        and why (``"<otherwise> (line N: <its reason>)"``). Required with ``requires``.
    """

    node: cst.BaseExpression
    imports: tuple[str, ...] = ("flashport",)
    notes: tuple[str, ...] = ()
    requires: tuple[cst.CSTNode, ...] = ()
    otherwise: str = ""

    def __post_init__(self) -> None:
        if self.requires and not self.otherwise:
            raise ValueError("Rewrite(requires=...) needs otherwise=: the reason when a required call stays")


@dataclasses.dataclass(frozen=True)
class Refusal:
    """The engine's record of a refused site: left byte-identical; ``reason`` is one line saying why.
    Rules refuse by raising :class:`Refuse`, never by building this."""

    reason: str


@dataclasses.dataclass(frozen=True)
class Report:
    """A scan finding that is not a rewrite candidate (selector, config string, probe)."""

    reason: str


Outcome = Rewrite | Refusal | Report | None

# Reason prefix of a site kept byte-identical because it needs no change to run on a TPU host with the
# same meaning (an SDPA backend switch, a probe of torch SDPA's kernels); benchmarks count it apart.
RUNS_AS_IS = "runs as is on a TPU host"


def runs_as_is(why: str) -> Report:
    """A report for a site that needs no port: :data:`RUNS_AS_IS`, then ``why``."""
    return Report(f"{RUNS_AS_IS}: {why}")


class Refuse(Exception):
    """The one way a rule refuses a site: ``raise Refuse(reason)``, from the rule's ``check_*`` or any
    helper it calls (argument binding, literal checks); the engine records a :class:`Refusal` with
    ``reason``. A rule may catch it from a helper to answer otherwise (a drop-in call instead)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# ----------------------------------------------------------------------------------- options


@dataclasses.dataclass(frozen=True)
class Patch:
    """A run-time replacement of a source API found in the files of a run
    (:mod:`flashport.rewriter.engine.run_context`): ``F.scaled_dot_product_attention = wrapper``.

    Attributes:
      api: the qualified name replaced (``torch.nn.functional.scaled_dot_product_attention``).
      path: the file that replaces it (as the run names it).
      line: 1-based line of the statement.
      how: a few words on how (the statement, shortened).
      root: the project the patching file belongs to (its nearest folder holding pyproject.toml,
        setup.py, setup.cfg or .git): the patch concerns the files of that project only; None:
        every file it is given to.
    """

    api: str
    path: str
    line: int
    how: str
    root: str | None = None

    def where(self) -> str:
        """``path:line`` of the patch."""
        return f"{self.path}:{self.line}"


@dataclasses.dataclass(frozen=True)
class RuleOptions:
    """Options every rule may read (CLI flags and ``[tool.flashport]``).

    Attributes:
      inference: treat ``p if self.training else 0.0`` style dropout as zero and drop it
        (the finding's note says so).
      flash_attn_version: (major, minor, patch) of flash-attn the source was written against; positional
        arguments are bound against that version's signature and ``causal`` is top-left before 2.1.
      torch_version: (major, minor) of torch for SDPA's signature.
      jax_version: (major, minor, patch) of jax for ``jax.nn.dot_product_attention``'s signature.
      patches: run-level context: the source APIs the run's files replace at run time
        (:class:`Patch`; found by :mod:`flashport.rewriter.engine.run_context` before any file is
        transformed, so every file of a project sees the patches of the others).
      format_rewrites: format the statements a rewrite changed with the project's formatter
        settings (:mod:`flashport.rewriter.engine.formatting`; the CLI turns it on, ``--no-format`` off).
    """

    inference: bool = False
    flash_attn_version: tuple[int, ...] = (2, 8, 3)
    torch_version: tuple[int, ...] = (2, 5)
    jax_version: tuple[int, ...] = (0, 10, 2)
    patches: tuple[Patch, ...] = ()
    format_rewrites: bool = False

    def patch_of(self, api: str) -> Patch | None:
        """The first :class:`Patch` of ``api`` (a qualified name) in this run, or None."""
        return next((p for p in self.patches if p.api == api), None)


@dataclasses.dataclass
class RuleContext:
    """What a rule knows about the current site besides the node.

    Attributes:
      path: file path (for messages only).
      line: 1-based line of the site in the file.
      qualified_name: the source API name the node resolved to.
      options: :class:`RuleOptions`.
      code_for_node: renders a node as source text (for messages and notes).
      node: the *original* node the engine is asking about (rules receive the updated node,
        a fresh object when inner nodes were rewritten; this one sits in the parsed chunk).
      ancestors: the original parents of :attr:`node`, nearest first, up to the module (the
        engine's traversal path: the links libcst's ``ParentNodeProvider`` would give).
      module: the parsed chunk module the nodes belong to (None outside the engine).
      tree: the whole file's ``ast.Module`` (None outside the engine): what lies outside the parsed
        chunks, such as module-level constants (read only). Rules ask about it through the
        accessors below (the file's :class:`~flashport.rewriter.source.semantic.SemanticModel`),
        not by walking it.

    The accessors answer from the whole file, whatever part of it the engine parsed with libcst
    (thin or pruned chunks): a libcst node is matched to the model by its dotted text and the
    site's line.
    """

    path: str
    line: int
    qualified_name: str
    options: RuleOptions
    code_for_node: object = None
    node: cst.CSTNode | None = None
    ancestors: tuple[cst.CSTNode, ...] = ()
    module: cst.Module | None = None
    tree: ast.Module | None = None

    def code(self, node: cst.CSTNode) -> str:
        """Source text of ``node`` (best effort)."""
        if callable(self.code_for_node):
            return self.code_for_node(node)
        return cst.Module(body=[]).code_for_node(node)

    @property
    def semantic(self) -> semantic.SemanticModel | None:
        """The file's semantic model (None outside the engine)."""
        return semantic.of(self.tree) if self.tree is not None else None

    def qualified_names(self, node: cst.CSTNode | ast.AST) -> set[str]:
        """The qualified names a Name/Attribute chain read at this site resolves to through the
        file's imports (:meth:`~flashport.rewriter.source.semantic.SemanticModel.imports_at`);
        empty when its first name is no such import, or outside the engine. An ``ast`` node (a
        module constant's value) resolves at this site's line too."""
        model = self.semantic
        if model is None:
            return set()
        if isinstance(node, ast.AST):
            name = model.qualified_name_at(semantic.dotted(node), self.line)
        else:
            name = model.qualified_name_at(dotted_text(node), self.line)
        return {name} if name else set()

    def module_constant(self, name: str) -> ast.expr | None:
        """The value of ``name`` when the file binds it exactly once, by ``name = value`` in the
        module's scope, and nothing rebinds it (its reads: :meth:`loads`); else None."""
        model = self.semantic
        return model.module_constant(name) if model is not None else None

    @classmethod
    def for_file(cls, path: str, options: RuleOptions, tree: ast.Module) -> RuleContext:
        """The context of a rule's per-file phase (:meth:`~flashport.rules.base.Rule.settle`): no
        site (line 0, no node); its accessors answer for the module's scope."""
        return cls(path, 0, "", options, tree=tree)

    def imports(self) -> list[ImportBinding]:
        """Every name an import binds anywhere in the file (empty outside the engine)."""
        model = self.semantic
        return list(model.imports) if model is not None else []

    def first_comparison(self, names: Iterable[str]) -> int | None:
        """The line of the file's first comparison with a plain read of one of ``names`` as a side
        (:meth:`~flashport.rewriter.source.semantic.SemanticModel.first_comparison`); None when
        there is none, or outside the engine."""
        model = self.semantic
        return model.first_comparison(names) if model is not None else None

    def mentions(self, matches: Callable[[str], bool]) -> Counter:
        """Line -> how many names, attribute names and identifier strings there ``matches``
        accepts, over the whole file
        (:meth:`~flashport.rewriter.source.semantic.SemanticModel.mentions`; empty outside the
        engine)."""
        model = self.semantic
        return model.mentions(matches) if model is not None else Counter()

    def loads(self, name: str) -> list[ast.Name]:
        """Every read of ``name`` in the file (empty outside the engine)."""
        model = self.semantic
        return model.loads(name) if model is not None else []

    def parent(self, node: cst.CSTNode | ast.AST) -> cst.CSTNode | ast.AST | None:
        """The parent of ``node``: of the site's node or one of its ancestors (libcst), or of an
        ``ast`` node of the file; None when unknown."""
        if isinstance(node, ast.AST):
            model = self.semantic
            return model.parent(node) if model is not None else None
        path = [self.node, *self.ancestors] if self.node is not None else []
        for index, item in enumerate(path[:-1]):
            if item is node:
                return path[index + 1]
        return None

    def enclosing(
        self, node: cst.CSTNode, kind: type | tuple[type, ...] = cst.FunctionDef
    ) -> cst.CSTNode | None:
        """The nearest ancestor of ``node`` (the site's node or one of its ancestors) of type
        ``kind``; None when there is none or it is unknown."""
        current = self.parent(node)
        while current is not None and not isinstance(current, kind):
            current = self.parent(current)
        return current  # type: ignore[return-value]


def dotted_text(node: cst.CSTNode) -> str:
    """``a.b.c`` for a libcst Name/Attribute chain; ``""`` for anything else."""
    parts = []
    while isinstance(node, cst.Attribute):
        parts.append(node.attr.value)
        node = node.value
    if not isinstance(node, cst.Name):
        return ""
    parts.append(node.value)
    return ".".join(reversed(parts))
