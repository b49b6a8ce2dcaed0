"""The libcst pass over one chunk: resolve qualified names, ask rules, replace rewritten calls.

The file is parsed as a *mini module* = its top-level import statements (header) followed by the
statements that mention a trigger (top-level ones, or single statements of a top-level class inside
a stand-in class), separated by sentinel comments. libcst's ``QualifiedNameProvider`` resolves names
in it exactly as in the whole file (imports, aliases, function-level and guarded imports), while
scope analysis only runs over the chunks, not the whole file. ``line_map`` maps mini-module lines
back to file lines; nodes outside the chunks (the header) are ignored. Those names are blind to the
flow; where the flow of the read's scope decides which bindings reach it (the file's ``ast``:
:meth:`~flashport.rewriter.source.semantic.SemanticModel.reaching`, the same in every mode), the names
no reaching binding gives are dropped: a read after an unconditional ``from npu import f as
flash_attn_func`` is no site, and a call through a name that a path to it rebinds to another value
is refused.

When several selected rules watch the same qualified name or string, the one with the lowest code
answers and the others are shadowed (``--ignore`` the first to let the next one answer); FPA905
relies on this to be opt-in behind FPA901.

``vetoes`` (rule code -> reason) turn that rule's rewrites into refusals, ``site_vetoes`` ((rule
code, line, column) -> reason) one site's: the engine's per-file phase sets them after a pass, from
:meth:`flashport.rules.base.Rule.settle` and from :meth:`SiteTransformer.unmet` (rewrites whose
:attr:`~flashport.rules.base.Rewrite.requires` calls did not end rewritten).

Cost: positions come from rendering only the statement a site sits in, located by the file's
``ast`` line numbers (:mod:`~flashport.rewriter.source.spans`; the whole mini module once when that cannot
tell), and ``changed`` lists the smallest statements holding every change so the engine renders
and splices only those; qualified names, whether a value's bindings are all imports, and local
aliases with the reads that resolve to them come from the file's semantic model
(:meth:`~flashport.rewriter.source.semantic.SemanticModel.header_names`,
:meth:`~flashport.rewriter.source.semantic.SemanticModel.local_alias`), and libcst's scope analysis
runs, once, only for a question the model names undecided (a module-level alias, a star import, a
function that also assigns an imported name, a read on a line holding a comprehension, ...). The
traversal does not
descend into nodes that cannot hold a site, nor into statements whose text matches nothing of
``relevant`` (the engine's triggers, watched strings and names bound to a source). Rules still see
every original ancestor and sibling: skipping only saves the visit.
"""

from __future__ import annotations

import ast
import bisect
import dataclasses
import functools
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import libcst as cst
from libcst.helpers import get_full_name_for_node
from libcst.metadata import MetadataWrapper, ScopeProvider

from flashport.rewriter.engine import run_context, suppress, thin
from flashport.rewriter.engine.results import AS_IS, REFUSED, REWRITE, SUPPRESSED, Site
from flashport.rewriter.imports import drop_in_imports
from flashport.rewriter.source import aliases, newsyntax, semantic
from flashport.rewriter.source.positions import Span, line_positions
from flashport.rewriter.source.spans import StatementSpans, indents
from flashport.rules import apis
from flashport.rules.base import (
    RUNS_AS_IS,
    Outcome,
    Refusal,
    Refuse,
    Report,
    Rewrite,
    Rule,
    RuleContext,
    RuleOptions,
    runs_as_is,
)
from flashport.rules.common import values
from flashport.rules.common.calls import keep_comments
from flashport.rules.common.values import call_drop_in

_OwnerT = TypeVar("_OwnerT", cst.FunctionDef, cst.Module)  # what binds aliases: a function or the module
# Nodes whose subtrees hold no call, string, assignment, argument or element: a site never sits
# inside them, so the traversal does not descend (the node itself is still visited).
_NO_SITES_BASES = (
    cst.Name,
    cst.Integer,
    cst.Float,
    cst.Imaginary,
    cst.BaseParenthesizableWhitespace,
    cst.TrailingWhitespace,
    cst.EmptyLine,
    cst.Newline,
    cst.Comment,
    cst.Comma,
    cst.Dot,
    cst.AssignEqual,
    cst.Colon,
    cst.Semicolon,
    cst.LeftParen,
    cst.RightParen,
    cst.LeftSquareBracket,
    cst.RightSquareBracket,
    cst.LeftCurlyBrace,
    cst.RightCurlyBrace,
    cst.BaseBinaryOp,
    cst.BaseBooleanOp,
    cst.BaseCompOp,
    cst.BaseUnaryOp,
    cst.BaseAugOp,
    cst.Import,
    cst.ImportFrom,
    cst.Pass,
    cst.Break,
    cst.Continue,
)


def _concrete(bases: tuple[type, ...]) -> frozenset[type]:
    """Every class under ``bases`` (libcst's bases are ABCs: ``isinstance`` on them is slow)."""
    found: set[type] = set()
    todo = list(bases)
    while todo:
        cls = todo.pop()
        if cls not in found:
            found.add(cls)
            todo.extend(cls.__subclasses__())
    return frozenset(found)


_NO_SITES = _concrete(_NO_SITES_BASES)
_LEAVES = frozenset((cst.Name, cst.Integer, cst.Float, cst.Imaginary))  # no site below, no handler
_HANDLERS: dict[
    tuple[type, str, type], Callable[..., Any] | None
] = {}  # (transformer class, prefix, node type) -> function
_STATEMENTS = _concrete((cst.BaseStatement,))


@dataclasses.dataclass(frozen=True)
class MiniFile:
    """One file's mini module and what every pass over it reads (the engine builds it once a pass
    over the file's chunks).

    Attributes:
      path: the file's path, in findings.
      module: the parsed mini module; ``source`` its text (None: no ``relevant`` skip, no comment scan).
      line_map: (first, last mini-module line, first file line) per chunk.
      suppressions: file line -> rule codes a ``# flashport: ignore`` comment suppresses there.
      tree: the whole file's ``ast`` (its :mod:`~flashport.rewriter.source.semantic` model; ``RuleContext.tree``).
      relevant: what a statement holding a site must mention (None: visit every statement).
      wrapper: libcst's metadata wrapper of ``module`` (made here when None; shared by the passes).
      names: the semantic model's :class:`~flashport.rewriter.source.semantic.HeaderNames` (None:
        libcst's scope analysis alone, the reference mode).
      positions: every node's position (libcst's ``PositionProvider``, the reference mode), or
        ``spans``: statements rendered one at a time; neither: a plain line mapping.
    """

    path: str
    module: cst.Module
    line_map: list[tuple[int, int, int]]
    suppressions: dict[int, frozenset[str]]
    tree: ast.Module | None = None
    source: str | None = None
    relevant: re.Pattern[str] | None = None
    wrapper: MetadataWrapper | None = None
    names: semantic.HeaderNames | None = None
    positions: Mapping[cst.CSTNode, Span] | None = None
    spans: StatementSpans | None = None


