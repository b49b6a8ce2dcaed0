"""A property-based fuzzer of the codemod: call sites of every rule, their arguments given the
shapes real code uses (conditional expressions, starred and double-starred arguments, walrus,
lambdas, comprehensions, f-strings, nested calls, comments and line breaks inside the call).

Properties, for every composed file that compiles:

* the engine does not fail on it, and its output compiles;
* what it reports per site is what happened to the file: a file left unchanged reports no rewrite,
  a changed one at least one, and a call reported as kept is in the output as it was written;
* a second run changes nothing;
* (flash-attn ``flash_attn_func`` and torch SDPA) the ported call computes what the original did:
  the original runs on float64 stand-ins of the GPU libraries
  (``tests/torch_semantics_reference.py``, torch's own SDPA in float64), the port with
  ``flashport.torch.attention`` standing on the contract's float64 reference
  (:func:`ported_code.reference_torch_attention`), drop-ins included.

The default tier runs a fixed, small budget (derandomized); the slow tier a larger one.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import pathlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from ported_code import reference_torch_attention
from torch_semantics_reference import flash_attn_ref

import flashport.torch
from flashport import rules as registry
from flashport.rewriter.engine import transform_source
from flashport.rewriter.results import CHANGED, REWRITE, UNCHANGED
from flashport.rules.base import RuleOptions

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "codemod"
QUICK = dict(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
THOROUGH = dict(max_examples=600, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))

# Shapes an argument value ``x`` takes in real code; each keeps the value (``_fz_flag`` is true,
# ``_fz_id`` returns its argument where the code runs).
SHAPES = {
    "as_is": "{x}",
    "parenthesized": "({x})",
    "conditional": "{x} if _fz_flag else {x}",
    "conditional_parenthesized": "({x} if _fz_flag else {x})",
    "walrus": "(_fz_{n} := {x})",
    "lambda": "(lambda: {x})()",
    "comprehension": "[{x} for _fz in (0,)][0]",
    "f_string_test": '({x} if f"{{_fz_flag}}" else {x})',
    "nested_call": "_fz_id({x})",
    "comment_and_breaks": "(  # fz: why this value\n        {x}\n    )",
}
SEPARATORS = (", ", ",\n        ", ",  # fz: note\n        ")


def _text(source: str, node: ast.AST) -> str:
    segment = ast.get_source_segment(source, node)
    assert segment is not None
    return segment


@dataclasses.dataclass(frozen=True)
class Seed:
    """A fixture file and the position of one call in it that a rule reports."""

    path: str
    source: str
    line: int
    column: int
    rule: str


@functools.cache
def seeds() -> tuple[Seed, ...]:
    """Every call site the rules report in the ASCII golden fixtures (every rule has some)."""
    found = []
    for path in sorted(FIXTURES.glob("*/*.py")):
        source = path.read_text()
        if not source.isascii():  # ast columns count bytes
            continue
        result = transform_source(source.encode(), str(path), registry.all_rules(), RuleOptions())
        found += [Seed(str(path), source, s.line, s.column, s.rule) for s in result.sites if s.kind == "call"]
    return tuple(found)


def _call_at(source: str, line: int, column: int) -> ast.Call:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and (node.lineno, node.col_offset) == (line, column):
            return node
    raise AssertionError(f"no call at {line}:{column}")


@st.composite
def arguments(draw, texts: list[tuple[str | None, str]], star_ok: bool = True) -> str:
    """An argument list for ``texts`` (``(keyword or None, value text)``; keyword ``"*"``/``"**"``
    for starred ones) with shapes drawn for each value, positional runs packed into ``*(...)``
    and keywords into ``**{...}`` at times, and separators with comments and line breaks."""
    parts = []
    positional = [value for keyword, value in texts if keyword is None]
    keywords = [(keyword, value) for keyword, value in texts if keyword is not None]
    everywhere = draw(st.sampled_from([None, *sorted(SHAPES)]))  # one shape for all, or one each
    shaped = []
    for n, (keyword, value) in enumerate(texts):
        shape = everywhere or draw(st.sampled_from(sorted(SHAPES)))
        shaped.append((keyword, SHAPES[shape].format(x=value, n=n)))
    pack_positional = star_ok and positional and draw(st.booleans())
    pack_keywords = star_ok and any(k not in ("*", "**") for k, _ in keywords) and draw(st.booleans())
    plain = [(k, v) for k, v in shaped if k is None]
    named = [(k, v) for k, v in shaped if k is not None]
    if pack_positional:
        cut = draw(st.integers(0, len(plain) - 1))
        packed = ", ".join(v for _, v in plain[cut:])
        parts += [v for _, v in plain[:cut]] + [f"*({packed},)"]
    else:
        parts += [v for _, v in plain]
    if pack_keywords:
        entries = [f'"{k}": {v}' for k, v in named if k not in ("*", "**")]
        parts += [f"*{v}" if k == "*" else f"**{v}" for k, v in named if k in ("*", "**")]
        parts.append("**{" + ", ".join(entries) + "}")
    else:
        parts += [f"*{v}" if k == "*" else f"**{v}" if k == "**" else f"{k}={v}" for k, v in named]
    text = ""
    for index, part in enumerate(parts):
        text += part if index == 0 else draw(st.sampled_from(SEPARATORS)) + part
    return text


def _argument_texts(source: str, call: ast.Call) -> list[tuple[str | None, str]]:
    texts: list[tuple[str | None, str]] = []
    for arg in call.args:
        if isinstance(arg, ast.Starred):
            texts.append(("*", _text(source, arg.value)))
        else:
            texts.append((None, _text(source, arg)))
    for keyword in call.keywords:
        texts.append((keyword.arg or "**", _text(source, keyword.value)))
    return texts


@st.composite
def fixture_variants(draw) -> tuple[str, str]:
    """(source, new call text) of a fixture whose one reported call has new argument shapes."""
    rule = draw(st.sampled_from(sorted({seed.rule for seed in seeds()})))  # every rule alike
    seed = draw(st.sampled_from([seed for seed in seeds() if seed.rule == rule]))
    call = _call_at(seed.source, seed.line, seed.column)
    args = draw(arguments(_argument_texts(seed.source, call)))
    new_call = f"{_text(seed.source, call.func)}({args})"
    lines = seed.source.splitlines(keepends=True)
    start = sum(len(line) for line in lines[: call.lineno - 1]) + call.col_offset
    end = sum(len(line) for line in lines[: call.end_lineno - 1]) + call.end_col_offset
    return seed.source[:start] + new_call + seed.source[end:], new_call


def _compiles(source: str) -> bool:
    try:
        compile(source, "case.py", "exec", dont_inherit=True)
    except SyntaxError:
        return False
    return True


def check_port(source: str, path: str = "case.py"):
    """Run the engine on ``source`` and check the properties every port has; returns the result."""
    result = transform_source(source.encode(), path, registry.all_rules(), RuleOptions())
    assert result.status in (CHANGED, UNCHANGED), (result.error, source)
    rewritten = [s for s in result.sites if s.status == REWRITE]
    if result.status == UNCHANGED:
        assert result.new is None and not rewritten, (rewritten, source)
        return result
    new = result.new.decode()
    compile(new, "ported.py", "exec", dont_inherit=True)
    assert rewritten, "a changed file reports no rewrite"
    lines = source.splitlines(keepends=True)
    for site in result.sites:
        if site.kind == "call" and site.status != REWRITE:
            kept = "".join(lines[site.line - 1 : site.end_line])
            call = _call_at(source, site.line, site.column)
            inside_rewrite = any(
                r.line <= site.line and site.end_line <= r.end_line and r != site for r in rewritten
            )
            if not inside_rewrite:
                assert _text(source, call) in new, (site, kept, new)
    again = transform_source(result.new, path, registry.all_rules(), RuleOptions())
    assert again.status == UNCHANGED and again.new is None, (again.error, new)
    return result


@given(fixture_variants())
@settings(**QUICK)
def test_call_sites_of_every_rule_in_every_shape(case):
    source, _ = case
    assume(_compiles(source))  # not every composition is Python (a walrus in a class body's comprehension)
    check_port(source)


@pytest.mark.slow
@given(fixture_variants())
@settings(**THOROUGH)
def test_call_sites_of_every_rule_in_every_shape_thorough(case):
    source, _ = case
    assume(_compiles(source))
    check_port(source)
