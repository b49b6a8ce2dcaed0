"""Remove GPU imports a rewrite made dead, at every scope, as line splices on the new text.

A name is *dead* when the original file read it and the rewritten one no longer does (``before``
and ``after`` are :func:`flashport.rewriter.imports.edits.name_uses` counts, so a name read anywhere in
the file keeps every import of it: feature probes, re-exports listed in ``__all__``, ...). Names
the original never read (possible re-exports) are never touched.

What goes:

* an import from a GPU module (``flash_attn``, ``xformers``, ... :attr:`Rule.GPU_MODULES`) whose
  bound names are all dead, wherever it is (module, function, class, ``if``, ``with`` ...); a
  partly dead one loses only its dead names;
* a whole ``try: <GPU imports> except ...: <fallbacks>`` block when its imports are all dead and
  everything else in it only existed for them: fallback assignments of the imported names
  (``flash_attn_func = None``, or a function the handler defines only for them), flags nobody
  reads any more (``HAS_FLASH_ATTN = True/False``), ``pass``, warnings/log calls and ``raise`` in
  the handlers. When other code is there the block
  stays exactly as it was: removing the import would change what it computes, and a guarded import
  already loads without the GPU library;
* a dead import in a ``try`` whose handlers only raise (``except ImportError as e: raise
  RuntimeError("pip install flash-attn") from e``): the library was required, not probed, so it
  goes as an unguarded one does (kept, it would still raise where the library is absent);
* a ``try`` availability guard whose GPU imports are all dead but whose flag is still read
  (``try: from flash_attn import f; HAS_FA = True`` / ``except ImportError: HAS_FA = False``)
  collapses to its success path, the flag assignments of the ``try`` body and ``else``
  (``HAS_FA = True``): the imports' names now come from flashport, so the import can no longer
  fail, and keeping the guard would send the ported code down the fallback path on a host without
  the GPU library. Only when the block holds nothing but dead imports, constant flags, fallbacks,
  ``pass``, warnings/log calls and ``raise``, and the file has no other GPU import (the flag may
  gate it);
* such a guard whose imports also bind names the file never read (``from flash_attn_interface
  import _flash_attn_forward, flash_attn_func`` where only the first was called and ported)
  collapses too: those names may be re-exported, so each one a drop-in replicates moves there, and
  the rest keep a ``try`` of their own with the handlers' ``name = None`` fallbacks of them. A
  guard that ported nothing is a pure probe and stays as it is;
* likewise a whole ``if available(): <GPU imports> else: <fallbacks>`` whose condition is a
  plain probe (names, attributes, ``is_*_available()`` / ``find_spec`` calls, comparisons of those).

A block left empty gets ``pass``. Statements that share a line with others (``;``, one-line
compound statements) are left alone. Blank lines around a removed top-level block are collapsed
to the larger of the two runs.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import itertools
import re

from flashport.rewriter.imports import drop_in_imports
from flashport.rewriter.source import astindex
from flashport.rewriter.source.text import split_lines

_PROBE_CALL = re.compile(r"(available|find_spec|^is_|^has_)", re.I)
_LOG_CALL = re.compile(
    r"(^|\.)(warn|warning|info|debug|error|exception|critical|print|print_once|warning_once|info_once)$"
)
_TRY = (ast.Try, ast.TryStar)
_Import = ast.Import | ast.ImportFrom
_Guard = ast.Try | ast.TryStar | ast.If  # a block whose branches may guard an import


@dataclasses.dataclass
class _Plan:
    lines: list[str]
    before: collections.Counter
    after: collections.Counter
    gpu_modules: tuple[str, ...]
    version: tuple[int, ...] = (2, 8, 3)  # the flash-attn release the port was written for
    probes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    exports: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    in_try: set[int] = dataclasses.field(default_factory=set)  # ids of statements directly in a try body
    gpu_import_count: int = 0  # GPU imports in the rewritten file that keep a name still read
    edits: list[tuple[int, int, str]] = dataclasses.field(default_factory=list)  # 1-based inclusive lines
    removed: list[str] = dataclasses.field(default_factory=list)

    def dead(self, name: str) -> bool:
        return bool(self.before[name]) and not self.after[name]

    def moved(self, node: _Import) -> list[tuple[ast.alias, str]]:
        """The aliases of ``node`` that can come from a flashport drop-in instead, with its module
        (:func:`flashport.rewriter.imports.drop_in_imports.target`)."""
        if not isinstance(node, ast.ImportFrom) or node.level:
            return []
        found = []
        for alias in node.names:
            drop_in = drop_in_imports.target(
                node.module or "",
                alias.name,
                _bound(alias),
                self.before,
                self.after,
                self.probes,
                self.exports,
                id(node) in self.in_try,
                self.version,
            )
            if drop_in is not None:
                found.append((alias, drop_in))
        return found


def remove_dead(
    text: str,
    tree: ast.Module,
    before: collections.Counter,
    after: collections.Counter,
    gpu_modules: tuple[str, ...],
    drop_aliases,
    version: tuple[int, ...] = (2, 8, 3),
) -> tuple[str, list[str], list[tuple[int, int, int]]]:
    """Drop GPU imports (and their fallbacks) that became dead; see the module docstring.

    Args:
      text: the rewritten file's text; ``tree`` its ``ast``.
      before, after: name read counts of the original and the rewritten file.
      gpu_modules: module prefixes whose imports may go.
      drop_aliases: ``f(statement_text, names) -> new text | None`` removing aliases from one import.
      version: the flash-attn release the port was written for (which drop-ins replicate it).

    Returns:
      The new text, the dotted names removed and the line edits made (``(first, last, new line
      count)`` in ``text``'s lines; :func:`flashport.rewriter.source.reparse.reparse` takes them).
    """
    plan = _Plan(split_lines(text), before, after, gpu_modules, version)
    plan.probes = drop_in_imports.probe_reads(tree)
    plan.exports = drop_in_imports.exported(tree)
    plan.in_try = {id(s) for n in astindex.of_type(tree, *_TRY) if isinstance(n, _TRY) for s in n.body}
    plan.gpu_import_count = _count_gpu_imports(tree, plan)
    _body(tree.body, plan, public=True, drop_aliases=drop_aliases)
    lines = plan.lines
    applied = []
    for start, end, new in sorted(_merged(plan.edits), reverse=True):
        if new == "" and _blank(lines, start - 2) and _blank(lines, end):
            while start > 1 and _blank(lines, start - 2):  # keep only the blank run below the block
                start -= 1
        elif new == "" and _opens_block(lines, start - 2):
            while _blank(lines, end):  # the block's first statement went: no blank line may lead it
                end += 1
        lines[start - 1 : end] = [new] if new else []
        applied.append((start, end, len(split_lines(new))))
    return "".join(lines), plan.removed, applied


def _moved_lines(node: ast.ImportFrom, moved: list[tuple[ast.alias, str]], plan: _Plan) -> str:
    """``from <drop-in> import ...`` for the moved aliases, at ``node``'s indentation; a comment
    after the import (``# noqa: F401``) stays on each new line."""
    line = plan.lines[node.lineno - 1]
    indent, newline = line[: node.col_offset], line[len(line.rstrip("\r\n")) :] or "\n"
    last = plan.lines[(node.end_lineno or node.lineno) - 1].encode("utf-8")
    comment = last[node.end_col_offset or 0 :].decode("utf-8", "replace").strip()
    comment = f"  {comment}" if comment.startswith("#") else ""
    by_module: dict[str, list[str]] = {}
    for alias, module in moved:
        by_module.setdefault(module, []).append(
            alias.name if alias.asname in (None, alias.name) else f"{alias.name} as {alias.asname}"
        )
    return "".join(
        f"{indent}from {m} import {', '.join(names)}{comment}{newline}" for m, names in by_module.items()
    )


def _merged(edits: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """``edits`` with removals of adjacent lines joined (their blank lines around collapse as one)."""
    out: list[tuple[int, int, str]] = []
    for start, end, new in sorted(edits):
        if out and new == "" and out[-1][2] == "" and out[-1][1] + 1 == start:
            out[-1] = (out[-1][0], end, "")
        else:
            out.append((start, end, new))
    return out


def _blank(lines: list[str], index: int) -> bool:
    return 0 <= index < len(lines) and not lines[index].strip()


def _opens_block(lines: list[str], index: int) -> bool:
    """Line ``index`` (0-based) opens a block (``try:``, ``def f():`` ...), comments aside."""
    if not 0 <= index < len(lines):
        return False
    code = lines[index].split("#", 1)[0].rstrip()
    return code.endswith(":")


def _gpu_import(node: ast.stmt, plan: _Plan) -> _Import | None:
    """``node`` if it is an import of a GPU module (no star import), else None."""
    if isinstance(node, ast.ImportFrom):
        if node.level or not _is_gpu(node.module or "", plan.gpu_modules):
            return None
        return node if all(a.name != "*" for a in node.names) else None
    if isinstance(node, ast.Import):
        return node if any(_is_gpu(a.name, plan.gpu_modules) for a in node.names) else None
    return None


def _count_gpu_imports(node: ast.Module, plan: _Plan) -> int:
    """How many GPU import statements the file ``node`` holds, at any depth, that keep a name still
    read (dead ones go in this pass, moved ones become flashport imports)."""
    return sum(
        (imp := _gpu_import(n, plan)) is not None
        and len(_dead_aliases(imp, plan)) + len(plan.moved(imp)) < len(imp.names)
        for n in astindex.of_type(node, ast.Import, ast.ImportFrom)
        if isinstance(n, ast.stmt)
    )


def _gpu_imports(body: list[ast.stmt], plan: _Plan) -> list[_Import]:
    """The GPU imports directly in ``body``."""
    return [imp for s in body if (imp := _gpu_import(s, plan)) is not None]


def _is_gpu(module: str, gpu_modules: tuple[str, ...]) -> bool:
    return any(module == m or module.startswith(m + ".") for m in gpu_modules)


def _bound(alias: ast.alias) -> str:
    return alias.asname or alias.name.split(".")[0]


def _dead_aliases(node: _Import, plan: _Plan) -> list[ast.alias]:
    aliases = node.names
    if isinstance(node, ast.Import):
        aliases = [a for a in aliases if _is_gpu(a.name, plan.gpu_modules)]
    return [a for a in aliases if plan.dead(_bound(a))]


def _dotted(node: _Import, alias: ast.alias) -> str:
    return f"{node.module}.{alias.name}" if isinstance(node, ast.ImportFrom) else alias.name


def _alone(node: ast.stmt, plan: _Plan) -> bool:
    """``node`` fills its lines: only indentation before it and only a comment after it."""
    lines = plan.lines
    start, end = node.lineno, node.end_lineno or node.lineno
    if start < 1 or end > len(lines) or lines[start - 1][: node.col_offset].strip():
        return False
    rest = lines[end - 1].encode("utf-8")[node.end_col_offset :].decode("utf-8", "replace").strip()
    return not rest or rest.startswith("#")


def _sharing_lines(body: list[ast.stmt]) -> set[int]:
    """The ids of the statements of ``body`` that share a line with another one (``a; b``). The
    statements follow each other, so only neighbours can: one pass over the pairs."""
    shared: set[int] = set()
    for previous, following in itertools.pairwise(body):
        if (previous.end_lineno or previous.lineno) >= following.lineno:
            shared.update((id(previous), id(following)))
    return shared


# ------------------------------------------------------------------------------ statement lists


def _body(
    body: list[ast.stmt],
    plan: _Plan,
    public: bool,
    drop_aliases,
    pad: bool = False,
    guarded: bool = False,
    fallbacks: frozenset[str] = frozenset(),
) -> set[str]:
    """Plan the removals in one statement list; returns the names whose imports it dropped.

    ``pad``: the list must not become empty; ``guarded``: the body of a ``try`` that stays, whose
    wholly dead imports must stay (their failure may matter: another GPU import of the file may
    still fail, or a handler binds a name read elsewhere that only it binds); ``fallbacks``: names
    such a body dropped, whose ``name = None`` style fallbacks in the handlers go too.
    """
    whole: list[ast.stmt] = []
    dropped: set[str] = set()
    sharing = _sharing_lines(body)
    for stmt in body:
        if id(stmt) in sharing:
            continue
        if (
            fallbacks
            and isinstance(stmt, ast.Assign)
            and _alone(stmt, plan)
            and _pure(stmt.value)
            and all(isinstance(t, ast.Name) and t.id in fallbacks for t in stmt.targets)
        ):
            whole.append(stmt)
        elif (imp := _gpu_import(stmt, plan)) is not None:
            dead = _dead_aliases(imp, plan)
            moved = plan.moved(imp)
            if (
                moved
                and isinstance(imp, ast.ImportFrom)
                and len(dead) + len(moved) == len(imp.names)
                and _alone(imp, plan)
            ):
                plan.edits.append((imp.lineno, imp.end_lineno or imp.lineno, _moved_lines(imp, moved, plan)))
                plan.removed.extend(_dotted(imp, a) for a in imp.names)
                dropped.update(_bound(a) for a in dead)
                continue
            # a dead import in a try body that stays: it can no longer fail (flashport stands in for
            # it), unless another GPU import of the file may still fail there
            if not dead or not _alone(imp, plan) or (guarded and len(dead) == len(imp.names)):
                continue
            if len(dead) == len(imp.names):
                whole.append(imp)
            else:
                start, end = imp.lineno, imp.end_lineno or imp.lineno
                new = drop_aliases("".join(plan.lines[start - 1 : end]), {_bound(a) for a in dead})
                if new is None:
                    continue
                plan.edits.append((start, end, new))
            plan.removed.extend(_dotted(imp, a) for a in dead)
            dropped.update(_bound(a) for a in dead)
        elif isinstance(stmt, _Guard) and _alone(stmt, plan) and _guard_removable(stmt, plan, public):
            whole.append(stmt)
            plan.removed.extend(_guard_names(stmt, plan))
        elif isinstance(stmt, _TRY) and _alone(stmt, plan) and (flags := _collapsed(stmt, plan)) is not None:
            unread, moved = _unread(stmt, plan), _unread_moved(stmt, plan)
            still_guarded = unread - {_bound(a) for a, _ in moved}
            plan.removed.extend(
                _dotted(imp, a)
                for imp in _gpu_imports(stmt.body, plan)
                for a in imp.names
                if _bound(a) not in still_guarded
            )
            if flags or unread:
                new = _drop_in_lines(stmt, moved, plan)
                rest = _flag_lines(stmt, flags, plan) + _probe_lines(stmt, still_guarded, plan)
                new += "\n" if new and rest and not stmt.col_offset else ""  # isort's gap below imports
                new += rest
                plan.edits.append((stmt.lineno, stmt.end_lineno or stmt.lineno, new))
            else:
                whole.append(stmt)
        elif isinstance(stmt, _TRY) and _alone(stmt, plan) and _emptied(stmt, plan):
            whole.append(stmt)
            plan.removed.extend(_guard_names(stmt, plan))
        else:
            _inner(stmt, plan, public, drop_aliases)
    if not whole:
        return dropped
    if pad and len(whole) == len(body):
        first = whole[0]
        line = plan.lines[first.lineno - 1]
        indent, newline = line[: first.col_offset], line[len(line.rstrip("\r\n")) :] or "\n"
        plan.edits.append((first.lineno, first.end_lineno or first.lineno, f"{indent}pass{newline}"))
        whole = whole[1:]
    plan.edits.extend((s.lineno, s.end_lineno or s.lineno, "") for s in whole)
    return dropped


def _inner(stmt: ast.stmt, plan: _Plan, public: bool, drop_aliases) -> None:
    """Recurse into the statement lists of a compound statement."""
    scope_public = public and not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef))
    dropped: set[str] = set()
    for field in ("body", "orelse", "finalbody"):
        inner = getattr(stmt, field, None)
        if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
            in_try = field == "body" and isinstance(stmt, _TRY)
            guarded = in_try and _guarded(stmt, plan)
            found = _body(inner, plan, scope_public, drop_aliases, pad=True, guarded=guarded)
            dropped.update(found if in_try else ())
    for handler in getattr(stmt, "handlers", []) or []:
        _body(handler.body, plan, scope_public, drop_aliases, pad=True, fallbacks=frozenset(dropped))
    for case in getattr(stmt, "cases", []) or []:
        _body(case.body, plan, scope_public, drop_aliases, pad=True)


def _emptied(stmt: ast.Try | ast.TryStar, plan: _Plan) -> bool:
    """A ``try`` (no ``else``/``finally``) whose body is only dead GPU imports that go (the body
    is not guarded, :func:`_guarded`): nothing in it can raise any more, so its handlers are dead
    code and the whole block goes (it was left as ``try: pass`` with its handlers)."""
    if stmt.orelse or stmt.finalbody or _guarded(stmt, plan):
        return False
    imports = []
    for inner in stmt.body:
        imp = _gpu_import(inner, plan)
        if isinstance(inner, ast.Pass):
            continue
        if imp is None or not _alone(imp, plan) or plan.moved(imp):
            return False
        imports.append(imp)
    return bool(imports) and _wholly_dead(imports, plan)


def _guarded(stmt: ast.stmt, plan: _Plan) -> bool:
    """The wholly dead GPU imports of this ``try`` body must stay: the imports were probed, not
    required (:func:`_required`), and another GPU import of the file may still fail there or a
    handler binds a name read elsewhere (:func:`_handlers_idle`). Otherwise a dead import in it can
    no longer fail (flashport stands in for it) and goes."""
    if _required(stmt, plan):
        return False
    return bool(plan.gpu_import_count) or not _handlers_idle(stmt, plan)


def _required(stmt: ast.stmt, plan: _Plan) -> bool:
    """A ``try`` whose handlers only raise (``except ImportError as e: raise RuntimeError(...) from
    e``) and whose GPU imports are all dead or moved: the imports were required, not probed, so the
    dead ones go as unguarded ones do (kept, they would still raise where the library is absent).
    Its libcst twin, for the values inside such a ``try``, is ``rules/common/values.py``'s ``_only_raises``."""
    handlers = getattr(stmt, "handlers", None) or []
    if not handlers or not all(all(isinstance(s, ast.Raise) for s in h.body) for h in handlers):
        return False
    imports = _gpu_imports(getattr(stmt, "body", []), plan)
    return all(len(_dead_aliases(i, plan)) + len(plan.moved(i)) == len(i.names) for i in imports)


def _handlers_idle(stmt: ast.stmt, plan: _Plan) -> bool:
    """No handler of ``stmt`` binds a name the rewritten file reads that the ``try`` body (or
    ``else``) does not bind too: with the import unable to fail, such a name could stay unbound."""
    success = _names_bound([*getattr(stmt, "body", []), *getattr(stmt, "orelse", [])])
    handled = _names_bound([s for h in getattr(stmt, "handlers", []) for s in h.body])
    return all(not plan.after[name] for name in handled - success)


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda, ast.comprehension)