@dataclasses.dataclass(frozen=True)
class PassMode:
    """What one pass over a :class:`MiniFile` watches and refuses.

    Attributes:
      watch_reads: the chunks are thin (rewriter/engine/thin.py): note a rule's read above a site's statement.
      watch_module: the chunks are pruned (rewriter/engine/prune.py): note a rule's read of the module.
      vetoes: rule code -> reason that turns its rewrites into refusals (the per-file phase).
      site_vetoes: (rule code, line, column) -> reason, for one site's rewrite.
    """

    watch_reads: bool = False
    watch_module: bool = False
    vetoes: Mapping[str, str] = dataclasses.field(default_factory=dict)
    site_vetoes: Mapping[tuple[str, int, int], str] = dataclasses.field(default_factory=dict)


class SiteTransformer(cst.CSTTransformer):
    """Visits a mini module; collects :class:`Site` s and applies :class:`Rewrite` s in the chunk."""

    # Qualified names are asked only for the nodes :meth:`_match` looks at: exactly what
    # ``QualifiedNameProvider`` would give them (:meth:`_qualified_names`). The file's semantic
    # model answers from the imports where that is provably the same
    # (:class:`~flashport.rewriter.source.semantic.HeaderNames`, also for reads in a function and at
    # module level); the scope analysis (``ScopeProvider``) runs only when the model leaves a
    # question undecided (:meth:`_scope`), once per file, and alone in the reference mode
    # (``names`` None). Positions come from
    # ``spans`` (one statement rendered at a time), or as a plain mapping
    # (:func:`~flashport.rewriter.source.positions.line_positions`): declaring them as a metadata
    # dependency would make libcst's resolver walk the whole module once more for nothing.

    def __init__(self, rules: list[Rule], options: RuleOptions, file: MiniFile, mode: PassMode = PassMode()):
        super().__init__()
        self.file = file
        # a thin pass: rules get watched ancestors, and ``read_beyond`` says whether one read
        # above the site's innermost statement or the module (rewriter/engine/thin.py); a pass over pruned
        # chunks (rewriter/engine/prune.py): whether one read the module
        self.watch_reads = mode.watch_reads
        self.watch_module = mode.watch_module
        self.read_beyond = False
        spans, positions, module = file.spans, file.positions, file.module
        self._spans = spans if spans is not None and not spans.failed and positions is None else None
        if self._spans is None:
            self._positions = positions if positions is not None else line_positions(module)
        self._wrapper = (
            file.wrapper if file.wrapper is not None else MetadataWrapper(module, unsafe_skip_copy=True)
        )
        self._names = file.names
        self._scopes: object = None  # ScopeProvider's mapping, computed on first use
        self._relevant = file.relevant if file.source is not None else None
        self._lines = file.source.splitlines() if file.source is not None else None  # the mini module's text
        self.vetoes = mode.vetoes
        self.site_vetoes = mode.site_vetoes
        self.tree = file.tree  # the whole file's ast (RuleContext.tree)
        self.options = options
        self.path = file.path
        self.line_map = file.line_map
        self._firsts = [first for first, _, _ in file.line_map]
        self.suppressions = file.suppressions
        self.module = module
        self.by_source: dict[str, Rule] = {}
        self.by_string: dict[str, Rule] = {}
        for rule in rules:
            for name in rule.SOURCES:
                self.by_source.setdefault(name, rule)
            for value in rule.STRINGS:
                self.by_string.setdefault(value, rule)
        self.sites: list[Site] = []
        self._site_of: dict[int, Site] = {}  # id(original call node) -> its site (Rewrite.requires)
        self._requirements: list[tuple[Site, Rewrite]] = []  # rewritten sites that require others
        self.imports: set[str] = set()
        self.rewrites = 0
        self._path: list[cst.CSTNode] = []  # original nodes from the module down to the current one
        self._aliases: dict[int, aliases.Alias] = {}  # id(Name target) -> alias (rewriter/source/aliases.py)
        self._values: dict[int, tuple[Rule, str, int]] = {}  # id(Name target) of other `name = <source>`
        self._value_names: set[str] = set()  # their names
        # id(Name target) of a local alias -> the semantic model's view of it (fast mode)
        self._local_aliases: dict[int, semantic.LocalAlias] = {}
        self._attributes: dict[
            tuple[str, str], tuple[Rule, str, int]
        ] = {}  # (receiver, attr) of `self.fn = <source>`
        self._dropped_in: set[int] = (
            set()
        )  # id(Name target) of `name = <source>` whose value became a drop-in
        self._attributes_dropped_in: set[tuple[str, str]] = set()  # every `self.fn = <source>` became one
        self._replacements: dict[int, cst.BaseExpression] = {}  # id(original value) -> its drop-in
        self._compared: dict[str, int | None] = {}  # name -> first line comparing it (``is``, ``==``)
        # file line of a function's GPU ``from m import ...`` -> (drop-in module, its ast node):
        # imports re-pointed at the drop-in when their function is left (:meth:`_branch_drop_in`)
        self._repoint: dict[int, tuple[str, ast.stmt]] = {}
        # Changed statements, for splicing them alone (``changed``): per open statement on the
        # path, [rewrites when it was entered, rewrites inside its changed child statements,
        # len(changed) when it was entered]; ``whole``: a change outside every chunk statement.
        self._marks: list[list[int]] = []
        self.changed: list[tuple[cst.CSTNode, cst.CSTNode, tuple[str, ...]]] = []
        self.whole = False

    # -- traversal path (what rules get as ``ctx.node`` / ``ctx.ancestors``) ------------------

    def on_visit(self, node: cst.CSTNode) -> bool:
        """Record ``node`` on the path, then dispatch to ``visit_*``; skip the children of nodes
        that cannot hold a site (names, numbers, whitespace, punctuation) and of statements whose
        text mentions nothing ``relevant`` matches."""
        self._path.append(node)
        kind = type(node)
        if kind in _STATEMENTS or kind is cst.Module:
            self._marks.append([self.rewrites, 0, len(self.changed)])
        visit = self._handler("visit_", kind)
        if (visit is not None and visit(self, node) is False) or kind in _NO_SITES:
            return False
        if kind is cst.Arg or kind is cst.AssignTarget:
            # `f(q, causal=True)`, `o = ...`: the value/target was asked about above (visit_Arg,
            # visit_Assign); a leaf that is not being replaced leaves nothing to visit below
            below = getattr(node, "value" if kind is cst.Arg else "target")
            return type(below) not in _LEAVES or id(below) in self._replacements
        if self._relevant is not None and type(node) in _STATEMENTS:
            return self._mentions_relevant(node)
        return True

    def _mentions_relevant(self, statement: cst.CSTNode) -> bool:
        """Whether the lines of ``statement`` (decorators and all) match the relevant pattern."""
        if getattr(statement, "decorators", ()):
            return True  # its position starts after the decorators
        if self._spans is not None and not self._spans.failed:
            lines = self._spans.lines_of(statement)
        else:
            pos = self._position(statement)
            lines = (pos[0][0], pos[1][0]) if pos is not None else None
        if lines is None or self._relevant is None or self._lines is None:
            return True
        return any(self._relevant.search(line) for line in self._lines[lines[0] - 1 : lines[1]])

    def _position(self, node: cst.CSTNode) -> Span | None:
        """``node``'s span in the mini module: from its statement alone (:mod:`~flashport.rewriter.source.spans`),
        or from a render of the whole module once that cannot tell."""
        if self._spans is not None:
            pos = self._spans.position(node, self._path)
            if not self._spans.failed:
                return pos
            self._spans = None
            self._positions = line_positions(self.module)
        return self._positions.get(node)

    def on_leave(self, original_node, updated_node):
        """Dispatch to ``leave_*`` (or put in the drop-in a value use was rewritten to), then take
        ``original_node`` off the path."""
        try:
            kind = type(original_node)
            leave = self._handler("leave_", kind)
            left = leave(self, original_node, updated_node) if leave is not None else updated_node
            left = self._replacements.get(id(original_node), left)
            if kind in _STATEMENTS or kind is cst.Module:
                self._note_change(original_node, left)
            return left
        finally:
            self._path.pop()

    def _note_change(self, original: cst.CSTNode, updated: object) -> None:
        """Keep ``changed`` the smallest statements that hold every change so far: a statement
        with a change outside its changed child statements replaces their entries."""
        entered, inside, count = self._marks.pop()
        delta = self.rewrites - entered
        if not delta:
            return
        if inside != delta:
            del self.changed[count:]
            if type(original) is cst.Module:
                self.whole = True
            else:
                indent = tuple(indents(self._path[:-1], self.module))
                self.changed.append((original, updated, indent))  # type: ignore[arg-type]
        if self._marks:
            self._marks[-1][1] += delta

    @classmethod
    def _handler(cls, prefix: str, kind: type) -> Callable[..., Any] | None:
        """The ``visit_<Type>`` / ``leave_<Type>`` function for nodes of ``kind`` (None: none), looked
        up once per class and node type instead of by name at every node, as libcst does."""
        key = (cls, prefix, kind)
        if key not in _HANDLERS:
            _HANDLERS[key] = getattr(cls, f"{prefix}{kind.__name__}", None)
        return _HANDLERS[key]

    def on_visit_attribute(self, node: cst.CSTNode, attribute: str) -> None:
        """No per-attribute hooks here (libcst looks one up by name for every field)."""

    def on_leave_attribute(self, original_node: cst.CSTNode, attribute: str) -> None:
        """No per-attribute hooks here (see :meth:`on_visit_attribute`)."""

    # -- helpers -----------------------------------------------------------------------------

    def _file_lines(self, node: cst.CSTNode) -> tuple[int, int, int] | None:
        """(start line, column, end line) in the file, or None for nodes outside the chunks."""
        pos = self._position(node)
        if pos is None:
            return None
        (start, column), (end, _) = pos
        index = bisect.bisect_right(self._firsts, start) - 1  # line_map is sorted by mini-module line
        if index < 0:
            return None
        first, last, file_line = self.line_map[index]
        if start > last:
            return None
        shift = file_line - first
        return start + shift, column, end + shift

    def _has_comment(self, node: cst.CSTNode) -> bool:
        """Whether the source lines of ``node`` hold a ``#`` (a cheap test before looking for comments)."""
        pos = self._position(node)
        if pos is None or self._lines is None:
            return True
        return any("#" in line for line in self._lines[pos[0][0] - 1 : pos[1][0]])

    def _scope(self, node: cst.CSTNode):
        """``ScopeProvider``'s scope of ``node`` (None outside any); the analysis of the whole mini
        module runs on the first call and is reused (the wrapper caches it for a second pass)."""
        if self._scopes is None:
            if self.watch_reads:  # the analysis would see the placeholders of a thin pass
                raise thin.Abandoned("the scope analysis is needed")
            self._scopes = self._wrapper.resolve(ScopeProvider)
        return self._scopes.get(node)  # type: ignore[attr-defined]

    def _qualified_names(self, node: cst.CSTNode) -> set[str]:
        """``QualifiedNameProvider``'s names for ``node``, blind to the flow: the semantic model's
        (:meth:`~flashport.rewriter.source.semantic.HeaderNames.qualified`, a speed layer: the
        exact names or none a source can be) where the imports decide them, else libcst's scope
        analysis (:meth:`_scope_names`; the reference mode asks only that, an independent
        computation the both-modes check compares)."""
        if self._names is not None and isinstance(node, (cst.Name, cst.Attribute)):
            full_name = get_full_name_for_node(node)
            names = self._names.qualified(full_name) if full_name is not None else None
            if names is None and full_name is not None and (where := self._file_lines(node)) is not None:
                names = self._names.qualified_at(full_name, where[0])
            if names is not None:
                return names
        return self._scope_names(node)

    def _scope_names(self, node: cst.CSTNode) -> set[str]:
        """``QualifiedNameProvider``'s names for ``node`` (same computation, on demand)."""
        scope = self._scope(node)
        if scope:
            return {q.name for q in scope.get_qualified_names_for(node)}
        return set()

    def _match(self, node: cst.CSTNode) -> tuple[Rule, str] | None:
        if not isinstance(node, (cst.Name, cst.Attribute)):
            return None
        # A node may have several qualified names (conditional imports): answer deterministically
        # (a set's order varies with PYTHONHASHSEED): lowest rule code, then the rule's first-listed
        # source (its canonical path).
        names = self._qualified_names(node)
        found = [
            (rule.CODE, rule.SOURCES.index(name), name, rule)
            for name in names
            if (rule := self.by_source.get(name)) is not None
        ]
        if found:  # a rebinding that dominates the read hides the bindings before it
            kept = self._flow_names(node, names)
            found = [item for item in found if item[2] in kept]
        if not found:
            return None
        *_, name, rule = min(found, key=lambda item: item[:2])
        return rule, name

    def _reaching(self, node: cst.CSTNode) -> tuple[object, ...] | None:
        """The bindings that may reach the read ``node`` (a Name/Attribute chain) by the flow of
        its scope (:meth:`~flashport.rewriter.source.semantic.SemanticModel.reaching` of its first
        name); None where the flow does not decide."""
        base = node
        while isinstance(base, cst.Attribute):
            base = base.value
        if self.tree is None or not isinstance(base, cst.Name):
            return None
        where = self._file_lines(base)
        if where is None:
            return None
        return semantic.of(self.tree).reaching(base.value, where[0])

    def _flow_names(self, node: cst.CSTNode, names: set[str]) -> set[str]:
        """``names`` (``node``'s qualified names, blind to the flow) less those no binding that
        reaches ``node`` gives it (:func:`~flashport.rewriter.source.semantic.narrowed`)."""
        full_name = get_full_name_for_node(node)
        if full_name is None:
            return names
        return semantic.narrowed(names, self._reaching(node), full_name)

    def _other_apis(self, func: cst.BaseExpression, api: str) -> list[str]:
        """The source APIs other than ``api`` (another function: another last name) that ``func``
        may also hold by another binding, sorted."""
        names = self._flow_names(func, self._qualified_names(func))
        leaf = api.rsplit(".", 1)[-1]
        return sorted(n for n in names if n in self.by_source and n.rsplit(".", 1)[-1] != leaf)

    def _rebound(self, func: cst.BaseExpression) -> str | None:
        """Why a call of ``func`` (a source API by one of its bindings) may call something else: a
        binding that reaches it by the flow (:meth:`_reaching`) assigns another value (a ``None``
        fallback aside: calling it fails either way); None when none does or the flow does not decide."""
        reaching = self._reaching(func)
        if reaching is None or self.tree is None:
            return None
        model = semantic.of(self.tree)
        for binding in reaching:
            if isinstance(binding, semantic.ImportBinding):
                continue
            statement = model.parent(binding) if isinstance(binding, ast.Name) else None
            if isinstance(statement, ast.Assign) and semantic.is_none(statement.value):
                continue
            line = getattr(binding, "lineno", 0)
            name = binding.id if isinstance(binding, ast.Name) else getattr(binding, "name", "")
            return (
                f"{name} may hold another value here (bound on line {line} on a path to this call): "
                "it does not always call the library function; not rewritten"
            )
        return None

    def _vetoed(self, rule: Rule, where: tuple[int, int, int]) -> str | None:
        """The per-file phase's reason to refuse this rule's rewrite at ``where`` (None: none)."""
        return self.vetoes.get(rule.CODE) or self.site_vetoes.get((rule.CODE, where[0], where[1]))

    def _record(
        self,
        rule: Rule,
        api: str,
        kind: str,
        where: tuple[int, int, int],
        outcome: Outcome,
        node: cst.CSTNode | None = None,
    ) -> Site | None:
        line, column, end = where
        status, reason = None, ""
        notes: tuple[str, ...] = ()
        if suppress.is_suppressed(self.suppressions, rule.CODE, line, end):
            status, reason = SUPPRESSED, suppress.REASON
        elif isinstance(outcome, Rewrite):
            status, notes = REWRITE, outcome.notes
        elif isinstance(outcome, (Refusal, Report)):
            status, reason = AS_IS if outcome.reason.startswith(RUNS_AS_IS) else REFUSED, outcome.reason
        if status is None:
            return None
        site = Site(self.path, line, column, end, rule.CODE, api, kind, status, reason, tuple(notes))
        self.sites.append(site)
        if node is not None:
            self._site_of[id(node)] = site
        if status == REWRITE and isinstance(outcome, Rewrite) and outcome.requires:
            self._requirements.append((site, outcome))
        return site

    def unmet(self) -> dict[tuple[str, int, int], str]:
        """After the pass: (rule code, line, column) -> reason for every rewritten site whose
        :attr:`~flashport.rules.base.Rewrite.requires` calls did not all end rewritten (refused,
        suppressed by a comment or the interactive review, or without a site: no selected rule
        answered for them)."""
        out: dict[tuple[str, int, int], str] = {}
        for site, rewrite in self._requirements:
            for node in rewrite.requires:
                other = self._site_of.get(id(node))
                if other is not None and other.status == REWRITE:
                    continue
                if other is None:
                    why = "no selected rule answered for it: its rule is left out by --select/--ignore"
                elif other.status == SUPPRESSED:
                    why = (
                        f"line {other.line}: {other.rule} suppressed by a # flashport: ignore comment "
                        "or declined in --interactive review"
                    )
                else:
                    why = f"line {other.line}: {other.reason}"
                out[(site.rule, site.line, site.column)] = f"{rewrite.otherwise} ({why})"
                break
        return out

    def _context(self, line: int, api: str, node: cst.CSTNode) -> RuleContext:
        """The rule's view of the site: ``node`` is original, its ancestors come from the path."""
        if self._path and self._path[-1] is node:
            ancestors = tuple(reversed(self._path[:-1]))
        else:  # a child of the node being visited (a value under an Arg/Assign/...)
            ancestors = tuple(reversed(self._path))
        kind = RuleContext
        if self.watch_reads:  # a thin pass (rewriter/engine/thin.py): note reads above the statement
            statement = type(node) in _STATEMENTS
            limit = (
                -1 if statement else next((i for i, a in enumerate(ancestors) if type(a) in _STATEMENTS), -1)
            )
            ancestors, kind = thin.Watched(ancestors, limit, self._note_read), thin.WatchedContext
        elif self.watch_module:  # pruned chunks: note reads of the module (its last ancestor)
            ancestors = thin.Watched(ancestors, len(ancestors) - 2, self._note_read)
            kind = thin.WatchedContext
        return kind(
            self.path,
            line,
            api,
            self.options,
            self.module.code_for_node,
            node=node,
            ancestors=ancestors,
            module=self.module,
            tree=self.tree,
        )

    def _note_read(self) -> None:
        """A rule read beyond what a watched pass holds whole (``watch_reads``, ``watch_module``):
        only recorded here, in rule code (a rule's own ``except Exception`` must not swallow it);
        :meth:`_ask` gives the pass up once the rule has returned."""
        self.read_beyond = True

    def _ask(self, check: Callable[..., Outcome], *args: Any) -> Outcome:
        """A rule's answer, ``check(*args)`` (a raised :class:`Refuse` as its refusal). In a thin
        pass, a rule that read beyond the site's statement (:meth:`_note_read`) may have seen a
        placeholder: its answer, or the error it raised, is dropped and the pass given up."""
        try:
            outcome = check(*args)
        except Refuse as refusal:
            outcome = Refusal(refusal.reason)
        except Exception:
            if self.read_beyond:
                raise thin.Abandoned("a rule read beyond the statement of a site") from None
            raise
        if self.read_beyond:
            raise thin.Abandoned("a rule read beyond the statement of a site")
        return outcome

    @property
    def used_scopes(self) -> bool:
        """Whether libcst's scope analysis ran (it saw the whole mini module)."""
        return self._scopes is not None

    # -- calls -------------------------------------------------------------------------------

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        """Ask the matching rule about a call to a source API (directly or through a local alias,
        :mod:`flashport.rewriter.source.aliases`); apply its rewrite."""
        matched = self._match(original_node.func)
        alias = None
        if matched is None and self._aliases and isinstance(original_node.func, cst.Name):
            alias = self._alias_read(original_node.func)
            matched = (alias.rule, alias.api) if alias is not None else None
        if matched is None:
            self._through_value(original_node)
            return updated_node
        where = self._file_lines(original_node)
        if where is None:
            return updated_node
        if alias is not None:
            alias.calls += 1
        rule, api = matched
        if suppress.is_suppressed(self.suppressions, rule.CODE, where[0], where[2]):
            if alias is not None:
                alias.suppressed += 1
            self._record(rule, api, "call", where, None, original_node)
            return updated_node
        rebound = self._rebound(original_node.func) if alias is None else None
        if rebound is not None:
            outcome: Outcome = Refusal(rebound)
        else:
            outcome = self._ask(rule.check_call, updated_node, self._context(where[0], api, original_node))
        outcome = run_context.refuse_patched(outcome, api, self.options)
        if isinstance(outcome, Rewrite) and (veto := self._vetoed(rule, where)):
            outcome = Refusal(veto)
        if isinstance(outcome, Rewrite) and self._has_comment(
            original_node
        ):  # comments are kept, never a reason to refuse
            node = keep_comments(original_node, outcome.node)
            if node is None:  # no current rule replaces a call by a non-call; stay safe if one does
                outcome = Refusal(
                    "the replacement has no place for the comments inside the call; move them out first"
                )
            else:
                outcome = dataclasses.replace(outcome, node=node)
        if (
            isinstance(outcome, Refusal)
            and alias is None
            and (others := self._other_apis(original_node.func, api))
        ):
            outcome = Refusal(
                f"{outcome.reason}; {self.module.code_for_node(original_node.func)} may also be "
                f"{' or '.join(others)} here (another import binds it), whose arguments differ"
            )
        if alias is not None and isinstance(outcome, Rewrite):
            alias.rewritten += 1
            outcome = dataclasses.replace(
                outcome, notes=(f"called through alias {alias.name} (line {alias.where[0]})", *outcome.notes)
            )
        self._record(rule, api, "call", where, outcome, original_node)
        if isinstance(outcome, Rewrite):
            self.imports.update(outcome.imports)
            self.rewrites += 1
            return outcome.node
        return updated_node

    def _alias_read(self, name: cst.Name) -> aliases.Alias | None:
        """The alias the read ``name`` resolves to alone, if any: the semantic model's answer
        where every alias of that name is a local one it answers for
        (:meth:`~flashport.rewriter.source.semantic.SemanticModel.local_alias`), else libcst's
        scope analysis (the only binding the read resolves to)."""
        candidates = [a for a in self._aliases.values() if a.name == name.value]
        if not candidates:
            return None  # whatever the read resolves to, it is no alias
        locals_ = [self._local_aliases.get(id(a.target)) for a in candidates]
        where = self._file_lines(name)
        if where is not None and all(local is not None for local in locals_):
            answers = [local.resolves(where[0]) for local in locals_ if local is not None]
            if None not in answers:
                return next((a for a, hit in zip(candidates, answers, strict=True) if hit), None)
        referent = aliases.referent(self._scope(name), name)
        return self._aliases.get(id(getattr(referent, "node", None)))

    def _through_value(self, call: cst.Call) -> None:
        """Report a call through a name that *may* hold a source API (bound to it and to other
        things): the call is where a reader looks, so it is listed there too."""
        if isinstance(call.func, cst.Attribute) and isinstance(call.func.value, cst.Name):
            key = (call.func.value.value, call.func.attr.value)
            held = None if key in self._attributes_dropped_in else self._attributes.get(key)
            where = self._file_lines(call) if held else None
            if held is not None and where is not None:
                self._report_through(
                    held,
                    where,
                    f"{call.func.value.value}.{call.func.attr.value}",
                    ": an attribute can be rebound from anywhere, so the call does not resolve to one function",
                )
            return
        if not isinstance(call.func, cst.Name) or call.func.value not in self._value_names:
            return  # no `name = <source>` of that name: none of its bindings is one
        scope = self._scope(call.func)
        for access in scope.accesses[call.func.value] if scope else ():
            if access.node is call.func:
                # bindings whose value became the drop-in are left out: their value use answers for them
                bound = [id(getattr(r, "node", None)) for r in access.referents]
                hits = [self._values[b] for b in bound if b in self._values and b not in self._dropped_in]
                where = self._file_lines(call)
                if hits and where is not None:
                    self._report_through(
                        hits[0],
                        where,
                        call.func.value,
                        " but may also hold something else: it does not resolve to one function",
                    )
                return

    def _report_through(
        self, held: tuple[Rule, str, int], where: tuple[int, int, int], through: str, why: str
    ) -> None:
        """Report a call through ``through``, which holds ``held``'s (rule, API, line of binding)."""
        rule, api, line = held
        short = api.rsplit(".", 1)[-1]
        self._record(
            rule,
            api,
            "call",
            where,
            Report(f"called through {through}, which holds {short} (line {line}){why}; not rewritten"),
        )

    # -- local aliases (``attn = flash_attn_func``; rewriter/source/aliases.py) ------------------------

    def _alias(self, node: cst.Assign) -> bool:
        """Register ``node`` as an alias statement when it is one; its site is recorded when its
        function/module is left, once every call through it has an outcome."""
        if not isinstance(node.value, (cst.Name, cst.Attribute)):
            return False
        matched = self._match(node.value)
        where = self._file_lines(node.value) if matched else None
        if (
            matched is None
            or where is None
            or suppress.is_suppressed(self.suppressions, matched[0].CODE, where[0], where[2])
        ):
            return False
        found = aliases.candidate(node, tuple(reversed(self._path[:-1])))
        if found is None:
            return False
        target, statement, owner = found
        local = None
        if self._names is not None and self.tree is not None and isinstance(owner, cst.FunctionDef):
            line = self._file_lines(target)
            local = semantic.of(self.tree).local_alias(target.value, line[0]) if line is not None else None
        if local is not None:
            uses = local.uses
            self._local_aliases[id(target)] = local
        else:  # libcst's scope analysis: the only binding of the name in its scope, and its reads
            assignment = aliases.single_assignment(self._scope(target), target)
            if assignment is None:
                return False
            uses = len(assignment.references)
        rule, api = matched
        answer = self._value_outcome(rule, api, node.value, where)
        own_reason = ""
        if type(rule).check_reference is not Rule.check_reference:  # the rule says why its values stay
            own_reason = answer.reason if isinstance(answer, (Refusal, Report)) else ""
        self._aliases[id(target)] = aliases.Alias(
            target.value,
            api,
            rule,
            statement,
            owner,
            target,
            where,
            uses=uses,
            own_reason=own_reason,
            drop_in=answer if isinstance(answer, Rewrite) else None,
        )
        return True

    def _settle_aliases(self, original: _OwnerT, updated: _OwnerT) -> _OwnerT:
        """Record the sites of the aliases bound in ``original``'s body; remove the removable ones,
        and give the others the drop-in as their value when the rule has one (every call through
        them then runs on flashport, ported or not)."""
        for alias in [a for a in self._aliases.values() if a.owner is original]:
            outcome: Outcome = Report(alias.own_reason or alias.reason())
            if not alias.own_reason and alias.calls < alias.uses and (kept := self._kept_torch_alias(alias)):
                outcome = runs_as_is(values.kept_torch_value(kept, alias.api))
            dropped = _drop_alias(original, updated, alias.statement) if alias.removable() else None
            swapped = None
            if dropped is None and alias.drop_in is None and alias.only_ported_calls():
                alias.drop_in = call_drop_in(alias.api, alias.name)
            if dropped is None and alias.drop_in is not None and not alias.suppressed:
                swapped = _drop_alias(original, updated, alias.statement, alias.drop_in.node)
            if dropped is not None:
                updated = dropped
                outcome = Rewrite(
                    cst.Name(alias.name),
                    notes=(f"alias removed: all {alias.uses} calls through it were ported",),
                )
                self.rewrites += 1
            elif swapped is not None and alias.drop_in is not None:
                updated = swapped
                outcome = alias.drop_in  # its note: "stored in <alias>: the value is now ... drop-in"
                self.imports.update(alias.drop_in.imports)
                self.rewrites += 1
            self._record(alias.rule, alias.api, "reference", alias.where, outcome)
        return updated

    def _kept_torch_alias(self, alias: aliases.Alias) -> str:
        """Why a function-local alias of torch's own attention function (SDPA, flex) that is also read
        as a value keeps its meaning as is -- every read that is not a call only copies its metadata
        (``@functools.wraps(alias)``, ``wrapper.__wrapped__ = alias``), inspects it
        (``getattr``/``hasattr``) or puts it back where it was read from (``F.scaled_dot_product_attention
        = alias`` after a patch) -- else "". The calls through it are sites of their own."""
        span = self._file_lines(alias.owner)
        if (
            not alias.local
            or values.family(alias.api) not in values.TORCH_OWN
            or span is None
            or self.tree is None
        ):
            return ""
        first, _, last = span
        model = semantic.of(self.tree)
        source = self.module.code_for_node(alias.statement.body[0].value)  # type: ignore[attr-defined]
        kinds: set[str] = set()
        for node in ast.walk(self.tree):
            if not first <= getattr(node, "lineno", 0) <= last:
                continue
            if isinstance(node, ast.arg) and node.arg == alias.name:
                return ""
            if not (isinstance(node, ast.Name) and node.id == alias.name):
                continue
            if not isinstance(node.ctx, ast.Load):
                if node.lineno != alias.where[0]:
                    return ""  # bound again: another variable of that name
                continue
            kind = _torch_value_use(node, model, source)
            if kind is None:
                return ""
            kinds.add(kind)
        kinds.discard("call")
        how = "also" if alias.calls else "only"
        return f"alias {alias.name} is {how} {' and '.join(sorted(kinds))}" if kinds else ""

    def leave_FunctionDef(
        self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef
    ) -> cst.FunctionDef:
        """Settle the aliases bound in this function; re-point its imports a branch port asked for."""
        updated = self._settle_aliases(original_node, updated_node)
        span = self._file_lines(original_node)
        for line in [n for n in self._repoint if span is not None and span[0] <= n <= span[2]]:
            module, node = self._repoint.pop(line)
            updated = _repointed(updated, node, module)
            self.rewrites += 1  # a change outside its changed statements: the function is spliced whole
        return updated

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        """Settle the module-level aliases."""
        return self._settle_aliases(original_node, updated_node)

    # -- references (functions passed as values) ---------------------------------------------

    def _reference(self, value: cst.BaseExpression | None) -> bool:
        """Ask the matching rule about a source API used as a value; put in its drop-in when the
        rule rewrites it (:func:`flashport.rules.common.values.answer`). True when it was rewritten."""
        if value is None or isinstance(value, cst.Call):
            return False
        matched = self._match(value)
        if matched is None:
            return False
        where = self._file_lines(value)
        if where is None:
            return False
        rule, api = matched
        outcome = self._value_outcome(rule, api, value, where)
        site = self._record(rule, api, "reference", where, outcome, value)
        if site is None or site.status != REWRITE or not isinstance(outcome, Rewrite):
            return False
        self._replacements[id(value)] = outcome.node
        self.imports.update(outcome.imports)
        self.rewrites += 1
        return True

    def _value_outcome(
        self, rule: Rule, api: str, value: cst.BaseExpression, where: tuple[int, int, int]
    ) -> Outcome:
        """The rule's answer for ``value`` (a source API not called), its rewrite turned into a
        report where the name may hold something else or the file compares it."""
        outcome = self._ask(rule.check_reference, value, self._context(where[0], api, value))
        if not isinstance(outcome, Rewrite):
            return outcome
        if veto := self._vetoed(rule, where):
            return Refusal(veto)
        why = self._value_may_differ(value)
        if why and values.family(api) in values.TORCH_OWN:
            return runs_as_is(values.kept_torch_value(why, api))
        if why and (branch := self._branch_drop_in(api, value)) is not None:
            return branch
        return (
            Report(f"{why}: not rewritten") if why else run_context.refuse_patched(outcome, api, self.options)
        )

    def _branch_drop_in(self, api: str, value: cst.BaseExpression) -> Rewrite | None:
        """The port of a name that branches bind to different libraries -- ``if npu: from npu_utils
        import pad_input`` / ``else: from flash_attn.bert_padding import pad_input``, then
        ``pad_input`` read -- by re-pointing the flash-attn branch's import at flashport's drop-in of
        the same name (:func:`~flashport.rewriter.imports.drop_in_imports.branch_target`); the read
        and the other branch stay. Only for a ``from`` import in a function that is the file's only
        import of that API, whose every name has such a drop-in and is compared nowhere (the
        drop-ins replicate the functions, so every other read of them keeps its meaning), when
        every binding reaching the read is an import and only that one is a GPU library's. None
        otherwise."""
        if not isinstance(value, cst.Name) or self.tree is None:
            return None
        reaching = self._reaching(value)
        if not reaching or not all(isinstance(b, semantic.ImportBinding) for b in reaching):
            return None
        gpu = [b for b in reaching if isinstance(b, semantic.ImportBinding) and b.qualified in self.by_source]
        gpu_modules = {m for rule in self.by_source.values() for m in rule.GPU_MODULES}
        others = [b for b in reaching if isinstance(b, semantic.ImportBinding) and b not in gpu]
        if len(gpu) != 1 or not others or gpu[0].qualified != api:
            return None
        if any(o.qualified.split(".")[0] in gpu_modules for o in others):
            return None
        binding = gpu[0]
        node = binding.node
        in_function = bool(binding.scopes) and isinstance(
            binding.scopes[-1], (ast.FunctionDef, ast.AsyncFunctionDef)
        )
        module = drop_in_imports.branch_module(
            node,
            [b.qualified for b in semantic.of(self.tree).imports],
            self.options.flash_attn_version,
            lambda name: self._compared_on(name) is not None,
        )
        if not in_function or binding.relative or module is None:
            return None
        self._repoint[node.lineno] = (module, node)
        other = ", ".join(sorted(f"{o.qualified} (line {o.node.lineno})" for o in others))
        return Rewrite(
            value,
            imports=(),
            notes=(
                f"the flash-attn branch's import (line {node.lineno}) now binds flashport's drop-in "
                f"{module}.{binding.imported.rsplit('.', 1)[-1]} (same name, signature and results); "
                f"the other binding, {other}, is kept",
            ),
        )

    def _value_may_differ(self, value: cst.BaseExpression) -> str | None:
        """Why replacing ``value`` by the drop-in could change what the program does: its name may
        be bound to something else too (a ``None`` fallback of a guarded import), or the file
        compares it (``fn is flash_attn_func``, ``flash_attn_func is None``)."""
        if any(map(_masked, self._path)):
            return "inside Python 3.12+ syntax that this host's Python cannot analyse (kept byte-identical)"
        chain: list[cst.BaseExpression] = [value]  # value, its receiver, ... down to the base name
        while isinstance(chain[-1], cst.Attribute):
            chain.append(chain[-1].value)
        base = chain[-1]
        if not isinstance(base, cst.Name):
            return "not a plain name"
        fallbacks = import_fallbacks(self.tree) if self.tree is not None else frozenset()
        meanings = self._qualified_names(value) - ({base.value} if base.value in fallbacks else set())
        reaching = self._reaching(base)
        if reaching is not None:  # the binding that dominates the read decides, not every one
            imports_only = all(isinstance(b, semantic.ImportBinding) for b in reaching)
            meanings = self._flow_names(value, meanings)
        else:
            imports_only = self._imports_only(chain, fallbacks)
        meanings = _one_library_path(meanings, self.by_source)
        if not imports_only or len(meanings) != 1:
            # `import xformers` + `import xformers.ops.fmha` is fine: both give the value one meaning
            return (
                f"{base.value} is bound by more than one import or assignment (a fallback such as "
                f"{base.value} = None, or another library's function): it may hold something else"
            )
        leaf = value.attr.value if isinstance(value, cst.Attribute) else base.value
        line = self._compared_on(leaf)
        if line is not None:
            return f"the file compares {leaf} (line {line}): the comparison must see the same object"
        return None

    def _imports_only(self, chain: list[cst.BaseExpression], fallbacks: frozenset[str]) -> bool:
        """Whether every binding the read ``chain`` (a value, its receiver, ... its base name)
        resolves to, blind to the flow, is an import (or a ``None`` fallback in ``fallbacks``):
        the semantic model's where its imports decide it
        (:meth:`~flashport.rewriter.source.semantic.HeaderNames.imports_only`), else libcst's scope
        analysis (``import a.b`` records the access of ``a.b``)."""
        base = chain[-1]
        if self._names is not None and isinstance(base, cst.Name):
            known = self._names.imports_only(base.value)
            found = None
            if known is None and (where := self._file_lines(base)) is not None:
                found = self._names.bindings_at(base.value, where[0])
            if found is not None:  # a None fallback's target counts as an import
                imports, others = found
                known = bool(imports or others) and all(
                    isinstance(b, ast.Name) and b.id in fallbacks for b in others
                )
            if known is not None:
                return known
        scope = self._scope(chain[-1])
        bindings = None
        for node in chain if scope else ():
            for access in scope.accesses[self.module.code_for_node(node)]:
                if access.node is node:
                    bindings = list(access.referents)
        return bool(bindings) and all(
            isinstance(getattr(b, "node", None), (cst.Import, cst.ImportFrom))
            or (isinstance(getattr(b, "node", None), cst.Name) and b.node.value in fallbacks)
            for b in bindings or ()
        )

    def _compared_on(self, name: str) -> int | None:
        """The first mini-module line that compares ``name`` with ``is``/``==``/``!=`` (None: none)."""
        if name not in self._compared:
            pattern = re.compile(
                rf"(\bis\b(\s+not)?|[=!]=)\s*[\w.]*\b{re.escape(name)}\b|\b{re.escape(name)}\s*(\bis\b|[=!]=)"
            )
            lines = self._lines or []
            line = next((i + 1 for i, text in enumerate(lines) if pattern.search(text)), None)
            index = bisect.bisect_right(self._firsts, line) - 1 if line is not None else -1
            if line is not None and index >= 0 and line <= self.line_map[index][1]:
                line += self.line_map[index][2] - self.line_map[index][0]  # the file's line
            self._compared[name] = line
        return self._compared[name]

    def visit_Arg(self, node: cst.Arg) -> None:
        """``f(attention_fn=flash_attn_func)``, ``functools.partial(flash_attn_func, causal=True)``
        and ``inspect.signature(flash_attn_func)``."""
        self._reference(node.value)

    def visit_Assign(self, node: cst.Assign) -> None:
        """``fn = flash_attn_func``: a local alias (calls through it are ported) or a value use."""
        if self._alias(node):
            return
        rewritten = self._reference(node.value)
        matched = self._match(node.value) if isinstance(node.value, (cst.Name, cst.Attribute)) else None
        where = self._file_lines(node.value) if matched else None
        if matched is not None and where is not None:
            for target in node.targets:
                if isinstance(target.target, cst.Name):
                    self._values[id(target.target)] = (*matched, where[0])
                    self._value_names.add(target.target.value)
                    if rewritten:
                        self._dropped_in.add(id(target.target))
                elif isinstance(target.target, cst.Attribute) and isinstance(target.target.value, cst.Name):
                    key = (target.target.value.value, target.target.attr.value)
                    if rewritten and (key in self._attributes_dropped_in or key not in self._attributes):
                        self._attributes_dropped_in.add(key)
                    else:
                        self._attributes_dropped_in.discard(key)
                    self._attributes[key] = (*matched, where[0])

    def visit_Annotation(self, node: cst.Annotation) -> None:
        """``mask: AttentionBias | None``, ``-> Optional[BlockDiagonalMask]``: a class named in an
        annotation is a value too (it moves with the constructors and type checks of its rule)."""
        pending: list[cst.BaseExpression] = [node.annotation]
        while pending:
            value = pending.pop()
            if isinstance(value, cst.BinaryOperation):
                pending += [value.left, value.right]
            elif isinstance(value, cst.Subscript):
                pending += [value.value] + [
                    e.slice.value for e in value.slice if isinstance(e.slice, cst.Index)
                ]
            elif isinstance(value, (cst.Name, cst.Attribute)):
                self._reference(value)

    def visit_IfExp(self, node: cst.IfExp) -> None:
        """``MaskType.CAUSAL if causal else MaskType.NO_MASK``: both branches are values."""
        self._reference(node.body)
        self._reference(node.orelse)

    def visit_DictElement(self, node: cst.DictElement) -> None:
        """``{"flash_attention_2": flash_attn_func}``."""
        self._reference(node.value)

    def visit_Element(self, node: cst.Element) -> None:
        """``(flash_attn_func, flash_attn_varlen_func)``."""
        self._reference(node.value)

    def visit_Return(self, node: cst.Return) -> None:
        """``return flash_attn_func`` (lazy-import tables)."""
        self._reference(node.value)

    # -- configuration strings ---------------------------------------------------------------

    def leave_SimpleString(
        self, original_node: cst.SimpleString, updated_node: cst.SimpleString
    ) -> cst.BaseExpression:
        """String literals some rule watches (``attn_implementation="flash_attention_2"``); a rule
        may rewrite them (e.g. to a value that routes through flashport)."""
        if not self.by_string:
            return updated_node
        try:
            value = original_node.evaluated_value
        except Exception:  # noqa: BLE001 - odd literals are simply not config values
            return updated_node
        if not isinstance(value, str):
            return updated_node
        rule = self.by_string.get(value)
        if rule is None:
            return updated_node
        where = self._file_lines(original_node)
        if where is None:
            return updated_node
        if suppress.is_suppressed(self.suppressions, rule.CODE, where[0], where[2]):
            self._record(rule, value, "string", where, None)
            return updated_node
        outcome = self._ask(
            rule.check_string, original_node, value, self._context(where[0], value, original_node)
        )
        if isinstance(outcome, Rewrite) and (veto := self._vetoed(rule, where)):
            outcome = Refusal(veto)
        self._record(rule, value, "string", where, outcome)
        if isinstance(outcome, Rewrite):
            self.imports.update(outcome.imports)
            self.rewrites += 1
            return outcome.node
        return updated_node


