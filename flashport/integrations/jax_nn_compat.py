"""``jax.nn.dot_product_attention`` whose ``implementation`` is only known at run time, on the contract.

:func:`dot_product_attention` has jax.nn's signature (jax 0.10). ``implementation="xla"`` -- the code
asks for XLA, which runs on every platform -- calls ``jax.nn.dot_product_attention`` unchanged;
``None`` (jax picks cuDNN on a GPU when it can) and ``"cudnn"`` (GPU only) run
:func:`flashport.attention` on any platform, with jax.nn's meaning (its docstring):

* layout ``[B, T, N, H]`` (or ``[T, N, H]``, one batch); ``scale=None`` is ``1/sqrt(H)``;
* ``is_causal`` top-left (``tril(ones(T, S))``); ``local_window_size=(l, r)`` (an int ``w`` is
  ``(w, w)``), inclusive, top-left anchored;
* ``mask`` boolean, True = attend; ``bias`` additive; both broadcast to ``[B, N, T, S]``;
* ``query_seq_lengths`` / ``key_value_seq_lengths`` (``[B]``): query ``t`` sees key ``s`` only when
  ``t`` and ``s`` are below their batch's lengths. A row that sees no key (padding, or masked out)
  returns 0 with the contract (jax.nn's XLA path returns the mean of ``value`` there: rows the
  caller discards);
* ``return_residual=True`` returns ``(out, lse)`` with lse ``[B, T, N]`` (natural log).
"""

from __future__ import annotations

__all__ = ["dot_product_attention"]


def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale=None,
    is_causal=False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size=None,
    implementation=None,
    return_residual=False,
):
    """jax.nn's ``dot_product_attention`` (module docstring): XLA when asked for, else the contract."""
    import jax
    import jax.numpy as jnp

    import flashport

    if implementation == "xla":
        extra = {"return_residual": True} if return_residual else {}
        return jax.nn.dot_product_attention(
            query,
            key,
            value,
            bias,
            mask,
            scale=scale,
            is_causal=is_causal,
            query_seq_lengths=query_seq_lengths,
            key_value_seq_lengths=key_value_seq_lengths,
            local_window_size=local_window_size,
            implementation="xla",
            **extra,
        )
    if implementation not in (None, "cudnn"):
        raise ValueError(f"Unsupported implementation option: {implementation}")
    unbatched = jnp.ndim(query) == 3
    if unbatched:
        query, key, value = (x[None] for x in (query, key, value))
    t, s = query.shape[1], key.shape[1]
    visible = None if mask is None else jnp.asarray(mask, bool)
    if query_seq_lengths is not None or key_value_seq_lengths is not None:
        rows = jnp.ones((query.shape[0], t), bool)
        cols = jnp.ones((key.shape[0], s), bool)
        if query_seq_lengths is not None:
            rows = jnp.arange(t)[None, :] < jnp.asarray(query_seq_lengths).reshape(-1, 1)
        if key_value_seq_lengths is not None:
            cols = jnp.arange(s)[None, :] < jnp.asarray(key_value_seq_lengths).reshape(-1, 1)
        pad = rows[:, None, :, None] & cols[:, None, None, :]
        visible = pad if visible is None else visible & pad
    window = None
    if local_window_size is not None:
        window = (
            (int(local_window_size), int(local_window_size))
            if isinstance(local_window_size, int)
            else tuple(int(w) for w in local_window_size)
        )
    result = flashport.attention(
        query,
        key,
        value,
        scale=scale,
        causal=bool(is_causal),
        window=window,
        align="top_left",
        bias=bias,
        mask=visible,
        layout="BSHD",
        return_lse=bool(return_residual),
    )
    out, lse = result if return_residual else (result, None)
    if unbatched:
        out = out[0]
    if not return_residual:
        return out
    lse = jnp.swapaxes(lse, 1, 2)  # [B, T, N]
    return out, lse[0] if unbatched else lse