def _names_bound(body: list[ast.stmt]) -> set[str]:
    """Names the statements bind in their own scope (not inside a nested def, class, lambda or
    comprehension)."""
    names: set[str] = set()
    stack: list[ast.AST] = list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(_bound(a) for a in node.names)
        if not isinstance(node, _SCOPES):
            stack.extend(ast.iter_child_nodes(node))
    return names


# ----------------------------------------------------------------------- guarded import blocks


def _guard_names(stmt: _Guard, plan: _Plan) -> list[str]:
    """Dotted names of the GPU imports directly in a guard's branches and handlers."""
    handlers = [] if isinstance(stmt, ast.If) else stmt.handlers
    bodies = [stmt.body, stmt.orelse, *[h.body for h in handlers]]
    return [_dotted(s, a) for body in bodies for s in _gpu_imports(body, plan) for a in s.names]


def _wholly_dead(imports: list[_Import], plan: _Plan, unread: frozenset[str] = frozenset()) -> bool:
    """Every name of these absolute imports is dead (a relative import is never flashport's to drop),
    or one of the ``unread`` names that stay behind a probe of their own."""
    return all(
        len(_dead_aliases(s, plan)) + sum(_bound(a) in unread for a in s.names) == len(s.names)
        and not (isinstance(s, ast.ImportFrom) and s.level)
        for s in imports
    )


