"""The per-file transform: bytes in, :class:`~flashport.rewriter.engine.results.FileResult` out.

Pipeline for one file (pure: no I/O; the runner reads the bytes):

1. **Byte prefilter**: the enabled rules' ``TRIGGERS`` as one bytes regex. A file without a match is
   never decoded or parsed.
2. Decode with the file's own encoding (cookie/BOM), ``ast.parse`` for syntax checking and for
   top-level statement boundaries (C parser: cheap). Syntax newer than the host's Python that
   libcst reads (``type X = ...``, PEP 701 f-strings) is masked for the ``ast`` stages
   (:mod:`~flashport.rewriter.source.newsyntax`) and restored in the output.
3. For every top-level statement that mentions a trigger (imports aside), build a mini module
   (header imports + that statement), parse it piece by piece (:mod:`~flashport.rewriter.source.pieces`)
   and run :class:`~flashport.rewriter.engine.transform.SiteTransformer`, which gives each candidate
   node libcst's qualified names (the semantic model's
   :meth:`~flashport.rewriter.source.semantic.SemanticModel.header_names`, libcst's scope analysis
   where the model leaves it undecided): rules answer per site.
   Then the per-file phase: each rule's ``settle`` sees every site's final status and may veto
   its own rewrites in this file, and a rewrite whose required calls (``Rewrite.requires``) did
   not all end rewritten is vetoed (the pass is redone with them refused, until no veto is added).
   Where most of the chunks' text mentions nothing relevant (long test functions), a first pass
   parses them thin, those statements as placeholders (:mod:`~flashport.rewriter.engine.thin`), and is
   given up for the whole chunks after a rule's read a placeholder could answer; a pass over
   pruned chunks (:mod:`~flashport.rewriter.engine.prune`) is redone over every chunk when a rule read
   the module. Both reads are recorded, never raised through rule code.
4. Splice rewritten statement texts into the original lines (everything else is byte-identical):
   each changed statement rendered alone where :mod:`~flashport.rewriter.source.spans` can place it (the
   same statements give the sites their positions), else every changed chunk from a render of the
   whole mini module; drop GPU imports a rewrite made unused, add ``import flashport`` once.
5. The new text must parse and compile (masked text: compile, and the restored text must parse
   with libcst), or the file is reported as an error and left alone.

Rules are instantiated afresh for every file.

**Reference mode** (``transform_source(..., reference=True)``, or the environment variable
``FLASHPORT_REFERENCE=1``) turns every speed layer off: every chunk is kept (no
:mod:`~flashport.rewriter.engine.prune`), there is no thin pass (:mod:`~flashport.rewriter.engine.thin`), the mini
module is parsed in one piece by ``cst.parse_module`` (no :mod:`~flashport.rewriter.source.pieces`), names
come from libcst's ``ScopeProvider``/qualified names alone (no
:meth:`~flashport.rewriter.source.semantic.SemanticModel.header_names`; the flow's narrowing,
:meth:`~flashport.rewriter.source.semantic.SemanticModel.reaching`, is the model's in both modes),
positions from libcst's ``PositionProvider`` (no :mod:`~flashport.rewriter.source.positions` or
:mod:`~flashport.rewriter.source.spans`), the traversal visits every statement (no ``relevant`` skip) and
the whole mini module is rendered and spliced chunk by chunk, and the rewritten and cleaned texts are
parsed whole (no :mod:`~flashport.rewriter.source.reparse`). Its output bytes and per-site results
must equal the fast mode's (``tests/test_reference_mode.py``); a difference is a speed-layer bug.
"""

from __future__ import annotations

import ast
import bisect
import dataclasses
import functools
import gc
import itertools
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from flashport.rewriter.engine import cuda_notes, formatting, prune, run_context, suppress, thin
from flashport.rewriter.engine.results import CHANGED, ERROR, REFUSED, REWRITE, FileResult
from flashport.rewriter.engine.transform import MiniFile, PassMode, SiteTransformer
from flashport.rewriter.imports import edits as import_edits
from flashport.rewriter.source import newsyntax, reparse, semantic
from flashport.rewriter.source import pieces as mini_parse
from flashport.rewriter.source import text as src
from flashport.rewriter.source.spans import StatementSpans
from flashport.rules.base import Rule, RuleContext, RuleOptions


