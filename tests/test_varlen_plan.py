"""Packed variable-length attention in O(total) memory (``kernels/contract/varlen.py``'s ``varlen_plan``).

Checked against per-sequence float64 reference calls: causal with Sq != Sk per sequence
(flash-attn's bottom-right alignment), top-left, windows, GQA, padding tokens past
``cu_seqlens[-1]`` and gradients, on the JAX and torch entry points and the flash-attn drop-in; the
plan's visible pairs against the per-sequence band written out here; and no [total, total] array
anywhere in the traced program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.extend.core import jaxprs_in_params
from reference import reference_attention, reference_attention_vjp

import flashport
from flashport.kernels.contract.varlen import varlen_plan

LENS_Q, LENS_K = [5, 1, 7, 3, 4], [7, 9, 7, 0, 2]
PAD_Q, PAD_K = 2, 1
HQ, HKV, D = 4, 2, 8
CASES = {
    "causal_bottom_right": dict(causal=True),
    "causal_top_left": dict(causal=True, align="top_left"),
    "window": dict(window=(2, 1)),
    "window_left_causal": dict(window=(3, None), causal=True),
    "plain": {},
}


def _packed(seed=0):
    rng = np.random.default_rng(seed)
    cu_q, cu_k = np.cumsum([0, *LENS_Q]), np.cumsum([0, *LENS_K])
    tq, tk = int(cu_q[-1]) + PAD_Q, int(cu_k[-1]) + PAD_K
    q = rng.standard_normal((tq, HQ, D)).astype(np.float32)
    k, v = (rng.standard_normal((tk, HKV, D)).astype(np.float32) for _ in range(2))
    d_out = rng.standard_normal(q.shape).astype(np.float32)
    return q, k, v, d_out, cu_q, cu_k


def _reference(q, k, v, d_out, cu_q, cu_k, options):
    """Per-sequence float64 (out, dq, dk, dv); rows and keys outside every sequence get 0."""
    out, dq, dk, dv = np.zeros(q.shape), np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.start == rows.stop or keys.start == keys.stop:
            continue  # no queries, or queries that see no key: 0
        args = (q[None, rows], k[None, keys], v[None, keys])
        out[rows] = reference_attention(*args, **options)[0][0]
        grads = reference_attention_vjp(*args, d_out[None, rows], **options)
        dq[rows], dk[keys], dv[keys] = (g[0] for g in grads[:3])
    return out, dq, dk, dv


@pytest.mark.parametrize("backend", ["auto", "blockwise"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_jax_varlen_matches_per_sequence_reference(case, backend):
    q, k, v, d_out, cu_q, cu_k = _packed()
    options = CASES[case]
    want = _reference(q, k, v, d_out, cu_q, cu_k, options)

    def loss(q, k, v):
        out = flashport.varlen_attention(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend=backend, **options
        )
        return jnp.sum(out * d_out), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    np.testing.assert_allclose(out, want[0], atol=3e-5)
    for got, ref in zip(grads, want[1:], strict=True):
        np.testing.assert_allclose(got, ref, atol=3e-4)


def test_same_cu_seqlens_under_jit_keeps_the_packed_layout():
    """Self-attention packing (one ``cu_seqlens`` for both) runs on the packed rows as they are."""
    lens = [5, 1, 7]
    cu = jnp.asarray(np.cumsum([0, *lens]), jnp.int32)
    q, _, _, d_out, _, _ = _packed(1)
    q, d_out = q[: sum(lens)], d_out[: sum(lens)]
    f = jax.jit(
        lambda q, cu: flashport.varlen_attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    )
    text = str(jax.make_jaxpr(f)(q, cu))
    assert f"{2 * sum(lens)}," not in text  # no virtual layout of total_q + total_k rows
    want = _reference(q, q, q, d_out, np.asarray(cu), np.asarray(cu), dict(causal=True))[0]
    np.testing.assert_allclose(f(q, cu), want, atol=3e-5)


@pytest.mark.parametrize("case", ["causal_bottom_right", "window"])
def test_torch_varlen_and_flash_attn_drop_in_match_reference(case):
    torch = pytest.importorskip("torch")
    from flashport.integrations import flash_attn_compat

    q, k, v, d_out, cu_q, cu_k = _packed(2)
    options = CASES[case]
    want = _reference(q, k, v, d_out, cu_q, cu_k, options)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    tcu_q, tcu_k = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    for backend in ("auto", "torch"):
        out = flashport.torch.varlen_attention(
            tq, tk, tv, cu_seqlens_q=tcu_q, cu_seqlens_k=tcu_k, backend=backend, **options
        )
        out.backward(torch.tensor(d_out))
        np.testing.assert_allclose(out.detach().numpy(), want[0], atol=3e-5, err_msg=backend)
        for t, ref in zip((tq, tk, tv), want[1:], strict=True):
            np.testing.assert_allclose(t.grad.numpy(), ref, atol=3e-4, err_msg=backend)
            t.grad = None
    out, lse = flash_attn_compat.varlen_core(tq, tk, tv, tcu_q, tcu_k, return_lse=True, **options)
    np.testing.assert_allclose(out.detach().numpy(), want[0], atol=3e-5)
    assert lse.shape == (HQ, q.shape[0]) and torch.isinf(lse[:, -PAD_Q:]).all()


def _largest_intermediate(jaxpr) -> int:
    sizes = [0]
    for eqn in jaxpr.eqns:
        sizes.extend(int(np.prod(v.aval.shape)) for v in eqn.outvars if hasattr(v.aval, "shape"))
        sizes.extend(_largest_intermediate(sub) for sub in jaxprs_in_params(eqn.params))
    return max(sizes)


def test_no_total_by_total_array():
    """At T = 4 x 1025 the gradient's program holds nothing near T x T (the dense mask alone was)."""
    lens_q, lens_k = [1025, 1000, 1025, 1050], [1025, 1025, 990, 1060]
    tq, tk = sum(lens_q), sum(lens_k)
    q = jax.ShapeDtypeStruct((tq, 2, 16), jnp.float32)
    k = jax.ShapeDtypeStruct((tk, 2, 16), jnp.float32)
    cu_q, cu_k = np.cumsum([0, *lens_q]), np.cumsum([0, *lens_k])

    def loss(q, k):
        out = flashport.varlen_attention(
            q, k, k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, backend="blockwise"
        )
        return out.sum()

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(q, k)
    assert _largest_intermediate(jaxpr.jaxpr) < tq * tk // 16


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7)), min_size=1, max_size=4),
    st.booleans(),
    st.sampled_from(["bottom_right", "top_left"]),
    st.one_of(
        st.none(), st.tuples(st.one_of(st.none(), st.integers(0, 6)), st.one_of(st.none(), st.integers(0, 6)))
    ),
    st.integers(0, 2),
)
def test_plan_sees_exactly_each_sequences_band(lens, causal, align, window, pad):
    """The pairs the plan's single top-left call sees, mapped back to packed rows, are each
    sequence's own causal/window band (written out here), and nothing across sequences."""
    cu_q = np.cumsum([0, *(a for a, _ in lens)])
    cu_k = np.cumsum([0, *(b for _, b in lens)])
    tq, tk = int(cu_q[-1]) + pad, int(cu_k[-1]) + pad
    plan = varlen_plan(cu_q, cu_k, tq, tk, align=align)
    q_ids, kv_ids = np.asarray(plan.q_ids), np.asarray(plan.kv_ids)
    n_q, n_k = len(q_ids), len(kv_ids)
    i, j = np.arange(n_q)[:, None], np.arange(n_k)[None, :]
    left, right = window or (None, None)
    right = 0 if causal and right is None else (min(right, 0) if causal else right)
    seen = q_ids[:, None] == kv_ids[None, :]
    if left is not None:
        seen &= j >= i - left
    if right is not None:
        seen &= j <= i + right
    q_rows = np.arange(tq) if plan.q_rows is None else np.asarray(plan.q_rows)
    kv_rows = np.arange(tk) if plan.kv_rows is None else np.asarray(plan.kv_rows)
    got = np.zeros((tq, tk), bool)
    for a, b in zip(*np.nonzero(seen), strict=True):
        got[q_rows[a], kv_rows[b]] = True
    want = np.zeros((tq, tk), bool)
    for s, (sq, sk) in enumerate(lens):
        off = sk - sq if align == "bottom_right" else 0
        for t in range(sq):
            for u in range(sk):
                ok = (left is None or u >= t + off - left) and (right is None or u <= t + off + right)
                want[cu_q[s] + t, cu_k[s] + u] = ok
    np.testing.assert_array_equal(got, want)
    out_rows = np.arange(tq) if plan.out_rows is None else np.asarray(plan.out_rows)
    assert (q_ids[out_rows[: cu_q[-1]]] >= 0).all() and (q_ids[out_rows[cu_q[-1] :]] < 0).all()
    if plan.q_rows is not None:  # every packed query's output row reads that query back
        np.testing.assert_array_equal(q_rows[out_rows[: cu_q[-1]]], np.arange(cu_q[-1]))