def _unread(stmt: ast.Try | ast.TryStar, plan: _Plan) -> frozenset[str]:
    """The names of a ``try`` body's ``from`` imports that neither the original nor the rewritten
    file reads (possible re-exports), when every other GPU name the body imports was ported (dead):
    the guard then protects the ported code too, so it collapses (:func:`_collapsed`) and only these
    names keep a guard of their own. A body that ports nothing is a pure probe and stays as it is."""
    imports = _gpu_imports(stmt.body, plan)
    if any(not isinstance(s, ast.ImportFrom) for s in imports):
        return frozenset()
    unread = {
        _bound(a)
        for s in imports
        for a in s.names
        if not plan.before[_bound(a)] and not plan.after[_bound(a)]
    }
    if not unread or not any(_dead_aliases(s, plan) for s in imports):
        return frozenset()
    return frozenset(unread)


def _unread_moved(stmt: ast.Try | ast.TryStar, plan: _Plan) -> list[tuple[ast.alias, str]]:
    """The :func:`_unread` names of a collapsing guard that a drop-in replicates at the release the
    port was written for (:func:`flashport.rewriter.imports.drop_in_imports.target`, judged as
    outside a ``try``: the guard no longer probes), with the drop-in's module."""
    unread = _unread(stmt, plan)
    found = []
    for imp in _gpu_imports(stmt.body, plan):
        for alias in imp.names:
            if _bound(alias) not in unread or not isinstance(imp, ast.ImportFrom):
                continue
            module = drop_in_imports.target(
                imp.module or "", alias.name, _bound(alias), plan.before, plan.after,
                plan.probes, plan.exports, False, plan.version,
            )  # fmt: skip
            if module is not None:
                found.append((alias, module))
    return found


