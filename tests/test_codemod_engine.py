"""Engine behaviour: prefilter, name resolution, per-version binding, imports, bytes, failures."""

from __future__ import annotations

import sys
import textwrap

import libcst
import pytest

from flashport import rules as registry
from flashport.rewriter.engine import pipeline as engine
from flashport.rewriter.engine.pipeline import transform_source
from flashport.rules.base import RuleOptions


def run(source: str | bytes, **options):
    data = textwrap.dedent(source).encode() if isinstance(source, str) else source
    return transform_source(data, "m.py", registry.all_rules(), RuleOptions(**options))


def new_text(result) -> str:
    assert result.status == "changed", (result.status, result.error, result.sites)
    return result.new.decode()


def test_prefilter_never_parses_files_without_triggers(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("parsed")

    monkeypatch.setattr(engine.cst, "parse_module", boom)
    monkeypatch.setattr(engine.ast, "parse", boom)
    result = run("import torch\n\ndef attention(q, k, v):\n    return q @ k\n")
    assert not result.parsed and result.status == "unchanged" and not result.sites


def test_statements_without_triggers_are_not_given_to_libcst(monkeypatch):
    seen = []
    real = libcst.parse_module
    monkeypatch.setattr(engine.cst, "parse_module", lambda code: seen.append(code) or real(code))
    run("""
        from flash_attn import flash_attn_func

        def untouched():
            return 'a big unrelated function'

        class Model:
            def other(self):
                return 1

            def forward(self, q, k, v):
                return flash_attn_func(q, k, v)
    """)
    given = "".join(seen)  # the mini module may be parsed piece by piece (rewriter/source/pieces.py)
    assert seen and "untouched" not in given and "def other" not in given and "def forward" in given


def test_resolution_through_module_alias_and_class_methods():
    text = new_text(
        run("""
        import flash_attn.flash_attn_interface as fai
        import torch.nn.functional as F

        class A:
            def f(self, q, k, v):
                return fai.flash_attn_func(q, k, v), F.scaled_dot_product_attention(q, k, v)
    """)
    )
    assert "fai.flash_attn_func" not in text and text.count("flashport.torch.attention(") == 2
    assert "import flash_attn.flash_attn_interface as fai" not in text  # became unused


def test_bare_names_never_match():
    source = """
        from mypkg import flash_attn_func, scaled_dot_product_attention

        def f(q, k, v):
            return flash_attn_func(q, k, v), scaled_dot_product_attention(q, k, v)
    """
    result = run(source)
    assert result.status == "unchanged" and not result.sites


def test_shadowing_local_definition_is_not_rewritten():
    result = run("""
        import torch.nn.functional as F

        def f(q, k, v):
            F = object()
            return F.scaled_dot_product_attention(q, k, v)
    """)
    assert result.status == "unchanged" and not [s for s in result.sites if s.status == "rewrite"]


def test_top_level_and_nested_calls():
    text = new_text(
        run("""
        from flash_attn import flash_attn_func
        out = flash_attn_func(flash_attn_func(q, k, v), k, v, causal=True)
    """)
    )
    assert text.count("flashport.torch.attention(") == 2 and "flash_attn_func" not in text


@pytest.mark.parametrize(
    "version,expect",
    [
        ((2, 8, 3), 'window=(4, 0), align="bottom_right"'),  # 7th positional = window_size (>= 2.3)
        ((2, 3), 'window=(4, 0), align="bottom_right"'),
    ],
)
def test_positional_binding_follows_the_flash_attn_version(version, expect):
    text = new_text(
        run(
            """
        from flash_attn import flash_attn_func
        y = flash_attn_func(q, k, v, 0.0, None, True, (4, 0))
    """,
            flash_attn_version=version,
        )
    )
    assert expect in text


def test_flash_attn_2_0_signature_and_top_left_causal():
    result = run(
        """
        from flash_attn import flash_attn_func
        y = flash_attn_func(q, k, v, 0.0, None, True, (4, 0))
    """,
        flash_attn_version=(2, 0),
    )
    assert (
        result.status == "unchanged" and "return_attn_probs" in result.sites[0].reason
    )  # 7th positional in 2.0-2.2
    text = new_text(
        run(
            """
        from flash_attn import flash_attn_func
        y = flash_attn_func(q, k, v, 0.0, None, True)
    """,
            flash_attn_version=(2, 0),
        )
    )
    assert 'causal=True, align="top_left"' in text


def test_sdpa_scale_keyword_unknown_before_torch_2_1():
    result = run(
        "import torch.nn.functional as F\ny = F.scaled_dot_product_attention(q, k, v, scale=0.5)\n",
        torch_version=(2, 0),
    )
    assert result.status == "unchanged" and "unknown argument 'scale'" in result.sites[0].reason


def test_jax_bias_mask_keyword_only_in_0_4_31():
    result = run(
        "import jax\ny = jax.nn.dot_product_attention(q, k, v, b, implementation='cudnn')\n",
        jax_version=(0, 4, 31),
    )
    assert result.status == "unchanged" and "positional" in result.sites[0].reason


def test_imports_partial_removal_dead_guard_removed_and_flashport_added_once():
    text = new_text(
        run("""
        import flashport
        from flash_attn import flash_attn_func, flash_attn_varlen_func  # GPU kernels
        if available():
            from flash_attn import flash_attn_kvpacked_func

        def f(q, k, v, kv, kw):
            a = flash_attn_func(q, k, v)
            b = flash_attn_varlen_func(q, k, v, kw, kw, 1, 1, kw, return_attn_probs=True)  # refused: S_dmask of dropout
            c = flash_attn_kvpacked_func(q, kv)
            return a, b, c
    """)
    )
    assert text.count("import flashport") == 1
    assert "from flash_attn import flash_attn_varlen_func  # GPU kernels\n" in text
    assert (
        "available()" not in text and "flash_attn_kvpacked_func" not in text
    )  # a dead probe guard goes whole


def test_signature_probe_of_a_ported_function_inspects_the_drop_in():
    text = new_text(
        run("""
        import inspect
        from flash_attn import flash_attn_func
        HAS_WINDOW = "window_size" in inspect.signature(flash_attn_func).parameters

        def f(q, k, v):
            return flash_attn_func(q, k, v)
    """)
    )
    assert "flash_attn import" not in text
    assert "inspect.signature(flashport.integrations.flash_attn_compat.flash_attn_func)" in text


def test_coding_declaration_and_latin1_bytes_preserved():
    source = (
        b"# -*- coding: latin-1 -*-\n# caf\xe9 \xb5s\r\nfrom flash_attn import flash_attn_func\n"
        b"s = '\xe9'\t# tab\n\n\ndef f(q, k, v):\n\treturn flash_attn_func(q, k, v)  # trailing \xe9\n"
    )
    result = run(source)
    new = result.new
    assert new.startswith(b"# -*- coding: latin-1 -*-\n# caf\xe9 \xb5s\r\n")
    assert b"s = '\xe9'\t# tab\n\n\n" in new
    assert (
        b'\treturn flashport.torch.attention(q, k, v, align="bottom_right", layout="BSHD")  # trailing \xe9\n'
        in new
    )
    compile(new, "m.py", "exec")


def test_only_rewritten_lines_and_imports_differ():
    source = textwrap.dedent("""\
        '''doc'''
        import os  # keep
        from flash_attn import flash_attn_func


        # a comment
        def f(q, k, v):
            x = 1   # odd   spacing
            return flash_attn_func(q, k, v, causal=True)
        """)
    new = new_text(run(source)).splitlines()
    old = source.splitlines()
    # the GPU import is dropped; flashport gets its own third-party group after the stdlib one (isort)
    assert new[:2] == old[:2] and new[2:4] == ["", "import flashport"]
    assert new[4:9] == old[3:8] and len(new) == len(old) + 1
    assert new[9].startswith("    return flashport.torch.attention(")


def test_suppression_bare_and_other_code():
    result = run("""
        from flash_attn import flash_attn_func
        a = flash_attn_func(q, k, v)  # flashport: ignore
        b = flash_attn_func(q, k, v)  # flashport: ignore[FPA101]
    """)
    assert [s.status for s in result.sites] == ["suppressed", "rewrite"]


@pytest.mark.parametrize(
    "data,needle",
    [
        (b"from flash_attn import flash_attn_func\ndef f(:\n", "syntax error at line 2"),
        (b"from flash_attn import flash_attn_func\nx = '\xff\xfe'\n", "cannot decode"),
        (b"# -*- coding: nonsense -*-\nimport flash_attn\n", "cannot decode"),
    ],
)
def test_broken_files_are_errors_and_untouched(data, needle):
    result = transform_source(data, "bad.py", registry.all_rules())
    assert result.status == "error" and needle in result.error and result.new is None


def test_results_are_deterministic_and_rules_fresh_per_file():
    source = "from flash_attn import flash_attn_func\nx = flash_attn_func(q, k, v)\n"
    first = run(source)
    second = run(source)
    assert first.sites == second.sites and first.new == second.new


def test_a_new_rule_plugs_into_the_engine_without_registration():
    """The seam issue-5 rules use: a Rule subclass, SOURCES/TRIGGERS, check_call -> Rewrite/Refusal."""
    from flashport.rules.base import Refusal, Rewrite, Rule
    from flashport.rules.common.binding import Signature
    from flashport.rules.common.calls import build_call, string

    class Demo(Rule):
        CODE, NAME, API = "FPA999", "demo", "mypkg.attn"
        SOURCES = ("mypkg.attn",)
        TRIGGERS = (b"mypkg",)
        GPU_MODULES = ("mypkg",)

        def check_call(self, call, ctx):
            bound = Signature(("q", "k", "v", "causal")).bind(call, self.API)
            if "causal" not in bound:
                return Refusal("needs an explicit causal")
            args = [bound[n].value for n in ("q", "k", "v")]
            return Rewrite(
                build_call(
                    "flashport.attention",
                    args,
                    [("causal", bound["causal"].value), ("layout", string("BSHD"))],
                    call,
                )
            )

    source = b"from mypkg import attn as a\n\nx = a(q, k, v, True)\ny = a(q, k, v)\n"
    result = transform_source(source, "demo.py", [Demo])
    assert (
        result.new
        == b'import flashport\nfrom mypkg import attn as a\n\nx = flashport.attention(q, k, v, causal=True, layout="BSHD")\ny = a(q, k, v)\n'
    )
    assert [(s.line, s.status, s.reason) for s in result.sites] == [
        (3, "rewrite", ""),
        (4, "refused", "needs an explicit causal"),
    ]


def test_rule_selection_by_prefix_and_name():
    assert {r.CODE for r in registry.select(["FPA00"])} >= {"FPA001", "FPA002", "FPA003", "FPA004"}
    assert all(r.CODE.startswith("FPA00") for r in registry.select(["FPA00"]))
    assert "FPA101" not in {r.CODE for r in registry.select(None, ["torch-sdpa"])}
    with pytest.raises(ValueError, match="matches no rule"):
        registry.select(["NOPE"])


IDENTICAL_FA3_CALLS = """
    from flash_attn_interface import flash_attn_func
    def f(q, k, v):
        a = flash_attn_func(q, k, v, causal=True){comment}
        out, lse = flash_attn_func(q, k, v, causal=True)
        return a, out, lse
"""


@pytest.mark.parametrize("how", ["suppressed", "declined"])
def test_identical_fa3_call_after_a_skipped_one_keeps_its_tuple(how):
    """Rules see the node they are asked about: skipping an identical earlier call (an ignore
    comment, or a site declined in --interactive review) must not lend its use to the next one."""
    comment = "  # flashport: ignore[FPA010]" if how == "suppressed" else ""
    data = textwrap.dedent(IDENTICAL_FA3_CALLS.format(comment=comment)).encode()
    skip = {4: frozenset({"FPA010"})} if how == "declined" else None
    result = transform_source(data, "m.py", registry.all_rules(), RuleOptions(), skip=skip)
    text = new_text(result)
    assert "    a = flash_attn_func(q, k, v, causal=True)" in text
    assert _line(text, "out, lse =").startswith("out, lse = flashport.torch.attention(")
    assert _line(text, "out, lse =").endswith(", return_lse=True)")
    assert [s.status for s in result.sites] == ["suppressed", "rewrite"]


def test_identical_fa3_calls_with_different_uses_each_get_their_own_return_type():
    result = run(IDENTICAL_FA3_CALLS.format(comment=""))
    text = new_text(result)
    assert (
        _line(text, "a =")
        == 'a = flashport.torch.attention(q, k, v, causal=True, align="bottom_right", layout="BSHD")'
    )
    assert _line(text, "out, lse =").endswith(", return_lse=True)")


def _line(text: str, start: str) -> str:
    """The stripped line of ``text`` that starts with ``start``."""
    return next(line.strip() for line in text.splitlines() if line.strip().startswith(start))


PY312_FILE = """from flash_attn import flash_attn_func

type Pair = tuple[int, int]


def f(q, k, v, name):
    out = flash_attn_func(q, k, v, causal=True)
    print(f"{"done: " + name}")
    return out
"""


def test_python_312_syntax_is_read_and_the_call_rewritten():
    """``type`` statements and PEP 701 f-strings must not make the host's ast reject the file."""
    result = run(PY312_FILE)
    text = new_text(result)
    expected = PY312_FILE.replace(
        "flash_attn_func(q, k, v, causal=True)",
        'flashport.torch.attention(q, k, v, causal=True, align="bottom_right", layout="BSHD")',
    )
    assert text.splitlines()[2:] == expected.splitlines()[2:]  # type/f-string lines byte-identical
    assert "import flashport" in text and "from flash_attn" not in text
    libcst.parse_module(text)


def test_python_312_f_string_use_of_an_import_keeps_it():
    source = PY312_FILE.replace('f"{"done: " + name}"', 'f"{"fn: " + repr(flash_attn_func)}"')
    text = new_text(run(source))
    assert "from flash_attn import flash_attn_func" in text and 'f"{"fn: " + repr(flash_attn_func)}"' in text


def test_newer_syntax_without_a_placeholder_is_reported_with_the_reason():
    result = run("from flash_attn import flash_attn_func\nclass A[T]:\n    x = flash_attn_func(q, k, v)\n")
    if sys.version_info >= (3, 12):  # the host reads it: nothing to report
        assert result.status == "changed"
        return
    assert result.status == "error" and result.new is None
    assert "line 2 uses Python syntax newer than this host's Python" in result.error


def test_comments_inside_the_arguments_are_kept_never_refused():
    """Each comment survives once; one after a carried-over argument stays after it, one after a
    dropped argument (FA3 tuning) moves before the closing paren."""
    result = run("""
        from flash_attn_interface import flash_attn_func
        def f(q, k, v):
            out = flash_attn_func(
                q,  # queries
                k,
                # keys and values share a layout
                v,
                causal=True,  # decoder
                num_splits=1,  # tuned on H100
            )
            return out
    """)
    text = new_text(result)
    assert [s.status for s in result.sites] == ["rewrite"]
    for comment in ("# queries", "# keys and values share a layout", "# decoder", "# tuned on H100"):
        assert text.count(comment) == 1, comment
    assert "q,  # queries" in text and "causal=True,  # decoder" in text
    assert text.index("# tuned on H100") > text.index('layout="BSHD"')
    compile(text, "m.py", "exec")
    assert run(text).new is None  # idempotent
