"""The rule interface: what one source-API rule declares and how it answers for one call site.

A rule is a small class, instantiated **fresh for every file** (no state leaks between files), that
the engine asks about each libcst node whose *qualified name* (resolved by libcst's
``QualifiedNameProvider``, never a bare name) is one of the rule's :attr:`Rule.SOURCES`:

* :meth:`Rule.check_call` for calls ``src(...)``: return :class:`Rewrite` (a replacement node plus the
  imports it needs), :class:`Refusal` (left byte-identical, reported with a one-line reason), or
  :class:`Report` (scan-only finding that is not a rewrite candidate, e.g. a backend selector).
* :meth:`Rule.check_reference` for a source passed as a value (``attention_fn=flash_attn_func``).
* :meth:`Rule.check_string` for string literals listed in :attr:`Rule.STRINGS` (config switches).

A decision that spans sites is made in the engine's per-file phase, from every site's *final*
status (rewritten, refused, suppressed, left out by ``--ignore``, declined interactively): a rewrite
names the other calls it is only correct with (:attr:`Rewrite.requires`), and :meth:`Rule.settle`
may refuse all of a rule's rewrites in a file. No rule asks or imports another rule.

Rules never touch imports or files themselves; the engine adds ``import flashport`` once, drops GPU
imports that became unused (:attr:`Rule.GPU_MODULES`, :mod:`flashport.rewriter.dead_imports`),
points names left only probed or re-exported at flashport's drop-ins and pins ``flash_attn.__version__``
reads (:mod:`flashport.rewriter.drop_in_imports`), and reports why each GPU import it keeps stays
(:mod:`flashport.rewriter.kept_imports`).

Adding a rule::

    # rules/fpa0NN_my_api.py
    from flashport.rules.base import Rule, Rewrite, Refusal, Signature, register
    @register
    class MyApi(Rule):
        '''What it rewrites / Semantics mapping / What it refuses / Example.'''
        CODE, NAME, API = "FPA0NN", "my-api", "pkg.my_api"
        SOURCES = ("pkg.my_api",); TRIGGERS = (b"my_api",)
        def check_call(self, call, ctx): ...
    # then list the module in rules/__init__.py::RULE_MODULES, add tests/fixtures/codemod/FPA0NN/ and
    # regenerate the docs (python -m flashport.rules.coverage --update docs/rules.md;
    # python -m flashport.rewriter.porting_guide --write docs/porting_guide.md). CONTRIBUTING.md has the steps.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import libcst as cst

if TYPE_CHECKING:  # the engine's record of a site; results imports nothing from the rules at run time
    from flashport.rewriter.results import Site
    from flashport.rules.apis import Param

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
    """Leave the site byte-identical; ``reason`` is one line saying why."""

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
    """Raised by helpers (argument binding, literal checks); the engine turns it into a Refusal."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# ----------------------------------------------------------------------------------- options