def _drop_in_lines(stmt: ast.stmt, moved: list[tuple[ast.alias, str]], plan: _Plan) -> str:
    """``from <drop-in> import name [as alias]`` for each moved alias, at ``stmt``'s indentation."""
    line = plan.lines[stmt.lineno - 1]
    indent, newline = line[: stmt.col_offset], line[len(line.rstrip("\r\n")) :] or "\n"
    return "".join(
        f"{indent}{ast.unparse(ast.ImportFrom(module, [alias], 0))}{newline}" for alias, module in moved
    )


def _probe_lines(stmt: ast.Try | ast.TryStar, unread: frozenset[str], plan: _Plan) -> str:
    """A ``try`` importing only the ``unread`` names of ``stmt``'s body, whose handlers keep only
    their fallbacks of those names (``name = None``) - the rest of them served the collapsed flag."""
    if not unread:
        return ""
    line = plan.lines[stmt.lineno - 1]
    indent, newline = line[: stmt.col_offset], line[len(line.rstrip("\r\n")) :] or "\n"
    out = [f"{indent}try:{newline}"]
    for imp in _gpu_imports(stmt.body, plan):
        kept = [a for a in imp.names if _bound(a) in unread]
        if kept and isinstance(imp, ast.ImportFrom):  # a guard with `import M` never collapses
            out.append(f"{indent}    {ast.unparse(ast.ImportFrom(imp.module, kept, 0))}{newline}")
    for handler in stmt.handlers:
        head = "except" + (f" {ast.unparse(handler.type)}" if handler.type else "")
        head += f" as {handler.name}" if handler.name else ""
        out.append(f"{indent}{head}:{newline}")
        fallbacks = [
            (targets, s.value)
            for s in handler.body
            if isinstance(s, ast.Assign) and _pure(s.value)
            if (targets := [t.id for t in s.targets if isinstance(t, ast.Name) and t.id in unread])
        ]
        out.extend(f"{indent}    {' = '.join(t)} = {ast.unparse(v)}{newline}" for t, v in fallbacks)
        if not fallbacks:
            out.append(f"{indent}    pass{newline}")
    return "".join(out)


