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
import types

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from ported_code import reference_torch_attention
from torch_semantics_reference import flash_attn_ref, sdpa_ref

import flashport.torch
from flashport import rules as registry
from flashport.rewriter.engine.pipeline import transform_source
from flashport.rewriter.engine.results import CHANGED, REWRITE, UNCHANGED
from flashport.rules.base import RuleOptions

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "codemod"
QUICK = dict(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
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


def compose(
    texts: list[tuple[str | None, str]],
    shapes: list[str],
    star_from: int | None = None,
    double_star: bool = False,
    separators: list[str] | None = None,
) -> str:
    """An argument list for ``texts`` (``(keyword or None, value text)``; keyword ``"*"``/``"**"``
    for starred ones): value ``i`` in ``SHAPES[shapes[i]]``, the positional values from
    ``star_from`` on packed into ``*(...)``, the keywords into ``**{...}`` with ``double_star``,
    and ``separators[i]`` before part ``i + 1`` (default ``", "``)."""
    shaped = [
        (keyword, SHAPES[shape].format(x=value, n=n))
        for n, ((keyword, value), shape) in enumerate(zip(texts, shapes, strict=True))
    ]
    plain = [v for k, v in shaped if k is None]
    named = [(k, v) for k, v in shaped if k is not None]
    parts = plain if star_from is None else plain[:star_from] + ["*(" + ", ".join(plain[star_from:]) + ",)"]
    parts = parts + [f"*{v}" for k, v in named if k == "*"] + [f"**{v}" for k, v in named if k == "**"]
    keywords = [(k, v) for k, v in named if k not in ("*", "**")]
    if double_star and keywords:
        parts.append("**{" + ", ".join(f'"{k}": {v}' for k, v in keywords) + "}")
    else:
        parts += [f"{k}={v}" for k, v in keywords]
    separators = separators or []
    return "".join(
        part if i == 0 else (separators[i - 1] if i - 1 < len(separators) else ", ") + part
        for i, part in enumerate(parts)
    )


@st.composite
def arguments(draw, texts: list[tuple[str | None, str]]) -> str:
    """:func:`compose` with shapes (one for all, or one each), packing and separators drawn."""
    everywhere = draw(st.sampled_from([None, *sorted(SHAPES)]))
    shapes = [everywhere or draw(st.sampled_from(sorted(SHAPES))) for _ in texts]
    positional = sum(1 for keyword, _ in texts if keyword is None)
    star_from = draw(st.none() | st.integers(0, positional - 1)) if positional else None
    separators = draw(st.lists(st.sampled_from(SEPARATORS), max_size=len(texts)))
    return compose(texts, shapes, star_from, draw(st.booleans()), separators)


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


def with_arguments(seed: Seed, args: str) -> str:
    """The fixture of ``seed`` with its call's arguments replaced by ``args``."""
    call = _call_at(seed.source, seed.line, seed.column)
    lines = seed.source.splitlines(keepends=True)
    start = sum(len(line) for line in lines[: call.lineno - 1]) + call.col_offset
    end = sum(len(line) for line in lines[: (call.end_lineno or call.lineno) - 1]) + (
        call.end_col_offset or 0
    )
    return seed.source[:start] + f"{_text(seed.source, call.func)}({args})" + seed.source[end:]


def seed_texts(seed: Seed) -> list[tuple[str | None, str]]:
    """The arguments of the call of ``seed`` (see :func:`compose`)."""
    return _argument_texts(seed.source, _call_at(seed.source, seed.line, seed.column))


@functools.cache
def richest() -> dict[str, Seed]:
    """Per rule, its call with the most arguments (the first one of the fixtures' order)."""
    best: dict[str, Seed] = {}
    for seed in seeds():
        if seed.rule not in best or len(seed_texts(seed)) > len(seed_texts(best[seed.rule])):
            best[seed.rule] = seed
    return best


@st.composite
def fixture_variants(draw) -> str:
    """A fixture whose one reported call has new argument shapes."""
    rule = draw(st.sampled_from(sorted({seed.rule for seed in seeds()})))  # every rule alike
    seed = draw(st.sampled_from([seed for seed in seeds() if seed.rule == rule]))
    return with_arguments(seed, draw(arguments(seed_texts(seed))))


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


def _check_variant(source: str) -> None:
    if _compiles(source):  # a walrus in a class body's comprehension is not Python, for one
        check_port(source)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_rule_with_every_argument_in_one_shape(shape):
    for seed in richest().values():
        texts = seed_texts(seed)
        _check_variant(with_arguments(seed, compose(texts, [shape] * len(texts))))


@given(fixture_variants())
@settings(**QUICK)
def test_call_sites_of_every_rule_in_mixed_shapes(source):
    assume(_compiles(source))
    check_port(source)


@pytest.mark.slow
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_call_of_the_fixtures_with_every_argument_in_one_shape(shape):
    for seed in seeds():
        texts = seed_texts(seed)
        _check_variant(with_arguments(seed, compose(texts, [shape] * len(texts))))
        positional = sum(1 for keyword, _ in texts if keyword is None)
        packed = compose(texts, [shape] * len(texts), 0 if positional else None, True, list(SEPARATORS) * 9)
        _check_variant(with_arguments(seed, packed))


@pytest.mark.slow
@given(fixture_variants())
@settings(**THOROUGH)
def test_call_sites_of_every_rule_in_mixed_shapes_thorough(source):
    assume(_compiles(source))
    check_port(source)


# ---------------------------------------------------------------- the port computes what the original did


def _flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attn 2.x ``flash_attn_func``, its signature over the float64 stand-in."""
    assert dropout_p == 0 and alibi_slopes is None and not return_attn_probs
    return flash_attn_ref(
        q, k, v, causal=causal, window_size=tuple(window_size), softmax_scale=softmax_scale, softcap=softcap
    )


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """torch's ``scaled_dot_product_attention``, its signature over the float64 stand-in."""
    assert dropout_p == 0
    return sdpa_ref(query, key, value, attn_mask, is_causal, scale, enable_gqa)


PROGRAM = """\
import torch.nn.functional as F
from flash_attn import flash_attn_func

_fz_flag = True


def _fz_id(x):
    return x


def run(q, k, v, mask):
    return {call}
"""

# Per API: (callee, positional parameters after q/k/v in signature order, and the values each takes).
APIS = {
    "flash_attn_func": (
        "flash_attn_func",
        [
            ("dropout_p", ["0.0"]),
            ("softmax_scale", ["None", "0.3"]),
            ("causal", ["True", "False"]),
            ("window_size", ["(-1, -1)", "(2, 0)", "(1, 2)", "[3, -1]", "(-1, 1)"]),
            ("softcap", ["0.0", "5.0"]),
            ("alibi_slopes", ["None"]),
            ("deterministic", ["False", "True"]),
        ],
    ),
    "sdpa": (
        "F.scaled_dot_product_attention",
        [
            ("attn_mask", ["None", "mask", "mask.logical_not()"]),
            ("dropout_p", ["0.0"]),
            ("is_causal", ["False", "True"]),
            ("scale", ["None", "0.3"]),
        ],
    ),
}


@st.composite
def api_calls(draw, api: str) -> str:
    """A call of ``api`` with drawn values, some passed by position (in signature order), the
    rest by keyword, each in drawn shapes (:func:`compose`)."""
    callee, parameters = APIS[api]
    chosen = [(name, draw(st.none() | st.sampled_from(values))) for name, values in parameters]
    if api == "sdpa" and dict(chosen).get("attn_mask") not in (None, "None"):
        chosen = [
            (n, "False" if n == "is_causal" and v is not None else v) for n, v in chosen
        ]  # torch: not both
    leading = next((i for i, (_, value) in enumerate(chosen) if value is None), len(chosen))
    by_position = draw(st.integers(0, leading))
    texts: list[tuple[str | None, str]] = [(None, "q"), (None, "k"), (None, "v")]
    texts += [(None, value) for _, value in chosen[:by_position]]
    texts += [(name, value) for name, value in chosen[by_position:] if value is not None]
    args = draw(arguments(texts))
    return f"{callee}({args})"


def _inputs(api: str):
    gen = torch.Generator().manual_seed(0)
    if api == "sdpa":  # BHSD
        q, k, v = (torch.randn(1, 2, n, 8, generator=gen, dtype=torch.float64) for n in (5, 6, 6))
    else:  # BSHD, grouped query heads
        q = torch.randn(1, 5, 4, 8, generator=gen, dtype=torch.float64)
        k, v = (torch.randn(1, 6, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = torch.rand(5, 6, generator=gen) > 0.3
    return q, k, v, mask


def check_semantics(api: str, call: str) -> None:
    """Port :data:`PROGRAM` around ``call`` (the general properties: :func:`check_port`); where the
    call was rewritten, run the original on the stand-ins and the port on the contract's float64
    reference and compare."""
    source = PROGRAM.format(call=call)
    if not _compiles(source):
        return
    result = check_port(source)
    (site,) = [s for s in result.sites if s.kind == "call"]
    if site.status != REWRITE:
        return
    original: dict = {
        "F": types.SimpleNamespace(scaled_dot_product_attention=_sdpa),
        "flash_attn_func": _flash_attn_func,
    }
    body = "".join(
        line for line in source.splitlines(keepends=True) if not line.startswith(("import", "from"))
    )
    exec(compile(body, "original.py", "exec"), original)
    ported: dict = {}
    exec(compile(result.new, "ported.py", "exec"), ported)
    inputs = _inputs(api)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(flashport.torch, "attention", reference_torch_attention)
        got = ported["run"](*inputs)
    want = original["run"](*inputs)
    np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=1e-9, err_msg=result.new.decode())


@pytest.mark.parametrize("api", sorted(APIS))
@given(data=st.data())
@settings(**QUICK)
def test_ported_calls_compute_what_the_original_did(api, data):
    check_semantics(api, data.draw(api_calls(api)))


@pytest.mark.slow
@pytest.mark.parametrize("api", sorted(APIS))
@given(data=st.data())
@settings(**THOROUGH)
def test_ported_calls_compute_what_the_original_did_thorough(api, data):
    check_semantics(api, data.draw(api_calls(api)))