@dataclasses.dataclass(frozen=True)
class Patch:
    """A run-time replacement of a source API found in the files of a run
    (:mod:`flashport.rewriter.run_context`): ``F.scaled_dot_product_attention = wrapper``.

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
        (:class:`Patch`; found by :mod:`flashport.rewriter.run_context` before any file is
        transformed, so every file of a project sees the patches of the others).
      format_rewrites: format the statements a rewrite changed with the project's formatter
        settings (:mod:`flashport.rewriter.formatting`; the CLI turns it on, ``--no-format`` off).
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
        chunks, such as module-level constants (read only).
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


# ----------------------------------------------------------------------------------- the base class


class Rule:
    """Base class of every rule; subclasses set the class attributes and override ``check_*``.

    Class attributes:
      CODE: stable id (``FPA001``); selection matches prefixes (``FPA0``).
      NAME: kebab-case name (``flash-attn-func``).
      API: the source API, for tables (``flash_attn.flash_attn_func``).
      FRAMEWORK: ``"torch"`` or ``"jax"``.
      SOURCES: fully qualified names that match (every public import path).
      TRIGGERS: byte strings; a file containing none of them is never parsed for this rule.
      STRINGS: string literal values reported by :meth:`check_string`.
      GPU_MODULES: module prefixes whose imports may be dropped once unused after a rewrite.
      TARGET: what rewrites produce (docs only).
      REWRITES: False for scan-only rules (they only ever return Report/Refusal).
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
        return Refusal("no rewrite implemented for this API")

    def check_reference(self, node: cst.BaseExpression, ctx: RuleContext) -> Outcome:
        """Answer for a source API used as a value (callback, mapping entry, ``functools.partial``,
        attribute): a rewrite to flashport's drop-in of the same name where one replicates the API
        exactly, else a report whose reason names the context (feature probe, comparison, version,
        no drop-in; :func:`flashport.rules._values.answer`)."""
        from flashport.rules import _values

        return _values.answer(node, ctx)

    def check_string(self, node: cst.SimpleString, value: str, ctx: RuleContext) -> Outcome:
        """Answer for a string literal whose value is in :attr:`STRINGS`."""
        return None

    def settle(self, sites: Sequence[Site], tree: ast.Module) -> str | None:
        """Per-file phase, after every site of the file has its final status (rewritten, refused,
        suppressed by a comment or by the interactive review; rules left out by ``--ignore`` have
        no sites). Return a reason to refuse *all* of this rule's rewrites in the file (their
        meaning depends on other sites), or None to keep them.

        A rewrite that depends on particular other calls names them instead (:attr:`Rewrite.requires`):
        the engine then refuses that one site when one of them is not rewritten. Both run in the
        same phase, repeated until no new refusal appears (a refusal may break another rewrite's
        requirement or change what a ``settle`` sees); a rule never asks another rule, nor imports it.

        Args:
          sites: every :class:`~flashport.rewriter.results.Site` of the file, all rules.
          tree: the file's ``ast.Module``.
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


# ----------------------------------------------------------------------------------- signatures


@dataclasses.dataclass(frozen=True)
class Signature:
    """A source API's parameter list for one version.

    Attributes:
      positional: names that may be passed positionally, in order.
      keyword_only: names that must be passed by keyword.
    """

    positional: tuple[str, ...]
    keyword_only: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """Every parameter name."""
        return self.positional + self.keyword_only

    @classmethod
    def of(cls, parameters: Sequence[Param]) -> Signature:
        """The signature of a source API's catalogued ``parameters`` (:mod:`flashport.rules.apis`)."""
        return cls(
            tuple(p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD),
            tuple(p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY),
        )

    def bind(self, call: cst.Call, api: str) -> dict[str, cst.Arg]:
        """Map every argument of ``call`` to its parameter name.

        Raises:
          Refuse: on ``*args``/``**kwargs`` splats, too many positionals, unknown or repeated names.
        """
        bound: dict[str, cst.Arg] = {}
        index = 0
        for arg in call.args:
            if arg.star == "**":
                raise Refuse("**kwargs splat: its keys are unknown statically")
            if arg.star == "*":
                raise Refuse("*args splat: which parameters it fills is unknown statically")
            if arg.keyword is None:
                if index >= len(self.positional):
                    raise Refuse(f"{api} takes at most {len(self.positional)} positional arguments here")
                name = self.positional[index]
                index += 1
            else:
                name = arg.keyword.value
                if name not in self.names:
                    raise Refuse(f"unknown argument {name!r} for {api} at this version")
            if name in bound:
                raise Refuse(f"argument {name!r} given twice")
            bound[name] = arg
        return bound


# ----------------------------------------------------------------------------------- literal helpers


def literal_number(node: cst.BaseExpression | None) -> float | int | None:
    """The value of an int/float literal (with an optional unary minus), else None."""
    if node is None:
        return None
    sign = 1
    while isinstance(node, cst.UnaryOperation) and isinstance(node.operator, (cst.Minus, cst.Plus)):
        if isinstance(node.operator, cst.Minus):
            sign = -sign
        node = node.expression
    if isinstance(node, cst.Integer):
        return sign * int(node.evaluated_value)
    if isinstance(node, cst.Float):
        return sign * float(node.evaluated_value)
    return None


