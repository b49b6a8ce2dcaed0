"""Ring steps of the ``blockwise`` backend that carry the ring's running state through their tiles.

The generic ring (:mod:`flashport.kernels.parallel.ring`) calls a backend once per ring step and merges each
step's full partial output into an accumulator in XLA, so every step holds a fresh q-sized output
beside the accumulator, and the inputs are transposed to the canonical BHSD layout. Here the ring
runs the blockwise backend's online softmax itself, tile by tile, on the user's layout (BSHD or
BHSD, read block by block), with the running state in place:

* **Forward.** The carry is ``(o, lse)``: the f32 output normalized over the keys seen so far, in
  the query's layout, and its log-sum-exp. That is exactly the online-softmax state
  ``(m = lse, l = 1, acc = o)`` (``l = 0`` for rows that saw nothing yet), so every query block
  resumes from it, visits the visible key blocks of the visiting chunk and writes its block back
  (``dynamic_update_slice`` in the loop-carried buffer): no per-step output, no merge pass.
* **Backward.** From the forward's residuals (the global ``out`` and ``lse``), a key block's
  gradients are the flash backward's with the *global* probabilities ``P = exp(s − lse)``; no step
  recomputes a forward. dQ accumulates in place; dK/dV accumulate in place in the f32 buffers that
  travel around the ring with K/V.

Which tiles a (query piece, key piece) pair visits depends on the traced shard index, so the block
tables of every branch of the ring's :class:`~flashport.kernels.parallel.ring.Plan` are stacked and indexed
by the traced branch id, and the positional test of partial tiles takes the branch's traced
offset. Fully visible tiles skip the positional mask, as in the blockwise backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from flashport.kernels.backends.blockwise import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q
from flashport.kernels.contract.spec import AttentionSpec, softcap_grad
from flashport.kernels.semantics.block_ranges import block_tables
from flashport.kernels.semantics.scores import group_heads, matmul_precision, tile_logits
from flashport.kernels.semantics.visibility import band_visible


def _divisor(length: int, block, name: str) -> int:
    """The largest divisor of ``length`` that is <= ``block`` (pieces are never padded)."""
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1:
        raise ValueError(f"blockwise option {name} must be a positive int, got {block!r}")
    return max(d for d in range(1, min(int(block), length) + 1) if length % d == 0)


class _Tables:
    """Block tables of every plan branch for one [pq, pk] piece pair, stacked ``[branches, blocks]``."""

    def __init__(self, specs: tuple[AttentionSpec | None, ...], pq: int, pk: int, bq: int, bk: int):
        nb, self.nq, self.nk = len(specs), pq // bq, pk // bk
        rows = np.zeros((4, nb, self.nq), np.int32)  # row_lo, row_hi, full_lo, full_hi
        cols = np.zeros((2, nb, self.nk), np.int32)  # col_lo, col_hi
        offsets = np.zeros((nb,), np.int32)
        for n, sp in enumerate(specs):
            if sp is None:  # empty branch: no tile anywhere
                continue
            t = block_tables(sp, bq, bk)
            rows[:, n] = (t.row_lo, t.row_hi, t.full_lo, t.full_hi)
            cols[:, n] = (t.col_lo, t.col_hi)
            offsets[n] = sp.offset
        self.rows, self.cols, self.offsets = rows, cols, offsets

    def of(self, branch):
        """Traced ``(rows [4, nq], cols [2, nk], offset)`` of ``branch``."""
        return (
            jnp.asarray(self.rows)[:, branch],
            jnp.asarray(self.cols)[:, branch],
            jnp.asarray(self.offsets)[branch],
        )


class BlockwiseRing:
    """The ring's per-step work on the blockwise backend, on one shard, in the user's ``layout``.

    Arrays are the shard's: q/out/d_out ``[B, S, H, D]`` (BSHD) or ``[B, H, S, D]`` (BHSD), lse
    ``[B, Hq, S]``, segment ids ``[B, S]``; query piece ``a`` holds rows ``[a·pq, (a+1)·pq)`` and key
    piece ``b`` rows ``[b·pk, (b+1)·pk)`` of the visiting chunk.
    """

    def __init__(self, plan, spec: AttentionSpec, options: dict, layout: str):
        unknown = set(options) - {"block_q", "block_k"}
        if unknown:
            raise ValueError(
                f"backend 'blockwise' takes options block_q, block_k; got unknown {sorted(unknown)}"
            )
        self.plan, self.spec, self.seq_axis = plan, spec, 1 if layout == "BSHD" else 2
        self.bq = _divisor(plan.pq, options.get("block_q", DEFAULT_BLOCK_Q), "block_q")
        self.bk = _divisor(plan.pk, options.get("block_k", DEFAULT_BLOCK_K), "block_k")
        self.tables = _Tables(plan.specs, plan.pq, plan.pk, self.bq, self.bk)

    # ---------------------------------------------------------------------------- layout access

    def rows(self, x, start, size):
        """Rows ``[start, start + size)`` of a layout array as ``[B, H, size, D]``."""
        block = jax.lax.dynamic_slice_in_dim(x, start, size, self.seq_axis)
        return jnp.swapaxes(block, 1, 2) if self.seq_axis == 1 else block

    def operand(self, x, start, size):
        """Rows of a matmul operand; 16-bit floats are sliced as raw uint16 bits.

        XLA:CPU runs bf16/f16 dots in f32 and would hoist the widening ``convert`` of every block out
        of the loops, i.e. keep an f32 copy of the whole q (and of each visiting K/V chunk); slicing
        the bits keeps the convert on the block.
        """
        if not (jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize == 2):
            return self.rows(x, start, size)
        bits = self.rows(jax.lax.bitcast_convert_type(x, jnp.uint16), start, size)
        return jax.lax.bitcast_convert_type(bits, x.dtype)

    def put(self, x, block, start):
        """Write ``block`` ``[B, H, size, D]`` into rows ``start...`` of a layout array (in place)."""
        block = jnp.swapaxes(block, 1, 2) if self.seq_axis == 1 else block
        return jax.lax.dynamic_update_slice_in_dim(x, block.astype(x.dtype), start, self.seq_axis)

    def heads(self, x):
        """The head count of a layout array."""
        return x.shape[3 - self.seq_axis]

    def _tile(self, q_i, k_j, q_pos, k_pos, qs, ks, full, offset, *, prescaled):
        """``(logits, visible, raw)`` of one tile; partial tiles apply the branch's traced offset."""
        spec = self.spec

        def masked(positional):
            logits, visible, raw = tile_logits(
                spec, q_i, k_j, q_pos, k_pos, None, None, qs, ks, positional=False, q_prescaled=prescaled
            )
            if positional:
                band = band_visible(
                    q_pos[:, None] + offset,
                    k_pos[None, :],
                    causal=spec.causal,
                    left=spec.window_left,
                    right=spec.window_right,
                )
                if band is not None:
                    visible = visible & band[None, None, None]
                    logits = jnp.where(visible, logits, -jnp.inf)
            return logits, jnp.broadcast_to(visible, logits.shape), raw

        return jax.lax.cond(full, lambda: masked(False), lambda: masked(True))

    # ---------------------------------------------------------------------------------- forward

    def init_forward(self, q, v):
        """The empty running state ``(o, lse)``: nothing seen yet (o 0, lse −inf)."""
        shape = list(q.shape)
        shape[-1] = v.shape[-1]
        sq = q.shape[self.seq_axis]
        return jnp.zeros(shape, jnp.float32), jnp.full((q.shape[0], self.heads(q), sq), -jnp.inf, jnp.float32)

    def forward_pair(self, state, a, b, r, s, q, q_seg, k, v, kv_seg):
        """Fold key piece ``b`` of shard ``s``'s chunk into query piece ``a``'s running state (shard ``r``)."""
        rows, _, offset = self.tables.of(self.plan.index(r, a, s, b))
        bq, bk, hkv = self.bq, self.bk, self.heads(k)
        prec = matmul_precision(v.dtype)

        def q_block(i, state):
            o, lse = state
            r0 = a * self.plan.pq + i * bq
            q_i = group_heads(self.operand(q, r0, bq), hkv)
            q_i = (q_i.astype(jnp.float32) * self.spec.scale).astype(q.dtype)
            lse_i = group_heads(jax.lax.dynamic_slice_in_dim(lse, r0, bq, 2)[..., None], hkv)[..., 0]
            qs = None if q_seg is None else jax.lax.dynamic_slice_in_dim(q_seg, r0, bq, 1)
            q_pos = i * bq + jnp.arange(bq)

            def kv_step(j, carry):
                m, l, acc = carry
                c0 = b * self.plan.pk + j * bk
                ks = None if kv_seg is None else jax.lax.dynamic_slice_in_dim(kv_seg, c0, bk, 1)
                full = (j >= rows[2, i]) & (j < rows[3, i])
                logits, _, _ = self._tile(
                    q_i,
                    self.operand(k, c0, bk),
                    q_pos,
                    j * bk + jnp.arange(bk),
                    qs,
                    ks,
                    full,
                    offset,
                    prescaled=True,
                )
                m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                alpha = jnp.exp(m - m_safe)
                p = jnp.exp(logits - m_safe[..., None])
                pv = jnp.einsum(
                    "bhgqk,bhkd->bhgqd",
                    p.astype(v.dtype),
                    self.operand(v, c0, bk),
                    preferred_element_type=jnp.float32,
                    precision=prec,
                )
                return m_new, alpha * l + jnp.sum(p, axis=-1), alpha[..., None] * acc + pv

            # (m = lse, l = 1, acc = o) is the online-softmax state of the normalized (o, lse).
            init = (lse_i, jnp.where(lse_i > -jnp.inf, 1.0, 0.0), group_heads(self.rows(o, r0, bq), hkv))
            m, l, acc = jax.lax.fori_loop(rows[0, i], rows[1, i], kv_step, init)
            l_safe = jnp.where(l > 0, l, 1.0)
            o_i = (acc / l_safe[..., None]).reshape(acc.shape[0], -1, bq, acc.shape[-1])
            lse_new = jnp.where(l > 0, jnp.where(m == -jnp.inf, 0.0, m) + jnp.log(l_safe), -jnp.inf)
            lse = jax.lax.dynamic_update_slice_in_dim(lse, lse_new.reshape(lse.shape[0], -1, bq), r0, 2)
            return self.put(o, o_i, r0), lse

        return jax.lax.fori_loop(0, self.tables.nq, q_block, state)

    def enter(self, x):
        """The shard arrays as this engine reads them: the user's layout, unchanged."""
        return x

    leave = enter

    def finish_forward(self, state, dtype):
        """``(out, lse)`` of the shard from the final running state."""
        o, lse = state
        return o.astype(dtype), lse

    # --------------------------------------------------------------------------------- backward

    def finish_backward(self, dq, dtype):
        """The shard's dQ from its f32 accumulator."""
        return dq.astype(dtype)

    def init_backward(self, q, k, v, out, lse, d_out, d_lse):
        """``(context, dq0, dk0, dv0)``: the rowwise ``delta = rowsum(dO·O) − dlse`` and zero grads."""
        delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
        delta = jnp.swapaxes(delta, 1, 2) if self.seq_axis == 1 else delta
        if d_lse is not None:
            delta = delta - d_lse
        zeros = tuple(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))
        return (d_out, lse, delta), *zeros

    def backward_pair(self, grads, context, a, b, r, s, q, q_seg, k, v, kv_seg):
        """Add key piece ``b``'s (of shard ``s``) gradients for query piece ``a`` into ``(dq, dk, dv)``."""
        d_out, lse, delta = context
        rows, cols, offset = self.tables.of(self.plan.index(r, a, s, b))
        bq, bk, hkv = self.bq, self.bk, self.heads(k)
        prec = matmul_precision(q.dtype)

        def kv_block(j, grads):
            dq, dk, dv = grads
            c0 = b * self.plan.pk + j * bk
            k_j, v_j = self.operand(k, c0, bk), self.operand(v, c0, bk)
            ks = None if kv_seg is None else jax.lax.dynamic_slice_in_dim(kv_seg, c0, bk, 1)
            k_pos = j * bk + jnp.arange(bk)

            def q_step(i, carry):
                dk_j, dv_j, dq = carry
                r0 = a * self.plan.pq + i * bq
                q_i = group_heads(self.operand(q, r0, bq), hkv)
                do_i = group_heads(self.operand(d_out, r0, bq), hkv)
                lse_i, delta_i = (
                    group_heads(jax.lax.dynamic_slice_in_dim(x, r0, bq, 2)[..., None], hkv)
                    for x in (lse, delta)
                )
                qs = None if q_seg is None else jax.lax.dynamic_slice_in_dim(q_seg, r0, bq, 1)
                full = (j >= rows[2, i]) & (j < rows[3, i])
                logits, visible, raw = self._tile(
                    q_i, k_j, i * bq + jnp.arange(bq), k_pos, qs, ks, full, offset, prescaled=False
                )
                seen = visible & (lse_i > -jnp.inf)
                p = jnp.where(seen, jnp.exp(logits - jnp.where(lse_i > -jnp.inf, lse_i, 0.0)), 0.0)
                dp = jnp.einsum(
                    "bhgqd,bhkd->bhgqk", do_i, v_j, preferred_element_type=jnp.float32, precision=prec
                )
                dlogits = p * (dp - delta_i)
                grad = softcap_grad(self.spec, raw, jnp)
                ds = (dlogits if grad is None else dlogits * grad) * self.spec.scale
                dv_j = dv_j + jnp.einsum("bhgqk,bhgqd->bhkd", p, do_i.astype(jnp.float32), precision=prec)
                dk_j = dk_j + jnp.einsum("bhgqk,bhgqd->bhkd", ds, q_i.astype(jnp.float32), precision=prec)
                dq_i = jnp.einsum("bhgqk,bhkd->bhgqd", ds, k_j.astype(jnp.float32), precision=prec)
                dq_i = self.rows(dq, r0, bq) + dq_i.reshape(dq_i.shape[0], -1, bq, dq_i.shape[-1])
                return dk_j, dv_j, self.put(dq, dq_i, r0)

            init = (self.rows(dk, c0, bk), self.rows(dv, c0, bk), dq)
            dk_j, dv_j, dq = jax.lax.fori_loop(cols[0, j], cols[1, j], q_step, init)
            return dq, self.put(dk, dk_j, c0), self.put(dv, dv_j, c0)

        return jax.lax.fori_loop(0, self.tables.nk, kv_block, grads)