def trigger_pattern(rules: Iterable[type[Rule]]) -> re.Pattern[bytes]:
    """One bytes regex matching any trigger of ``rules`` (matches nothing when there are none)."""
    triggers = sorted({t for rule in rules for t in rule.TRIGGERS})
    if not triggers:
        return re.compile(rb"(?!x)x")
    return re.compile(b"|".join(re.escape(t) for t in triggers))


def transform_source(
    data: bytes,
    path: str,
    rules: Sequence[type[Rule]],
    options: RuleOptions | None = None,
    pattern: re.Pattern[bytes] | None = None,
    skip: dict[int, frozenset[str]] | None = None,
    reference: bool | None = None,
) -> FileResult:
    """Find and rewrite GPU attention sites in one file's bytes.

    Args:
      data: the file's bytes.
      path: used in findings and messages.
      rules: rule classes to apply (instantiated fresh here).
      options: :class:`RuleOptions`.
      pattern: a precompiled :func:`trigger_pattern` (computed when omitted).
      skip: extra suppressions, 1-based line -> rule codes, merged with the file's
        ``# flashport: ignore`` comments (the interactive review leaves declined sites this way).
      reference: run with every speed layer off (module docstring); None: the environment
        variable ``FLASHPORT_REFERENCE`` (set and not ``0``) decides.

    Returns:
      A :class:`FileResult`; ``new`` holds the rewritten bytes when something changed.
    """
    options = options or RuleOptions()
    if reference is None:
        reference = reference_mode()
    pattern = pattern or trigger_pattern(rules)
    result = FileResult(path, size=len(data))
    if not pattern.search(data):
        return result
    result.parsed = True
    try:
        text, encoding = src.decode(data)
    except (SyntaxError, UnicodeDecodeError, LookupError) as err:
        return _error(result, f"cannot decode: {err}")
    collecting = gc.isenabled()
    # The parsers build ~10 objects a source token (ast and libcst); cyclic GC passes over them
    # cost ~30% of a big file's time (and a full pass grows with every object alive).
    gc.disable()
    try:
        parsed = _parse_for_analysis(text, path)
        if isinstance(parsed, str):
            return _error(result, parsed)
        tree, text, masks = parsed
        # the patches of this file's project; its own ones too (the run's pre-pass may lack this file)
        options = run_context.with_file_patches(run_context.scoped(options, path), tree, path, text)
        parsed_file = _Parsed(data, text, encoding, tree, masks)
        return _as_done(_transform(result, parsed_file, [rule() for rule in rules], options, skip, reference))
    except Exception as err:  # noqa: BLE001 - one bad file must not stop a run
        detail = traceback.format_exception_only(type(err), err)[-1].strip()
        return _error(result, f"internal error, file left unchanged: {detail}")
    finally:
        if collecting:
            gc.enable()


def reference_mode() -> bool:
    """Whether the environment asks for the reference mode (``FLASHPORT_REFERENCE`` set, not ``0``)."""
    return os.environ.get("FLASHPORT_REFERENCE", "0") not in ("", "0")


def _as_done(result: FileResult) -> FileResult:
    """``result`` reporting what was done to the file: a site counts as rewritten only when the
    file changed (a rewrite that renders the text it replaces changes nothing)."""
    if result.status != CHANGED:
        _unrewritten(result, "the rewrite leaves the text as it is")
    return result


def _parse_for_analysis(text: str, path: str) -> tuple[ast.Module, str, dict[str, str]] | str:
    """``(tree, text, masks)`` for the ``ast`` stages, or the error message. Syntax newer than the
    host's Python that libcst reads is masked (:mod:`~flashport.rewriter.source.newsyntax`)."""
    try:
        return ast.parse(text, filename=path), text, {}
    except SyntaxError as err:
        masked = newsyntax.mask(text)
        if masked is None:  # libcst cannot read it either: a real syntax error
            return f"syntax error at line {err.lineno}: {err.msg}"
        text, masks = masked
        try:
            return ast.parse(text, filename=path), text, masks
        except SyntaxError as newer:
            host = ".".join(map(str, sys.version_info[:2]))
            return (
                f"line {newer.lineno} uses Python syntax newer than this host's Python {host} "
                f"can analyse ({newer.msg}); run flashport under a newer Python for this file"
            )
    except (ValueError, RecursionError, MemoryError) as err:
        return f"cannot parse: {err}"


