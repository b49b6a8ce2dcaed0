"""The contract's attention dropout: one keep-mask (a position hash of the key) on every backend.

Checked against tests/reference.py's float64 attention, whose keep-mask is written from the
definition in the contract's docs (kernels/semantics/dropout.py), not imported from it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashport
from flashport.kernels.contract import registry
from tests.reference import dropout_keep, reference_attention, reference_attention_vjp

jax.config.update("jax_enable_x64", False)


def _words(seed: int):
    """The seed words of jax.random.key(seed) for a non-negative 32-bit seed."""
    return (seed >> 32, seed & 0xFFFFFFFF)


def _inputs(b=2, sq=48, sk=64, hq=4, hkv=2, d=16, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, sq, hq, d), jnp.float32)
    k = jax.random.normal(ks[1], (b, sk, hkv, d), jnp.float32)
    v = jax.random.normal(ks[2], (b, sk, hkv, d), jnp.float32)
    do = jax.random.normal(ks[3], (b, sq, hq, d), jnp.float32)
    return q, k, v, do


def _dropout_backends():
    """Backends that claim dropout and run on this (CPU) machine."""
    return [
        name
        for name, info in registry.all_backends().items()
        if "dropout" in info.features and "cpu" in info.platforms and info.available
    ]


CONFIGS = {
    "plain": {},
    "causal_bottom_right": dict(causal=True),
    "causal_top_left_window": dict(causal=True, window=(8, None), align="top_left"),
    "softcap_bias": dict(softcap=5.0, bias="bias"),
    "segments": dict(segments=True),
}


def _kwargs(cfg, b, hq, sq, sk):
    kw = {k: v for k, v in cfg.items() if k not in ("bias", "segments")}
    if cfg.get("bias"):
        kw["bias"] = jnp.linspace(-1.0, 1.0, hq * sq * sk).reshape(1, hq, sq, sk)
    if cfg.get("segments"):
        kw["q_segment_ids"] = jnp.broadcast_to((jnp.arange(sq) >= sq // 3).astype(jnp.int32), (b, sq))
        kw["kv_segment_ids"] = jnp.broadcast_to((jnp.arange(sk) >= sk // 2).astype(jnp.int32), (b, sk))
    return kw


def _backend_config_pairs():
    """Every (backend, config); the interpreters (10-20 s a case) run two configs by default and
    the rest under ``pytest -m slow`` (their kernels have their own dropout tests)."""
    for backend in _dropout_backends():
        for cfg in CONFIGS:
            slow = backend.endswith("_interpret") and cfg not in ("causal_bottom_right", "segments")
            yield pytest.param(backend, cfg, id=f"{cfg}-{backend}", marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize(("backend", "cfg"), list(_backend_config_pairs()))
def test_dropout_forward_and_grad_match_float64_reference(backend, cfg):
    """For a fixed key, out, lse and the gradients equal the float64 reference with the same mask."""
    q, k, v, do = _inputs()
    b, sq, hq, _ = q.shape
    sk = k.shape[1]
    kw = _kwargs(CONFIGS[cfg], b, hq, sq, sk)
    rate, seed = 0.25, 7

    def f(q, k, v):
        return flashport.attention(
            q,
            k,
            v,
            dropout_rate=rate,
            dropout_rng=jax.random.key(seed),
            backend=backend,
            return_lse=True,
            **kw,
        )

    (out, lse), vjp = jax.vjp(f, q, k, v)
    dq, dk, dv = vjp((do, jnp.zeros_like(lse)))
    ref_out, ref_lse = reference_attention(q, k, v, dropout_rate=rate, dropout_seed=_words(seed), **kw)
    rdq, rdk, rdv, _ = reference_attention_vjp(
        q, k, v, do, dropout_rate=rate, dropout_seed=_words(seed), **kw
    )
    np.testing.assert_allclose(out, ref_out, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-5, rtol=2e-5)
    for got, want in ((dq, rdq), (dk, rdk), (dv, rdv)):
        np.testing.assert_allclose(got, want, atol=5e-5, rtol=5e-5)


def _extract_mask(backend, rate, key, b=1, h=2, s=128):
    """Read a backend's keep-mask back: with V = I and uniform scores, out = Z / ((1 - rate) * S)."""
    q = jnp.zeros((b, s, h, s), jnp.float32)
    v = jnp.broadcast_to(jnp.eye(s, dtype=jnp.float32)[None, :, None, :], (b, s, h, s))
    out = flashport.attention(q, q, v, dropout_rate=rate, dropout_rng=key, backend=backend)
    return np.asarray(jnp.swapaxes(out, 1, 2)) != 0  # [B, H, Sq, Sk]


@pytest.mark.parametrize("backend", _dropout_backends())
def test_every_backend_draws_the_reference_mask(backend):
    mask = _extract_mask(backend, 0.4, jax.random.key(3))
    np.testing.assert_array_equal(mask, dropout_keep(_words(3), 0.4, mask.shape))


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_kept_fraction_is_one_minus_rate_within_binomial_error(rate):
    mask = _extract_mask("xla", rate, jax.random.key(11), b=2, h=4, s=128)
    n = mask.size
    kept = mask.mean()
    sigma = np.sqrt(rate * (1 - rate) / n)
    assert abs(kept - (1 - rate)) < 5 * sigma, (kept, 1 - rate, sigma)
    # No structure by row or column: each row's kept count is binomial too (loose 6-sigma bound).
    rows = mask.reshape(-1, mask.shape[-1]).mean(axis=1)
    row_sigma = np.sqrt(rate * (1 - rate) / mask.shape[-1])
    assert np.all(np.abs(rows - (1 - rate)) < 6 * row_sigma)