_IMPORT_ERRORS = ("ImportError", "ModuleNotFoundError", "Exception", "BaseException")
_PROBE = re.compile(
    r"(^|\.)(callable|getattr|hasattr|isinstance|issubclass|id|type|signature|getfullargspec)$"
)


def _one_library_path(meanings: set[str], sources: Mapping[str, object]) -> set[str]:
    """``meanings`` with the other import paths of a source dropped: names of the same package and
    last name that no rule knows (``xformers.attn_bias.BlockDiagonalMask`` imported where
    ``xformers.ops.fmha.attn_bias.BlockDiagonalMask`` failed: the library's other layout of the same
    object). A second known source (flash-attn's Triton ``flash_attn_func``) is another API: kept, unless every one is an import
    path of the same catalogued API."""
    known = [m for m in meanings if m in sources]
    if len(known) > 1 and len(known) == len(meanings) and _one_api(known):
        return {min(known)}
    if len(known) != 1 or len(meanings) == 1:
        return meanings
    package, _, rest = known[0].partition(".")
    leaf = rest.rsplit(".", 1)[-1]
    same = all(m.partition(".")[0] == package and m.rsplit(".", 1)[-1] == leaf for m in meanings)
    return {known[0]} if same and rest else meanings


def _one_api(names: list[str]) -> bool:
    """Whether ``names`` are import paths of one catalogued source API (FA3's builds under
    ``flash_attn_3`` and, before 2025-01-07, ``flashattn_hopper``)."""
    try:
        found = {id(apis.api(name)) for name in names}
    except KeyError:
        return False
    return len(found) == 1


