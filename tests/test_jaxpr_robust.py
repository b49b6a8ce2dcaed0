"""The jaxpr pass never breaks a program: unusual sites and internal errors leave it exactly as written.

Each case checks output and gradient parity of ``fuse_attention(f)`` with ``f`` itself (the
original program is the reference) and what ``find_attention`` reports.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxpr_util import assert_fused

import flashport
from flashport.fusion import interpreter, patterns

B, N, T, D = 2, 3, 5, 8
SCALE = 1.0 / math.sqrt(D)


def _qkv(seed=0):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    return tuple(jax.random.normal(key, (B, N, T, D)) for key in (kq, kk, kv))


def _weights(q, k):
    return jax.nn.softmax(q @ k.swapaxes(-1, -2) * SCALE)


def _plain(q, k, v):
    return _weights(q, k) @ v


def test_returned_attention_maps_without_pv_do_not_crash():
    def f(q, k, v):
        return _weights(q, k)

    args = _qkv()
    assert_fused(f, args, 0)
    report = flashport.find_attention(f)(*args)
    assert not report.matches


def test_returned_weights_and_output_are_left_unchanged():
    def f(q, k, v):
        w = _weights(q, k)
        return w, w @ v

    args = _qkv()
    assert_fused(f, args, 0)
    (miss,) = flashport.find_attention(f)(*args).near_misses
    assert "other users" in miss.reason


def test_matcher_exception_leaves_program_unchanged_and_is_reported(monkeypatch):
    def boom(g, eqn, *options):
        raise RuntimeError("matcher bug")

    monkeypatch.setattr(patterns, "match_at", boom)
    args = _qkv()
    assert_fused(_plain, args, 0)
    (miss,) = flashport.find_attention(_plain)(*args).near_misses
    assert "internal error" in miss.reason and "RuntimeError: matcher bug" in miss.reason


def test_rewrite_exception_demotes_only_the_failing_site(monkeypatch):
    real_emit = interpreter.emit

    def emit(match, read, backend):
        if match.causal:
            raise ValueError("emitter bug")
        return real_emit(match, read, backend)

    monkeypatch.setattr(interpreter, "emit", emit)
    causal = jnp.tril(jnp.ones((T, T), bool))

    def f(q, k, v):
        s = q @ k.swapaxes(-1, -2) * SCALE
        return jax.nn.softmax(jnp.where(causal, s, -jnp.inf)) @ v + _plain(q, k, v)

    args = _qkv()
    assert_fused(f, args, 1)
    report = flashport.find_attention(f)(*args)
    assert len(report.matches) == 1
    (miss,) = report.near_misses
    assert "ValueError: emitter bug" in miss.reason


def test_analysis_exception_runs_the_original(monkeypatch):
    def boom(closed, *a, **k):
        raise KeyError("analysis bug")

    monkeypatch.setattr(flashport.fusion.fuse, "analyze", boom)
    args = _qkv()
    assert_fused(_plain, args, 0)
    (miss,) = flashport.find_attention(_plain)(*args).near_misses
    assert "analysis bug" in miss.reason
