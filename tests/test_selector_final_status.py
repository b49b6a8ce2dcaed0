"""An SDPA backend selector is made neutral only when every SDPA call in its body ends rewritten.

FPA102 used to ask FPA101's rule whether the body's calls "would be rewritten" and neutralized the
selector (``contextlib.nullcontext()``) even when the call then stayed torch SDPA -- suppressed with
``# flashport: ignore[FPA101]``, left out by ``--ignore FPA101``, declined in ``--interactive``
review -- so torch SDPA ran without the kernel choice the code made. Now the rewrite names the
calls it needs (``Rewrite.requires``) and the engine's per-file phase refuses it unless each one's
final status is "rewritten". The original source is the reference: a kept selector is the same
text, byte for byte.
"""

from __future__ import annotations

import os

import libcst as cst
import pytest

from flashport import rules as registry
from flashport.rewriter.app import cli, interactive
from flashport.rewriter.engine.pipeline import transform_source
from flashport.rules.base import Refusal, Rewrite, Rule, RuleOptions
from flashport.rules.common.calls import dotted

SELECTOR = "    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):\n"
SOURCE = (
    "import torch.nn.functional as F\n"
    "from torch.nn.attention import SDPBackend, sdpa_kernel\n"
    "\n"
    "\n"
    "def attend(q, k, v):\n"
    f"{SELECTOR}"
    "        y = F.scaled_dot_product_attention(q, k, v){comment}\n"
    "    return y\n"
)


def run(source: str, rules=None):
    return transform_source(source.encode(), "case.py", rules or registry.all_rules(), RuleOptions())


def selector_site(result):
    (site,) = [s for s in result.sites if s.rule == "FPA102"]
    return site


def test_selector_over_a_rewritten_call_is_made_neutral():
    result = run(SOURCE.format(comment=""))
    assert selector_site(result).status == "rewrite"
    assert "with contextlib.nullcontext():" in result.new.decode()


def test_selector_over_a_suppressed_call_is_kept():
    source = SOURCE.format(comment="  # flashport: ignore[FPA101]")
    result = run(source)
    site = selector_site(result)
    assert site.status == "refused"
    assert "line 7: FPA101 suppressed" in site.reason
    assert result.new is None  # nothing else to port: the file stays as it was


def test_selector_with_fpa101_ignored_is_kept():
    rules = [rule for rule in registry.all_rules() if rule.CODE != "FPA101"]
    result = run(SOURCE.format(comment=""), rules)
    site = selector_site(result)
    assert site.status == "refused" and "left out by --select/--ignore" in site.reason
    assert result.new is None


def test_cli_ignore_fpa101_keeps_the_selector(tmp_path, capsys):
    path = tmp_path / "case.py"
    source = SOURCE.format(comment="")
    path.write_text(source)
    code = cli.main(["rewrite", str(path), "--ignore", "FPA101", "--write", "--isolated", "--jobs", "1"])
    capsys.readouterr()
    assert code == 0
    assert path.read_text() == source


def test_selector_over_a_refused_call_is_kept():
    result = run(SOURCE.format(comment="").replace("(q, k, v)", "(q, k, v, bogus=1)"))
    site = selector_site(result)
    call = next(s for s in result.sites if s.rule == "FPA101")
    assert call.status == "refused" and site.status == "refused"
    assert site.reason.endswith(f"(line 7: {call.reason})")
    assert result.new is None


INTERACTIVE = (
    "import torch.nn.functional as F\n"
    "from torch.nn.attention import SDPBackend, sdpa_kernel\n"
    "\n"
    "\n"
    "def attend(q, k, v):\n"
    f"{SELECTOR}"
    "        y = F.scaled_dot_product_attention(q, k, v)\n"
    "        z = F.scaled_dot_product_attention(q, k, v, is_causal=True)\n"
    "    return y + z\n"
    "\n"
    "\n"
    "def other(q, k, v):\n"
    "    return F.scaled_dot_product_attention(q, k, v)\n"
)


def test_interactive_decline_keeps_the_selector(tmp_path):
    from rich.console import Console

    path = tmp_path / "case.py"
    path.write_text(INTERACTIVE)
    result = transform_source(INTERACTIVE.encode(), str(path), registry.all_rules(), RuleOptions())
    assert [(s.line, s.rule, s.status) for s in result.sites] == [
        (6, "FPA102", "rewrite"),
        (7, "FPA101", "rewrite"),
        (8, "FPA101", "rewrite"),
        (13, "FPA101", "rewrite"),
    ]
    replies = ["y", "y", "n", "y"]  # accept the selector, decline the causal call on line 8
    outcome = interactive.review(
        [result],
        registry.all_rules(),
        RuleOptions(),
        ask=lambda _: replies.pop(0),
        console=Console(file=open(os.devnull, "w"), no_color=True),
    )
    text = path.read_text()
    assert outcome.written == [str(path)] and not outcome.failed
    assert SELECTOR in text  # kept: line 8 still runs torch SDPA under it
    assert "        z = F.scaled_dot_product_attention(q, k, v, is_causal=True)\n" in text
    assert "y = flashport.torch.attention(" in text and "return flashport.torch.attention(" in text
    assert sorted(s.line for s in outcome.declined) == [6, 8]
    assert sorted(s.line for s in outcome.accepted) == [7, 13]
    compile(text, "case.py", "exec")


# -- the engine contract, with two small rules: B's rewrite requires A's call, A's settle may veto


class _A(Rule):
    CODE, NAME, API, FRAMEWORK = "FPA990", "test-a", "mylib.a", "torch"
    SOURCES, TRIGGERS = ("mylib.a",), (b"mylib",)
    veto: str | None = None

    def check_call(self, call, ctx):
        return Rewrite(call.with_changes(func=dotted("mylib.a_new")), imports=())

    def settle(self, sites, ctx):
        return self.veto if any(s.rule == self.CODE and s.status == "rewrite" for s in sites) else None


class _VetoedA(_A):
    veto = "A refused in the per-file phase"


class _B(Rule):
    CODE, NAME, API, FRAMEWORK = "FPA991", "test-b", "mylib.b", "torch"
    SOURCES, TRIGGERS = ("mylib.b",), (b"mylib",)

    def check_call(self, call, ctx):
        inner = ctx.node.args[0].value
        return Rewrite(
            call.with_changes(func=dotted("mylib.b_new")),
            imports=(),
            requires=(inner,),
            otherwise="B kept: its argument stays mylib.a",
        )


CHAIN = "import mylib\n\nx = mylib.b(mylib.a(1))\n"


def test_required_call_rewritten_keeps_the_rewrite():
    result = transform_source(CHAIN.encode(), "case.py", [_A, _B], RuleOptions())
    assert result.new == b"import mylib\n\nx = mylib.b_new(mylib.a_new(1))\n"


def test_required_call_vetoed_by_settle_refuses_the_rewrite():
    result = transform_source(CHAIN.encode(), "case.py", [_VetoedA, _B], RuleOptions())
    assert result.new is None
    statuses = {s.rule: (s.status, s.reason) for s in result.sites}
    assert statuses == {
        "FPA990": ("refused", "A refused in the per-file phase"),
        "FPA991": ("refused", "B kept: its argument stays mylib.a (line 3: A refused in the per-file phase)"),
    }


def test_requires_needs_a_reason():
    with pytest.raises(ValueError, match="otherwise="):
        Rewrite(cst.Name("x"), requires=(cst.Name("y"),))
    assert Refusal("x").reason == "x"