@functools.lru_cache(maxsize=8)
def import_fallbacks(tree: ast.Module) -> frozenset[str]:
    """Names whose only bindings besides imports are ``name = None`` in the ``except ImportError``
    handler of a ``try`` that imports them, and that the file never asks about (a test, comparison
    or probe such as ``callable(fn)`` would then see the drop-in on one line and None on another):
    the library's function, or None where it is absent. The port makes the library always present
    (the import clean-up turns such guards' flags True), so a value of such a name takes the drop-in
    too -- one meaning for flags and values."""
    guarded: set[str] = set()
    other: set[str] = set()
    fallback_targets: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Try):
            continue
        imported = {name for stmt in node.body for name in semantic.import_names(stmt)}
        for handler in node.handlers:
            names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
            if handler.type is not None and not any(
                (n.id if isinstance(n, ast.Name) else getattr(n, "attr", "")) in _IMPORT_ERRORS for n in names
            ):
                continue
            for stmt in handler.body:
                if (
                    isinstance(stmt, ast.Assign)
                    and isinstance(stmt.value, ast.Constant)
                    and stmt.value.value is None
                ):
                    for target in stmt.targets:
                        if isinstance(target, ast.Name) and target.id in imported:
                            guarded.add(target.id)
                            fallback_targets.add(id(target))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Name)
            and isinstance(node.ctx, ast.Store)
            and id(node) not in fallback_targets
        ):
            other.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            other.add(node.name)
        elif isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            other.update(n.id for n in ast.walk(node.test) if isinstance(n, ast.Name))  # `if fn:` asks
        elif isinstance(node, (ast.Compare, ast.BoolOp, ast.UnaryOp)):
            other.update(n.id for n in ast.walk(node) if isinstance(n, ast.Name))  # `fn is None`
        elif isinstance(node, ast.Call) and _PROBE.search(ast.unparse(node.func)):
            other.update(a.id for a in node.args if isinstance(a, ast.Name))  # callable(fn)
    return frozenset(guarded - other)