def _error(result: FileResult, message: str) -> FileResult:
    """``result`` as a file left unchanged for ``message``: none of its sites counts as rewritten."""
    result.status = ERROR
    result.error = message
    result.old = result.new = None
    _unrewritten(result, message)
    return result


def _unrewritten(result: FileResult, why: str) -> None:
    """Report the sites of ``result`` that were to be rewritten as refused, for ``why``."""
    result.sites = [
        dataclasses.replace(site, status=REFUSED, reason=why, notes=()) if site.status == REWRITE else site
        for site in result.sites
    ]


@dataclasses.dataclass
class _MiniModule:
    """The chunks of one file joined under its import header (see the module docstring)."""

    header: str
    ordered: list[src.Unit]  # chunk units in mini-module order
    source: str
    line_map: list[tuple[int, int, int]]  # (first, last mini-module line, first file line)
    header_units: list[src.Unit] = dataclasses.field(default_factory=list)
    wrappers: list[str] = dataclasses.field(default_factory=list)  # stand-in class names
    pieces: list[str] = dataclasses.field(default_factory=list)  # independent top-level parts of source

    def names(self, tree: ast.Module, rules: Iterable[Rule]) -> semantic.HeaderNames:
        """The file's model's :class:`~flashport.rewriter.source.semantic.HeaderNames` for this mini
        module (``tree``: the file's)."""
        header = [node for unit in self.header_units for node in unit.nodes]
        sources = [s for rule in rules for s in rule.SOURCES]
        chunks = [node for unit in self.ordered for node in unit.nodes]
        return semantic.of(tree).header_names(header, self.wrappers, sources, chunks)


@dataclasses.dataclass(frozen=True)
class _Parsed:
    """One file as read and parsed: its bytes, their text (masked where syntax newer than the
    host's Python was, :mod:`~flashport.rewriter.source.newsyntax`), its encoding, the ``ast`` of
    the text and the masks to restore."""

    data: bytes
    text: str
    encoding: str
    tree: ast.Module
    masks: dict[str, str]


def _transform(
    result: FileResult,
    parsed: _Parsed,
    rules: list[Rule],
    options: RuleOptions,
    skip: dict[int, frozenset[str]] | None = None,
    reference: bool = False,
) -> FileResult:
    """Steps 3 to 5 of the module docstring over one parsed file; ``result`` filled in."""
    data, text, encoding, tree, masks = parsed.data, parsed.text, parsed.encoding, parsed.tree, parsed.masks
    lines = src.split_lines(text)
    units = src.top_level_units(tree)
    header_units = [u for u in units if u.importish]
    table = suppress.parse(lines)
    for line, codes in (skip or {}).items():
        table[line] = table.get(line, frozenset()) | frozenset(codes)
    newline = src.newline_of(lines)
    text_pattern, attributes = _site_pattern(tree, units, header_units, rules)
    every, chunk_ids = _select_chunks(units, lines, text_pattern)
    chunks = every if reference else _pruned(every, tree, rules, attributes)
    if not chunks:
        return result
    mini = _mini_module(lines, header_units, chunks, chunk_ids, newline)
    if reference:
        ported = _port(_FilePass(result, lines, tree, options, table, None, reference=True), mini, rules)
    else:
        file = _FilePass(result, lines, tree, options, table, _relevant_pattern(tree, text_pattern, rules))
        ported = _thin_pass(file, mini, rules, attributes)
        if ported is None:  # rules afresh: a given-up pass leaves no state in them
            rules = [type(rule)() for rule in rules]
            ported = _port(file, mini, rules, watch_module=len(chunks) < len(every))
        if ported is None:  # a rule read the module, which pruning left incomplete: every chunk
            rules = [type(rule)() for rule in rules]
            ported = _port(file, _mini_module(lines, header_units, every, chunk_ids, newline), rules)
    if ported is None:
        raise RuntimeError("the pass over every chunk was given up")  # only a watched one can be
    transformer, replacements = ported
    result.sites.extend(transformer.sites)
    result.sites.sort(key=lambda s: (s.line, s.column, s.rule))
    result.sites = cuda_notes.annotate(result.sites, tree, lines)
    if not replacements:
        return result
    gpu_modules = tuple(sorted({m for r in rules for m in r.GPU_MODULES}))
    edits = _fix_imports(
        result,
        _splice(lines, replacements),
        _reparsed(tree, lines, replacements, reference),
        tree,
        gpu_modules,
        transformer.imports,
        newline,
        options.flash_attn_version,
        reference,
    )
    new_text = edits.text
    try:
        check_compiles(new_text, result.path, edits.starts)  # the guarantee: output compiles
    except SyntaxError as err:
        return _error(
            result, f"the port does not compile (line {err.lineno}: {err.msg}); file left unchanged"
        )
    if masks:
        try:
            new_text = newsyntax.unmask(new_text, masks)
        except ValueError as err:
            return _error(result, f"{err}; file left unchanged")
        cst.parse_module(new_text)  # the restored text must still parse (libcst's grammar)
    if options.format_rewrites:
        new_text = formatting.format_changed(result.path, src.decode(data)[0], new_text)
    new_data = src.encode(new_text, encoding)
    if new_data != data:
        result.status = CHANGED
        result.old = data
        result.new = new_data
    return result


