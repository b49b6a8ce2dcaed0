"""The libcst pass over one chunk: resolve qualified names, ask rules, replace rewritten calls.

The file is parsed as a *mini module* = its top-level import statements (header) followed by the
statements that mention a trigger (top-level ones, or single statements of a top-level class inside
a stand-in class), separated by sentinel comments. libcst's ``QualifiedNameProvider`` resolves names
in it exactly as in the whole file (imports, aliases, function-level and guarded imports), while
scope analysis only runs over the chunks, not the whole file. ``line_map`` maps mini-module lines
back to file lines; nodes outside the chunks (the header) are ignored.

When several selected rules watch the same qualified name or string, the one with the lowest code
answers and the others are shadowed (``--ignore`` the first to let the next one answer); FPA905
relies on this to be opt-in behind FPA901.

``vetoes`` (rule code -> reason) turn that rule's rewrites into refusals: the engine's per-file
phase (:meth:`flashport.rules.base.Rule.settle`) sets them after a first pass.
"""

from __future__ import annotations

import dataclasses

import libcst as cst
from libcst.metadata import PositionProvider, ScopeProvider

from flashport.rewriter import suppress
from flashport.rewriter.results import REFUSED, REWRITE, SUPPRESSED, Site
from flashport.rules.base import Refusal, Refuse, Report, Rewrite, Rule, RuleContext, RuleOptions, keep_comments


