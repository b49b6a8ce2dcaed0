"""Helpers shared by the jaxpr-pass tests: counting fused sites and parity checks."""

from __future__ import annotations

import jax
import jax.extend
import numpy as np

import flashport


def count_sites(fn, *args) -> int:
    """Number of ``flashport_attention`` call sites in ``jax.make_jaxpr(fn)(*args)`` (structurally)."""
    return _count(jax.make_jaxpr(fn)(*args).jaxpr)


def _count(jaxpr) -> int:
    return len(attention_calls(jaxpr))


def attention_calls(jaxpr, *, nested=False) -> list:
    """The ``flashport_attention`` call equations of ``jaxpr``, searched through sub-jaxprs; with
    ``nested`` also inside such a call (the fused program never nests them)."""
    calls = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("jit", "pjit") and eqn.params.get("name") == "flashport_attention":
            calls.append(eqn)
            if not nested:
                continue
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            calls.extend(attention_calls(sub, nested=nested))
    return calls


def assert_fused(fn, args, sites, *, grad=True, atol=2e-5, rtol=2e-5, argnums=None, backend="auto"):
    """Fuse ``fn``; check the site count, output parity and (optionally) gradient parity."""
    fused = flashport.fuse_attention(fn, backend=backend)
    assert count_sites(fused, *args) == sites, flashport.find_attention(fn)(*args)
    argnums = tuple(range(len(args))) if argnums is None else argnums

    def loss(f):
        def inner(*a):
            out = jax.tree_util.tree_leaves(f(*a))
            return sum((o.astype(np.float32) * np.cos(np.arange(o.size).reshape(o.shape))).sum() for o in out)

        return inner

    def both(*a):  # one compilation for outputs and gradients of both programs
        res = (fn(*a), fused(*a))
        if grad:
            res += (jax.grad(loss(fn), argnums=argnums)(*a), jax.grad(loss(fused), argnums=argnums)(*a))
        return res

    res = jax.jit(both)(*args)
    for w, g in zip(jax.tree_util.tree_leaves(res[0]), jax.tree_util.tree_leaves(res[1]), strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=atol, rtol=rtol)
    if grad:
        for w, g in zip(jax.tree_util.tree_leaves(res[2]), jax.tree_util.tree_leaves(res[3]), strict=True):
            np.testing.assert_allclose(
                np.asarray(g, np.float32), np.asarray(w, np.float32), atol=atol * 10, rtol=rtol * 10
            )
    return fused
