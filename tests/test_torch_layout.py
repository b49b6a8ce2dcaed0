"""``flashport.torch.attention`` has no default layout: torch code holds SDPA's [B, H, S, D] and
flash-attn's [B, S, H, D] tensors alike, so a guessed layout would be a silently wrong answer.

Checked here: a call without ``layout`` raises naming both choices (on every path, before any
work), an SDPA-shaped call with ``layout="BHSD"`` matches SDPA, and every call the codemod writes
(its golden fixtures) states the layout.
"""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from reference import reference_attention  # noqa: E402

import flashport.torch as ft  # noqa: E402

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("backend", ["auto", "torch", "sdpa", "xla"])
def test_missing_layout_names_both_choices(backend):
    q = torch.zeros(1, 2, 8, 4)  # SDPA-shaped: [B, H, S, D]
    with pytest.raises(TypeError) as err:
        ft.attention(q, q, q, backend=backend)
    message = str(err.value)
    assert "layout" in message and "'BHSD'" in message and "'BSHD'" in message, message


def test_sdpa_shaped_call_with_bhsd_matches_sdpa():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 3, 6, 8)).astype(np.float32) for _ in range(3))  # [B, H, S, D]
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    got = ft.attention(tq, tk, tv, causal=True, align="top_left", layout="BHSD")
    want_sdpa = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
    want, _ = reference_attention(q, k, v, causal=True, align="top_left", layout="BHSD")
    np.testing.assert_allclose(got.numpy(), want, atol=2e-5)
    np.testing.assert_allclose(got.numpy(), want_sdpa.numpy(), atol=2e-5)


def _contract_calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in (
            "flashport.torch.attention",
            "flashport.attention",
        ):
            yield node


def test_codemod_output_always_states_the_layout():
    outputs = sorted(FIXTURES.rglob("*.py.out"))
    calls = [(p, c) for p in outputs for c in _contract_calls(ast.parse(p.read_text(encoding="utf-8")))]
    assert len(calls) > 40, "the golden fixtures should hold the codemod's contract calls"
    missing = [
        f"{p.relative_to(FIXTURES)}:{c.lineno}"
        for p, c in calls
        if "layout" not in {k.arg for k in c.keywords}
    ]
    assert not missing, f"codemod output without an explicit layout: {missing}"
