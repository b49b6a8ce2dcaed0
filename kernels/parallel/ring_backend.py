"""Ring steps over any registered backend: one backend call per (query piece, key piece) and step.

The engine :func:`flashport.ring_attention` uses for every backend but ``blockwise`` (which has its
own, :mod:`flashport.kernels.parallel.ring_blockwise`). It works on the canonical BHSD arrays (a BSHD shard
is transposed once on entry).

* **Forward.** Each step runs the backend with ``return_lse=True`` on (local queries, visiting
  keys) and the partial results merge through the log-sum-exp (:func:`merge`)::

      lse = logsumexp_t lse_t,    out = Σ_t exp(lse_t − lse) · out_t

* **Backward.** The backend's own residual backward
  (:func:`flashport.kernels.contract.backward.flashport_attention_backward`) runs on every (query piece,
  key piece) with the *global* ``out`` and ``lse`` of the forward: the flash backward's
  probabilities ``exp(s − lse)`` are then the global ones restricted to the visiting keys, so the
  contributions are exact and no forward is recomputed. Backends without a residual backward fall
  back to recomputing their forward under ``jax.vjp`` (:func:`~flashport.kernels.contract.execute.recompute_backward`).

Every (shard, piece, visiting shard, piece) combination takes one branch of the ring's plan
(:class:`flashport.kernels.parallel.ring.Plan`): empty (skipped: out 0, lse −inf, zero gradients), full or
partial, chosen by ``lax.switch`` on the traced branch id.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from flashport.kernels.contract import dispatch, execute
from flashport.kernels.contract.call import Call
from flashport.kernels.contract.spec import AttentionSpec


def local_call(spec: AttentionSpec, features, q, k, v) -> Call:
    """The static :class:`~flashport.kernels.contract.api.Call` of one piece pair with local ``spec``."""
    feats = set(features) - {"causal", "window", "align_bottom_right", "bias", "mask", "dropout"}
    feats |= {"return_lse", *spec.positional_features}
    return Call.over(spec, feats, q, k, v)


def piece(x, axis, i, size):
    """Piece ``i`` (``size`` positions) of ``x`` along ``axis`` (``None`` stays ``None``)."""
    return None if x is None else jax.lax.slice_in_dim(x, i * size, (i + 1) * size, axis=axis)


def merge(acc, part):
    """Merge two normalized partial attentions ``(out f32, lse)`` over disjoint key sets.

    Rows where both are empty (lse −inf) stay out 0, lse −inf, with finite (zero) gradients.
    """
    o1, l1 = acc
    o2, l2 = part
    mx = jnp.maximum(l1, l2)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    w1, w2 = jnp.exp(l1 - mx), jnp.exp(l2 - mx)
    total = w1 + w2
    safe = jnp.where(total > 0, total, 1.0)
    lse = jnp.where(total > 0, mx + jnp.log(safe), -jnp.inf)
    out = o1 * (w1 / safe)[..., None] + o2.astype(jnp.float32) * (w2 / safe)[..., None]
    return out, lse


def _forward_local(call, choice, q, k, v, qs, ks):
    return dispatch.flashport_attention(q, k, v, None, None, qs, ks, None, call=call, choice=choice)


def _backward_local(call, choice, q, k, v, qs, ks, out, lse, d_out, d_lse):
    grads = dispatch.flashport_attention_backward(
        q, k, v, None, None, qs, ks, None, out, lse, d_out, d_lse, call=call, choice=choice
    )
    return tuple(g.astype(jnp.float32) for g in grads[:3])


class BackendRing:
    """The ring's per-step work as backend calls, on one shard (canonical BHSD arrays).

    ``forward_pair`` / ``backward_pair`` take the query piece ``a`` of shard ``r`` and key piece
    ``b`` of the visiting chunk of shard ``s``; the state is a tuple of per-query-piece
    ``(out f32, lse)`` (forward) and ``(dq pieces, dk, dv)`` in f32 (backward).
    """

    def __init__(self, plan, backend, features, layout: str):
        self.plan, self.backend, self.features, self.layout = plan, backend, features, layout
        self._fwd = self._bwd = None

    def enter(self, x):
        """A shard array of the user's layout in the canonical BHSD layout."""
        return jnp.swapaxes(x, 1, 2) if self.layout == "BSHD" else x

    leave = enter

    def _branches(self, q, k, v):
        """Per plan branch, the forward and backward functions of one piece pair (built once)."""
        if self._fwd is None:
            plan = self.plan
            shapes = (piece(q, 2, 0, plan.pq), piece(k, 2, 0, plan.pk), piece(v, 2, 0, plan.pk))
            out_shape = shapes[0].shape[:3] + (v.shape[-1],)
            self._fwd, self._bwd = [], []
            for sp in plan.specs:
                if sp is None:
                    self._fwd.append(functools.partial(_empty_forward, out_shape, q.dtype))
                    self._bwd.append(_empty_backward)
                    continue
                call = local_call(sp, self.features, *shapes)
                choice = execute.resolve_backend(self.backend, call)
                self._fwd.append(functools.partial(_forward_local, call, choice))
                self._bwd.append(functools.partial(_backward_local, call, choice))
        return self._fwd, self._bwd

    def _dispatch(self, fns, a, b, r, s, *args):
        ids = sorted(self.plan.branches_of(a, b))
        if len(ids) == 1:  # the same branch on every shard pair: no switch
            return fns[ids[0]](*args)
        return jax.lax.switch(self.plan.index(r, a, s, b), fns, *args)

    def init_forward(self, q, v):
        """The empty running state: per query piece, out 0 and lse −inf."""
        b_, h_, pq = q.shape[0], q.shape[1], self.plan.pq
        return tuple(
            (jnp.zeros((b_, h_, pq, v.shape[-1]), jnp.float32), jnp.full((b_, h_, pq), -jnp.inf, jnp.float32))
            for _ in range(self.plan.m)
        )

    def forward_pair(self, state, a, b, r, s, q, q_seg, k, v, kv_seg):
        """Merge the backend's attention of query piece ``a`` over key piece ``b`` into the state."""
        fwd, _ = self._branches(q, k, v)
        pq, pk = self.plan.pq, self.plan.pk
        args = (piece(q, 2, a, pq), piece(k, 2, b, pk), piece(v, 2, b, pk))
        part = self._dispatch(fwd, a, b, r, s, *args, piece(q_seg, 1, a, pq), piece(kv_seg, 1, b, pk))
        state = list(state)
        state[a] = merge(state[a], part)
        return tuple(state)

    def finish_forward(self, state, dtype):
        """``(out, lse)`` of the shard from the final state."""
        out = jnp.concatenate([o for o, _ in state], axis=2).astype(dtype)
        return out, jnp.concatenate([l for _, l in state], axis=2)

    def init_backward(self, q, k, v, out, lse, d_out, d_lse):
        """``(context, dq0, dk0, dv0)``: the per-piece residual rows and zero f32 gradients."""
        pq = self.plan.pq
        d_lse = jnp.zeros_like(lse) if d_lse is None else d_lse
        rows = tuple(
            (
                piece(out, 2, a, pq),
                piece(lse, 2, a, pq),
                piece(d_out.astype(out.dtype), 2, a, pq),
                piece(d_lse, 2, a, pq),
            )
            for a in range(self.plan.m)
        )
        dq = tuple(jnp.zeros(piece(q, 2, a, pq).shape, jnp.float32) for a in range(self.plan.m))
        return rows, dq, jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)

    def backward_pair(self, grads, context, a, b, r, s, q, q_seg, k, v, kv_seg):
        """Add the backend's residual-backward gradients of piece pair (a, b) into ``grads``."""
        _, bwd = self._branches(q, k, v)
        pq, pk = self.plan.pq, self.plan.pk
        dq, dk, dv = grads
        args = (piece(q, 2, a, pq), piece(k, 2, b, pk), piece(v, 2, b, pk), piece(q_seg, 1, a, pq))
        gq, gk, gv = self._dispatch(bwd, a, b, r, s, *args, piece(kv_seg, 1, b, pk), *context[a])
        dq = dq[:a] + (dq[a] + gq,) + dq[a + 1 :]
        dk = jax.lax.dynamic_update_slice_in_dim(dk, piece(dk, 2, b, pk) + gk, b * pk, 2)
        dv = jax.lax.dynamic_update_slice_in_dim(dv, piece(dv, 2, b, pk) + gv, b * pk, 2)
        return dq, dk, dv

    def finish_backward(self, dq, dtype):
        """The shard's dQ from its per-piece accumulators."""
        return jnp.concatenate(dq, axis=2).astype(dtype)


def _empty_forward(out_shape, dtype, q, k, v, qs, ks):
    del q, k, v, qs, ks
    return jnp.zeros(out_shape, dtype), jnp.full(out_shape[:3], -jnp.inf, jnp.float32)


def _empty_backward(q, k, v, qs, ks, out, lse, d_out, d_lse):
    del qs, ks, out, lse, d_out, d_lse
    return tuple(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))
