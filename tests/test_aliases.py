"""Calls through local aliases (``attn = flash_attn_func; attn(...)``) and value uses
(dispatch tables, ``functools.partial``, attributes): ported when they resolve to one function,
reported with the reason otherwise (:mod:`flashport.rewriter.aliases`, :mod:`flashport.rules._values`)."""

from __future__ import annotations

import textwrap

import pytest

from flashport import rules as registry
from flashport.rewriter.engine import transform_source
from flashport.rules.base import RuleOptions


def run(source: str):
    return transform_source(textwrap.dedent(source).encode(), "m.py", registry.all_rules(), RuleOptions())


def sites(result) -> list[tuple[int, str, str, str]]:
    return [(s.line, s.kind, s.status, s.reason) for s in result.sites]


def test_calls_through_a_local_alias_are_ported_like_direct_calls_and_the_alias_goes():
    via_alias = run("""
        from flash_attn import flash_attn_func

        def f(q, k, v):
            # pick the kernel
            attn = flash_attn_func
            a = attn(q, k, v, causal=True, softmax_scale=0.5)
            return a, attn(q, k, v)
    """)
    direct = run("""
        from flash_attn import flash_attn_func

        def f(q, k, v):
            # pick the kernel
            a = flash_attn_func(q, k, v, causal=True, softmax_scale=0.5)
            return a, flash_attn_func(q, k, v)
    """)
    assert via_alias.new == direct.new  # the reference: the same calls written directly
    assert "flash_attn" not in via_alias.new.decode()
    assert [s.status for s in via_alias.sites] == ["rewrite"] * 3
    assert via_alias.sites[0].notes == ("alias removed: all 2 calls through it were ported",)


def test_a_ported_alias_call_computes_what_the_original_api_computes():
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    result = run("""
        from flash_attn import flash_attn_func

        def f(q, k, v):
            attn = flash_attn_func
            return attn(q, k, v, causal=True)
    """)
    namespace: dict = {}
    exec(compile(result.new, "m.py", "exec"), namespace)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 2, 8, generator=g) for _ in range(3))
    t = lambda x: x.double().transpose(1, 2)  # noqa: E731 - float64 reference of flash-attn's causal attention
    want = F.scaled_dot_product_attention(t(q), t(k), t(v), is_causal=True).transpose(1, 2)
    assert (namespace["f"](q, k, v).double() - want).abs().max().item() < 1e-5


def test_an_alias_with_a_call_that_is_not_ported_stays_and_says_why():
    result = run("""
        from flash_attn import flash_attn_func

        def f(q, k, v, drop, table):
            attn = flash_attn_func
            table.append(attn)
            return attn(q, k, v, causal=True)
    """)
    text = result.new.decode()
    assert "    attn = flash_attn_func\n" in text and "from flash_attn import flash_attn_func" in text
    alias = next(s for s in result.sites if s.kind == "reference")
    assert alias.status == "refused" and "also used as a value" in alias.reason


@pytest.mark.parametrize(
    "binding",
    [
        "attn = flash_attn_func\n    if p:\n        attn = other",  # rebound
        "attn = flash_attn_func if p else other",  # not a plain alias
        "for attn in (flash_attn_func, other):\n        pass",  # loop target
    ],
)
def test_a_name_that_may_hold_something_else_is_not_rewritten_and_is_reported_at_the_call(binding):
    source = f"from flash_attn import flash_attn_func\n\ndef f(q, k, v, p):\n    {binding}\n    return attn(q, k, v)\n"
    result = transform_source(source.encode(), "m.py", registry.all_rules(), RuleOptions())
    assert result.new is None or b"return attn(q, k, v)" in result.new
    assert all(s.status != "rewrite" for s in result.sites)


def test_a_rebound_alias_call_is_reported_where_it_is_called():
    result = run("""
        from flash_attn import flash_attn_func

        def f(q, k, v, p):
            attn = flash_attn_func
            if p:
                attn = other
            return attn(q, k, v)
    """)
    assert result.new is None
    call = next(s for s in result.sites if s.kind == "call")
    assert call.line == 8 and call.status == "refused" and "does not resolve to one function" in call.reason


def test_scope_analysis_keeps_a_same_named_parameter_apart():
    result = run("""
        from flash_attn import flash_attn_func

        def f(q, k, v):
            attn = flash_attn_func
            return attn(q, k, v)

        def g(q, k, v, attn):
            return attn(q, k, v)
    """)
    assert "def g(q, k, v, attn):\n    return attn(q, k, v)\n" in result.new.decode()


def test_module_level_alias_calls_are_ported_and_the_alias_kept_for_importers():
    result = run("""
        from flash_attn import flash_attn_func

        attention = flash_attn_func


        def f(q, k, v):
            return attention(q, k, v, causal=True)
    """)
    text = result.new.decode()
    assert "attention = flash_attn_func\n" in text and "return flashport.torch.attention(" in text
    alias = next(s for s in result.sites if s.kind == "reference")
    assert alias.status == "refused" and "another module may import it" in alias.reason


def test_a_suppressed_alias_line_is_not_followed():
    result = run("""
        from flash_attn import flash_attn_func

        def f(q, k, v):
            attn = flash_attn_func  # flashport: ignore[FPA001]
            return attn(q, k, v)
    """)
    assert result.new is None


@pytest.mark.parametrize(
    "use, words",
    [
        ('ATTN = {"flash": flash_attn_func}', "dispatch table"),
        ("fn = functools.partial(flash_attn_func, causal=True)", "functools.partial"),
        ("self.fn = flash_attn_func", "stored in self.fn"),
        ("register(flash_attn_func)", "passed to register"),
        ("ok = inspect.signature(flash_attn_func)", "feature probe"),
    ],
)
def test_value_uses_are_reported_with_their_context(use, words):
    source = f"import functools, inspect\nfrom flash_attn import flash_attn_func\n\ndef f(self):\n    {use}\n"
    result = transform_source(source.encode(), "m.py", registry.all_rules(), RuleOptions())
    assert result.new is None
    [site] = result.sites
    assert site.kind == "reference" and site.status == "refused" and words in site.reason


def test_a_call_through_an_attribute_alias_is_reported_at_the_call():
    result = run("""
        from flash_attn import flash_attn_qkvpacked_func

        class Attention:
            def __init__(self):
                self.flash_qkv_fn = flash_attn_qkvpacked_func

            def forward(self, qkv):
                return self.flash_qkv_fn(qkv, causal=True)
    """)
    assert result.new is None
    call = next(s for s in result.sites if s.kind == "call")
    assert call.line == 9 and call.status == "refused" and "self.flash_qkv_fn" in call.reason


def test_a_value_use_names_the_drop_in_when_flashport_has_one():
    source = b"from flash_attn import flash_attn_varlen_func\nfrom flash_attn.flash_attn_triton import flash_attn_func\nT = {'a': flash_attn_varlen_func, 'b': flash_attn_func}\n"
    result = transform_source(source, "m.py", registry.all_rules(), RuleOptions())
    varlen, triton = sorted(result.sites, key=lambda s: s.column)
    assert "flashport.integrations.flash_attn_compat.flash_attn_varlen_func is a drop-in" in varlen.reason
    assert "drop-in" not in triton.reason  # the Triton kernel's 4th argument is a bias: no drop-in
