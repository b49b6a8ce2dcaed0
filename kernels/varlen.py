"""``flashport.varlen_attention``: flash-attn's packed variable-length convention on the contract.

flash-attn's varlen functions take ``[total, H, D]`` tensors (no batch dim) and ``cu_seqlens``
``(B+1,)``; causal and window are bottom-right **per sequence** (offset ``len_k[b] - len_q[b]``). A
single global bottom-right offset plus segment ids is *not* the same when per-sequence q and k
lengths differ, so this helper builds, from ``cu_seqlens``, segment ids (tokens past
``cu_seqlens[-1]`` get ids that match nothing, so their output is 0) and a boolean mask that holds
each sequence's own causal/window band, then calls the contract with batch 1.

:func:`varlen_attention` here runs JAX arrays through ``flashport.attention`` (jit-compatible:
``total`` is a static shape); torch tensors (torchax and torch_xla tensors included) go through
``flashport.torch.varlen_attention``, and ``flashport.varlen_attention`` dispatches between the two.
This module never imports the torch adapter, and imports neither framework at module import.

Dropout positions: the sequences are packed into one batch row, so the contract's keep-mask is
drawn at batch 0 and at the **packed token positions** (query ``i`` and key ``j`` index the
``total_q`` / ``total_k`` axes), not at positions within each sequence.
"""

from __future__ import annotations

import sys

from flashport.kernels.keywords import VARLEN_KEYWORDS, takes_contract_keywords
from flashport.kernels.visibility import band_visible


def is_torch_tensor(x) -> bool:
    """Whether ``x`` is a ``torch.Tensor`` (subclasses too: torchax tensors), without importing torch.

    A torch tensor cannot exist unless torch has been imported, so an unimported torch means no.
    """
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def varlen_layout(
    cu_seqlens_q, cu_seqlens_k, total_q, total_k, *, causal=False, window=None, align="bottom_right"
):
    """Return ``(q_segment_ids [total_q], kv_segment_ids [total_k], mask [total_q, total_k])``.

    Works on torch tensors or JAX/numpy arrays (the type of ``cu_seqlens_q`` decides).
    """
    if align not in ("bottom_right", "top_left"):
        raise ValueError(f"align={align!r} is not supported; use 'bottom_right' or 'top_left'")
    if is_torch_tensor(cu_seqlens_q):
        import torch

        cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
        arange = lambda n: torch.arange(n, device=cu_q.device)  # noqa: E731
        # bucketize(right=True) == searchsorted(right=True); torchax implements only the former.
        search = lambda cu, pos: torch.bucketize(pos, cu[1:].contiguous(), right=True)  # noqa: E731
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
    left, right = window if window is not None else (None, None)
    mask = band_visible(i, j, causal=causal, left=left, right=right, visible=mask)
    q_ids = where(valid_q, seq_q, -1)
    kv_ids = where(valid_k, seq_k, -2)
    return q_ids, kv_ids, mask


def run_varlen(attention, query, key, value, *, cu_seqlens_q, cu_seqlens_k, backend, contract, extra):
    """Call ``attention`` (a contract implementation) on packed sequences; shared by the JAX and the
    torch ``varlen_attention``. ``contract`` holds the :data:`~flashport.kernels.keywords.VARLEN_KEYWORDS`;
    ``extra`` (dropout keywords) is passed through unchanged."""
    scale, causal, window, align, softcap, layout = (contract[n] for n in VARLEN_KEYWORDS)
    if layout != "THD":
        raise ValueError(
            f"layout={layout!r}: varlen_attention takes packed [total, heads, head_dim] tensors (layout='THD')"
        )
    q_ids, kv_ids, mask = varlen_layout(
        cu_seqlens_q, cu_seqlens_k, query.shape[0], key.shape[0], causal=causal, window=window, align=align
    )
    # unsqueeze/squeeze rather than [None]/[0] on torch tensors: torchax's indexing drops autograd.
    lift = (lambda x: x.unsqueeze(0)) if is_torch_tensor(query) else (lambda x: x[None])
    out = attention(
        lift(query),
        lift(key),
        lift(value),
        scale=scale,
        softcap=softcap,
        mask=lift(lift(mask)),
        q_segment_ids=lift(q_ids),
        kv_segment_ids=lift(kv_ids),
        layout="BSHD",
        backend=backend,
        **extra,
    )
    return out.squeeze(0) if is_torch_tensor(out) else out[0]


@takes_contract_keywords(VARLEN_KEYWORDS, layout="THD")
def varlen_attention(
    query,
    key,
    value,
    *,
    cu_seqlens_q,
    cu_seqlens_k,
    backend="auto",
    dropout_rate=0.0,
    dropout_rng=None,
    attention=None,
    **contract,
):
    """Attention over packed variable-length JAX arrays, flash-attn varlen semantics.

    Args:
      query: [total_q, Hq, D]; key, value: [total_k, Hkv, D] (``layout="THD"``).
      cu_seqlens_q, cu_seqlens_k: int (B+1,) cumulative sequence starts (flash-attn's convention).
      scale, softcap: as :func:`flashport.attention`.
      causal, window: applied per sequence with ``align`` (``"bottom_right"``: offset
        ``len_k[b] - len_q[b]``, flash-attn >= 2.1; ``"top_left"``: offset 0).
      layout: must be ``"THD"``.
      backend: passed to the attention function.
      dropout_rate, dropout_rng: as :func:`flashport.attention`; the keep-mask is drawn at batch 0
        and the packed token positions (module docstring).
      attention: the contract implementation to call (default: ``flashport.attention``); tests pass
        a reference. Dropout keywords are passed to it only when ``dropout_rate`` is non-zero.

    Returns:
      [total_q, Hq, D]; rows of tokens past ``cu_seqlens_q[-1]`` are 0.

    Raises:
      TypeError for torch tensors without ``attention`` (use ``flashport.varlen_attention`` or
      ``flashport.torch.varlen_attention``, which take ``dropout_p`` / ``generator``).
    """
    if attention is None:
        if is_torch_tensor(query):
            raise TypeError(
                "flashport.kernels.varlen.varlen_attention takes JAX arrays, got a torch tensor; use "
                "flashport.varlen_attention or flashport.torch.varlen_attention for torch tensors"
            )
        from flashport.kernels.api import attention
    extra = dict(dropout_rate=dropout_rate, dropout_rng=dropout_rng) if dropout_rate else {}
    cu = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    return run_varlen(attention, query, key, value, **cu, backend=backend, contract=contract, extra=extra)
