"""xformers bias constructors (FPA111) are only ported when every consumer is (issue 10, defect 2).

A constructor rewritten to flashport's mirror class while the ``memory_efficient_attention`` that
consumes it stays xformers breaks working code (xformers rejects the foreign bias). The decision is
made in the engine's per-file phase, after suppression, ``--ignore`` and interactive review. The
fixtures under ``tests/fixtures/codemod/FPA111/`` cover the suppressed, value-use and isinstance
cases; this file covers ``--ignore FPA110``, the interactive review, ``materialize`` and the type checks
that move with the constructors (ported code runs, and accepts biases xformers still builds).
"""

from __future__ import annotations

import os

import pytest

from flashport import rules as registry
from flashport.rewriter.app import interactive
from flashport.rewriter.engine.pipeline import transform_source
from flashport.rules.base import RuleOptions

SOURCE = b"""import xformers.ops as xops


def attend(q, k, v):
    bias = xops.LowerTriangularMask()
    y = xops.memory_efficient_attention(q, k, v, attn_bias=bias)
    z = xops.memory_efficient_attention(q, k, v)
    return y, z
"""


def test_ignore_fpa110_keeps_bias_constructors():
    rules = [r for r in registry.all_rules() if r.CODE != "FPA110"]
    result = transform_source(SOURCE, "case.py", rules, RuleOptions())
    assert result.new is None  # byte-identical: the constructor feeds a call that stays xformers
    (site,) = result.sites
    assert site.rule == "FPA111" and site.status == "refused" and "line 6 stays xformers" in site.reason


def test_interactive_declined_call_keeps_bias_constructor(tmp_path):
    from rich.console import Console

    path = tmp_path / "case.py"
    path.write_bytes(SOURCE)
    result = transform_source(SOURCE, str(path), registry.all_rules(), RuleOptions())
    assert [(s.line, s.rule) for s in result.sites] == [(5, "FPA111"), (6, "FPA110"), (7, "FPA110")]
    # accept the constructor and the first call, decline the second call
    replies = ["y", "y", "n"]
    outcome = interactive.review(
        [result],
        registry.all_rules(),
        RuleOptions(),
        ask=lambda _: replies.pop(0),
        console=Console(file=open(os.devnull, "w"), no_color=True),
    )
    text = path.read_text()
    assert outcome.written == [str(path)] and not outcome.failed
    assert "bias = xops.LowerTriangularMask()" in text  # kept: line 7 still runs xformers
    assert (
        "y = flashport.integrations.xformers_compat.memory_efficient_attention(q, k, v, attn_bias=bias)"
        in text
    )
    assert "z = xops.memory_efficient_attention(q, k, v)" in text
    assert sorted(s.line for s in outcome.declined) == [5, 7] and [s.line for s in outcome.accepted] == [6]
    compile(text, "case.py", "exec")


def test_all_consumers_rewritten_ports_constructors():
    result = transform_source(
        SOURCE.replace(b"    z = xops.memory_efficient_attention(q, k, v)\n", b"    z = y\n"),
        "case.py",
        registry.all_rules(),
        RuleOptions(),
    )
    assert b"bias = flashport.integrations.xformers_compat.LowerTriangularMask()" in result.new


# ------------------------------------------------------------------------------------- materialize


def _expected(mq, mk, allowed):
    """Dense additive reference: 0 where ``allowed(i, j)``, -inf elsewhere (xformers' convention)."""
    import torch

    return torch.tensor([[0.0 if allowed(i, j) else float("-inf") for j in range(mk)] for i in range(mq)])


def test_materialize_matches_xformers_semantics():
    torch = pytest.importorskip("torch")
    from flashport.integrations import xformers_compat as xf

    mq, mk = 3, 5
    cases = [
        (xf.LowerTriangularMask(), lambda i, j: j <= i),
        (xf.LowerTriangularFromBottomRightMask(), lambda i, j: j <= i + mk - mq),
        (
            xf.LowerTriangularFromBottomRightMask().make_local_attention(2),
            lambda i, j: i + mk - mq - 2 < j <= i + mk - mq,
        ),
        (xf.LocalAttentionFromBottomRightMask(1, 1), lambda i, j: i - 1 <= j + mq - mk <= i + 1),
    ]
    for bias, allowed in cases:
        got = bias.materialize((2, 4, mq, mk))
        assert got.shape == (2, 4, mq, mk) and got.dtype == torch.float32, type(bias).__name__
        assert torch.equal(got[1, 3], _expected(mq, mk, allowed)), type(bias).__name__
    t = torch.randn(mq, mk, dtype=torch.float64)
    got = xf.LowerTriangularMask().add_bias(t).materialize((mq, mk), dtype=torch.float64)
    assert torch.equal(got, _expected(mq, mk, lambda i, j: j <= i).double() + t)
    assert xf.LowerTriangularMask().materialize((2, 2), dtype=torch.bfloat16).dtype == torch.bfloat16


