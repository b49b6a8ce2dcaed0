"""fuse_attention composes with JAX transforms and finds attention inside nested jaxprs."""

from __future__ import annotations

import math

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_util import assert_fused, count_sites

import flashport

B, T, N, H = 2, 8, 4, 8


def _qkv(seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    return tuple(jax.random.normal(k, (B, T, N, H)) * 1.3 for k in ks)


def attn(q, k, v):
    """Causal hand-written attention used across these tests."""
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(H)
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -1e9)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)


def _close(a, b, tol=2e-5):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=tol, rtol=tol)


def test_jit_grad_vmap_in_either_order():
    q, k, v = _qkv()
    fused = flashport.fuse_attention(attn)
    loss = lambda f: lambda q, k, v: (f(q, k, v) ** 2).sum()  # noqa: E731
    want_g = jax.jit(jax.grad(loss(attn), argnums=(0, 1, 2)))(q, k, v)
    _close(jax.jit(jax.grad(loss(fused), argnums=(0, 1, 2)))(q, k, v), want_g)
    outer_jit = flashport.fuse_attention(jax.jit(attn))
    assert count_sites(outer_jit, q, k, v) == 1
    _close(jax.jit(jax.grad(loss(outer_jit), argnums=(0, 1, 2)))(q, k, v), want_g)
    # vmap outside and inside the pass
    qs, ks, vs = (jnp.stack([x, x * 0.5]) for x in (q, k, v))
    want = jax.jit(jax.vmap(attn))(qs, ks, vs)
    _close(jax.jit(jax.vmap(fused))(qs, ks, vs), want)
    inner = flashport.fuse_attention(jax.vmap(attn))
    assert count_sites(inner, qs, ks, vs) == 1
    _close(jax.jit(inner)(qs, ks, vs), want)
    _close(
        jax.jit(jax.vmap(jax.grad(loss(fused))))(qs, ks, vs),
        jax.jit(jax.vmap(jax.grad(loss(attn))))(qs, ks, vs),
    )


def test_checkpoint_both_orders():
    q, k, v = _qkv()
    assert_fused(jax.checkpoint(attn), (q, k, v), 1)
    fused = flashport.fuse_attention(attn)
    g = jax.grad(lambda q: jax.checkpoint(fused)(q, k, v).sum())(q)
    _close(g, jax.grad(lambda q: attn(q, k, v).sum())(q))


def test_nested_jit_custom_jvp_and_custom_vjp_bodies():
    q, k, v = _qkv()
    assert_fused(lambda q, k, v: jax.jit(attn)(q, k, v) + 1.0, (q, k, v), 1)

    @jax.custom_vjp
    def cv(q, k, v):
        return attn(q, k, v)

    cv.defvjp(lambda q, k, v: (attn(q, k, v), (q, k, v)), lambda res, g: jax.vjp(attn, *res)[1](g))
    assert_fused(cv, (q, k, v), 1)

    @jax.custom_jvp
    def cj(q, k, v):
        return attn(q, k, v)

    cj.defjvp(lambda primals, tangents: jax.jvp(attn, primals, tangents))
    assert_fused(cj, (q, k, v), 1)


def test_scan_over_layers_cond_and_while():
    q, k, v = _qkv()
    ws = jax.random.normal(jax.random.PRNGKey(9), (3, H, H)) * 0.3

    def layers(x, ws):
        def body(h, w):
            return h + attn(h @ w, h, h), None

        return jax.lax.scan(body, x, ws)[0]

    assert_fused(layers, (q, ws), 1)

    def branches(p, q, k, v):
        return jax.lax.cond(p > 0, attn, lambda q, k, v: v * 2.0, q, k, v)

    assert_fused(branches, (jnp.float32(1.0), q, k, v), 1, argnums=(1, 2, 3))
    fused = flashport.fuse_attention(branches)
    _close(fused(jnp.float32(-1.0), q, k, v), v * 2.0)

    def loop(n, q, k, v):
        return jax.lax.fori_loop(0, n, lambda i, x: attn(x, k, v), q)

    fused = flashport.fuse_attention(loop)
    assert count_sites(fused, 2, q, k, v) == 1
    _close(fused(2, q, k, v), loop(2, q, k, v))