class SiteTransformer(cst.CSTTransformer):
    """Visits a mini module; collects :class:`Site` s and applies :class:`Rewrite` s in the chunk."""

    # Qualified names come from the scope analysis, asked only for the nodes :meth:`_match` looks
    # at: exactly what ``QualifiedNameProvider`` would give them, without computing it for every
    # node of the chunk.
    METADATA_DEPENDENCIES = (ScopeProvider, PositionProvider)

    def __init__(
        self,
        rules: list[Rule],
        options: RuleOptions,
        path: str,
        line_map: list[tuple[int, int, int]],
        suppressions: dict[int, frozenset[str]],
        module: cst.Module,
        vetoes: dict[str, str] | None = None,
    ):
        super().__init__()
        self.vetoes = vetoes or {}
        self.options = options
        self.path = path
        self.line_map = line_map
        self.suppressions = suppressions
        self.module = module
        self.by_source: dict[str, Rule] = {}
        self.by_string: dict[str, Rule] = {}
        for rule in rules:
            for name in rule.SOURCES:
                self.by_source.setdefault(name, rule)
            for value in rule.STRINGS:
                self.by_string.setdefault(value, rule)
        self.sites: list[Site] = []
        self.imports: set[str] = set()
        self.rewrites = 0
        self._path: list[cst.CSTNode] = []  # original nodes from the module down to the current one

    # -- traversal path (what rules get as ``ctx.node`` / ``ctx.ancestors``) ------------------

    def on_visit(self, node: cst.CSTNode) -> bool:
        """Record ``node`` on the path, then dispatch to ``visit_*``."""
        self._path.append(node)
        return super().on_visit(node)

    def on_leave(self, original_node, updated_node):
        """Dispatch to ``leave_*``, then take ``original_node`` off the path."""
        try:
            return super().on_leave(original_node, updated_node)
        finally:
            self._path.pop()

    # -- helpers -----------------------------------------------------------------------------

    def _file_lines(self, node: cst.CSTNode) -> tuple[int, int, int] | None:
        """(start line, column, end line) in the file, or None for nodes outside the chunks."""
        pos = self.get_metadata(PositionProvider, node, None)
        if pos is None:
            return None
        for first, last, file_line in self.line_map:
            if first <= pos.start.line <= last:
                shift = file_line - first
                return pos.start.line + shift, pos.start.column, pos.end.line + shift
        return None

    def _qualified_names(self, node: cst.CSTNode):
        """``QualifiedNameProvider``'s answer for ``node`` (same computation, on demand)."""
        scope = self.get_metadata(ScopeProvider, node, None)
        if scope:
            return scope.get_qualified_names_for(node)
        return set()

    def _match(self, node: cst.CSTNode) -> tuple[Rule, str] | None:
        if not isinstance(node, (cst.Name, cst.Attribute)):
            return None
        # A node may have several qualified names (conditional imports): answer deterministically
        # (a set's order varies with PYTHONHASHSEED): lowest rule code, then the rule's first-listed
        # source (its canonical path).
        found = [(rule.CODE, rule.SOURCES.index(q.name), q.name, rule)
                 for q in self._qualified_names(node) if (rule := self.by_source.get(q.name)) is not None]
        if not found:
            return None
        *_, name, rule = min(found, key=lambda item: item[:2])
        return rule, name

    def _record(self, rule: Rule, api: str, kind: str, where, outcome) -> Site | None:
        line, column, end = where
        status, reason, notes = None, "", ()
        if suppress.is_suppressed(self.suppressions, rule.CODE, line, end):
            status, reason = SUPPRESSED, "suppressed by a # flashport: ignore comment"
        elif isinstance(outcome, Rewrite):
            status, notes = REWRITE, outcome.notes
        elif isinstance(outcome, (Refusal, Report)):
            status, reason = REFUSED, outcome.reason
        if status is None:
            return None
        site = Site(self.path, line, column, end, rule.CODE, api, kind, status, reason, tuple(notes))
        self.sites.append(site)
        return site

    def _context(self, line: int, api: str, node: cst.CSTNode) -> RuleContext:
        """The rule's view of the site: ``node`` is original, its ancestors come from the path."""
        if self._path and self._path[-1] is node:
            ancestors = tuple(reversed(self._path[:-1]))
        else:  # a child of the node being visited (a value under an Arg/Assign/...)
            ancestors = tuple(reversed(self._path))
        return RuleContext(self.path, line, api, self.options, self.module.code_for_node,
                           node=node, ancestors=ancestors, module=self.module)

    # -- calls -------------------------------------------------------------------------------

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        """Ask the matching rule about a call to a source API; apply its rewrite."""
        matched = self._match(original_node.func)
        if matched is None:
            return updated_node
        where = self._file_lines(original_node)
        if where is None:
            return updated_node
        rule, api = matched
        if suppress.is_suppressed(self.suppressions, rule.CODE, where[0], where[2]):
            self._record(rule, api, "call", where, None)
            return updated_node
        try:
            outcome = rule.check_call(updated_node, self._context(where[0], api, original_node))
        except Refuse as refusal:
            outcome = Refusal(refusal.reason)
        if isinstance(outcome, Rewrite) and rule.CODE in self.vetoes:
            outcome = Refusal(self.vetoes[rule.CODE])
        if isinstance(outcome, Rewrite):  # comments are kept, never a reason to refuse
            node = keep_comments(original_node, outcome.node)
            if node is None:  # no current rule replaces a call by a non-call; stay safe if one does
                outcome = Refusal("the replacement has no place for the comments inside the call; move them out first")
            else:
                outcome = dataclasses.replace(outcome, node=node)
        self._record(rule, api, "call", where, outcome)
        if isinstance(outcome, Rewrite):
            self.imports.update(outcome.imports)
            self.rewrites += 1
            return outcome.node
        return updated_node

    # -- references (functions passed as values) ---------------------------------------------

    def _reference(self, value: cst.BaseExpression | None) -> None:
        if value is None or isinstance(value, cst.Call):
            return
        matched = self._match(value)
        if matched is None:
            return
        where = self._file_lines(value)
        if where is None:
            return
        rule, api = matched
        try:
            outcome = rule.check_reference(value, self._context(where[0], api, value))
        except Refuse as refusal:
            outcome = Refusal(refusal.reason)
        if isinstance(outcome, Rewrite):  # references are reported, never rewritten by the engine
            outcome = Report("used as a value: not rewritten")
        self._record(rule, api, "reference", where, outcome)

    def visit_Arg(self, node: cst.Arg) -> None:
        """``f(attention_fn=flash_attn_func)`` and ``inspect.signature(flash_attn_func)``."""
        self._reference(node.value)

    def visit_Assign(self, node: cst.Assign) -> None:
        """``fn = flash_attn_func``."""
        self._reference(node.value)

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

    def leave_SimpleString(self, original_node: cst.SimpleString, updated_node: cst.SimpleString) -> cst.BaseExpression:
        """String literals some rule watches (``attn_implementation="flash_attention_2"``); a rule
        may rewrite them (e.g. to a value that routes through flashport)."""
        if not self.by_string:
            return updated_node
        try:
            value = original_node.evaluated_value
        except Exception:  # noqa: BLE001 - odd literals are simply not config values
            return updated_node
        rule = self.by_string.get(value) if isinstance(value, str) else None
        if rule is None:
            return updated_node
        where = self._file_lines(original_node)
        if where is None:
            return updated_node
        if suppress.is_suppressed(self.suppressions, rule.CODE, where[0], where[2]):
            self._record(rule, value, "string", where, None)
            return updated_node
        try:
            outcome = rule.check_string(original_node, value, self._context(where[0], value, original_node))
        except Refuse as refusal:
            outcome = Refusal(refusal.reason)
        if isinstance(outcome, Rewrite) and rule.CODE in self.vetoes:
            outcome = Refusal(self.vetoes[rule.CODE])
        self._record(rule, value, "string", where, outcome)
        if isinstance(outcome, Rewrite):
            self.imports.update(outcome.imports)
            self.rewrites += 1
            return outcome.node
        return updated_node