def test_materialize_block_diagonal():
    torch = pytest.importorskip("torch")
    from flashport.integrations import xformers_compat as xf

    q_lens, kv_lens = [2, 3], [3, 1]
    qb = [0, 0, 1, 1, 1]  # block of each query / key, written out by hand
    kb = [0, 0, 0, 1]
    qi = [0, 1, 0, 1, 2]  # position inside the block
    ki = [0, 1, 2, 0]
    plain = xf.BlockDiagonalMask.from_seqlens(q_lens, kv_lens)
    assert torch.equal(plain.materialize((5, 4)), _expected(5, 4, lambda i, j: qb[i] == kb[j]))
    assert torch.equal(
        plain.make_causal().materialize((5, 4)),
        _expected(5, 4, lambda i, j: qb[i] == kb[j] and ki[j] <= qi[i]),
    )
    assert torch.equal(
        plain.make_causal_from_bottomright().materialize((5, 4)),
        _expected(5, 4, lambda i, j: qb[i] == kb[j] and ki[j] <= qi[i] + kv_lens[qb[i]] - q_lens[qb[i]]),
    )
    with pytest.raises(ValueError, match=r"shape must end with \(5, 4\)"):
        plain.materialize((4, 4))


def test_materialized_bias_gives_the_same_attention():
    """The dense tensor and the bias object mean the same attention (flashport's drop-in, float64)."""
    torch = pytest.importorskip("torch")
    from flashport.integrations import xformers_compat as xf

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 2, 8, generator=g) for n in (5, 7, 7))
    bias = xf.BlockDiagonalCausalFromBottomRightMask.from_seqlens([2, 3], [3, 4])  # no fully masked row
    dense = bias.materialize((1, 2, 5, 7), dtype=torch.float64)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * 8**-0.5 + dense
    want = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v.double())
    got = xf.memory_efficient_attention(q, k, v, attn_bias=bias, backend="torch")
    assert (got.double() - want).abs().max().item() < 1e-5


def _xformers_class(name, *bases):
    """A stand-in for a real xformers bias class (module and name are all the mirror looks at)."""
    return type(name, bases or (object,), {"__module__": "xformers.ops.fmha.attn_bias"})


def test_ported_type_checks_accept_the_mirror_and_real_xformers_biases_of_that_class():
    from flashport.integrations import xformers_compat as xc

    base = _xformers_class("AttentionBias")
    block = _xformers_class("BlockDiagonalMask", base)
    causal = _xformers_class("BlockDiagonalCausalMask", block)
    padded = _xformers_class("BlockDiagonalCausalWithOffsetPaddedKeysMask", base)
    assert isinstance(causal(), xc.BlockDiagonalMask) and isinstance(causal(), xc.BlockDiagonalCausalMask)
    assert not isinstance(block(), xc.BlockDiagonalCausalMask)
    assert not isinstance(causal(), xc.LowerTriangularMask)
    assert isinstance(padded(), xc.AttentionBias) and isinstance(padded(), xc.AttentionMask)
    assert not isinstance(padded(), xc.BlockDiagonalMask)
    assert not isinstance(object(), xc.AttentionBias)
    mirror = xc.BlockDiagonalMask.from_seqlens([2, 3]).make_causal()
    assert isinstance(mirror, (xc.BlockDiagonalCausalMask, xc.AttentionBias))
    assert not isinstance(mirror, xc.LowerTriangularMask)


def test_ported_annotations_and_type_checks_run_without_xformers():
    torch = pytest.importorskip("torch")

    fixture = os.path.join(
        os.path.dirname(__file__), "fixtures", "codemod", "FPA111", "annotated_bias_types.py"
    )
    ported = open(fixture + ".out").read()
    assert "xformers" not in ported.replace("xformers_compat", "")
    namespace: dict = {}
    exec(compile(ported, fixture, "exec"), namespace)
    q = torch.randn(1, 5, 2, 4, generator=torch.Generator().manual_seed(0))
    bias = namespace["packed_bias"]([2, 3], causal=True)
    out = namespace["attend"](q, q, q, bias)
    # block-diagonal causal attention by hand: each block sees its own earlier keys
    expected = torch.empty_like(q)
    for start, length in ((0, 2), (2, 3)):
        part = q[:, start : start + length].transpose(1, 2)
        scores = part @ part.transpose(-1, -2) / 2.0
        scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
        expected[:, start : start + length] = (scores.softmax(-1) @ part).transpose(1, 2)
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)