def is_none(node: cst.BaseExpression | None) -> bool:
    """True for an absent argument or the literal ``None``."""
    return node is None or (isinstance(node, cst.Name) and node.value == "None")


def literal_bool(node: cst.BaseExpression | None) -> bool | None:
    """True/False for the literals ``True``/``False``, else None."""
    if isinstance(node, cst.Name) and node.value in ("True", "False"):
        return node.value == "True"
    return None


def is_zero(node: cst.BaseExpression | None) -> bool:
    """True for a literal numeric zero."""
    value = literal_number(node)
    return value is not None and value == 0


def literal_string(node: cst.BaseExpression | None) -> str | None:
    """The value of a plain string literal, else None."""
    if isinstance(node, cst.SimpleString):
        value = node.evaluated_value
        return value if isinstance(value, str) else None
    return None


def training_gated_zero(node: cst.BaseExpression) -> bool:
    """True for ``x if <cond> else 0`` or ``0 if <cond> else x`` (dropout gated by a condition)."""
    return isinstance(node, cst.IfExp) and (is_zero(node.orelse) or is_zero(node.body))


def no_dropout(
    node: cst.BaseExpression | None,
    name: str,
    ctx: RuleContext,
    why: str = "flashport.attention has no dropout",
) -> list[str]:
    """Check a dropout argument is zero, for targets that cannot take dropout; returns notes
    (``--inference`` drops a training-gated one).

    Raises:
      Refuse: for dropout that may be non-zero; ``why`` says why the target cannot carry it.
    """
    if node is None or is_zero(node):
        return []
    if training_gated_zero(node) and ctx.options.inference:
        return [f"dropped {name}={ctx.code(node)} (--inference: treated as 0)"]
    if training_gated_zero(node):
        raise Refuse(f"{name}={ctx.code(node)} is non-zero in training; {why} (--inference drops it)")
    raise Refuse(f"{name}={ctx.code(node)} may be non-zero; {why}")


def carry_dropout(
    node: cst.BaseExpression | None, name: str, target: str, ctx: RuleContext
) -> tuple[list[tuple[str, cst.BaseExpression]], list[str]]:
    """Carry a dropout argument over verbatim as the target's ``target`` keyword.

    Returns ``(keywords, notes)``: no keyword for an absent or literal-zero dropout (the contract's
    default is 0), none either for a training-gated one under ``--inference`` (dropped, with a note),
    else ``[(target, node)]`` -- the expression itself, evaluated once by the new call. Place the
    keyword with :func:`insert_in_source_order`.
    """
    if node is None or is_zero(node):
        return [], []
    if training_gated_zero(node) and ctx.options.inference:
        return [], [f"dropped {name}={ctx.code(node)} (--inference: treated as 0)"]
    return [(target, node)], []


_PURE_LEAVES = (cst.Name, cst.Integer, cst.Float, cst.Imaginary, cst.SimpleString, cst.ConcatenatedString)


def is_pure(node: cst.BaseExpression) -> bool:
    """True for expressions whose evaluation order does not matter: names, attribute chains,
    literals, subscripts, and operators / comparisons / conditionals over those (no calls, no
    ``await``/``yield``/``:=``). Properties and operator overloads are presumed side-effect free."""
    if isinstance(node, _PURE_LEAVES):
        return True
    if isinstance(node, cst.Attribute):
        return is_pure(node.value)
    if isinstance(node, cst.UnaryOperation):
        return is_pure(node.expression)
    if isinstance(node, (cst.BinaryOperation, cst.BooleanOperation)):
        return is_pure(node.left) and is_pure(node.right)
    if isinstance(node, cst.Comparison):
        return is_pure(node.left) and all(is_pure(t.comparator) for t in node.comparisons)
    if isinstance(node, cst.IfExp):
        return is_pure(node.test) and is_pure(node.body) and is_pure(node.orelse)
    if isinstance(node, cst.Subscript):
        return is_pure(node.value) and all(
            isinstance(e.slice, cst.Index) and is_pure(e.slice.value) for e in node.slice
        )
    if isinstance(node, cst.Tuple):
        return all(type(e) is cst.Element and is_pure(e.value) for e in node.elements)
    return False