def _masked(node: cst.CSTNode) -> bool:
    """Whether ``node`` is a placeholder of :func:`flashport.rewriter.source.newsyntax.mask` (``(key, names)``
    or ``key = (names,)``), whose text must stay as it is."""
    first: cst.CSTNode | None = None
    if isinstance(node, cst.Tuple) and node.elements:
        first = node.elements[0].value
    elif isinstance(node, cst.Assign):
        first = node.targets[0].target
    return isinstance(first, cst.Name) and first.value.startswith(newsyntax.PREFIX)


def _drop_alias(
    original: _OwnerT,
    updated: _OwnerT,
    statement: cst.SimpleStatementLine,
    value: cst.BaseExpression | None = None,
) -> _OwnerT | None:
    """``updated`` without the alias ``statement`` (located in ``original``'s body) or, given a
    ``value``, with ``value`` as the alias's value; None when it cannot be changed safely
    (:func:`flashport.rewriter.source.aliases.drop_statement`)."""
    if isinstance(original, cst.Module) and isinstance(updated, cst.Module):
        body = aliases.drop_statement(updated.body, original.body, statement, value)
        return None if body is None else updated.with_changes(body=body)
    block, original_block = updated.body, original.body
    if not isinstance(block, cst.IndentedBlock) or not isinstance(original_block, cst.IndentedBlock):
        return None  # `def f(): a = x; ...` on one line holds small statements, never an alias line
    body = aliases.drop_statement(block.body, original_block.body, statement, value)
    return None if body is None else updated.with_changes(body=block.with_changes(body=body))


