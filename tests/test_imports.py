"""Import management after a rewrite (:mod:`flashport.rewriter.imports`): dead GPU imports go,
everything still used stays, ``import flashport`` lands where isort would put it."""

from __future__ import annotations

import textwrap

import pytest

from flashport import rules as registry
from flashport.rewriter import imports
from flashport.rewriter.engine import transform_source
from flashport.rules.base import RuleOptions


def port(source: str) -> str:
    """The rewritten text of ``source`` (dedented); fails when nothing changed."""
    result = transform_source(textwrap.dedent(source).encode(), "m.py", registry.all_rules(), RuleOptions())
    assert result.status == "changed", (result.status, result.error, result.sites)
    return result.new.decode()


# ------------------------------------------------------------------ parenthesized multi-line imports

@pytest.mark.parametrize("stmt, drop, want", [
    # the stray, indented ")" of issue 10: the closing parenthesis keeps its own line and column
    ("from m import (\n    a,\n    b,\n    c,\n)\n", {"b", "c"}, "from m import (\n    a,\n)\n"),
    ("from m import (a, b,\n    c)\n", {"c"}, "from m import (a, b)\n"),
    ("from m import (a,\n    b, c\n)\n", {"c"}, "from m import (a,\n    b\n)\n"),
    # a line comment stays with the alias it was written after
    ("from m import (  # x\n    a,  # keep a\n    b,  # drop b\n)\n", {"b"}, "from m import (  # x\n    a,  # keep a\n)\n"),
    ("    from m import (\n        a,\n        b,\n    )\n", {"b"}, "    from m import (\n        a,\n    )\n"),
    ("from m import a, b, c\n", {"a", "c"}, "from m import b\n"),
])
def test_dropping_aliases_keeps_the_closing_parenthesis_in_place(stmt, drop, want):
    assert imports._drop_aliases(stmt, drop) == want


def test_multi_line_import_of_fa1_names_loses_only_the_ported_names():
    text = port("""
        from flash_attn.flash_attn_interface import (
            flash_attn_unpadded_func,
            flash_attn_unpadded_kvpacked_func,
        )


        def f(q, k, v, kv, cu, m):
            a = flash_attn_unpadded_kvpacked_func(q, kv, cu, cu, m, m, 0.0, causal=True)
            return a, flash_attn_unpadded_func(q, k, v, cu, cu, m, m, 0.0, None, True, True)
    """)
    assert "from flash_attn.flash_attn_interface import (\n    flash_attn_unpadded_func,\n)\n" in text
    compile(text, "m.py", "exec")
