"""``attention_backward``: the gradients of :func:`flashport.attention` from the forward's residuals.

A caller that ran the forward with ``return_lse=True`` already holds everything a flash-attention
backward needs: the inputs, ``out`` and ``lse`` (O(S) memory). :func:`attention_backward` turns the
cotangents ``(d_out, d_lse)`` into ``(dq, dk, dv, dbias)`` from those residuals, without running
the forward again. Bridges that cannot carry a JAX VJP closure from the forward to the backward
(torch_xla's and torchax's ``call_jax``) stage it as their backward.

Each backend's residual backward is its ``BackendInfo.backward`` (see
:mod:`flashport.kernels.contract.registry`):

* ``blockwise``: its ``custom_vjp`` backward (the dQ pass and the dK/dV pass);
* ``pallas_tpu`` / ``pallas_tpu_interpret``: the dK/dV and dQ Pallas kernels of its ``custom_vjp``;
* ``xla``: :func:`flashport.kernels.backends.xla.xla_attention_backward` (recomputes the scores Q·Kᵀ, as
  every flash backward does, but not the softmax normalizer nor the output P·V);
* a backend without one (a user-registered backend, ``cudnn``): the fallback recomputes the forward
  under ``jax.vjp`` (correct, one extra forward), and logs that at debug level.

``backend="auto"`` picks, per platform, exactly what :func:`flashport.attention` picks for the same
call with ``return_lse=True``, so the backward always matches the forward that made the residuals.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from flashport.kernels.contract import dispatch, execute
from flashport.kernels.contract.dispatch import flashport_attention_backward
from flashport.kernels.contract.execute import recompute_backward, run_backend
from flashport.kernels.contract.keywords import takes_contract_keywords
from flashport.kernels.contract.validate import prepare, prepare_mods
from flashport.kernels.semantics import bias_grad

# The backward's lower-layer names that callers reach through ``backward``.
__all__ = ["attention_backward", "flashport_attention_backward", "recompute_backward", "run_backend"]


@takes_contract_keywords()
def attention_backward(
    query,
    key,
    value,
    out,
    lse,
    d_out,
    d_lse=None,
    *,
    backend="auto",
    dropout_rate=0.0,
    dropout_rng=None,
    score_mod=None,
    mask_mod=None,
    block_mask=None,
    **contract,
):
    """Gradients of ``flashport.attention(..., return_lse=True)`` from its residuals.

    Args:
      query, key, value, scale, causal, window, align, softcap, bias, mask, q_segment_ids,
        kv_segment_ids, layout, backend, dropout_rate, dropout_rng, score_mod, mask_mod, block_mask:
        exactly as passed to the forward
        :func:`flashport.attention` call that produced ``out`` and ``lse``.
      out: the forward's output (``query``'s layout and dtype).
      lse: the forward's log-sum-exp, float32 [B, Hq, Sq].
      d_out: cotangent of ``out`` (same shape as ``out``).
      d_lse: cotangent of ``lse`` (float32 [B, Hq, Sq]); ``None`` means zeros.

    Returns:
      ``(dq, dk, dv, dbias)`` shaped and typed like ``query``, ``key``, ``value`` and ``bias``
      (``dbias`` is ``None`` without a bias). Rows that see no key get zero gradients.

    Raises:
      The errors of :func:`flashport.attention` for arguments that do not fit the contract, and
      ValueError when ``out`` / ``lse`` / the cotangents do not have the forward's shapes.
    """
    bias, layout = contract.pop("bias"), contract["layout"]
    options = dict(contract, return_lse=True, dropout_rate=dropout_rate, dropout_rng=dropout_rng)
    (q, k, v, bias_c, mask_c, q_seg, kv_seg, seed), call = prepare(query, key, value, bias=bias, **options)
    if bias is not None:  # dbias is among the results: only backends with bias gradients qualify
        call = dataclasses.replace(call, features=call.features | {bias_grad.FEATURE})
    mods = prepare_mods(query, key, score_mod, mask_mod, block_mask, layout)
    if mods is not None:
        call = dataclasses.replace(call, features=call.features | mods.features)

    def canonical(query, key, value, bias):
        arrays, _ = prepare(query, key, value, bias=bias, **options)
        return arrays[:3] + arrays[3:4]

    # The layout transposes, bias reshape and dtype cast of `prepare`, pulled back onto the user's arrays.
    _, to_user = jax.vjp(canonical, query, key, value, bias)

    b, hq, sq, _ = call.q_shape
    out_shape = (b, hq, sq, call.v_head_dim) if layout == "BHSD" else (b, sq, hq, call.v_head_dim)
    for name, x, shape in (
        ("out", out, out_shape),
        ("d_out", d_out, out_shape),
        ("lse", lse, (b, hq, sq)),
        ("d_lse", d_lse, (b, hq, sq)),
    ):
        if x is not None and tuple(jnp.shape(x)) != shape:
            raise ValueError(f"{name} must have the forward's shape {shape}, got {tuple(jnp.shape(x))}")
    out, d_out = jnp.asarray(out), jnp.asarray(d_out)
    if layout == "BSHD":
        out, d_out = jnp.swapaxes(out, 1, 2), jnp.swapaxes(d_out, 1, 2)
    lse = jnp.asarray(lse, jnp.float32)
    d_lse = jnp.zeros((b, hq, sq), jnp.float32) if d_lse is None else jnp.asarray(d_lse, jnp.float32)
    choice = execute.resolve_backend(backend, call)
    dq, dk, dv, dbias = dispatch.flashport_attention_backward(
        q, k, v, bias_c, mask_c, q_seg, kv_seg, seed, out, lse, d_out, d_lse, mods, call=call, choice=choice
    )
    return to_user((dq, dk, dv, dbias))