# Top-level statements compiled together by check_compiles: CPython's compiler takes time
# quadratic in the number of alike class bodies in one code object (a 160k-line file of small
# classes: minutes), and statements compiled in groups of this size cost the same in total.
_COMPILE_GROUP = 256


def check_compiles(text: str, path: str, starts: Sequence[int] | None = None) -> None:
    """Raise ``SyntaxError`` (or ``ValueError``) when ``text`` does not compile as a module.

    Its lines are compiled in groups of :data:`_COMPILE_GROUP` top-level statements (time linear in
    the file's size), cut at ``starts``, the first line of each top-level statement (from a parse
    when not given; a wrong cut can only make a group fail). Each group after the first is
    compiled after a ``pass`` line, so a ``from __future__`` import that does not lead the file is
    still an error; the error's line numbers are the file's.
    """
    if starts is None:
        starts = [src.first_line(n) for n in ast.parse(text, filename=path).body]
    lines = src.split_lines(text)
    cuts = [1, *starts[_COMPILE_GROUP::_COMPILE_GROUP], len(lines) + 1]
    for first, end in itertools.pairwise(cuts):
        lead = "" if first == 1 else "pass\n"
        try:
            compile(lead + "".join(lines[first - 1 : end - 1]), path, "exec", dont_inherit=True)
        except SyntaxError as err:
            shift = first - 1 - len(lead.splitlines())
            err.lineno = err.lineno + shift if err.lineno else err.lineno
            err.end_lineno = err.end_lineno + shift if err.end_lineno else err.end_lineno
            raise


def _splice(lines: list[str], replacements: list[tuple[int, int, str]]) -> str:
    """``lines`` joined, with each (disjoint) ``(first, last line, text)`` put in place of its
    lines: in one pass (a slice assignment per statement moves the rest of the file each time)."""
    out: list[str] = []
    at = 0
    for start, end, text in sorted(replacements):
        out.extend(lines[at : start - 1])
        out.append(text)
        at = end
    out.extend(lines[at:])
    return "".join(out)


def _site_pattern(
    tree: ast.Module, units: list[src.Unit], header_units: list[src.Unit], rules: list[Rule]
) -> tuple[re.Pattern[str], frozenset[str]]:
    """The text a unit holding a site mentions (triggers and module-level aliases), and the
    attribute names assigned a trigger name anywhere."""
    text_pattern = re.compile(
        "|".join(re.escape(t.decode("utf-8")) for r in rules for t in r.TRIGGERS) or "(?!x)x"
    )
    aliases = _aliases(tree, header_units, text_pattern) | _value_aliases(tree, units, text_pattern)
    attributes = _attribute_aliases(
        tree, text_pattern
    )  # self.fn = flash_attn_func: calls self.fn(...) are reported
    aliases |= attributes
    if aliases:  # `from flash_attn import flash_attn_func as fa`: a later `fa(...)` has no trigger text
        text_pattern = re.compile(
            text_pattern.pattern + "|" + r"\b(?:" + "|".join(map(re.escape, sorted(aliases))) + r")\b"
        )
    return text_pattern, attributes


