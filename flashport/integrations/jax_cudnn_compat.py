"""JAX's private cuDNN attention entry point on the flashport contract.

``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`` (MaxText, axlearn) only runs on an
NVIDIA GPU with cuDNN. :func:`dot_product_attention` here has its signature (jax 0.10) and meaning,
and runs :func:`flashport.attention` on any platform. Semantics (the function's docstring and
``_normalize_layout`` / ``has_padding`` in ``fused_attention_stablehlo.py``):

* ``qkv_layout`` ``"BTNH"``/``"BSNH"`` (= the contract's ``BSHD``) or ``"BNTH"``/``"BNSH"`` (``BHSD``);
  the output has the query's layout;
* ``scale`` defaults to **1.0** (not 1/sqrt(H));
* ``bias`` additive ``[B, N, T, S]``; ``mask`` boolean ``[B, N, T, S]``, True = attend;
* ``mask_type`` (jax's ``MaskType`` or its name): ``NO_MASK``; ``CAUSAL`` (top-left, as jax.nn's
  ``is_causal``); ``PADDING`` / ``PADDING_CAUSAL`` need ``q_seqlen`` and ``kv_seqlen`` (``[B]``, the
  non-padded lengths): query ``t`` sees key ``s`` only when ``t < q_seqlen[b]`` and
  ``s < kv_seqlen[b]``. A padded query row sees no key and returns 0 (lse -inf), the contract's
  value for an empty row; cuDNN's values there are padding the caller discards;
* ``sliding_window_length=L``: keys in ``(pos - L, pos]`` (``window=(L - 1, 0)``, causal);
* GQA: fewer key/value heads, contiguous groups, as in the contract;
* ``return_residual=True`` returns ``(out, lse)`` with the natural-log logsumexp of the scaled scores
  in ``[B, T, N]`` for the ``BTNH`` layouts and ``[B, N, T]`` for ``BNTH``;
* ``dropout_rate > 0``: the contract's dropout with the PRNG key ``jax.random.key(seed)`` (the same
  rate and scaling; a different random mask than cuDNN's, as any two dropout draws are).

Packed segments (``q_offsets``/``kv_offsets``), FP8 (``use_fp8``/``fp8_params``) and ALiBi raise
``NotImplementedError`` naming the argument.
"""

from __future__ import annotations

__all__ = ["MaskType", "dot_product_attention"]

import enum

_LAYOUTS = {"BTNH": "BSHD", "BSNH": "BSHD", "BNTH": "BHSD", "BNSH": "BHSD"}


try:  # jax's own enum: a member the codemod moved here still means the same to jax's function
    from jax._src.cudnn.fused_attention_stablehlo import MaskType
except ImportError:  # a jax without the private cuDNN module: an enum of the same names and values

    class MaskType(enum.Enum):  # type: ignore[no-redef]
        """jax's ``fused_attention_stablehlo.MaskType`` (same names and values)."""

        NO_MASK = 0
        PADDING = 1
        CAUSAL = 2
        PADDING_CAUSAL = 3
        ALIBI = 4


def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    q_seqlen=None,
    kv_seqlen=None,
    q_offsets=None,
    kv_offsets=None,
    fp8_params=None,
    *,
    scale=1.0,
    mask_type=MaskType.NO_MASK,
    seed=42,
    dropout_rate=0.0,
    qkv_layout="BTNH",
    sliding_window_length=None,
    use_fp8=False,
    return_residual=False,
):
    """``fused_attention_stablehlo.dot_product_attention`` through :func:`flashport.attention`
    (module docstring). Returns the output, or ``(out, lse)`` with ``return_residual=True``."""
    import jax
    import jax.numpy as jnp

    import flashport

    for name, given in (("q_offsets", q_offsets), ("kv_offsets", kv_offsets), ("fp8_params", fp8_params)):
        if given is not None:
            raise NotImplementedError(f"cuDNN dot_product_attention {name}= is not supported by flashport")
    if use_fp8:
        raise NotImplementedError("cuDNN dot_product_attention use_fp8=True is not supported by flashport")
    kind = getattr(mask_type, "name", mask_type)
    if kind not in MaskType.__members__ or kind == "ALIBI":
        raise NotImplementedError(f"cuDNN mask_type {kind} is not supported by flashport")
    layout = _LAYOUTS.get(str(qkv_layout).upper())
    if layout is None:
        raise ValueError(f"qkv_layout must be one of {sorted(_LAYOUTS)}, got {qkv_layout!r}")
    padding = kind in ("PADDING", "PADDING_CAUSAL")
    if padding and (q_seqlen is None or kv_seqlen is None):
        raise ValueError("Require q_seqlen and kv_seqlen to generate padding mask")
    if not padding and (q_seqlen is not None or kv_seqlen is not None):
        raise NotImplementedError(f"q_seqlen/kv_seqlen with mask_type {kind}: only PADDING masks read them")
    axis = 1 if layout == "BSHD" else 2
    visible = None if mask is None else jnp.asarray(mask, bool)
    if padding:
        rows = jnp.arange(query.shape[axis])[None, :] < jnp.asarray(q_seqlen).reshape(-1, 1)
        cols = jnp.arange(key.shape[axis])[None, :] < jnp.asarray(kv_seqlen).reshape(-1, 1)
        pad = rows[:, None, :, None] & cols[:, None, None, :]
        visible = pad if visible is None else visible & pad
    window = None
    if sliding_window_length is not None:
        window = (int(sliding_window_length) - 1, 0)
    dropout = {}
    if dropout_rate:
        dropout = {"dropout_rate": dropout_rate, "dropout_rng": jax.random.key(seed)}
    result = flashport.attention(
        query,
        key,
        value,
        scale=scale,
        causal=kind in ("CAUSAL", "PADDING_CAUSAL") or window is not None,
        window=window,
        align="top_left",
        bias=bias,
        mask=visible,
        layout=layout,
        return_lse=bool(return_residual),
        **dropout,
    )
    if not return_residual:
        return result
    out, lse = result  # [B, N, T]
    return out, (jnp.swapaxes(lse, 1, 2) if layout == "BSHD" else lse)
