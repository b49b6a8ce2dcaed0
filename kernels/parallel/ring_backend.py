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
partial, chosen by ``lax.switch`` on the traced branch id. With a ``mask_mod``, a pair that its
piece classes (:func:`flashport.kernels.parallel.ring.piece_classes`) mark empty for all of the
shard's batches and heads takes the empty branch too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from flashport.kernels.contract import dispatch, execute
from flashport.kernels.contract.call import Call
from flashport.kernels.contract.spec import AttentionSpec
from flashport.kernels.semantics.block_mask import EMPTY
from flashport.kernels.semantics.mods import Mods


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


def _forward_local(call, choice, q, k, v, qs, ks, mods=None):
    return dispatch.flashport_attention(q, k, v, None, None, qs, ks, None, mods, call=call, choice=choice)


def _backward_local(call, choice, floats, q, k, v, qs, ks, out, lse, d_out, d_lse, mods=None):
    """f32 ``(dq, dk, dv)`` of one piece pair, and with mods the f32 gradients of the score_mod's
    float arrays at indices ``floats`` (from the blockwise backend's pass over the tiles, as the
    Pallas backends get theirs)."""
    from flashport.kernels.backends.blockwise import mods_cotangent

    args = (q, k, v, None, None, qs, ks, None, out, lse, d_out, d_lse)
    grads = dispatch.flashport_attention_backward(*args, mods, call=call, choice=choice)
    grads = tuple(g.astype(jnp.float32) for g in grads[:3])
    if mods is None:
        return grads
    d_mods = ()
    if floats:
        cotangent = mods_cotangent(*args, spec=call.spec, mods=mods)
        d_mods = tuple(cotangent.score_consts[n].astype(jnp.float32) for n in floats)
    return (*grads, d_mods)