def _guard_removable(stmt: _Guard, plan: _Plan, public: bool) -> bool:
    """A ``try``/``if`` that only imports dead GPU names and handles their absence (module doc)."""
    imports = _gpu_imports(stmt.body, plan)
    if not imports or not _wholly_dead(imports, plan):
        return False
    names = {_bound(a) for s in imports for a in s.names}
    if isinstance(stmt, ast.If):
        if not _probe(stmt.test):
            return False
        rest = [s for s in stmt.body if s not in imports]
        return all(_removable(s, names, plan, public, handler=False) for s in rest) and _else_removable(
            stmt.orelse, names, plan, public
        )
    if stmt.finalbody:
        return False
    rest = [s for s in stmt.body if s not in imports]
    if not all(_removable(s, names, plan, public, handler=False) for s in rest + stmt.orelse):
        return False
    return all(
        _removable(s, names, plan, public, handler=True) or _fallback_helper(s, h.body, plan)
        for h in stmt.handlers
        for s in h.body
    )


def _fallback_helper(stmt: ast.stmt, body: list[ast.stmt], plan: _Plan) -> bool:
    """A plain function a handler defines only for its fallbacks (``def _unsupported(*a): raise ...``
    then ``flash_attn_func = _unsupported``): no decorator, and read nowhere but in ``body``."""
    if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) or stmt.decorator_list:
        return False
    reads = sum(
        isinstance(n, ast.Name) and n.id == stmt.name and isinstance(n.ctx, ast.Load)
        for s in body
        for n in ast.walk(s)
    )
    return reads == plan.after[stmt.name]