def _select_chunks(
    units: list[src.Unit], lines: list[str], text_pattern: re.Pattern[str]
) -> tuple[list[src.Unit], set[int]]:
    """The units that mention a site name (:func:`_chunks`) and their ids (the header leaves them
    out, pruned or not)."""
    chunks = list(_chunks(units, lines, text_pattern))
    return chunks, {id(c.parent or c) for c in chunks}


def _pruned(
    chunks: list[src.Unit], tree: ast.Module, rules: list[Rule], attributes: frozenset[str]
) -> list[src.Unit]:
    """The ``chunks`` that :func:`~flashport.rewriter.engine.prune.keep` keeps."""
    flags = prune.keep([c.nodes for c in chunks], tree, _watch(rules, attributes))
    return [c for c, kept in zip(chunks, flags, strict=False) if kept]


def _watch(rules: list[Rule], attributes: frozenset[str]) -> prune.Watch:
    """What the rules can match (:func:`~flashport.rewriter.engine.prune.watch_of`), with the attribute
    names assigned a trigger name anywhere (``self.fn = flash_attn_func``)."""
    watch = prune.watch_of(rules)
    return dataclasses.replace(watch, lasts=watch.lasts | attributes) if attributes else watch


def _mini_module(
    lines: list[str],
    header_units: list[src.Unit],
    chunks: list[src.Unit],
    chunk_ids: set[int],
    newline: str,
    thinning: tuple[re.Pattern[str], Callable[[Sequence[ast.AST]], bool]] | None = None,
) -> _MiniModule:
    """Header imports, then each chunk after a sentinel comment (class members inside a stand-in
    class), with the map from mini-module lines back to file lines. ``thinning``: (relevant
    pattern, site test) to thin the function chunks with
    (:func:`~flashport.rewriter.engine.thin.thin_text`; same lines)."""
    in_header = [h for h in header_units if id(h) not in chunk_ids]
    header = "".join(_terminated(src.unit_text(lines, h)) for h in in_header)
    pieces: list[list[str]] = [[header]]  # a top-level chunk, or a stand-in class with its members
    line_map = []
    mini_line = len(src.split_lines(header))
    wrapper_of: dict[int, int] = {}
    ordered = [c for c in chunks if c.parent is None] + [c for c in chunks if c.parent is not None]
    for index, unit in enumerate(ordered):
        if unit.parent is None:
            pieces.append([])
        elif id(unit.parent) not in wrapper_of:
            wrapper_of[id(unit.parent)] = len(wrapper_of)
            pieces.append([f"class _flashport_chunk_{wrapper_of[id(unit.parent)]}_:{newline}"])
            mini_line += 1
        pieces[-1].append(f"# flashport-chunk-{index}{newline}")
        mini_line += 1
        if thinning is not None:
            body = _terminated(thin.thin_text(lines, unit.start, unit.end, unit.nodes, *thinning))
        else:
            body = _terminated(src.unit_text(lines, unit))
        count = len(src.split_lines(body))
        line_map.append((mini_line + 1, mini_line + count, unit.start))
        pieces[-1].append(body)
        mini_line += count
    wrappers = [f"_flashport_chunk_{i}_" for i in range(len(wrapper_of))]
    texts = ["".join(piece) for piece in pieces]
    return _MiniModule(header, ordered, "".join(texts), line_map, in_header, wrappers, texts)


def _relevant_pattern(tree: ast.Module, text_pattern: re.Pattern[str], rules: list[Rule]) -> re.Pattern[str]:
    """What a statement holding a site must mention: ``text_pattern``, watched strings, and every
    name bound, at any depth, by an import or an assignment of something ``text_pattern`` matches
    (``from flash_attn import flash_attn_func as fa``, ``fn = flash_attn_func``: calls through
    them carry no trigger text). The libcst pass skips statements that mention none of these."""
    model = semantic.of(tree)
    names = {b.name for b in model.imports if text_pattern.search(b.imported)}
    # what SiteTransformer.visit_Assign tracks: `x = <name>`, `o.x = <name>`
    bound = re.compile(r"\b(?:" + "|".join(map(re.escape, sorted(names))) + r")\b") if names else None
    for assignment in model.assignments():
        if text_pattern.search(assignment.value) or (bound is not None and bound.search(assignment.value)):
            names.update(assignment.names)
            names.update(assignment.attributes)
    names.discard("*")
    parts = [text_pattern.pattern] + [re.escape(v) for r in rules for v in r.STRINGS]
    if names:
        parts.append(r"\b(?:" + "|".join(map(re.escape, sorted(names))) + r")\b")
    return re.compile("|".join(parts))


