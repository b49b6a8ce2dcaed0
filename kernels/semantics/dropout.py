"""Attention dropout as a pure function of position: every backend draws the same keep-mask.

The contract's dropout zeroes entries of the normalized probabilities P (after softmax, before P·V)
and scales the kept ones by ``1 / (1 - rate)``, as flash-attn and torch SDPA do. Which entries are
kept is not drawn from a stateful generator but computed by a counter-based hash of

    (seed words k0, k1; batch b; query head h; query position i; key position j)

so the XLA path, the blockwise loop, the Pallas TPU kernel (and its interpreter) and the torch
paths draw the identical mask, whatever their block sizes or sharding, and a backward pass
regenerates it instead of storing it. ``i`` and ``j`` are absolute positions in the canonical
arrays, ``h`` is the query head (GQA: not the kv head), all four count from 0.

The definition, in uint32 arithmetic (every ``+`` and ``*`` wraps modulo 2**32)::

    fmix(x)  = murmur3's 32-bit finalizer:
               x ^= x >> 16; x *= 0x85EBCA6B; x ^= x >> 13; x *= 0xC2B2AE35; x ^= x >> 16
    t_b      = fmix(k0 + 0x9E3779B9 * (b + 1))
    t_bh     = fmix(t_b ^ (k1 + 0x7F4A7C15 * (h + 1)))
    row_i    = fmix(t_bh + 0x9E3779B9 * (i + 1))
    bits_ij  = fmix(row_i ^ (0x27D4EB2F * (j + 1)))
    keep_ij  = bits_ij >= threshold(rate),   threshold(rate) = min(floor(rate * 2**32), 2**32 - 1)

For a fixed row, ``bits`` is a bijection of ``j`` (odd multiplier, fmix is invertible), and rows
are bijections of ``i``, so no two entries of a row or of a column share their bits.

The seed words come from the caller's key: :func:`seed_words` takes a JAX PRNG key (typed or a raw
uint32 key) and uses its two 32-bit words when it has two (the default threefry key:
``jax.random.key(s)`` has words ``(s >> 32, s & 0xFFFFFFFF)``), else folds the words with ``fmix``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flashport.kernels.semantics import dropout_constants as constants
from flashport.kernels.semantics.dropout_constants import (  # noqa: F401  (the hash constants, re-exported)
    BATCH_MUL,
    FMIX_M1,
    FMIX_M2,
    HEAD_MUL,
    KEY_MUL,
    MASK32,
    ROW_MUL,
    threshold,
)


def check_rate(name: str, rate) -> float:
    """Validate a dropout rate: a real number in [0, 1). Returns it as a float."""
    hint = "a traced or array rate cannot be used (the rate is static, like scale)"
    return constants.check_rate(name, rate, type_hint=hint)


def seed_words(rng):
    """Return the two uint32 seed words of a JAX PRNG key (typed ``jax.random.key`` or raw uint32).

    Raises TypeError naming ``dropout_rng`` when ``rng`` is not a key.
    """
    if rng is None:
        raise TypeError(
            "dropout_rng is required when dropout_rate > 0: pass a JAX PRNG key, e.g. "
            "dropout_rng=jax.random.key(0) (split it per step for fresh masks)"
        )
    dtype = getattr(rng, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        if getattr(rng, "shape", ()) != ():
            raise ValueError(
                f"dropout_rng must be a single key (shape ()), got a key array of shape {rng.shape}"
            )
        words = jax.random.key_data(rng)
    else:
        words = jnp.asarray(rng)
        if words.dtype != jnp.uint32 or words.ndim != 1:
            raise TypeError(
                f"dropout_rng must be a JAX PRNG key (jax.random.key(seed) or jax.random.PRNGKey(seed)), "
                f"got {getattr(rng, 'dtype', type(rng).__name__)} of shape {getattr(rng, 'shape', ())}"
            )
    words = jnp.ravel(words).astype(jnp.uint32)
    if words.shape[0] == 2:
        return words
    folded = [jnp.uint32(0), jnp.uint32(0)]
    for n in range(words.shape[0]):
        folded[n % 2] = _fmix(folded[n % 2] ^ words[n], _mul_jnp)
    return jnp.stack(folded)


def _mul_jnp(x, c):
    return x * jnp.uint32(c)


def _fmix(x, mul):
    """murmur3 fmix32; ``mul(x, const)`` multiplies modulo 2**32 in the caller's array type."""
    x = x ^ (x >> 16)
    x = mul(x, FMIX_M1)
    x = x ^ (x >> 13)
    x = mul(x, FMIX_M2)
    return x ^ (x >> 16)


def head_seed(seed, b, h):
    """``t_bh`` of the definition for batch ``b`` and query head ``h`` (uint32 arrays that broadcast)."""
    k0, k1 = seed[0], seed[1]
    b = jnp.asarray(b).astype(jnp.uint32)
    h = jnp.asarray(h).astype(jnp.uint32)
    t_b = _fmix(k0 + jnp.uint32(BATCH_MUL) * (b + jnp.uint32(1)), _mul_jnp)
    return _fmix(t_b ^ (k1 + jnp.uint32(HEAD_MUL) * (h + jnp.uint32(1))), _mul_jnp)


def hash_bits(t_bh, q_pos, k_pos):
    """``bits_ij`` of the definition; ``t_bh``, ``q_pos`` and ``k_pos`` broadcast against each other."""
    i = jnp.asarray(q_pos).astype(jnp.uint32)
    j = jnp.asarray(k_pos).astype(jnp.uint32)
    row = _fmix(t_bh + jnp.uint32(ROW_MUL) * (i + jnp.uint32(1)), _mul_jnp)
    return _fmix(row ^ (jnp.uint32(KEY_MUL) * (j + jnp.uint32(1))), _mul_jnp)


def keep_mask(rate: float, t_bh, q_pos, k_pos):
    """Boolean keep-mask for head seeds ``t_bh`` (see :func:`head_seed`) at the given positions."""
    return hash_bits(t_bh, q_pos, k_pos) >= jnp.uint32(threshold(rate))


def apply(p, keep, rate: float):
    """Dropped and rescaled probabilities: ``where(keep, p / (1 - rate), 0)``."""
    return jnp.where(keep, p * (1.0 / (1.0 - rate)), 0.0)


def grouped_head_seeds(seed, batch: int, hkv: int, group: int):
    """``t_bh`` for grouped queries [B, Hkv, G]: query head ``h = kv_head * G + g`` (uint32 [B, Hkv, G])."""
    b = jnp.arange(batch, dtype=jnp.uint32)[:, None, None]
    h = (
        jnp.arange(hkv, dtype=jnp.uint32)[:, None] * jnp.uint32(group) + jnp.arange(group, dtype=jnp.uint32)
    )[None]
    return head_seed(seed, b, h)
