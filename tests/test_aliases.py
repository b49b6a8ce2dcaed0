"""Calls through local aliases (``attn = flash_attn_func; attn(...)``) and value uses
(dispatch tables, ``functools.partial``, attributes): ported when they resolve to one function,
reported with the reason otherwise (:mod:`flashport.rewriter.source.aliases`, :mod:`flashport.rules.common.values`)."""

from __future__ import annotations

import textwrap

import pytest

from flashport import rules as registry
from flashport.rewriter.engine.pipeline import transform_source
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


def test_an_alias_also_used_as_a_value_stays_with_the_drop_in_as_its_value():
    result = run("""
        from flash_attn import flash_attn_func

        def f(q, k, v, drop, table):
            attn = flash_attn_func
            table.append(attn)
            return attn(q, k, v, causal=True)
    """)
    text = result.new.decode()
    assert "    attn = flashport.integrations.flash_attn_compat.flash_attn_func\n" in text
    assert "flash_attn import" not in text and "table.append(attn)" in text
    alias = next(s for s in result.sites if s.kind == "reference")
    assert alias.status == "rewrite" and "drop-in" in alias.notes[0]


def test_an_alias_with_a_suppressed_call_keeps_its_value_and_says_why():
    result = run("""
        from flash_attn import flash_attn_func

        def f(q, k, v, drop, table):
            attn = flash_attn_func
            table.append(attn)
            a = attn(q, k, v)  # flashport: ignore[FPA001]
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
    assert all(s.status != "rewrite" for s in result.sites if s.kind == "call")


REBOUND = """
from flash_attn import flash_attn_func

def f(q, k, v, p):
    attn = flash_attn_func
    if p:
        attn = other
    return attn(q, k, v)
"""


def test_a_rebound_alias_call_is_reported_where_it_is_called():
    old = RuleOptions(flash_attn_version=(2, 5, 0))  # no drop-in at this version: the value stays
    result = transform_source(REBOUND.encode(), "m.py", registry.all_rules(), old)
    assert result.new is None
    call = next(s for s in result.sites if s.kind == "call")
    assert call.line == 8 and call.status == "refused" and "does not resolve to one function" in call.reason


def test_a_rebound_alias_gets_the_drop_in_and_its_call_reaches_it():
    result = run(REBOUND)
    text = result.new.decode()
    assert "    attn = flashport.integrations.flash_attn_compat.flash_attn_func\n" in text
    assert "return attn(q, k, v)" in text and "flash_attn import" not in text
    assert [(s.kind, s.status) for s in result.sites] == [("reference", "rewrite")]


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
    assert "attention = flashport.integrations.flash_attn_compat.flash_attn_func\n" in text
    assert "return flashport.torch.attention(" in text and "flash_attn import" not in text
    alias = next(s for s in result.sites if s.kind == "reference")
    assert alias.status == "rewrite" and "stored in attention" in alias.notes[0]


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
        ("ok = inspect.signature(flash_attn_func)", "same parameters and defaults"),
    ],
)
def test_value_uses_become_the_drop_in_with_their_context_in_the_note(use, words):
    source = f"import functools, inspect\nfrom flash_attn import flash_attn_func\n\ndef f(self):\n    {use}\n"
    result = transform_source(source.encode(), "m.py", registry.all_rules(), RuleOptions())
    text = result.new.decode()
    assert use.replace("flash_attn_func", "flashport.integrations.flash_attn_compat.flash_attn_func") in text
    assert "flash_attn import" not in text and "import flashport.integrations.flash_attn_compat\n" in text
    [site] = result.sites
    assert site.kind == "reference" and site.status == "rewrite" and words in site.notes[0]


@pytest.mark.parametrize(
    "use, words",
    [
        ("ok = callable(flash_attn_func)", "feature probe"),
        ("ok = getattr(flash_attn_func, '__doc__', None)", "feature probe"),
        ("ok = isinstance(x, (flash_attn_func, int))", "feature probe"),
        ("ok = fn in (flash_attn_func, other)", "compared"),
        (
            "ok = fn is flash_attn_func\n    t = [flash_attn_func]",
            "the file compares flash_attn_func (line 5)",
        ),
    ],
)
def test_value_uses_that_probe_or_compare_stay_and_say_why(use, words):
    source = f"import functools, inspect\nfrom flash_attn import flash_attn_func\n\ndef f(self):\n    {use}\n"
    result = transform_source(source.encode(), "m.py", registry.all_rules(), RuleOptions())
    assert result.new is None
    [site] = result.sites
    assert site.kind == "reference" and site.status == "refused" and words in site.reason


def test_a_value_of_a_name_whose_only_fallback_is_none_takes_the_drop_in():
    # flashport is always there: the guard's None fallback is dead, as its flag is True
    result = run("""
        try:
            from flash_attn import flash_attn_func
        except ImportError:
            flash_attn_func = None

        ATTN = {"flash": flash_attn_func}
    """)
    [site] = result.sites
    assert site.status == "rewrite"
    assert 'ATTN = {"flash": flashport.integrations.flash_attn_compat.flash_attn_func}' in result.new.decode()
    assert "flash_attn import" not in result.new.decode()


def test_a_value_of_a_name_the_file_also_asks_about_stays():
    result = run("""
        try:
            from flash_attn import flash_attn_func
        except ImportError:
            flash_attn_func = None

        ATTN = {"flash": flash_attn_func} if flash_attn_func is not None else {}
    """)
    assert result.new is None
    assert all(s.status == "refused" for s in result.sites)


def test_a_value_inside_an_import_guard_stays():
    result = run("""
        try:
            from flash_attn import flash_attn_func
            ATTN = {"flash": flash_attn_func}
        except ImportError:
            ATTN = {}
    """)
    assert result.new is None
    [site] = result.sites
    assert site.status == "refused" and "import guard" in site.reason


def test_a_value_of_a_version_without_a_drop_in_signature_stays():
    source = b"from flash_attn import flash_attn_func\nATTN = {'flash': flash_attn_func}\n"
    result = transform_source(source, "m.py", registry.all_rules(), RuleOptions(flash_attn_version=(2, 3, 0)))
    assert result.new is None
    [site] = result.sites
    assert site.status == "refused" and "--flash-attn-version is 2.3.0" in site.reason


ATTRIBUTE = """
from flash_attn import flash_attn_qkvpacked_func

class Attention:
    def __init__(self):
        self.flash_qkv_fn = flash_attn_qkvpacked_func

    def forward(self, qkv):
        return self.flash_qkv_fn(qkv, causal=True)
"""


def test_a_call_through_an_attribute_alias_is_reported_at_the_call():
    old = RuleOptions(flash_attn_version=(2, 5, 0))  # no drop-in at this version: the value stays
    result = transform_source(ATTRIBUTE.encode(), "m.py", registry.all_rules(), old)
    assert result.new is None
    call = next(s for s in result.sites if s.kind == "call")
    assert call.line == 9 and call.status == "refused" and "self.flash_qkv_fn" in call.reason


def test_an_attribute_alias_gets_the_drop_in_and_its_calls_reach_it():
    result = run(ATTRIBUTE)
    text = result.new.decode()
    assert "self.flash_qkv_fn = flashport.integrations.flash_attn_compat.flash_attn_qkvpacked_func\n" in text
    assert "flash_attn import" not in text
    assert [(s.kind, s.status) for s in result.sites] == [("reference", "rewrite")]


def test_a_value_use_becomes_the_drop_in_when_flashport_has_one():
    source = b"from flash_attn import flash_attn_varlen_func\nfrom flash_attn.flash_attn_triton import flash_attn_func\nT = {'a': flash_attn_varlen_func, 'b': flash_attn_func}\n"
    result = transform_source(source, "m.py", registry.all_rules(), RuleOptions())
    varlen, triton = sorted(result.sites, key=lambda s: s.column)
    assert varlen.status == "rewrite"
    assert "flashport.integrations.flash_attn_compat.flash_attn_varlen_func" in varlen.notes[0]
    assert "'a': flashport.integrations.flash_attn_compat.flash_attn_varlen_func" in result.new.decode()
    # the Triton kernel's 4th argument is a bias: no drop-in
    assert triton.status == "refused" and "port it by hand" in triton.reason


def test_a_value_of_a_name_imported_from_two_libraries_stays():
    result = run("""
        try:
            from flash_attn_interface import flash_attn_func
        except ImportError:
            from flash_attn import flash_attn_func

        ATTN = {"flash": flash_attn_func}
    """)
    assert result.new is None  # FA3 or FA2 at run time: no single drop-in replicates both
    [site] = result.sites
    assert site.status == "refused" and "may hold something else" in site.reason


def test_a_value_through_dotted_imports_becomes_the_drop_in():
    result = run("""
        import xformers
        import xformers.ops.fmha

        xformers_attention = xformers.ops.fmha.memory_efficient_attention
    """)
    text = result.new.decode()
    assert "xformers_attention = flashport.integrations.xformers_compat.memory_efficient_attention\n" in text
    assert "import xformers" not in text


def test_a_suppressed_or_declined_value_use_stays():
    source = b"from flash_attn import flash_attn_func\nATTN = {'a': flash_attn_func}\nB = [flash_attn_func]\n"
    declined = transform_source(
        source, "m.py", registry.all_rules(), RuleOptions(), skip={2: frozenset({"FPA001"})}
    )
    text = declined.new.decode()  # the declined entry keeps the GPU function, and so its import
    assert "ATTN = {'a': flash_attn_func}" in text and "from flash_attn import flash_attn_func" in text
    assert "B = [flashport.integrations.flash_attn_compat.flash_attn_func]" in text
    assert [s.status for s in declined.sites] == ["suppressed", "rewrite"]