def test_mean_over_keys_is_the_no_dropout_output():
    q, k, v, _ = _inputs(b=1, sq=16, sk=32, hq=2, hkv=2)
    rate, n = 0.3, 400
    plain = flashport.attention(q, k, v, backend="xla")
    run = jax.jit(
        jax.vmap(lambda key: flashport.attention(q, k, v, dropout_rate=rate, dropout_rng=key, backend="xla"))
    )
    outs = np.asarray(run(jax.random.split(jax.random.key(0), n)))
    mean, sem = outs.mean(axis=0), outs.std(axis=0) / np.sqrt(n)
    assert np.all(np.abs(mean - np.asarray(plain)) < 5 * sem + 1e-6)


def test_different_keys_give_different_masks_and_the_same_key_the_same_output():
    q, k, v, _ = _inputs()
    a = flashport.attention(q, k, v, dropout_rate=0.2, dropout_rng=jax.random.key(1), backend="xla")
    a2 = flashport.attention(q, k, v, dropout_rate=0.2, dropout_rng=jax.random.key(1), backend="xla")
    c = flashport.attention(q, k, v, dropout_rate=0.2, dropout_rng=jax.random.key(2), backend="xla")
    np.testing.assert_array_equal(a, a2)
    assert not np.allclose(a, c)
    m1 = _extract_mask("xla", 0.5, jax.random.key(1))
    m2 = _extract_mask("xla", 0.5, jax.random.key(2))
    assert 0.4 < (m1 != m2).mean() < 0.6  # independent masks disagree on about half the entries


def test_raw_and_typed_keys_give_the_same_mask():
    typed = _extract_mask("xla", 0.5, jax.random.key(5))
    raw = _extract_mask("xla", 0.5, jax.random.PRNGKey(5))
    np.testing.assert_array_equal(typed, raw)


def test_rate_zero_is_no_dropout_and_needs_no_key():
    q, k, v, _ = _inputs()
    np.testing.assert_array_equal(
        flashport.attention(q, k, v, dropout_rate=0.0, backend="xla"),
        flashport.attention(q, k, v, backend="xla"),
    )


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(dropout_rate=0.1), TypeError, "dropout_rng is required"),
        (dict(dropout_rate=1.0, dropout_rng=jax.random.key(0)), ValueError, "dropout_rate must be in [0, 1)"),
        (
            dict(dropout_rate=-0.1, dropout_rng=jax.random.key(0)),
            ValueError,
            "dropout_rate must be in [0, 1)",
        ),
        (
            dict(dropout_rate=jnp.float32(0.1), dropout_rng=jax.random.key(0)),
            TypeError,
            "dropout_rate must be a Python float",
        ),
        (dict(dropout_rate=0.1, dropout_rng=3), TypeError, "dropout_rng must be a JAX PRNG key"),
        (
            dict(dropout_rate=0.1, dropout_rng=jax.random.split(jax.random.key(0), 2)),
            ValueError,
            "single key",
        ),
    ],
)
def test_bad_dropout_arguments_name_the_argument_and_the_fix(kwargs, error, words):
    q, k, v, _ = _inputs()
    with pytest.raises(error, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        flashport.attention(q, k, v, **kwargs)


def test_cudnn_refuses_dropout_with_the_reason_and_auto_falls_back():
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match=r"backend='cudnn' does not support this call: .*dropout"):
        flashport.attention(
            q.astype(jnp.bfloat16),
            k.astype(jnp.bfloat16),
            v.astype(jnp.bfloat16),
            dropout_rate=0.1,
            dropout_rng=jax.random.key(0),
            backend="cudnn",
        )
    (_, _, _, _, _, _, _, seed), call = flashport.kernels.contract.api.prepare(
        q, k, v, dropout_rate=0.1, dropout_rng=jax.random.key(0)
    )
    assert "dropout" in call.features and seed.dtype == jnp.uint32
    assert registry.choose("cuda", call)[0] != "cudnn"


def test_dropout_under_jit_and_vmap_over_keys_matches_eager():
    q, k, v, _ = _inputs()
    keys = jax.random.split(jax.random.key(9), 3)
    batched = jax.jit(jax.vmap(lambda key: flashport.attention(q, k, v, dropout_rate=0.2, dropout_rng=key)))(
        keys
    )
    for n in range(3):
        np.testing.assert_allclose(
            batched[n],
            flashport.attention(q, k, v, dropout_rate=0.2, dropout_rng=keys[n], backend="xla"),
            atol=2e-6,
            rtol=2e-6,
        )


@pytest.mark.parametrize("blocks", [(16, 32), (32, 16), (48, 64), (7, 9)])
def test_blockwise_dropout_is_independent_of_block_sizes(blocks):
    """Ragged blocks (Sq=48, Sk=64 not multiples of 7/9) and GQA: same output and grads as the reference."""
    q, k, v, do = _inputs()
    choice = registry.use("blockwise", block_q=blocks[0], block_k=blocks[1])

    def f(q, k, v):
        return flashport.attention(
            q, k, v, causal=True, dropout_rate=0.3, dropout_rng=jax.random.key(4), backend=choice
        )

    out, vjp = jax.vjp(f, q, k, v)
    grads = vjp(do)
    kw = dict(causal=True, dropout_rate=0.3, dropout_seed=_words(4))
    np.testing.assert_allclose(out, reference_attention(q, k, v, **kw)[0], atol=2e-5, rtol=2e-5)
    for got, want in zip(grads, reference_attention_vjp(q, k, v, do, **kw)[:3], strict=True):
        np.testing.assert_allclose(got, want, atol=5e-5, rtol=5e-5)