# A first pass over thin chunks (rewriter/engine/thin.py) when they are at most this share of the whole
# chunks' text: it is given up (and the whole chunks parsed) on about half of the files, so it
# pays only where the placeholders leave out most of the text.
_THIN_ENOUGH = 0.5
_SPACE = re.compile(r"\s+")


def _weight(text: str) -> int:
    """What libcst's parse of ``text`` costs, roughly: its characters other than whitespace."""
    return len(text) - sum(len(m) for m in _SPACE.findall(text))


@dataclasses.dataclass(frozen=True)
class _FilePass:
    """What every pass over one file's mini module shares: the file's result, its lines and tree, the
    rule options, the suppression-comment table, the pattern of relevant text (None in the reference
    mode) and whether it is the reference mode (module docstring)."""

    result: FileResult
    lines: list[str]
    tree: ast.Module
    options: RuleOptions
    table: dict[int, frozenset[str]]
    relevant: re.Pattern[str] | None
    reference: bool = False


def _thin_pass(
    file: _FilePass, mini: _MiniModule, rules: list[Rule], attributes: frozenset[str]
) -> tuple[SiteTransformer, list[tuple[int, int, str]]] | None:
    """:func:`_port` over the thin chunks of ``mini`` (rewriter/engine/thin.py) when they leave out
    enough of its text; None when not tried or given up."""
    if file.relevant is None:
        return None
    watch = _watch(rules, attributes)
    may_hold = functools.partial(
        prune.may_hold_site, watch=watch, aliases=prune.import_aliases(file.tree, watch)
    )
    lines = file.lines
    newline = src.newline_of(lines)  # the same header and chunks in the same order, thinned
    thinned = _mini_module(lines, mini.header_units, mini.ordered, set(), newline, (file.relevant, may_hold))
    if _weight(thinned.source) > _THIN_ENOUGH * _weight(mini.source):
        return None
    return _port(file, thinned, rules, watch=True)


def _port(
    file: _FilePass,
    mini: _MiniModule,
    rules: list[Rule],
    watch: bool = False,
    watch_module: bool = False,
) -> tuple[SiteTransformer, list[tuple[int, int, str]]] | None:
    """The transformer of :func:`_run_rules` and the ``(first, last line, text)`` replacements
    of the statements it changed. ``watch``: ``mini`` holds thin chunks; None when that pass may
    have seen a placeholder (a rule read above a site's statement or the module, the scope
    analysis ran, or a change cannot be placed statement by statement). ``watch_module``: ``mini``
    holds pruned chunks; None when a rule read the module."""
    try:
        transformer, new_module, spans, beyond = _run_rules(file, mini, rules, watch, watch_module)
    except thin.Abandoned:
        return None
    if watch and (beyond or spans is None or spans.failed or transformer.whole):
        return None
    if not transformer.rewrites:
        return transformer, []
    spliced = None if spans is None else _spliced(transformer, spans, mini, file.lines)
    if spliced is not None:
        return transformer, spliced
    if watch:
        return None
    return transformer, _replacements(new_module.code, mini, file.lines)  # render it all