def _is_literal(node: cst.BaseExpression) -> bool:
    """Numbers, strings, ``None``/``True``/``False`` (with a unary sign): nothing to evaluate."""
    if isinstance(node, cst.Name):
        return node.value in ("None", "True", "False")
    return literal_number(node) is not None or isinstance(node, (cst.SimpleString, cst.ConcatenatedString))


def _source_positions(node: cst.CSTNode, positions: dict[int, int]) -> list[int]:
    """Indices (in the original call) of the source arguments whose value appears in ``node``."""
    found: list[int] = []

    class _Finder(cst.CSTVisitor):
        def on_visit(self, inner: cst.CSTNode) -> bool:
            if id(inner) in positions:
                found.append(positions[id(inner)])
                return False
            return True

    if id(node) in positions:
        return [positions[id(node)]]
    node.visit(_Finder())
    return found


def insert_in_source_order(
    call: cst.Call,
    positional: Sequence[cst.BaseExpression | cst.Arg],
    keywords: list,
    entry: tuple[str, cst.BaseExpression],
    name: str,
    ctx: RuleContext,
) -> list:
    """``keywords`` with ``entry`` (whose value is an argument of ``call``) inserted so that it is
    evaluated in the same order, relative to the other carried-over arguments, as in ``call``.

    The entry goes right after the last keyword holding an argument that preceded it in ``call``.
    When the rewrite reorders the other arguments around it (e.g. SDPA's ``is_causal`` written
    before a positional dropout), the order still holds for a side-effect-free expression
    (:func:`is_pure`); otherwise the site is refused.

    Raises:
      Refuse: for an impure expression that cannot keep its place.
    """
    value = entry[1]
    # A literal argument cannot observe a side effect, so its place does not constrain the entry.
    positions = {
        id(arg.value): i
        for i, arg in enumerate(call.args)
        if arg.value is value or not _is_literal(arg.value)
    }
    here = positions[id(value)]

    def spots(item: cst.BaseExpression | cst.Arg | tuple[str, cst.BaseExpression]) -> list[int]:
        node = item if isinstance(item, cst.CSTNode) else item[1]
        return _source_positions(node, positions)

    index = 0
    for i, item in enumerate(keywords):
        if any(p < here for p in spots(item)):
            index = i + 1
    before = [p for item in [*positional, *keywords[:index]] for p in spots(item)]
    after = [p for item in keywords[index:] for p in spots(item)]
    if not is_pure(value) and (any(p > here for p in before) or any(p < here for p in after)):
        raise Refuse(
            f"{name}={ctx.code(value)} may have side effects and would be evaluated out of its "
            f"original order here; bind it to a name first"
        )
    return [*keywords[:index], entry, *keywords[index:]]


_EMPTY = cst.Module(body=())


def comments(node: cst.CSTNode) -> list[str]:
    """The texts of every comment in ``node``'s subtree, in source order."""
    # Fast paths: visiting a subtree rebuilds it node by node (milliseconds per call), rendering
    # it is cheap, and almost no subtree holds a comment.
    if isinstance(node, cst.SimpleWhitespace) or "#" not in _EMPTY.code_for_node(node):
        return []
    found: list[str] = []

    class _Finder(cst.CSTVisitor):
        def visit_Comment(self, comment: cst.Comment) -> bool:
            found.append(comment.value)
            return False

    node.visit(_Finder())
    return found


def contains_comment(node: cst.CSTNode) -> bool:
    """True when ``node``'s subtree holds a comment."""
    return bool(comments(node))


def _without_comment(ws: cst.BaseParenthesizableWhitespace) -> cst.BaseParenthesizableWhitespace:
    """``ws`` with its comments removed (a layout template must not copy one arg's comment)."""
    if isinstance(ws, cst.ParenthesizedWhitespace):
        return ws.with_changes(first_line=cst.TrailingWhitespace(), empty_lines=())
    return ws


def _trailing(arg: cst.Arg) -> cst.BaseParenthesizableWhitespace:
    """The whitespace after ``arg`` (after its comma when it has one): where its comments sit."""
    return arg.comma.whitespace_after if isinstance(arg.comma, cst.Comma) else arg.whitespace_after_arg


