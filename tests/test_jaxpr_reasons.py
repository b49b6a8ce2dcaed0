"""Near-miss reasons name the first failed property, the equation where it failed and its source line."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp

import flashport

B, N, T, D = 2, 3, 5, 8


def _qkv(seed=0):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    return tuple(jax.random.normal(key, (B, N, T, D)) for key in (kq, kk, kv))


def _line_of(fn, text):
    src, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(src) if text in line)


def _reason(fn):
    (miss,) = flashport.find_attention(fn)(*_qkv()).near_misses
    return miss.reason


def test_nonlinear_op_on_scores_names_the_op_and_line():
    def f(q, k, v):
        s = jnp.sin(q @ k.swapaxes(-1, -2))  # MARK-sin
        return jax.nn.softmax(s) @ v

    reason = _reason(f)
    assert "`sin` on the scores path" in reason
    assert f"[at `sin`, {__file__}:{_line_of(f, 'MARK-sin')}" in reason


def test_rescaled_probabilities_name_the_multiplication():
    def f(q, k, v):
        p = jax.nn.softmax(q @ k.swapaxes(-1, -2))
        p = p * jnp.linspace(0.5, 1.0, T)  # MARK-mul
        return p @ v

    reason = _reason(f)
    assert reason.startswith("the probabilities are multiplied by a tensor")
    assert f"[at `mul`, {__file__}:{_line_of(f, 'MARK-mul')}" in reason


def test_pv_over_the_wrong_axis_names_the_pv_product():
    def f(q, k, v):
        p = jax.nn.softmax(q @ k.swapaxes(-1, -2))
        return jnp.einsum("bnts,bnsd->bntd", p.swapaxes(-1, -2), v)  # MARK-pv

    reason = _reason(f)
    assert (
        "does not contract the softmax (key) axis" in reason or "free dims are not the query dims" in reason
    )
    assert f"{__file__}:{_line_of(f, 'MARK-pv')}" in reason


def test_escaping_scores_name_the_dot():
    def f(q, k, v):
        s = q @ k.swapaxes(-1, -2)  # MARK-dot
        return jax.nn.softmax(s) @ v, s.sum()

    reason = _reason(f)
    assert "also used elsewhere" in reason
    assert f"{__file__}:{_line_of(f, 'MARK-dot')}" in reason