def _run_rules(
    file: _FilePass, mini: _MiniModule, rules: list[Rule], watch: bool, watch_module: bool
) -> tuple[SiteTransformer, cst.Module, StatementSpans | None, bool]:
    """The libcst pass over the mini module, then the per-file phase: each rule's ``settle`` sees
    every site's final status and may veto its rewrites, and a rewrite whose required calls
    (``Rewrite.requires``) did not all end rewritten is vetoed; the pass is redone with the vetoes
    (reusing the parse and the metadata) until none is added. Returns the transformer, the new
    module, the statement spans (positions are rendered per statement,
    :mod:`~flashport.rewriter.source.spans`; None in the reference mode) and, with ``watch`` (thin chunks),
    whether a pass read beyond the sites' statements."""
    tree, reference = file.tree, file.reference
    module = cst.parse_module(mini.source) if reference else mini_parse.parse(mini.pieces)
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    if reference:  # libcst's own analyses only
        names, spans = None, None
        positions = {
            node: ((r.start.line, r.start.column), (r.end.line, r.end.column))
            for node, r in wrapper.resolve(PositionProvider).items()
        }
    else:
        names = mini.names(tree, rules)
        spans = StatementSpans(module, src.split_lines(mini.source), mini.ordered, mini.line_map)
        positions = None
    context = MiniFile(
        file.result.path,
        module,
        mini.line_map,
        file.table,
        tree,
        source=mini.source,
        relevant=file.relevant,
        wrapper=wrapper,
        names=names,
        positions=positions,
        spans=spans,
    )
    mode = PassMode(watch_reads=watch, watch_module=watch_module)
    transformer = SiteTransformer(rules, file.options, context, mode)
    new_module = module.visit(transformer)
    beyond = transformer.read_beyond or transformer.used_scopes
    whole_file = RuleContext.for_file(file.result.path, file.options, tree)
    vetoes: dict[str, str] = {}
    site_vetoes: dict[tuple[str, int, int], str] = {}
    while True:  # vetoes only grow, so this ends (at most one pass more per rule and per site)
        more = {
            r.CODE: why
            for r in rules
            if r.CODE not in vetoes and (why := r.settle(transformer.sites, whole_file))
        }
        more_sites = {key: why for key, why in transformer.unmet().items() if key not in site_vetoes}
        if not more and not more_sites:
            return transformer, new_module, spans, beyond
        vetoes.update(more)
        site_vetoes.update(more_sites)
        mode = dataclasses.replace(mode, vetoes=dict(vetoes), site_vetoes=dict(site_vetoes))
        transformer = SiteTransformer(rules, file.options, context, mode)
        new_module = module.visit(transformer)
        beyond = beyond or transformer.read_beyond or transformer.used_scopes


def _spliced(
    transformer: SiteTransformer, spans: StatementSpans, mini: _MiniModule, lines: list[str]
) -> list[tuple[int, int, str]] | None:
    """(first line, last line, new text) for every statement the pass changed, each rendered
    alone (:meth:`~flashport.rewriter.source.spans.StatementSpans.replacement`); None when one cannot be
    (then :func:`_replacements` renders the whole mini module)."""
    if transformer.whole or spans.failed:
        return None
    firsts = [first for first, _, _ in mini.line_map]
    out = []
    for original, updated, indent in transformer.changed:
        found = spans.replacement(original, updated, indent)
        if found is None:
            return None
        first, last, text = found
        index = bisect.bisect_right(firsts, first) - 1
        if index < 0 or last > mini.line_map[index][1]:
            return None
        shift = mini.line_map[index][2] - mini.line_map[index][0]
        start, end = first + shift, last + shift
        if not lines[end - 1].endswith(("\n", "\r")) and text.endswith("\n"):
            text = text[:-1]  # _terminated() added it
        if text != "".join(lines[start - 1 : end]):
            out.append((start, end, text))
    return out


def _replacements(new_code: str, mini: _MiniModule, lines: list[str]) -> list[tuple[int, int, str]]:
    """(first line, last line, new text) for every chunk the pass changed."""
    if not new_code.startswith(mini.header):
        raise RuntimeError("rewrite touched the import header")
    replacements = []
    pieces = _split_chunks(new_code[len(mini.header) :], len(mini.ordered))
    for unit, new_chunk in zip(mini.ordered, pieces, strict=False):
        chunk = src.unit_text(lines, unit)
        if not chunk.endswith(("\n", "\r")) and new_chunk.endswith("\n"):
            new_chunk = new_chunk[:-1]  # _terminated() added it
        if new_chunk != chunk:
            replacements.append((unit.start, unit.end, new_chunk))
    return replacements


def _reparsed(
    tree: ast.Module, lines: list[str], replacements: list[tuple[int, int, str]], reference: bool
) -> Callable[[str], ast.Module]:
    """A function parsing the text that ``replacements`` make of ``lines`` (``tree``'s source):
    only the statements they touch, or the whole text in the reference mode. Call it once the
    original tree is no longer needed (it moves the original's untouched statements)."""
    if reference:
        return ast.parse
    edits = reparse.line_edits(replacements)
    return lambda new_text: reparse.reparse(tree, len(lines), new_text, edits)