def _collapsed(stmt: ast.Try | ast.TryStar, plan: _Plan) -> list[ast.Assign] | None:
    """An availability guard whose GPU imports all became dead but whose flag is still read
    (``try: from flash_attn import f; HAS_FA = True / except ImportError: HAS_FA = False``): the
    imports now always succeed (flashport stands in for them), so the block is its success path, the
    flag assignments of the ``try`` body and ``else``. Returns those assignments (possibly none), or
    None when the block holds anything else (module doc)."""
    imports = _gpu_imports(stmt.body, plan)
    if not imports or stmt.finalbody:
        return None
    unread = _unread(stmt, plan)
    # Another GPU import left in the file may sit behind the flag (``if HAS_FA: from flash_attn...``):
    # forcing the flag on would make a host without the library fail where the original fell back.
    # The guard's own never-read names stay behind a probe of their own (:func:`_probe_lines`).
    own = sum(any(_bound(a) in unread for a in s.names) for s in imports)
    if plan.gpu_import_count - own or not _wholly_dead(imports, plan, unread):
        return None
    names = {_bound(a) for s in imports for a in s.names}
    success = [s for s in stmt.body if s not in imports] + stmt.orelse
    flags = [
        s
        for s in success
        if isinstance(s, ast.Assign) and _flag(s) and not _removable(s, names, plan, True, handler=False)
    ]
    if not all(s in flags or _removable(s, names, plan, True, handler=False) for s in success):
        return None
    if not all(
        _flag(s) or _removable(s, names, plan, True, handler=True) or _fallback_helper(s, h.body, plan)
        for h in stmt.handlers
        for s in h.body
    ):
        return None
    return flags