# ----------------------------------------------------------------------------------- builders


_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def callee_name(call: cst.Call) -> str:
    """The last name of ``call``'s callee (``torch.zeros(...)`` -> ``"zeros"``); ``""`` for other callees."""
    func = call.func
    if isinstance(func, cst.Attribute):
        return func.attr.value
    return func.value if isinstance(func, cst.Name) else ""


def dotted(name: str) -> cst.BaseExpression:
    """``"flashport.torch.attention"`` as a Name/Attribute chain."""
    if not _DOTTED.match(name):
        raise ValueError(f"not a dotted name: {name!r}")
    parts = name.split(".")
    node: cst.BaseExpression = cst.Name(parts[0])
    for part in parts[1:]:
        node = cst.Attribute(value=node, attr=cst.Name(part))
    return node


def _as_args(
    positional: Sequence[cst.BaseExpression | cst.Arg],
    keywords: Sequence[tuple[str, cst.BaseExpression] | cst.Arg],
) -> list[cst.Arg]:
    """``positional`` then ``keywords`` as ``cst.Arg`` nodes (ready-made ``cst.Arg`` items kept)."""
    args = [item if isinstance(item, cst.Arg) else cst.Arg(value=item) for item in positional]
    for item in keywords:
        if isinstance(item, cst.Arg):
            args.append(item)
            continue
        name, value = item
        equal = cst.AssignEqual(
            whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
        )
        args.append(cst.Arg(value=value, keyword=cst.Name(name), equal=equal))
    return args


def _order_inversions(spots: list[list[int]], like: cst.Call) -> list[tuple[int, int]]:
    """Pairs of source argument indices ``(earlier, later)`` of ``like`` that the new argument list
    (given as the source indices each new argument holds, in order) evaluates the other way round,
    where at least one of the two may have side effects (:func:`is_pure`)."""
    seen: list[int] = []
    found = []
    for held in spots:
        for here in held:
            for before in seen:
                if before > here and not (
                    is_pure(like.args[before].value) and is_pure(like.args[here].value)
                ):
                    found.append((here, before))
        seen.extend(held)
    return found


def _in_source_order(args: list[cst.Arg], like: cst.Call) -> list[cst.Arg]:
    """``args`` with every argument carried over from ``like`` evaluated in ``like``'s order.

    Keyword and ``**mapping`` arguments are free to move, so when the rewrite evaluates an argument with possible side
    effects out of its source order (``causal=f(), softmax_scale=g()`` mapped to ``scale=g(),
    causal=f()``), the keywords holding source arguments are sorted back into source order (the
    others keep their slots). Literals take no part (nothing to evaluate).

    Raises:
      Refuse: when the order still differs (a positional argument of the target holds a source
        argument that came after one with side effects).
    """
    if all(is_pure(arg.value) for arg in like.args):
        return args  # nothing can observe the order (the common case: names, attributes, literals)
    positions = {id(arg.value): i for i, arg in enumerate(like.args) if not _is_literal(arg.value)}
    spots = [_source_positions(arg.value, positions) for arg in args]
    if not _order_inversions(spots, like):
        return args
    movable = [i for i, arg in enumerate(args) if (arg.keyword is not None or arg.star == "**") and spots[i]]
    ordered = sorted(movable, key=lambda i: min(spots[i]))
    args, spots = list(args), list(spots)
    new_args, new_spots = list(args), list(spots)
    for slot, source in zip(movable, ordered, strict=True):
        new_args[slot], new_spots[slot] = args[source], spots[source]
    inversions = _order_inversions(new_spots, like)
    if inversions:
        moved = like.args[inversions[0][1]]
        name = moved.keyword.value if moved.keyword is not None else f"argument {inversions[0][1] + 1}"
        raise Refuse(
            f"{name}={_EMPTY.code_for_node(moved.value)} may have side effects and would be evaluated "
            "out of its original order here; bind it to a name first"
        )
    return new_args