def _fix_imports(
    result: FileResult,
    new_text: str,
    parse: Callable[[str], ast.Module],
    tree: ast.Module,
    gpu_modules: tuple[str, ...],
    needed: Iterable[str],
    newline: str,
    version: tuple[int, ...],
    reference: bool,
) -> import_edits.ImportEdits:
    """Drop GPU imports a rewrite made unused, add the imports rewrites need, and say why each GPU
    import left in place stays (``result.imports_kept``); the edits of
    :func:`~flashport.rewriter.imports.edits.edit_imports`. ``tree``: the original file's;
    ``parse(new_text)`` gives the rewritten file's."""
    before = import_edits.name_uses(tree, gpu_modules)
    edits = import_edits.edit_imports(
        new_text, parse(new_text), before, gpu_modules, needed, newline, version, whole_parse=reference
    )
    result.imports_added.extend(edits.added)
    result.imports_removed = edits.removed
    result.imports_kept = edits.kept
    return edits


def _aliases(tree: ast.Module, header_units: Iterable[src.Unit], pattern: re.Pattern[str]) -> set[str]:
    """Names bound by module-level imports of trigger names (``... import x as alias``)."""
    header = {id(stmt) for unit in header_units for stmt in unit.nodes}
    names = {b.name for b in semantic.of(tree).imports if id(b.top) in header and pattern.search(b.imported)}
    names.discard("*")
    return names


def _value_aliases(tree: ast.Module, units: Iterable[src.Unit], pattern: re.Pattern[str]) -> set[str]:
    """Names bound at module level by ``name = <trigger name>`` (``attn = flash_attn_func``): calls
    through them (rewriter/source/aliases.py) sit in statements without trigger text."""
    statements = (stmt for unit in units for stmt in unit.nodes)
    return {name for name, value in semantic.of(tree).value_aliases(statements) if pattern.search(value)}


def _attribute_aliases(tree: ast.Module, pattern: re.Pattern[str]) -> frozenset[str]:
    """Attribute names assigned a trigger name anywhere (``self.fn = flash_attn_func``)."""
    return frozenset(
        name for a in semantic.of(tree).assignments() if pattern.search(a.value) for name in a.attributes
    )


_SENTINEL = re.compile(r"^(?:class _flashport_chunk_\d+_:|# flashport-chunk-(\d+))(?:\r\n|\r|\n)", re.M)


def _split_chunks(code: str, count: int) -> list[str]:
    """Cut the rewritten mini-module body back into chunk texts at the sentinel comments."""
    marks = list(_SENTINEL.finditer(code))
    pieces: dict[int, str] = {}
    for i, mark in enumerate(marks):
        if mark.group(1) is None:
            continue
        end = marks[i + 1].start() if i + 1 < len(marks) else len(code)
        pieces[int(mark.group(1))] = code[mark.end() : end]
    if sorted(pieces) != list(range(count)):
        raise RuntimeError("chunk sentinels lost in the rewrite")
    return [pieces[i] for i in range(count)]


def _chunks(units: Iterable[src.Unit], lines: list[str], pattern: re.Pattern[str]) -> Iterator[src.Unit]:
    """Units to parse: statements mentioning a trigger, descending one level into top-level
    classes (methods are parsed alone, which is what keeps big model files cheap). Plain import
    statements are header only."""
    for unit in units:
        if not pattern.search(src.unit_text(lines, unit)):
            continue
        if unit.importish and all(semantic.is_import(n) for n in unit.nodes):
            continue
        inner = src.class_body_units(unit)
        if inner:
            head = src.Unit(unit.start, inner[0].start - 1, unit.nodes, False)
            if inner[0].start > unit.start and not pattern.search(src.unit_text(lines, head)):
                yield from (
                    dataclasses.replace(u, parent=unit)
                    for u in inner
                    if pattern.search(src.unit_text(lines, u))
                )
                continue
        yield unit


def _terminated(chunk: str) -> str:
    """``chunk`` ending with a newline (a file's last line may lack one)."""
    return chunk if chunk.endswith(("\n", "\r")) else chunk + "\n"