class BackendRing:
    """The ring's per-step work as backend calls, on one shard (canonical BHSD arrays).

    ``forward_pair`` / ``backward_pair`` take the query piece ``a`` of shard ``r`` and key piece
    ``b`` of the visiting chunk of shard ``s``; the state is a tuple of per-query-piece
    ``(out f32, lse)`` (forward) and ``((dq pieces, d mods), dk, dv)`` in f32 (backward).

    With ``mods`` (:class:`~flashport.kernels.semantics.mods.Mods` of the global call; their arrays arrive per
    call as ``consts``), every step runs them :meth:`~flashport.kernels.semantics.mods.Mods.shifted` to the
    global (batch, head, q_idx, kv_idx) of its pieces: the pieces' starts from the plan, the batch
    and head offsets from the shard index of ``mod_axes`` (``(batch_axis, head_axis)``).
    """

    def __init__(self, plan, backend, features, layout: str, *, mods=None, mod_axes=(None, None)):
        self.plan, self.backend, self.features, self.layout = plan, backend, features, layout
        self._fwd = self._bwd = None
        self.mods, self.mod_axes = mods, mod_axes
        consts = () if mods is None else mods.score_consts
        # the score_mod's float arrays: the ones with gradients
        self.floats = tuple(
            n for n, c in enumerate(consts) if jnp.issubdtype(jnp.result_type(c), jnp.floating)
        )

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
                    self._bwd.append(functools.partial(_empty_backward, self.floats))
                    continue
                call = local_call(sp, self.features, *shapes)
                choice = execute.resolve_backend(self.backend, call)
                self._fwd.append(functools.partial(_forward_local, call, choice))
                self._bwd.append(functools.partial(_backward_local, call, choice, self.floats))
            # the last branch: the empty one, for pairs the mask_mod's piece classes skip
            self._fwd.append(functools.partial(_empty_forward, out_shape, q.dtype))
            self._bwd.append(functools.partial(_empty_backward, self.floats))
        return self._fwd, self._bwd

    def _shifted(self, consts, q, r, a, s, b):
        """The call's mods at the global positions of query piece ``a`` (shard ``r``) and key piece
        ``b`` (shard ``s``), as extra arguments of a step (``()`` without mods)."""
        if self.mods is None:
            return ()
        offsets = []
        for axes, size in zip(self.mod_axes, q.shape[:2], strict=True):
            offsets.append(0 if axes is None else jax.lax.axis_index(axes) * size)
        offsets.extend(self.plan.starts(r, a, s, b))
        mods = Mods(self.mods.score, consts[0], self.mods.mask, consts[1])
        return (mods.shifted(jnp.stack([jnp.asarray(x, jnp.int32) for x in offsets])),)

    def mods_gradients(self, dq, consts):
        """The cotangent of the mods' arrays ``consts`` (``(score arrays, mask arrays[, piece
        classes])``) from the backward state's dQ part: the score_mod's float arrays get their
        summed gradients (in their dtype), the rest none."""
        score = [None] * len(consts[0])
        for n, grad in zip(self.floats, dq[1], strict=True):
            score[n] = grad.astype(jnp.result_type(consts[0][n]))
        return (tuple(score), tuple(None for _ in consts[1]), *(None for _ in consts[2:]))

    def _live(self, consts, q, r, a, s, b):
        """Traced bool: whether the mask_mod leaves anything of query piece ``a`` (shard ``r``) x key
        piece ``b`` (shard ``s``) visible to some batch and head of this shard (``None`` without
        piece classes, i.e. without a mask_mod)."""
        if consts is None or len(consts) < 3:
            return None
        classes = consts[2]  # int8 [B|1, H|1, Sq / pq, Sk / pk] over the global batch and heads
        for axis, (axes, size) in enumerate(zip(self.mod_axes, q.shape[:2], strict=True)):
            if axes is not None and classes.shape[axis] > 1:  # this shard's rows
                classes = jax.lax.dynamic_slice_in_dim(classes, jax.lax.axis_index(axes) * size, size, axis)
        q0, k0 = self.plan.starts(r, a, s, b)
        return jnp.any(classes[:, :, q0 // self.plan.pq, k0 // self.plan.pk] != EMPTY)

    def _dispatch(self, fns, a, b, r, s, live, *args):
        """Run the plan's branch of the pair (the empty one, the last of ``fns``, where ``live`` is
        False), switching only among the branches the pair can take."""
        ids = sorted(self.plan.branches_of(a, b))
        if live is None and len(ids) == 1:  # the same branch on every shard pair: no switch
            return fns[ids[0]](*args)
        branches = [fns[i] for i in ids]
        position = np.zeros(len(fns), np.int32)
        position[ids] = np.arange(len(ids))
        index = jnp.asarray(position)[self.plan.index(r, a, s, b)]
        if live is not None:
            branches.append(fns[-1])
            index = jnp.where(live, index, len(ids))
        return jax.lax.switch(index, branches, *args)

    def init_forward(self, q, v):
        """The empty running state: per query piece, out 0 and lse −inf."""
        b_, h_, pq = q.shape[0], q.shape[1], self.plan.pq
        return tuple(
            (jnp.zeros((b_, h_, pq, v.shape[-1]), jnp.float32), jnp.full((b_, h_, pq), -jnp.inf, jnp.float32))
            for _ in range(self.plan.m)
        )

    def forward_pair(self, state, a, b, r, s, q, q_seg, k, v, kv_seg, consts=None):
        """Merge the backend's attention of query piece ``a`` over key piece ``b`` into the state."""
        fwd, _ = self._branches(q, k, v)
        pq, pk = self.plan.pq, self.plan.pk
        args = (piece(q, 2, a, pq), piece(k, 2, b, pk), piece(v, 2, b, pk))
        segs = (piece(q_seg, 1, a, pq), piece(kv_seg, 1, b, pk))
        live = self._live(consts, q, r, a, s, b)
        part = self._dispatch(fwd, a, b, r, s, live, *args, *segs, *self._shifted(consts, q, r, a, s, b))
        state = list(state)
        state[a] = merge(state[a], part)
        return tuple(state)

    def finish_forward(self, state, dtype):
        """``(out, lse)`` of the shard from the final state."""
        out = jnp.concatenate([o for o, _ in state], axis=2).astype(dtype)
        return out, jnp.concatenate([l for _, l in state], axis=2)

    def init_backward(self, q, k, v, out, lse, d_out, d_lse, consts=None):
        """``(context, dq0, dk0, dv0)``: the per-piece residual rows and zero f32 gradients (dq0 =
        ``(dq pieces, d mods)``, the latter one zero per float array of the score_mod)."""
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
        d_mods = tuple(jnp.zeros(jnp.shape(consts[0][n]), jnp.float32) for n in self.floats)
        return rows, (dq, d_mods), jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)

    def backward_pair(self, grads, context, a, b, r, s, q, q_seg, k, v, kv_seg, consts=None):
        """Add the backend's residual-backward gradients of piece pair (a, b) into ``grads``."""
        _, bwd = self._branches(q, k, v)
        pq, pk = self.plan.pq, self.plan.pk
        (dq, d_mods), dk, dv = grads
        args = (piece(q, 2, a, pq), piece(k, 2, b, pk), piece(v, 2, b, pk), piece(q_seg, 1, a, pq))
        mods = self._shifted(consts, q, r, a, s, b)
        live = self._live(consts, q, r, a, s, b)
        got = self._dispatch(bwd, a, b, r, s, live, *args, piece(kv_seg, 1, b, pk), *context[a], *mods)
        gq, gk, gv = got[:3]
        if mods:
            d_mods = tuple(x + g for x, g in zip(d_mods, got[3], strict=True))
        dq = (dq[:a] + (dq[a] + gq,) + dq[a + 1 :], d_mods)
        dk = jax.lax.dynamic_update_slice_in_dim(dk, piece(dk, 2, b, pk) + gk, b * pk, 2)
        dv = jax.lax.dynamic_update_slice_in_dim(dv, piece(dv, 2, b, pk) + gv, b * pk, 2)
        return dq, dk, dv

    def finish_backward(self, dq, dtype):
        """The shard's dQ from its per-piece accumulators."""
        return jnp.concatenate(dq[0], axis=2).astype(dtype)


def _empty_forward(out_shape, dtype, q, k, v, qs, ks, mods=None):
    del q, k, v, qs, ks, mods
    return jnp.zeros(out_shape, dtype), jnp.full(out_shape[:3], -jnp.inf, jnp.float32)


def _empty_backward(floats, q, k, v, qs, ks, out, lse, d_out, d_lse, mods=None):
    del qs, ks, out, lse, d_out, d_lse
    grads = tuple(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))
    if mods is None:
        return grads
    return (*grads, tuple(jnp.zeros(jnp.shape(mods.score_consts[n]), jnp.float32) for n in floats))