def _layout(
    like: cst.Call,
) -> tuple[cst.BaseParenthesizableWhitespace | None, cst.BaseParenthesizableWhitespace]:
    """(whitespace between arguments when ``like`` has one argument per line, else None; whitespace
    before the closing paren), comments removed."""
    opening = like.whitespace_before_args
    between_ws = _without_comment(opening) if isinstance(opening, cst.ParenthesizedWhitespace) else None
    for original in like.args[:-1]:
        if (
            between_ws is None
            and isinstance(original.comma, cst.Comma)
            and isinstance(original.comma.whitespace_after, cst.ParenthesizedWhitespace)
        ):
            between_ws = _without_comment(original.comma.whitespace_after)
    closing: cst.BaseParenthesizableWhitespace = cst.SimpleWhitespace("")
    if between_ws is not None and like.args:
        closing = _without_comment(_trailing(like.args[-1]))
    return between_ws, closing


# The entry points that take the contract's keywords with their defaults (flashport.kernels.contract.keywords).
CONTRACT_TARGETS = ("flashport.attention", "flashport.torch.attention", "flashport.varlen_attention")


def _is_default(keyword: tuple[str, cst.BaseExpression] | cst.Arg) -> bool:
    """A ``(name, literal)`` keyword that spells the contract's default (``scale=None``,
    ``causal=False``); ``layout`` is always written, so that a call never depends on the default."""
    from flashport.kernels.contract.keywords import CONTRACT_KEYWORDS

    if isinstance(keyword, cst.Arg) or keyword[0] == "layout":
        return False
    name, value = keyword
    default = dict(CONTRACT_KEYWORDS).get(name, ...)
    spelled = "None" if default is None else "False" if default is False else None
    return spelled is not None and isinstance(value, cst.Name) and value.value == spelled


def build_call(
    target: str,
    positional: Sequence[cst.BaseExpression | cst.Arg],
    keywords: Sequence[tuple[str, cst.BaseExpression] | cst.Arg],
    like: cst.Call,
) -> cst.Call:
    """A call ``target(*positional, **keywords)`` formatted like ``like`` (one line or one arg per line).

    Comments are kept: an argument carried over from ``like`` keeps the comment after it; the
    engine re-attaches any other comment of ``like`` (:func:`keep_comments`). Arguments carried over
    from ``like`` are evaluated in their source order (:func:`_in_source_order`).

    ``positional`` and ``keywords`` items may be ready-made ``cst.Arg`` (e.g. a ``*x.unbind(2)``
    or ``**mapping`` argument). Keyword values are inserted as given; build string values with
    :func:`string`.

    Raises:
      Refuse: when an argument with possible side effects cannot keep its evaluation order.
    """
    if target in CONTRACT_TARGETS:
        keywords = [k for k in keywords if not _is_default(k)]
    args = _in_source_order(_as_args(positional, keywords), like)
    between_ws, closing = _layout(like)
    multiline = between_ws is not None
    # An argument carried over keeps the comments that followed it (its comma's whitespace).
    commented = {id(a.value): _trailing(a) for a in like.args if comments(_trailing(a))}
    formatted = []
    for i, arg in enumerate(args):
        kept = commented.pop(id(arg.value), None)
        comma: cst.Comma | cst.MaybeSentinel
        if i < len(args) - 1:
            between = between_ws if between_ws is not None else cst.SimpleWhitespace(" ")
            comma = cst.Comma(whitespace_after=kept or between)
        elif kept is not None or (multiline and isinstance(closing, cst.ParenthesizedWhitespace)):
            comma = cst.Comma(whitespace_after=kept or closing)  # never a `,)` on the last line
        else:
            comma = cst.MaybeSentinel.DEFAULT
        # one with_changes per argument (each is a dataclasses.replace with validation)
        formatted.append(arg.with_changes(whitespace_after_arg=cst.SimpleWhitespace(""), comma=comma))
    return like.with_changes(
        func=dotted(target), args=formatted, whitespace_before_args=like.whitespace_before_args
    )