def test_shared_jitted_body_is_rewritten_once_per_site():
    q, k, v = _qkv()
    shared = jax.jit(attn)
    assert_fused(lambda q, k, v: shared(q, k, v) + shared(k, q, v), (q, k, v), 2)


def test_softmax_custom_jvp_flag():
    q, k, v = _qkv()
    with jax.softmax_custom_jvp(True):
        assert_fused(attn, (q, k, v), 1)


def test_traces_once_per_signature_and_pytrees():
    calls = []

    def f(inputs, *, scale):
        calls.append(1)
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        p = jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, k) * scale, axis=-1)
        return {"out": jnp.einsum("bnts,bsnh->btnh", p, v), "aux": [q.sum()]}

    q, k, v = _qkv()
    fused = flashport.fuse_attention(f)
    for _ in range(3):
        out = fused({"q": q, "k": k, "v": v}, scale=0.5)
    assert len(calls) == 1 and fused.cache_size() == 1
    _close(out, f({"q": q, "k": k, "v": v}, scale=0.5))
    fused({"q": q, "k": k, "v": v}, scale=0.25)  # a new static value is a new signature
    assert fused.cache_size() == 2


def test_unmatched_program_runs_the_original():
    calls = []

    def f(x):
        calls.append(x)
        return jnp.sin(x) * 2

    fused = flashport.fuse_attention(f)
    x = jnp.arange(4.0)
    np.testing.assert_array_equal(fused(x), f(x))
    assert len(calls) == 3  # traced once, then the original called again, plus our direct call


def test_fuse_of_grad_is_refused_with_reason_but_runs():
    q, k, v = _qkv()
    g = jax.grad(lambda q, k, v: attn(q, k, v).sum())
    fused = flashport.fuse_attention(g)
    assert count_sites(fused, q, k, v) == 0
    _close(fused(q, k, v), g(q, k, v))
    rep = flashport.find_attention(g)(q, k, v)
    assert not rep.matches and rep.near_misses and all(s.reason for s in rep.near_misses)


def test_report_as_data_and_table():
    q, k, v = _qkv()

    def two(q, k, v):
        p = jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, k), axis=-1)
        return attn(q, k, v), jnp.einsum("bnts,bsnh->btnh", p, v), p

    rep = flashport.find_attention(two)(q, k, v)
    assert len(rep.matches) == 1 and len(rep.near_misses) == 1
    m = rep.matches[0].as_dict()
    assert m["location"].startswith(__file__) or "test_jaxpr_transforms.py" in m["location"]
    assert m["q"] == (B, T, N, H) and m["scale"] == pytest.approx(1 / math.sqrt(H), rel=1e-6)
    assert m["mask"] == "causal(bottom_right)" and m["gqa"] == 1 and m["dtypes"].startswith("float32")
    text = str(rep)
    assert "near-miss" in text and "other" in text
    assert "other users" in rep.near_misses[0].reason
    from rich.table import Table

    assert isinstance(rep.__rich__(), Table)
    assert rep.to_dicts()[1]["status"] == "near-miss"


def test_explicit_backend_is_passed_through():
    q, k, v = _qkv()
    assert_fused(attn, (q, k, v), 1, backend="blockwise")
    assert_fused(attn, (q, k, v), 1, backend="xla")


