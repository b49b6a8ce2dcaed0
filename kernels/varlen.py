"""``flashport.varlen_attention``: flash-attn's packed variable-length convention on the contract.

flash-attn's varlen functions take ``[total, H, D]`` tensors (no batch dim) and ``cu_seqlens``
``(B+1,)``; causal and window are bottom-right **per sequence** (offset ``len_k[b] - len_q[b]``). A
single global bottom-right offset plus segment ids is *not* the same when per-sequence q and k
lengths differ, so this helper builds, from ``cu_seqlens``, segment ids (tokens past
``cu_seqlens[-1]`` get ids that match nothing, so their output is 0) and a boolean mask that holds
each sequence's own causal/window band, then calls the contract with batch 1.

Works on torch tensors (through ``flashport.torch.attention``) and on JAX arrays (through
``flashport.attention``, jit-compatible: ``total`` is a static shape). Imports neither framework
at module import.
"""

from __future__ import annotations


def _is_torch(x) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def varlen_layout(cu_seqlens_q, cu_seqlens_k, total_q, total_k, *, causal=False, window=None, align="bottom_right"):
    """Return ``(q_segment_ids [total_q], kv_segment_ids [total_k], mask [total_q, total_k])``.

    Works on torch tensors or JAX/numpy arrays (the type of ``cu_seqlens_q`` decides).
    """
    if align not in ("bottom_right", "top_left"):
        raise ValueError(f"align={align!r} is not supported; use 'bottom_right' or 'top_left'")
    if _is_torch(cu_seqlens_q):
        import torch

        cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
        arange = lambda n: torch.arange(n, device=cu_q.device)  # noqa: E731
        search = lambda cu, pos: torch.searchsorted(cu[1:].contiguous(), pos, right=True)  # noqa: E731
        where, clip = torch.where, lambda x, hi: x.clamp(max=hi)
    else:
        import jax.numpy as jnp

        cu_q, cu_k = jnp.asarray(cu_seqlens_q, jnp.int32), jnp.asarray(cu_seqlens_k, jnp.int32)
        arange = lambda n: jnp.arange(n, dtype=jnp.int32)  # noqa: E731
        search = lambda cu, pos: jnp.searchsorted(cu[1:], pos, side="right").astype(jnp.int32)  # noqa: E731
        where, clip = jnp.where, lambda x, hi: jnp.minimum(x, hi)
    batch = cu_q.shape[0] - 1

    def tokens(cu, total):
        pos = arange(total)
        seq = clip(search(cu, pos), batch - 1)
        valid = pos < cu[-1]
        return seq, valid, pos - cu[seq]

    seq_q, valid_q, pos_q = tokens(cu_q, total_q)
    seq_k, valid_k, pos_k = tokens(cu_k, total_k)
    row = pos_q
    if align == "bottom_right":
        len_q = cu_q[1:] - cu_q[:-1]
        len_k = cu_k[1:] - cu_k[:-1]
        row = pos_q + (len_k - len_q)[seq_q]
    i, j = row[:, None], pos_k[None, :]
    mask = (seq_q[:, None] == seq_k[None, :]) & valid_q[:, None] & valid_k[None, :]
    if causal:
        mask = mask & (j <= i)
    if window is not None:
        left, right = window
        if left is not None:
            mask = mask & (j >= i - left)
        if right is not None:
            mask = mask & (j <= i + right)
    q_ids = where(valid_q, seq_q, -1)
    kv_ids = where(valid_k, seq_k, -2)
    return q_ids, kv_ids, mask


def varlen_attention(
    query,
    key,
    value,
    *,
    cu_seqlens_q,
    cu_seqlens_k,
    scale=None,
    causal=False,
    window=None,
    align="bottom_right",
    softcap=None,
    layout="THD",
    backend="auto",
    attention=None,
):
    """Attention over packed variable-length sequences, flash-attn varlen semantics.

    Args:
      query: [total_q, Hq, D]; key, value: [total_k, Hkv, D] (``layout="THD"``).
      cu_seqlens_q, cu_seqlens_k: int (B+1,) cumulative sequence starts (flash-attn's convention).
      scale, softcap: as :func:`flashport.attention`.
      causal, window: applied per sequence with ``align`` (``"bottom_right"``: offset
        ``len_k[b] - len_q[b]``, flash-attn >= 2.1; ``"top_left"``: offset 0).
      layout: must be ``"THD"``.
      backend: passed to the attention function.
      attention: the contract implementation to call (default: ``flashport.torch.attention`` for
        torch tensors, ``flashport.attention`` otherwise); tests pass a reference.

    Returns:
      [total_q, Hq, D]; rows of tokens past ``cu_seqlens_q[-1]`` are 0.
    """
    if layout != "THD":
        raise ValueError(f"layout={layout!r}: varlen_attention takes packed [total, heads, head_dim] tensors (layout='THD')")
    if attention is None:
        if _is_torch(query):
            import flashport.torch

            attention = flashport.torch.attention
        else:
            from flashport.kernels.api import attention
    q_ids, kv_ids, mask = varlen_layout(
        cu_seqlens_q, cu_seqlens_k, query.shape[0], key.shape[0], causal=causal, window=window, align=align
    )
    out = attention(
        query[None], key[None], value[None],
        scale=scale, softcap=softcap, mask=mask[None, None],
        q_segment_ids=q_ids[None], kv_segment_ids=kv_ids[None],
        layout="BSHD", backend=backend,
    )
    return out[0]
