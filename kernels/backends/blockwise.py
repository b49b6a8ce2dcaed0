"""The ``blockwise`` backend: flash attention in plain XLA, O(S) memory forward and backward.

Forward: ``lax.map`` over query blocks; for each, a loop over only the key blocks that causal/window
structure leaves visible (the loop bounds are static per query block, so fully masked blocks cost
nothing), carrying the f32 online-softmax state (running max, sum, accumulator). The output and
the log-sum-exp are saved for the backward.

Backward (``custom_vjp``), recomputing probabilities from the saved lse, so training memory stays
O(S) too. Without a bias: one pass (scan over key blocks, loop over the query blocks that see them)
that accumulates dK/dV per key block and dQ in place in an O(S) buffer, so each tile costs one exp
and five matmuls; like the forward's, its masked tiles that a query block sees only in part (the top
of the causal diagonal) run per key block of ``block_q`` when it divides ``block_k``. With a bias, the FA2 split: a dQ pass (map over query blocks, loop over their key
blocks) that also produces the bias gradient block by block, and a dK/dV pass. Dropout (:mod:`flashport.kernels.semantics.dropout`)
hashes each tile's positions, so the backward regenerates the forward's mask instead of storing it.

Options: ``block_q`` and ``block_k`` (defaults 256 and 512; ``flashport.kernels.contract.registry.use(
"blockwise", block_q=128)``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flashport.kernels.contract import registry
from flashport.kernels.contract.spec import FEATURES, AttentionSpec, softcap_grad
from flashport.kernels.semantics import dropout
from flashport.kernels.semantics.block_mask import EMPTY, FULL, PARTIAL, tile_classes
from flashport.kernels.semantics.block_ranges import block_tables
from flashport.kernels.semantics.mods import Mods
from flashport.kernels.semantics.padding import pad_broadcastable, pad_to
from flashport.kernels.semantics.scores import (
    group_broadcastable,
    group_heads,
    grouped_einsum,
    matmul_precision,
    mod_score_grad,
    tile_logits,
)

# Measured on a 2-core XLA:CPU host at S=4096, D=64 (causal): 256x512 tiles beat 512x512 by ~1.5x
# (less wasted work on diagonal blocks, scores tile stays in L2).
DEFAULT_BLOCK_Q = 256
DEFAULT_BLOCK_K = 512
# auto on CPU: below this many keys the materialized xla path is faster and small enough.
MIN_KEYS_FOR_BLOCKWISE = 1024


def blockwise_attention(
    q, k, v, bias, mask, q_seg, kv_seg, seed, *, spec: AttentionSpec, options, mods: Mods | None = None
):
    """Blockwise attention over the canonical arrays; returns ``(out, lse)``.

    ``mods`` (:mod:`flashport.kernels.semantics.mods`): the score_mod runs on every tile, the mask_mod on the
    tiles its block mask marks partial; empty tiles are skipped. Gradients reach the arrays the
    score_mod closes over through one more pass over the visited tiles (dropped by XLA when unused).
    """
    unknown = set(options) - {"block_q", "block_k"}
    if unknown:
        raise ValueError(f"backend 'blockwise' takes options block_q, block_k; got unknown {sorted(unknown)}")
    block_q = _block(options.get("block_q", DEFAULT_BLOCK_Q), spec.seq_q, "block_q")
    block_k = _block(options.get("block_k", DEFAULT_BLOCK_K), spec.seq_k, "block_k")
    tiling = _Tiling(spec, block_q, block_k)
    return _attention(tiling, q, k, v, bias, mask, q_seg, kv_seg, seed, mods)


def blockwise_attention_backward(
    q,
    k,
    v,
    bias,
    mask,
    q_seg,
    kv_seg,
    seed,
    out,
    lse,
    d_out,
    d_lse,
    *,
    spec: AttentionSpec,
    options,
    mods=None,
):
    """The residual backward (the ``custom_vjp`` backward: dQ pass, dK/dV pass) from ``out`` and
    ``lse``; returns ``(dq, dk, dv, dbias)`` without running the forward again."""
    unknown = set(options) - {"block_q", "block_k"}
    if unknown:
        raise ValueError(f"backend 'blockwise' takes options block_q, block_k; got unknown {sorted(unknown)}")
    block_q = _block(options.get("block_q", DEFAULT_BLOCK_Q), spec.seq_q, "block_q")
    block_k = _block(options.get("block_k", DEFAULT_BLOCK_K), spec.seq_k, "block_k")
    residuals = (q, k, v, bias, mask, q_seg, kv_seg, seed, out.astype(q.dtype), lse, mods)
    return _backward(_Tiling(spec, block_q, block_k), residuals, (d_out.astype(q.dtype), d_lse))[:4]


def _block(value, seq, name):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"blockwise option {name} must be a positive int, got {value!r}")
    return int(min(value, seq))


def _split_ranges(full, lo, hi):
    """``[4, n]`` int32 bounds ``(lo, a, b, hi)`` per block: its visited range ``[lo, hi)`` split into
    masked ``[lo, a)``, mask-free ``[a, b)`` and masked ``[b, hi)``. ``full[n, m]`` marks the tiles
    that need no positional mask; where a block's mask-free tiles are not one run inside its range,
    the whole range counts as masked (correct, only slower)."""
    bounds = np.empty((4, len(lo)), np.int32)
    for n, (l, h) in enumerate(zip(lo, hi, strict=True)):
        runs = np.flatnonzero(full[n, l:h]) + l
        a = b = h
        if runs.size and runs[-1] - runs[0] + 1 == runs.size:
            a, b = runs[0], runs[-1] + 1
        bounds[:, n] = (l, a, b, h)
    return bounds


def _fine_ranges(t, spec):
    """``[4, nq]`` bounds ``(lo, a, b, hi)`` in key blocks of ``t.fine_bk``: the fine blocks
    ``[lo, a)`` and ``[b, hi)`` that query block i visits outside its mask-free coarse blocks (the
    coarse ``[a, b)`` of ``t.row_split`` covers fine ``[a·r, b·r)``, r = bk / fine_bk)."""
    fine = block_tables(spec, t.bq, t.fine_bk)
    r = t.bk // t.fine_bk
    lo, hi = np.array(fine.row_lo, np.int32), np.array(fine.row_hi, np.int32)
    a = np.minimum(t.row_split[1] * r, hi)
    b = np.maximum(np.minimum(t.row_split[2] * r, hi), a)
    return np.stack([lo, a, b, hi])


def _fine_cols(t, spec):
    """The backward's masked query ranges per coarse key block j, as ``(whole, fine)``: ``whole``
    ``[2, 2, nk]`` (lo, hi) of the masked query blocks that see every fine sub-block of j (whole
    [bq, bk] masked tiles), ``fine`` ``[r, 4, 2, nk]`` per fine sub-block s (fine block j·r + s,
    r = bk / fine_bk) the other masked query blocks that see it. A diagonal query block that sees
    only part of j so computes only the fine blocks it sees, the rest keep whole tiles."""
    tables = block_tables(spec, t.bq, t.fine_bk)
    r = t.bk // t.fine_bk
    f_lo = np.zeros(t.nk * r, np.int32)
    f_hi = np.zeros(t.nk * r, np.int32)  # fine blocks past seq_k (key padding) stay empty
    f_lo[: len(tables.col_lo)], f_hi[: len(tables.col_hi)] = tables.col_lo, tables.col_hi
    f_lo, f_hi = f_lo.reshape(t.nk, r).T, f_hi.reshape(t.nk, r).T
    lo, a, b, hi = t.col_split
    masked = ((lo, a), (b, hi))
    c_lo, c_hi = f_lo.max(axis=0), np.maximum(f_hi.min(axis=0), f_lo.max(axis=0))
    whole = np.array([_clip(x, y, c_lo, c_hi) for x, y in masked], np.int32)
    fine = np.empty((r, 4, 2, t.nk), np.int32)
    for s in range(r):
        parts = []
        for x, y in masked:
            x, y = _clip(x, y, f_lo[s], f_hi[s])
            parts += [_clip(x, y, x, c_lo), _clip(x, y, c_hi, y)]
        fine[s] = parts
    return whole, fine


def _clip(lo, hi, at_least, below):
    """``[lo, hi) ∩ [at_least, below)`` elementwise, as (lo, hi) with hi >= lo."""
    lo2 = np.maximum(lo, at_least)
    return lo2, np.maximum(np.minimum(hi, below), lo2)


def _loop_split(split, n, step, init, clamp=None):
    """``step(m, carry, positional)`` over block ``n``'s visited range as three loops (masked,
    mask-free, masked), so no tile pays a ``cond`` and mask-free tiles skip the position mask;
    ``clamp(lo, hi)``: each loop's bounds narrowed (a block mask's span, :meth:`_Inputs.span`)."""
    lo, a, b, hi = (jnp.asarray(split[r])[n] for r in range(4))
    if clamp is not None:
        (lo, a), (a, b), (b, hi) = clamp(lo, a), clamp(a, b), clamp(b, hi)
    carry = jax.lax.fori_loop(lo, a, lambda m, c: step(m, c, True), init)
    carry = jax.lax.fori_loop(a, b, lambda m, c: step(m, c, False), carry)
    return jax.lax.fori_loop(b, hi, lambda m, c: step(m, c, True), carry)


class _Tiling:
    """Static block geometry: block sizes, counts and, per block, the range of blocks it meets."""

    def __init__(self, spec: AttentionSpec, block_q: int, block_k: int):
        self.spec, self.bq, self.bk = spec, block_q, block_k
        self.nq = -(-spec.seq_q // block_q)
        self.nk = -(-spec.seq_k // block_k)
        # full_lo/full_hi: key blocks every query of the block sees entirely (no positional mask needed).
        t = block_tables(spec, block_q, block_k)
        self.kv_lo, self.kv_hi = np.array(t.row_lo, np.int32), np.array(t.row_hi, np.int32)
        self.q_lo, self.q_hi = np.array(t.col_lo, np.int32), np.array(t.col_hi, np.int32)
        self.full_lo, self.full_hi = np.array(t.full_lo, np.int32), np.array(t.full_hi, np.int32)
        full = np.zeros((self.nq, self.nk), bool)
        for i in range(self.nq):
            full[i, self.full_lo[i] : self.full_hi[i]] = True
        # Per block, its visited range split [lo, a) masked, [a, b) mask-free, [b, hi) masked.
        self.row_split = _split_ranges(full, self.kv_lo, self.kv_hi)
        self.col_split = _split_ranges(full.T, self.q_lo, self.q_hi)
        # The forward's masked tiles (the causal diagonal) use key blocks of bq when bq divides bk:
        # a [bq, bk] tile on the diagonal computes up to bk - bq keys no query of the block sees.
        self.fine_bk = block_q if block_k > block_q and block_k % block_q == 0 else block_k
        self.fine_rows = _fine_ranges(self, spec) if self.fine_bk < block_k else None
        self.fine_cols = _fine_cols(self, spec) if self.fine_bk < block_k else None

    def __hash__(self):
        return hash((self.spec, self.bq, self.bk))

    def __eq__(self, other):
        return isinstance(other, _Tiling) and (self.spec, self.bq, self.bk) == (
            other.spec,
            other.bq,
            other.bk,
        )

    @property
    def visited_blocks(self) -> int:
        """How many (query block, key block) tiles the forward computes."""
        return int(np.sum(self.kv_hi - self.kv_lo))


def _slice(x, axis, start, size):
    """Block ``start*size`` of ``x`` along ``axis``, or ``x`` itself where that axis is broadcast (1)."""
    if x is None or x.shape[axis] == 1:
        return x
    return jax.lax.dynamic_slice_in_dim(x, start * size, size, axis)


class _Inputs:
    """Padded, grouped arrays and per-tile accessors."""

    def __init__(self, t: _Tiling, q, k, v, bias, mask, q_seg, kv_seg, seed, mods=None, *, prescale=False):
        hkv = k.shape[1]
        self.mods = mods
        # Block-mask classes per key block size the loops use ([nq, nk] for all heads at once).
        self.classes = None
        if mods is not None and mods.blocks is not None:
            self.classes = {
                bk: tile_classes(mods.blocks, t.bq, bk, per_head=False) for bk in {t.bk, t.fine_bk}
            }
            if t.fine_bk < t.bk:  # the fine key blocks of the last coarse one's padding are empty
                fine = self.classes[t.fine_bk]
                width = t.nk * (t.bk // t.fine_bk) - fine.shape[1]
                self.classes[t.fine_bk] = jnp.pad(fine, ((0, 0), (0, width)), constant_values=EMPTY)
        # Per key block size, per row and per column of tiles, the [first, last] non-empty ones.
        self.spans = None if self.classes is None else {bk: _spans(c) for bk, c in self.classes.items()}
        sqp, skp = t.nq * t.bq, t.nk * t.bk
        self.t, self.prescaled = t, prescale
        if prescale:  # one multiply of q instead of one per score tile
            q = (q.astype(jnp.float32) * t.spec.scale).astype(q.dtype)
        self.q = pad_to(group_heads(q, hkv), 3, sqp)
        self.k = pad_to(k, 2, skp)
        self.v = pad_to(v, 2, skp)
        self.bias = pad_broadcastable(group_broadcastable(bias, hkv), {3: sqp, 4: skp})
        self.mask = pad_broadcastable(group_broadcastable(mask, hkv), {3: sqp, 4: skp}, False)
        self.q_seg = pad_to(q_seg, 1, sqp)
        self.kv_seg = pad_to(kv_seg, 1, skp)
        # Dropout: per (batch, query head) seeds [B, Hkv, G, 1, 1]; tiles hash their own positions.
        self.head_seeds = None
        if t.spec.dropout_rate > 0:
            self.head_seeds = dropout.grouped_head_seeds(seed, q.shape[0], hkv, q.shape[1] // hkv)[
                ..., None, None
            ]

    def dropped(self, i, j, p, bk=None):
        """``p`` of tile (i, j) with the contract's dropout applied (``p`` itself without dropout);
        ``bk``: the tile's key block size (default the tiling's)."""
        if self.head_seeds is None:
            return p
        t = self.t
        bk = bk or t.bk
        q_pos = (i * t.bq + jnp.arange(t.bq))[:, None]
        k_pos = j * bk + jnp.arange(bk)
        keep = dropout.keep_mask(t.spec.dropout_rate, self.head_seeds, q_pos, k_pos)
        return dropout.apply(p, keep, t.spec.dropout_rate)

    def span(self, axis, n, bk=None):
        """``clamp(lo, hi)`` for the loops over tile row (``axis=0``: key blocks of query block
        ``n``) or column (``axis=1``: query blocks of key block ``n``, of size ``bk``): the range
        narrowed to the tiles from the first to the last one the block mask does not mark empty,
        so a loop no longer runs (and switches on) the empty tiles around them. None without a
        block mask."""
        if self.spans is None:
            return None
        first, end = self.spans[bk or self.t.bk][axis]
        first, end = first[n], end[n]

        def clamp(lo, hi):
            lo = jnp.maximum(lo, first)
            return lo, jnp.maximum(jnp.minimum(hi, end), lo)

        return clamp

    def sparse(self, i, j, bk, carry, run, partial=None):
        """``run(carry, mask_mod)`` for tile (i, j) (key block size ``bk``) as its block-mask class
        says: skipped when empty, without the mask_mod test when full; ``partial(carry)`` in place
        of ``run(carry, True)`` for a partial tile (see :meth:`refine`)."""
        if self.classes is None:
            return run(carry, True)
        branches = {
            EMPTY: lambda c: c,
            PARTIAL: partial or (lambda c: run(c, True)),
            FULL: lambda c: run(c, False),
        }
        return jax.lax.switch(
            self.classes[bk or self.t.bk][i, j], [branches[n] for n in sorted(branches)], carry
        )

    def refine(self, i, j, bk, step):
        """The ``partial`` of :meth:`sparse` for coarse tile (i, j): its fine sub-tiles (key blocks
        of ``t.fine_bk``), each by its own class, ``carry = step(jf, carry)`` for fine block jf in
        order. As the built-in masks' diagonal runs in fine blocks, a mask_mod's partial coarse tile
        (a causal or sliding-window diagonal) so skips the fine blocks no query of it sees. None
        without a block mask, for a fine tile, or when the tiling has no finer key blocks."""
        t = self.t
        if self.classes is None or (bk or t.bk) != t.bk or t.fine_bk == t.bk:
            return None
        r = t.bk // t.fine_bk

        def run(carry):
            for s in range(r):
                carry = step(j * r + s, carry)
            return carry

        return run

    def mod_grad(self, i, j, raw, bk=None):
        """d score_mod / d score of tile (i, j) (None without a score_mod)."""
        t = self.t
        bk = bk or t.bk
        bias = _slice(_slice(self.bias, 3, i, t.bq), 4, j, bk)
        q_pos, k_pos = i * t.bq + jnp.arange(t.bq), j * bk + jnp.arange(bk)
        return mod_score_grad(t.spec, self.mods, self.q, raw, bias, q_pos, k_pos)

    def logits(self, i, j, positional=True, bk=None, mask_mod=True, mods=None):
        """``tile_logits`` of tile (i, j); ``bk``: its key block size (default the tiling's);
        ``mods``: in place of the call's (the same mods with other closed-over arrays)."""
        t = self.t
        bk = bk or t.bk
        return tile_logits(
            t.spec,
            _slice(self.q, 3, i, t.bq),
            _slice(self.k, 2, j, bk),
            i * t.bq + jnp.arange(t.bq),
            j * bk + jnp.arange(bk),
            _slice(_slice(self.bias, 3, i, t.bq), 4, j, bk),
            _slice(_slice(self.mask, 3, i, t.bq), 4, j, bk),
            _slice(self.q_seg, 1, i, t.bq),
            _slice(self.kv_seg, 1, j, bk),
            positional=positional,
            q_prescaled=self.prescaled,
            mods=self.mods if mods is None else mods,
            mask_mod=mask_mod,
        )


def _spans(classes):
    """``((first, end) per row, (first, end) per column)`` of int8 tile classes ``[n, m]``: the
    first non-empty tile and one past the last (both 0 where all are empty)."""
    seen = classes != EMPTY
    spans = []
    for axis in (1, 0):
        size = seen.shape[axis]
        any_seen = jnp.any(seen, axis=axis)
        first = jnp.argmax(seen, axis=axis).astype(jnp.int32)
        end = size - jnp.argmax(jnp.flip(seen, axis=axis), axis=axis).astype(jnp.int32)
        spans.append((jnp.where(any_seen, first, 0), jnp.where(any_seen, end, 0)))
    return tuple(spans)


def _unblock(stacked, axis_of_block, true_len):
    """[n, ..., block, ...] stacked per block -> [..., n*block, ...] cut to ``true_len``."""
    x = jnp.moveaxis(stacked, 0, axis_of_block)
    shape = list(x.shape)
    shape[axis_of_block : axis_of_block + 2] = [shape[axis_of_block] * shape[axis_of_block + 1]]
    return jax.lax.slice_in_dim(x.reshape(shape), 0, true_len, axis=axis_of_block)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(t: _Tiling, q, k, v, bias, mask, q_seg, kv_seg, seed, mods=None):
    out, lse = _forward(t, q, k, v, bias, mask, q_seg, kv_seg, seed, mods)
    return out, lse


def _forward(t: _Tiling, q, k, v, bias, mask, q_seg, kv_seg, seed, mods=None):
    x = _Inputs(t, q, k, v, bias, mask, q_seg, kv_seg, seed, mods, prescale=True)
    b, hkv, g = x.q.shape[:3]
    dv = v.shape[-1]

    def q_block(i):
        def kv_step(j, carry, positional, bk=t.bk):
            def tile(jj, b):
                return lambda c, mm: update(jj, c, x.logits(i, jj, positional, b, mm)[0], b)

            def fine(jf, c):
                return x.sparse(i, jf, t.fine_bk, c, tile(jf, t.fine_bk))

            return x.sparse(i, j, bk, carry, tile(j, bk), x.refine(i, j, bk, fine))

        def update(j, carry, logits, bk):
            m, l, acc = carry
            m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp(m - m_safe)
            p = jnp.exp(logits - m_safe[..., None])
            l = alpha * l + jnp.sum(p, axis=-1)  # the normalizer counts dropped entries too
            pv = grouped_einsum(
                "bhgqk,bhkd->bhgqd",
                x.dropped(i, j, p, bk).astype(v.dtype),
                _slice(x.v, 2, j, bk),
                preferred_element_type=jnp.float32,
                precision=matmul_precision(v.dtype),
            )
            return m_new, l, alpha[..., None] * acc + pv

        init = (
            jnp.full((b, hkv, g, t.bq), -jnp.inf, jnp.float32),
            jnp.zeros((b, hkv, g, t.bq), jnp.float32),
            jnp.zeros((b, hkv, g, t.bq, dv), jnp.float32),
        )
        coarse = x.span(0, i) or (lambda lo, hi: (lo, hi))
        if t.fine_rows is None:
            m, l, acc = _loop_split(t.row_split, i, kv_step, init, x.span(0, i))
        else:  # masked tiles in fine key blocks, mask-free ones in coarse blocks
            f_lo, f_a, f_b, f_hi = (jnp.asarray(t.fine_rows[r])[i] for r in range(4))
            narrow = x.span(0, i, t.fine_bk) or (lambda lo, hi: (lo, hi))
            fine = functools.partial(kv_step, positional=True, bk=t.fine_bk)
            f_lo, f_a = narrow(f_lo, f_a)
            f_b, f_hi = narrow(f_b, f_hi)
            carry = jax.lax.fori_loop(f_lo, f_a, fine, init)
            row = t.row_split
            start, stop = coarse(jnp.asarray(row[1])[i], jnp.asarray(row[2])[i])
            carry = jax.lax.fori_loop(start, stop, lambda j, c: kv_step(j, c, False), carry)
            m, l, acc = jax.lax.fori_loop(f_b, f_hi, fine, carry)
        l_safe = jnp.where(l > 0, l, 1.0)
        out = (acc / l_safe[..., None]).astype(q.dtype)
        lse = jnp.where(l > 0, jnp.where(m == -jnp.inf, 0.0, m) + jnp.log(l_safe), -jnp.inf)
        return out, lse

    out, lse = jax.lax.map(q_block, jnp.arange(t.nq))
    hq, sq = q.shape[1], q.shape[2]
    out = _unblock(out, 3, sq).reshape(b, hq, sq, dv)
    lse = _unblock(lse, 3, sq).reshape(b, hq, sq)
    return out, lse


def _forward_vjp(t, q, k, v, bias, mask, q_seg, kv_seg, seed, mods=None):
    out, lse = _forward(t, q, k, v, bias, mask, q_seg, kv_seg, seed, mods)
    return (out, lse), (q, k, v, bias, mask, q_seg, kv_seg, seed, out, lse, mods)


def _backward(t: _Tiling, residuals, cotangents):
    q, k, v, bias, mask, q_seg, kv_seg, seed, out, lse, *rest = residuals
    mods = rest[0] if rest else None
    d_out, d_lse = cotangents
    x = _Inputs(t, q, k, v, bias, mask, q_seg, kv_seg, seed, mods)
    hkv = k.shape[1]
    sqp = t.nq * t.bq
    # dL/dlogits = P * (dP - rowsum(dO*O)) + P * dlse, so the lse cotangent folds into delta.
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - d_lse
    d_out_g = pad_to(group_heads(d_out, hkv), 3, sqp)
    delta_g = pad_to(group_heads(delta[..., None], hkv)[..., 0], 3, sqp)
    lse_g = pad_to(group_heads(lse[..., None], hkv)[..., 0], 3, sqp, -jnp.inf)

    def probs_and_dlogits(i, j, logits, visible, raw, bk=None, through_mod=True):
        """Recompute P and dL/dlogits of tile (i, j) (key block size ``bk``, default the tiling's);
        P comes back with dropout applied (for dV). dL/dlogits is pulled back through the
        score_mod unless ``through_mod`` is False.

        With dropout, out = (P∘Z/(1-r))·V: dP picks up Z/(1-r) and delta = rowsum(dO∘O) still holds.
        """
        lse_i = _slice(lse_g, 3, i, t.bq)[..., None]
        p = jnp.where(
            visible & (lse_i > -jnp.inf), jnp.exp(logits - jnp.where(lse_i > -jnp.inf, lse_i, 0.0)), 0.0
        )
        d_out_i = _slice(d_out_g, 3, i, t.bq)
        dp = grouped_einsum(
            "bhgqd,bhkd->bhgqk",
            d_out_i,
            _slice(x.v, 2, j, bk or t.bk),
            preferred_element_type=jnp.float32,
            precision=matmul_precision(d_out_i.dtype),
        )
        dlogits = p * (x.dropped(i, j, dp, bk) - _slice(delta_g, 3, i, t.bq)[..., None])
        grad = x.mod_grad(i, j, raw, bk) if through_mod else None
        if grad is not None:  # through the score_mod: dL/d(its input)
            dlogits = jnp.where(visible, dlogits * grad, 0.0)
        return x.dropped(i, j, p, bk), dlogits, raw, d_out_i

    # The f32-upcast gradient products: float32 math for float32 inputs; for bf16/f16 inputs the
    # platform default (TF32 on CUDA) is as precise as the inputs.
    prec = matmul_precision(q.dtype)

    def dscores(dlogits, raw):
        grad = softcap_grad(t.spec, raw, jnp)
        return (dlogits if grad is None else dlogits * grad) * t.spec.scale

    bias_g = x.bias
    if bias_g is None:
        grads = _single_pass_backward(t, x, q, k, probs_and_dlogits, dscores, prec)
    else:
        grads = _split_backward(t, x, q, k, v, bias, probs_and_dlogits, dscores, prec)
    if not rest:  # the residual backward (blockwise_attention_backward without mods)
        return grads
    if mods is None:
        return (*grads, None)
    return (*grads, _mods_cotangent(t, x, probs_and_dlogits))


def _split_backward(t: _Tiling, x: _Inputs, q, k, v, bias, probs_and_dlogits, dscores, prec):
    """The FA2 split backward (with a bias): a dQ/dbias pass and a dK/dV pass."""
    bias_g = x.bias

    # ---- dQ (and dbias) pass: map over query blocks, loop over their key blocks.
    def dq_block(i):
        def kv_step(j, carry, positional):
            return x.sparse(
                i, j, None, carry, lambda c, mm: dq_update(j, c, *x.logits(i, j, positional, mask_mod=mm))
            )

        def dq_update(j, carry, *tile):
            dq, dbias = carry
            _, dlogits, raw, _ = probs_and_dlogits(i, j, *tile)
            ds = dscores(dlogits, raw)
            dq = dq + grouped_einsum(
                "bhgqk,bhkd->bhgqd", ds, _slice(x.k, 2, j, t.bk).astype(jnp.float32), precision=prec
            )
            if dbias is not None:
                dbias = _accumulate_bias(dbias, dlogits, j, t.bk)
            return dq, dbias

        q_i = _slice(x.q, 3, i, t.bq)
        dbias0 = None
        if bias_g is not None:
            shape = list(bias_g.shape)
            shape[3] = t.bq if shape[3] > 1 else 1
            dbias0 = jnp.zeros(shape, jnp.float32)
        init = (jnp.zeros(q_i.shape, jnp.float32), dbias0)
        return _loop_split(t.row_split, i, kv_step, init, x.span(0, i))

    dq, dbias = jax.lax.map(dq_block, jnp.arange(t.nq))
    b, hq, sq, d = q.shape
    dq = _unblock(dq, 3, sq).reshape(b, hq, sq, d).astype(q.dtype)
    if dbias is not None:
        dbias = _unblock(dbias, 3, sq) if bias_g.shape[3] > 1 else jnp.sum(dbias, axis=0)
        dbias = jax.lax.slice_in_dim(dbias, 0, min(dbias.shape[4], k.shape[2]), axis=4)
        dbias = dbias.reshape(bias.shape).astype(bias.dtype)

    # ---- dK/dV pass: map over key blocks, loop over the query blocks that see them.

    def dkv_block(j):
        def q_step(i, carry, positional):
            return x.sparse(
                i, j, None, carry, lambda c, mm: dkv_update(i, c, *x.logits(i, j, positional, mask_mod=mm))
            )

        def dkv_update(i, carry, *tile):
            dk, dv = carry
            p, dlogits, raw, d_out_i = probs_and_dlogits(i, j, *tile)
            ds = dscores(dlogits, raw)
            dv = dv + _key_grad_t(d_out_i, p, prec)
            dk = dk + _key_grad_t(_slice(x.q, 3, i, t.bq), ds, prec)
            return dk, dv

        k_j, v_j = _slice(x.k, 2, j, t.bk), _slice(x.v, 2, j, t.bk)
        init = (jnp.zeros(_t(k_j).shape, jnp.float32), jnp.zeros(_t(v_j).shape, jnp.float32))
        dk_t, dv_t = _loop_split(t.col_split, j, q_step, init, x.span(1, j))
        return _t(dk_t), _t(dv_t)

    dk, dv = jax.lax.map(dkv_block, jnp.arange(t.nk))
    sk = k.shape[2]
    dk = _unblock(dk, 2, sk).astype(k.dtype)
    dv = _unblock(dv, 2, sk).astype(v.dtype)
    return dq, dk, dv, dbias, None, None, None, None


def _single_pass_backward(t: _Tiling, x: _Inputs, q, k, probs_and_dlogits, dscores, prec):
    """dQ, dK, dV in one pass (no bias): scan over key blocks, loop over the query blocks that see
    them; each tile's probabilities are recomputed once (one exp, five matmuls per tile instead of
    two exps and seven in the split passes), and dQ accumulates in place in an O(S) f32 buffer.
    Where the tiling has fine key blocks, masked tiles (the causal diagonal) run per fine block and
    skip the fine blocks no query of the tile sees."""
    b, hq, sq, d = q.shape

    def tile_grads(i, j, bk, *tile):
        """(dKᵀ, dVᵀ, dQ) contributions of tile (i, j) with key block size ``bk``."""
        p, dlogits, raw, d_out_i = probs_and_dlogits(i, j, *tile, bk=bk)
        ds = dscores(dlogits, raw)
        k_j = _slice(x.k, 2, j, bk).astype(jnp.float32)
        return (
            _key_grad_t(_slice(x.q, 3, i, t.bq), ds, prec),
            _key_grad_t(d_out_i, p, prec),
            grouped_einsum("bhgqk,bhkd->bhgqd", ds, k_j, precision=prec),
        )

    def add_dq(dq_acc, i, dq_i):
        row = jax.lax.dynamic_slice_in_dim(dq_acc, i * t.bq, t.bq, axis=3)
        return jax.lax.dynamic_update_slice_in_dim(dq_acc, row + dq_i, i * t.bq, axis=3)

    def kv_block(dq_acc, j):
        def grads_of(i, jj, bk, positional):
            """Tile (i, jj)'s contributions; under a block mask the branch returns only them (zeros
            for an empty tile), so the O(S) dQ buffer is updated outside the conditional, in place."""

            def run(_, mask_mod):
                return tile_grads(i, jj, bk, *x.logits(i, jj, positional, bk, mask_mod))

            if x.classes is None:
                return run(None, True)
            zeros = jax.eval_shape(lambda: run(None, True))
            zeros = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), zeros)

            def fine(jf, parts):  # a partial coarse tile's fine sub-tiles, dK/dV side by side
                got = grads_of(i, jf, t.fine_bk, positional)
                return (*parts, got)

            refined = x.refine(i, jj, bk, fine)
            partial = None
            if refined is not None:

                def partial(_):
                    parts = refined(())
                    dk_, dv_ = (jnp.concatenate([p[n] for p in parts], axis=-1) for n in (0, 1))
                    return dk_, dv_, functools.reduce(jnp.add, [p[2] for p in parts])

            return x.sparse(i, jj, bk, zeros, run, partial)

        def q_step(i, carry, positional):
            dk, dv, dq_acc = carry
            ddk, ddv, dq_i = grads_of(i, j, t.bk, positional)
            return dk + ddk, dv + ddv, add_dq(dq_acc, i, dq_i)

        def fine_step(s, i, carry):
            dk, dv, dq_acc = carry
            jf, fb = j * (t.bk // t.fine_bk) + s, t.fine_bk
            ddk, ddv, dq_i = grads_of(i, jf, fb, True)
            dk = dk.at[..., s * fb : (s + 1) * fb].add(ddk)
            dv = dv.at[..., s * fb : (s + 1) * fb].add(ddv)
            return dk, dv, add_dq(dq_acc, i, dq_i)

        shape_k, shape_v = _t(_slice(x.k, 2, j, t.bk)).shape, _t(_slice(x.v, 2, j, t.bk)).shape
        init = (jnp.zeros(shape_k, jnp.float32), jnp.zeros(shape_v, jnp.float32), dq_acc)
        if t.fine_cols is None:
            dk_t, dv_t, dq_acc = _loop_split(t.col_split, j, q_step, init, x.span(1, j))
        else:
            dk_t, dv_t, dq_acc = _fine_split(t, x, t.fine_cols, j, q_step, fine_step, init)
        return dq_acc, (_t(dk_t), _t(dv_t))

    dq, (dk, dv) = jax.lax.scan(kv_block, jnp.zeros(x.q.shape, jnp.float32), jnp.arange(t.nk))
    dq = jax.lax.slice_in_dim(dq, 0, sq, axis=3).reshape(b, hq, sq, d).astype(q.dtype)
    sk = k.shape[2]
    dk = _unblock(dk, 2, sk).astype(k.dtype)
    dv = _unblock(dv, 2, sk).astype(x.v.dtype)
    return dq, dk, dv, None, None, None, None, None


def _fine_split(t: _Tiling, x: _Inputs, fine_cols, j, q_step, fine_step, carry):
    """Key block ``j``'s query loops: masked tiles a query block sees in part per fine key block
    (``fine_step(s, i, carry)``), the other masked ones and the mask-free ones as whole [bq, bk]
    tiles (``q_step(i, carry, positional)``); ``fine_cols``: ``t.fine_cols``, known to be set.
    Each loop narrowed to the block mask's span of its column (:meth:`_Inputs.span`), if any."""
    whole, fine = fine_cols
    ratio = fine.shape[0]
    coarse = x.span(1, j) or (lambda lo, hi: (lo, hi))
    for s in range(ratio):
        narrow = x.span(1, j * ratio + s, t.fine_bk) or (lambda lo, hi: (lo, hi))
        for lo, hi in fine[s]:
            step = functools.partial(fine_step, s)
            start, stop = narrow(jnp.asarray(lo)[j], jnp.asarray(hi)[j])
            carry = jax.lax.fori_loop(start, stop, step, carry)
    for lo, hi in whole:
        start, stop = coarse(jnp.asarray(lo)[j], jnp.asarray(hi)[j])
        carry = jax.lax.fori_loop(start, stop, lambda i, c: q_step(i, c, True), carry)
    a, b = coarse(*(jnp.asarray(t.col_split[r])[j] for r in (1, 2)))
    return jax.lax.fori_loop(a, b, lambda i, c: q_step(i, c, False), carry)


def _mods_cotangent(t: _Tiling, x: _Inputs, probs_and_dlogits):
    """The cotangent of the ``mods`` pytree: the gradients of the float arrays the score_mod closes
    over (None for the rest), summed over the visited tiles of one more pass (map over query blocks,
    loop over their key blocks) that pulls each tile's dL/dlogits back through the score_mod."""
    mods = x.mods
    cotangent = jax.tree_util.tree_map(lambda _: None, mods)
    floats = [n for n, c in enumerate(mods.score_consts) if jnp.issubdtype(jnp.result_type(c), jnp.floating)]
    if mods.score is None or not floats:
        return cotangent

    def q_block(i):
        def kv_step(j, acc, positional):
            def run(acc, mask_mod):
                def logits_of(chosen):
                    consts = list(mods.score_consts)
                    for n, c in zip(floats, chosen, strict=True):
                        consts[n] = c
                    swapped = Mods(mods.score, consts, mods.mask, mods.mask_consts, mods.blocks)
                    logits, visible, raw = x.logits(i, j, positional, mask_mod=mask_mod, mods=swapped)
                    return logits, (visible, raw)

                chosen = [mods.score_consts[n] for n in floats]
                logits, pull, (visible, raw) = jax.vjp(logits_of, chosen, has_aux=True)
                _, d_post, _, _ = probs_and_dlogits(i, j, logits, visible, raw, through_mod=False)
                (d_chosen,) = pull(d_post)
                return [a + d.astype(jnp.float32) for a, d in zip(acc, d_chosen, strict=True)]

            return x.sparse(i, j, None, acc, run)

        init = [jnp.zeros(jnp.shape(mods.score_consts[n]), jnp.float32) for n in floats]
        return _loop_split(t.row_split, i, kv_step, init, x.span(0, i))

    sums = jax.lax.map(q_block, jnp.arange(t.nq))
    consts: list[Any] = [None] * len(mods.score_consts)
    for n, total in zip(floats, sums, strict=True):
        consts[n] = jnp.sum(total, axis=0).astype(jnp.result_type(mods.score_consts[n]))
    return Mods(mods.score, consts, mods.mask, cotangent.mask_consts, cotangent.blocks)


def mods_cotangent(
    q, k, v, bias, mask, q_seg, kv_seg, seed, out, lse, d_out, d_lse, *, spec: AttentionSpec, mods: Mods
):
    """The cotangent of ``mods`` (gradients of the arrays its score_mod closes over) from a forward's
    residuals, for backends whose kernels give dq, dk, dv only: this backend's backward with default
    blocks, of which only that pass stays once XLA drops the unused gradients."""
    t = _Tiling(
        spec, _block(DEFAULT_BLOCK_Q, spec.seq_q, "block_q"), _block(DEFAULT_BLOCK_K, spec.seq_k, "block_k")
    )
    residuals = (q, k, v, bias, mask, q_seg, kv_seg, seed, out.astype(q.dtype), lse, mods)
    return _backward(t, residuals, (d_out.astype(q.dtype), d_lse))[-1]


def _t(x):
    """Swap the last two axes."""
    return jnp.swapaxes(x, -1, -2)


def _key_grad_t(rows, grad, prec):
    """One tile's dK or dV contribution, transposed: ``rowsᵀ · grad`` as [B, Hkv, D, bk] for rows
    [B, Hkv, G, bq, D] and grad [B, Hkv, G, bq, bk]. The key-block loops accumulate dKᵀ/dVᵀ and
    transpose once per key block: on XLA:CPU this form ran at 77 GFLOP/s per core and
    ``gradᵀ · rows`` (the [bk, D] layout) at 29 (both its generic dot, not YNNPACK; [8, 256, 512])."""
    return grouped_einsum("bhgqd,bhgqk->bhdk", rows.astype(jnp.float32), grad, precision=prec)


def _accumulate_bias(dbias, dlogits, j, bk):
    """Add tile ``dlogits`` [B, Hkv, G, bq, bk] into the row block ``dbias`` of the bias's shape."""
    axes = tuple(a for a in range(5) if dbias.shape[a] == 1 and dlogits.shape[a] != 1)
    contrib = jnp.sum(dlogits, axis=axes, keepdims=True) if axes else dlogits
    if dbias.shape[4] == 1:
        return dbias + contrib
    return jax.lax.dynamic_update_slice_in_dim(dbias, _slice(dbias, 4, j, bk) + contrib, j * bk, axis=4)


_attention.defvjp(_forward_vjp, _backward)


def _prefer(call) -> str | None:
    if call.kv_shape[2] < MIN_KEYS_FOR_BLOCKWISE:
        return f"Sk={call.kv_shape[2]} < {MIN_KEYS_FOR_BLOCKWISE}: the materialized xla path is faster"
    return None


registry.register(
    registry.BackendInfo(
        name="blockwise",
        description="Online-softmax attention over key/value blocks in plain XLA; O(S) memory, "
        "causal/window block skipping, custom_vjp backward; any platform.",
        platforms=("cpu", "cuda", "rocm", "tpu"),
        features=frozenset(FEATURES),
        fn=blockwise_attention,
        prefer=_prefer,
        backward=blockwise_attention_backward,
    )
)