def _flag(stmt: ast.stmt) -> bool:
    """``NAME = <constant>`` (one or more plain names)."""
    return (
        isinstance(stmt, ast.Assign)
        and isinstance(stmt.value, ast.Constant)
        and all(isinstance(t, ast.Name) for t in stmt.targets)
    )


def _flag_lines(stmt: ast.stmt, flags: list[ast.Assign], plan: _Plan) -> str:
    """The flag assignments as lines at ``stmt``'s indentation."""
    line = plan.lines[stmt.lineno - 1]
    indent, newline = line[: stmt.col_offset], line[len(line.rstrip("\r\n")) :] or "\n"
    return "".join(f"{indent}{ast.unparse(flag)}{newline}" for flag in flags)


def _else_removable(orelse: list[ast.stmt], names: set[str], plan: _Plan, public: bool) -> bool:
    return all(_removable(s, names, plan, public, handler=True) for s in orelse)


def _removable(stmt: ast.stmt, names: set[str], plan: _Plan, public: bool, handler: bool) -> bool:
    """A statement that only existed for the dead imports ``names``."""
    if isinstance(stmt, ast.Pass):
        return True
    if (imp := _gpu_import(stmt, plan)) is not None:  # a fallback import of the same kernels (another path)
        return len(_dead_aliases(imp, plan)) == len(imp.names)
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
        return True
    if isinstance(stmt, ast.Assign):
        targets = [t for t in stmt.targets if isinstance(t, ast.Name)]
        if len(targets) != len(stmt.targets):
            return False
        if all(t.id in names for t in targets):  # fallback: flash_attn_func = None
            return _pure(stmt.value)
        # a flag: HAS_FLASH_ATTN = True/False, read by nobody now (and not a possible export)
        return isinstance(stmt.value, ast.Constant) and all(
            not plan.after[t.id] and (plan.before[t.id] or t.id.startswith("_") or not public)
            for t in targets
        )
    if handler and isinstance(stmt, ast.Raise):
        return True
    if handler and isinstance(stmt, _Guard):  # a nested fallback guard: another path to the kernels
        return _alone(stmt, plan) and _guard_removable(stmt, plan, public)
    if handler and isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        return bool(_LOG_CALL.search(_name(stmt.value.func) or "")) and all(_pure(a) for a in stmt.value.args)
    return False