def _torch_value_use(read: ast.Name, model: semantic.SemanticModel, source: str) -> str | None:
    """How a read of an alias of torch's attention function (bound to ``source``) uses it: "call",
    or a use that keeps its meaning on every host (:meth:`Transformer._kept_torch_alias`); None for
    any other use (stored, passed on: its callers are out of sight)."""
    up = model.parent(read)
    if isinstance(up, ast.Call) and up.func is read:
        return "call"
    if isinstance(up, ast.Call) and up.args == [read] and not up.keywords:
        callee = semantic.dotted(up.func)
        if callee in ("functools.wraps", "wraps") and isinstance(
            model.parent(up), (ast.FunctionDef, ast.AsyncFunctionDef)
        ):
            return "copied by @functools.wraps (metadata only)"
    if (
        isinstance(up, ast.Call)
        and up.args[:1] == [read]
        and semantic.dotted(up.func) in ("getattr", "hasattr")
    ):
        return "inspected with getattr/hasattr"
    if (
        isinstance(up, ast.Assign)
        and up.value is read
        and all(isinstance(t, ast.Attribute) for t in up.targets)
    ):
        if all(t.attr == "__wrapped__" for t in up.targets):  # type: ignore[attr-defined]
            return "stored as a wrapper's __wrapped__ (metadata only)"
        if all(semantic.dotted(t) == source for t in up.targets):
            return f"put back as {source} (a patch undone)"
    return None


def _repointed(function: cst.FunctionDef, node: ast.stmt, module: str) -> cst.FunctionDef:
    """``function`` with the ``from ... import ...`` that ``node`` (its ``ast`` statement) is, same
    module and names, importing from ``module`` instead, names, aliases and layout kept."""
    source, names = drop_in_imports.from_import_names(node)

    class _Repoint(cst.CSTTransformer):
        def leave_ImportFrom(self, original: cst.ImportFrom, updated: cst.ImportFrom) -> cst.ImportFrom:
            if updated.relative or updated.module is None or get_full_name_for_node(updated.module) != source:
                return updated
            if isinstance(updated.names, cst.ImportStar):
                return updated
            found = [
                (get_full_name_for_node(a.name), a.asname.name.value if a.asname else None)  # type: ignore[union-attr]
                for a in updated.names
            ]
            if found != names:
                return updated
            return updated.with_changes(module=cst.parse_expression(module))

    return function.visit(_Repoint())  # type: ignore[return-value]