def keep_comments(original: cst.Call, new: cst.BaseExpression) -> cst.BaseExpression | None:
    """``new`` with every comment of ``original`` that it lacks added before its closing paren
    (one comment per line); None when ``new`` is not a call, so there is no place to put them."""
    missing = list(comments(original))
    for text in comments(new):
        if text in missing:
            missing.remove(text)
    if not missing:
        return new
    if not isinstance(new, cst.Call):
        return None
    # Indent the comments like the arguments (a multi-line call's continuation lines), else like the block.
    template = next(
        (
            a.comma.whitespace_after
            for a in new.args[:-1]
            if isinstance(a.comma, cst.Comma)
            and isinstance(a.comma.whitespace_after, cst.ParenthesizedWhitespace)
        ),
        None,
    )
    indent = template.indent if template is not None else True
    space = template.last_line if template is not None else cst.SimpleWhitespace("")
    lines = [cst.EmptyLine(indent=indent, whitespace=space, comment=cst.Comment(text)) for text in missing]
    if not new.args:
        ws = new.whitespace_before_args
        return new.with_changes(whitespace_before_args=_append_lines(ws, lines))
    last = new.args[-1]
    if isinstance(last.comma, cst.Comma):
        last = last.with_changes(
            comma=last.comma.with_changes(whitespace_after=_append_lines(last.comma.whitespace_after, lines))
        )
    else:
        last = last.with_changes(whitespace_after_arg=_append_lines(last.whitespace_after_arg, lines))
    return new.with_changes(args=[*new.args[:-1], last])


def _append_lines(
    ws: cst.BaseParenthesizableWhitespace, lines: list[cst.EmptyLine]
) -> cst.ParenthesizedWhitespace:
    """``ws`` followed by the comment ``lines``; the closing paren then starts its own line."""
    if isinstance(ws, cst.ParenthesizedWhitespace):
        return ws.with_changes(empty_lines=[*ws.empty_lines, *lines])
    return cst.ParenthesizedWhitespace(
        first_line=cst.TrailingWhitespace(),
        empty_lines=lines,
        indent=True,
        last_line=cst.SimpleWhitespace(""),
    )


def string(value: str) -> cst.SimpleString:
    """A double-quoted string literal."""
    return cst.SimpleString('"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"')


def tuple_of(*items: cst.BaseExpression) -> cst.Tuple:
    """``(a, b)`` as a parenthesized tuple."""
    elements = []
    for i, item in enumerate(items):
        comma = (
            cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
            if i < len(items) - 1
            else cst.MaybeSentinel.DEFAULT
        )
        elements.append(cst.Element(value=item, comma=comma))
    return cst.Tuple(elements=elements)


def parenthesized(node: cst.BaseExpression) -> cst.BaseExpression:
    """``node`` in parentheses unless it is a name, attribute, call or subscript or has them already:
    an operand that keeps its meaning wherever a template puts it (``(a if c else b)[0]``,
    ``for w in (x if c else y)``, ``(q := x).unbind(0)``)."""
    if isinstance(node, (cst.Name, cst.Attribute, cst.Call, cst.Subscript)) or node.lpar:
        return node
    return node.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])


def number(value: int | float) -> cst.BaseExpression:
    """An int or float literal (negative values get a unary minus)."""
    node: cst.BaseExpression = (
        cst.Integer(str(abs(value))) if isinstance(value, int) else cst.Float(repr(abs(value)))
    )
    return cst.UnaryOperation(operator=cst.Minus(), expression=node) if value < 0 else node


# ----------------------------------------------------------------------------------- registry


REGISTRY: dict[str, type[Rule]] = {}


def register(cls: type[Rule]) -> type[Rule]:
    """Class decorator adding a rule to :data:`REGISTRY` (codes and names must be unique)."""
    if not re.fullmatch(r"FPA\d{3}", cls.CODE):
        raise ValueError(f"rule code must look like FPA001, got {cls.CODE!r}")
    for other in REGISTRY.values():
        if other is not cls and (other.CODE == cls.CODE or other.NAME == cls.NAME):
            raise ValueError(f"duplicate rule code/name: {cls.CODE} {cls.NAME} vs {other.CODE} {other.NAME}")
    REGISTRY[cls.CODE] = cls
    return cls