def test_rewrite_edits_the_jaxpr_without_retracing(monkeypatch):
    """Nested bodies are rewritten in place (no evaluation through ``run``), each distinct site is
    traced once, the result type-checks and a nested call keeps its params."""
    from flashport.fusion import fuse as fuse_mod
    from flashport.fusion import interpreter

    def no_run(*a, **kw):
        raise AssertionError("the rewrite retraced a body through interpreter.run")

    traced = []
    site_jaxpr = interpreter._site_jaxpr
    monkeypatch.setattr(interpreter, "run", no_run)
    monkeypatch.setattr(interpreter, "_site_jaxpr", lambda *a: traced.append(1) or site_jaxpr(*a))
    q, k, v = _qkv()
    ws = jax.random.normal(jax.random.PRNGKey(9), (3, H, H)) * 0.3
    inner = jax.jit(attn, inline=False)

    def program(q, k, v, ws):
        def body(h, w):
            return h + jax.checkpoint(attn)(h @ w, h, h), None

        x = jax.lax.scan(body, q, ws)[0]
        x = jax.lax.cond(x.sum() > 0, attn, lambda q, k, v: v, x, k, v)
        return x + inner(q, k, v) + inner(v, k, q) + attn(q, k, v)

    args = (q, k, v, ws)
    closed, _ = fuse_mod._trace(program, list(args), jax.tree_util.tree_structure((args, {})), (0, 1, 2, 3))
    plan = interpreter.analyze(closed)
    new = interpreter.rewrite(plan, "auto")
    jax.extend.core.check_jaxpr(new.jaxpr)
    assert len(traced) == 1  # five sites, one signature
    from jaxpr_util import _count

    assert _count(new.jaxpr) == 5
    calls = [e for e in new.jaxpr.eqns if e.primitive.name in ("jit", "pjit") and e.params["name"] == "attn"]
    assert len(calls) == 2 and calls[0].params["jaxpr"] is calls[1].params["jaxpr"]  # shared body, once
    assert calls[0].params["jaxpr"] is not inner.trace(q, k, v).jaxpr
    monkeypatch.undo()
    _close(flashport.fuse_attention(program)(*args), program(*args))


def test_bodies_that_need_constants_fall_back_to_retracing_that_call(monkeypatch):
    """A rewritten scan/cond/checkpoint body with constants is rebuilt by retracing that one call
    (its container cannot hold constants); a jit body or the top level keeps them."""
    from flashport.fusion import interpreter

    site_jaxpr = interpreter._site_jaxpr

    def with_const(match, inputs, backend):  # the same snippet, times an array constant of ones
        closed = site_jaxpr(match, inputs, backend)
        ones = np.ones(closed.out_avals[0].shape, closed.out_avals[0].dtype)
        return jax.make_jaxpr(lambda *a: [jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *a)[0] * ones])(
            *[jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in inputs]
        )

    retraced = []
    splice_retraced = interpreter._splice_retraced
    monkeypatch.setattr(interpreter, "_site_jaxpr", with_const)
    monkeypatch.setattr(
        interpreter,
        "_splice_retraced",
        lambda b, plan, eqn, backend: (
            retraced.append(eqn.primitive.name) or splice_retraced(b, plan, eqn, backend)
        ),
    )
    q, k, v = _qkv()
    ws = jax.random.normal(jax.random.PRNGKey(9), (3, H, H)) * 0.3

    def program(q, k, v, ws):
        x = jax.lax.scan(lambda h, w: (h + jax.checkpoint(attn)(h @ w, h, h), None), q, ws)[0]
        x = jax.lax.cond(x.sum() > 0, attn, lambda q, k, v: v, x, k, v)
        x = jax.lax.fori_loop(0, 2, lambda i, y: attn(y, k, v), x)  # a scan (static trip count)
        return x + jax.jit(attn)(q, k, v) + attn(q, k, v)

    args = (q, k, v, ws)
    fused = flashport.fuse_attention(program)
    assert count_sites(fused, *args) == 5
    # the checkpoint in the layer scan, the cond and the fori_loop's scan; the layer scan itself is
    # edited in place (the retraced checkpoint brings no constants), the jit and the top level too
    assert sorted(retraced) == ["cond", "remat2", "scan"], retraced
    _close(fused(*args), program(*args))