def _pure(node: ast.expr) -> bool:
    """An expression without side effects (constants, names, attributes, lambdas, f-strings)."""
    if isinstance(node, (ast.Constant, ast.Name, ast.Lambda)):
        return True
    if isinstance(node, ast.Attribute):
        return _pure(node.value)
    if isinstance(node, ast.JoinedStr):
        return all(_pure(v.value) if isinstance(v, ast.FormattedValue) else True for v in node.values)
    if isinstance(node, (ast.Tuple, ast.List)):
        return all(_pure(e) for e in node.elts)
    return False


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _name(node.value)
        return f"{inner}.{node.attr}" if inner else node.attr
    return None


def _probe(test: ast.expr) -> bool:
    """A condition that only probes availability (no side effects to keep)."""
    if isinstance(test, (ast.Name, ast.Attribute, ast.Constant)):
        return _pure(test)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _probe(test.operand)
    if isinstance(test, ast.BoolOp):
        return all(_probe(v) for v in test.values)
    if isinstance(test, ast.Compare):
        return _probe(test.left) and all(_probe(c) for c in test.comparators)
    if isinstance(test, ast.Call):
        name = _name(test.func) or ""
        return (
            bool(_PROBE_CALL.search(name.rsplit(".", 1)[-1] or ""))
            and all(_pure(a) for a in test.args)
            and all(_pure(k.value) for k in test.keywords)
        )
    return False
