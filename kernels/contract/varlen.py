"""``flashport.varlen_attention``: flash-attn's packed variable-length convention on the contract.

flash-attn's varlen functions take ``[total, H, D]`` tensors (no batch dim) and ``cu_seqlens``
``(B+1,)``; causal and window are bottom-right **per sequence** (offset ``len_k[b] - len_q[b]``). A
single global offset plus segment ids is *not* the same when per-sequence q and k lengths differ.
:func:`varlen_plan` therefore lays the sequences out so that one offset fits them all, in O(total)
memory (no total x total mask):

* when every sequence has as many queries as keys (``cu_seqlens_q`` is ``cu_seqlens_k``, or equal
  concrete arrays, and equal totals) the packed layout already fits: segment ids, top-left;
* otherwise sequence ``b`` gets ``max(len_q[b], len_k[b])`` rows of a virtual layout of
  ``total_q + total_k`` rows, its queries and keys placed so that their ends line up (bottom-right;
  starts for top-left); q, k and v are gathered into it, the contract runs with segment ids and
  ``align="top_left"``, and the output (and lse) are gathered back.

Tokens past ``cu_seqlens[-1]`` get segment ids that match nothing, so their output is 0. Tiles
whose queries and keys lie in different sequences hold no visible pair; the causal/window band of
the layout skips those beyond it.

:func:`varlen_attention` here runs JAX arrays through ``flashport.attention`` (jit-compatible:
``total`` is a static shape); torch tensors (torchax and torch_xla tensors included) go through
``flashport.torch.varlen_attention``, and ``flashport.varlen_attention`` dispatches between the two.
This module never imports the torch adapter, and imports neither framework at module import.

Dropout positions: the sequences are packed into one batch row, so the contract's keep-mask is
drawn at batch 0 and at the **packed token positions** (query ``i`` and key ``j`` index the
``total_q`` / ``total_k`` axes), not at positions within each sequence. To keep those positions, a
call with dropout whose sequences need the virtual layout runs on the packed layout with a dense
per-sequence mask (:func:`varlen_layout`, O(total_q x total_k) memory).
"""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import Any

from flashport.kernels.contract.keywords import VARLEN_KEYWORDS, takes_contract_keywords
from flashport.kernels.semantics.visibility import band_visible


def is_torch_tensor(x) -> bool:
    """Whether ``x`` is a ``torch.Tensor`` (subclasses too: torchax tensors), without importing torch.

    A torch tensor cannot exist unless torch has been imported, so an unimported torch means no.
    """
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def varlen_layout(
    cu_seqlens_q, cu_seqlens_k, total_q, total_k, *, causal=False, window=None, align="bottom_right"
):
    """Return ``(q_segment_ids [total_q], kv_segment_ids [total_k], mask [total_q, total_k])``: the
    packed layout with a dense mask holding each sequence's own causal/window band (O(total_q x
    total_k) memory; :func:`varlen_plan` is the O(total) layout).

    Works on torch tensors or JAX/numpy arrays (the type of ``cu_seqlens_q`` decides).
    """
    if align not in ("bottom_right", "top_left"):
        raise ValueError(f"align={align!r} is not supported; use 'bottom_right' or 'top_left'")
    xp = _ops(cu_seqlens_q)
    cu_q, cu_k = xp.ints(cu_seqlens_q), xp.ints(cu_seqlens_k)
    seq_q, valid_q, pos_q = _tokens(xp, cu_q, total_q)
    seq_k, valid_k, pos_k = _tokens(xp, cu_k, total_k)
    row = pos_q
    if align == "bottom_right":
        len_q = cu_q[1:] - cu_q[:-1]
        len_k = cu_k[1:] - cu_k[:-1]
        row = pos_q + (len_k - len_q)[seq_q]
    i, j = row[:, None], pos_k[None, :]
    mask = (seq_q[:, None] == seq_k[None, :]) & valid_q[:, None] & valid_k[None, :]
    left, right = window if window is not None else (None, None)
    mask = band_visible(i, j, causal=causal, left=left, right=right, visible=mask)
    return xp.where(valid_q, seq_q, -1), xp.where(valid_k, seq_k, -2), mask


def _tokens(xp, cu, total):
    """Per packed token: its sequence, whether it lies before ``cu[-1]``, its position in the sequence."""
    pos = xp.arange(total)
    seq = xp.minimum(xp.search(cu[1:], pos), cu.shape[0] - 2)
    return seq, pos < cu[-1], pos - cu[seq]


def _ops(cu) -> types.SimpleNamespace:
    """The integer array operations varlen layouts need, for torch tensors or JAX/numpy arrays."""
    if is_torch_tensor(cu):
        import torch

        return types.SimpleNamespace(
            ints=lambda x: x.long(),
            arange=lambda n: torch.arange(n, device=cu.device),
            # bucketize(right=True) == searchsorted(right=True); torchax implements only the former.
            search=lambda ends, pos: torch.bucketize(pos, ends.contiguous(), right=True),
            where=torch.where,
            minimum=lambda x, hi: x.clamp(max=hi),
            maximum=torch.maximum,
            cumsum=lambda x: x.cumsum(0),
        )
    import jax.numpy as jnp

    return types.SimpleNamespace(
        ints=lambda x: jnp.asarray(x, jnp.int32),
        arange=lambda n: jnp.arange(n, dtype=jnp.int32),
        search=lambda ends, pos: jnp.searchsorted(ends, pos, side="right").astype(jnp.int32),
        where=jnp.where,
        minimum=jnp.minimum,
        maximum=jnp.maximum,
        cumsum=jnp.cumsum,
    )


def _same_lengths(cu_q, cu_k) -> bool:
    """Whether ``cu_q`` and ``cu_k`` are known, without tracing, to be equal."""
    if cu_q is cu_k:
        return True
    if is_torch_tensor(cu_q):
        import torch

        plain = type(cu_q) is torch.Tensor and type(cu_k) is torch.Tensor and cu_q.device.type == "cpu"
        return plain and cu_q.shape == cu_k.shape and bool(torch.equal(cu_q, cu_k.to(cu_q.device)))
    import jax
    import numpy as np

    if isinstance(cu_q, jax.core.Tracer) or isinstance(cu_k, jax.core.Tracer):
        return False
    return np.shape(cu_q) == np.shape(cu_k) and bool(np.array_equal(np.asarray(cu_q), np.asarray(cu_k)))


@dataclasses.dataclass(frozen=True)
class VarlenPlan:
    """Where packed sequences go for one contract call (:func:`varlen_plan`).

    ``q_ids`` / ``kv_ids``: segment ids of the rows the call sees. ``q_rows`` / ``kv_rows``: the packed
    row each of those rows is gathered from, and ``out_rows``: the row of the call's output each packed
    query takes (all three ``None`` when the packed layout is used as is).
    """

    q_ids: Any
    kv_ids: Any
    q_rows: Any = None
    kv_rows: Any = None
    out_rows: Any = None


def varlen_plan(
    cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int, *, align="bottom_right"
) -> VarlenPlan:
    """The O(total) layout of packed sequences under one ``align="top_left"`` call (module docstring).

    Works on torch tensors or JAX/numpy arrays (the type of ``cu_seqlens_q`` decides).
    """
    if align not in ("bottom_right", "top_left"):
        raise ValueError(f"align={align!r} is not supported; use 'bottom_right' or 'top_left'")
    xp = _ops(cu_seqlens_q)
    cu_q, cu_k = xp.ints(cu_seqlens_q), xp.ints(cu_seqlens_k)
    batch = cu_q.shape[0] - 1
    seq_q, valid_q, pos_q = _tokens(xp, cu_q, total_q)
    seq_k, valid_k, _ = _tokens(xp, cu_k, total_k)
    packed = (xp.where(valid_q, seq_q, -1), xp.where(valid_k, seq_k, -2))
    if min(total_q, total_k) == 0 or (total_q == total_k and _same_lengths(cu_seqlens_q, cu_seqlens_k)):
        return VarlenPlan(*packed)
    len_q, len_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    span = xp.maximum(len_q, len_k)
    end = xp.cumsum(span)
    q_start, k_start = (end - len_q, end - len_k) if align == "bottom_right" else (end - span, end - span)
    rows = total_q + total_k  # >= sum(span)
    pos = xp.arange(rows)
    seq = xp.minimum(xp.search(end, pos), batch - 1)

    def place(start, length, cu, missing):
        offset = pos - start[seq]
        valid = (offset >= 0) & (offset < length[seq])
        return xp.where(valid, seq, missing), xp.where(valid, cu[seq] + offset, 0)

    q_ids, q_rows = place(q_start, len_q, cu_q, -1)
    kv_ids, kv_rows = place(k_start, len_k, cu_k, -2)
    # A query past cu_seqlens_q[-1] reads the last virtual row, which no sequence reaches then.
    out_rows = xp.where(valid_q, q_start[seq_q] + pos_q, rows - 1)
    return VarlenPlan(q_ids, kv_ids, q_rows, kv_rows, out_rows)


def _rows(x, index):
    """``x[index]`` along dim 0 (``index_select`` on torch: torchax's indexing drops autograd)."""
    if index is None:
        return x
    return x.index_select(0, index) if is_torch_tensor(x) else x[index]


def attend_packed(attention, query, key, value, plan: VarlenPlan, *, return_lse=False, **options):
    """Call ``attention`` (a contract implementation) on packed [total, H, D] tensors laid out by
    ``plan``; ``options`` are its keywords besides the layout, alignment and segment ids (which the
    plan fixes). Returns ``out`` [total_q, H, Dv], or ``(out, lse [H, total_q])``."""
    torch_in = is_torch_tensor(query)
    # unsqueeze/squeeze rather than [None]/[0] on torch tensors: torchax's indexing drops autograd.
    lift = (lambda x: x.unsqueeze(0)) if torch_in else (lambda x: x[None])
    drop = (lambda x: x.squeeze(0)) if torch_in else (lambda x: x[0])
    q, k, v = _rows(query, plan.q_rows), _rows(key, plan.kv_rows), _rows(value, plan.kv_rows)
    result = attention(
        *(lift(x) for x in (q, k, v)),
        align="top_left",
        q_segment_ids=lift(plan.q_ids),
        kv_segment_ids=lift(plan.kv_ids),
        layout="BSHD",
        **options,
        **({"return_lse": True} if return_lse else {}),
    )
    out, lse = result if return_lse else (result, None)
    out = _rows(drop(out), plan.out_rows)
    if not return_lse:
        return out
    lse = drop(lse)
    if plan.out_rows is not None:
        lse = lse.index_select(1, plan.out_rows) if torch_in else lse[:, plan.out_rows]
    return out, lse


def attend_varlen(
    attention,
    query,
    key,
    value,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    causal,
    window,
    align,
    return_lse=False,
    **options,
):
    """Call ``attention`` (a contract implementation) on packed sequences with per-sequence
    ``causal``/``window``/``align``; ``options`` (scale, softcap, backend, dropout keywords) go
    through. Returns ``out`` [total_q, H, Dv], or ``(out, lse [H, total_q])``."""
    total_q, total_k = query.shape[0], key.shape[0]
    plan = varlen_plan(cu_seqlens_q, cu_seqlens_k, total_q, total_k, align=align)
    dropout = any(options.get(n) for n in ("dropout_rate", "dropout_p"))
    if plan.q_rows is None or not dropout:
        return attend_packed(
            attention, query, key, value, plan, causal=causal, window=window, return_lse=return_lse, **options
        )
    # Dropout draws at packed positions (module docstring): the packed layout with a dense mask.
    q_ids, kv_ids, mask = varlen_layout(
        cu_seqlens_q, cu_seqlens_k, total_q, total_k, causal=causal, window=window, align=align
    )
    torch_in = is_torch_tensor(query)
    lift = (lambda x: x.unsqueeze(0)) if torch_in else (lambda x: x[None])
    drop = (lambda x: x.squeeze(0)) if torch_in else (lambda x: x[0])
    result = attention(
        lift(query),
        lift(key),
        lift(value),
        mask=lift(lift(mask)),
        q_segment_ids=lift(q_ids),
        kv_segment_ids=lift(kv_ids),
        layout="BSHD",
        **options,
        **({"return_lse": True} if return_lse else {}),
    )
    return (drop(result[0]), drop(result[1])) if return_lse else drop(result)


def run_varlen(attention, query, key, value, *, cu_seqlens_q, cu_seqlens_k, backend, contract, extra):
    """Call ``attention`` (a contract implementation) on packed sequences; shared by the JAX and the
    torch ``varlen_attention``. ``contract`` holds the :data:`~flashport.kernels.contract.keywords.VARLEN_KEYWORDS`;
    ``extra`` (dropout keywords) is passed through unchanged."""
    scale, causal, window, align, softcap, layout = (contract[n] for n in VARLEN_KEYWORDS)
    if layout != "THD":
        raise ValueError(
            f"layout={layout!r}: varlen_attention takes packed [total, heads, head_dim] tensors (layout='THD')"
        )
    cu = (cu_seqlens_q, cu_seqlens_k)
    band = dict(causal=causal, window=window, align=align)
    return attend_varlen(
        attention, query, key, value, *cu, **band, scale=scale, softcap=softcap, backend=backend, **extra
    )


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
                "flashport.kernels.contract.varlen.varlen_attention takes JAX arrays, got a torch tensor; use "
                "flashport.varlen_attention or flashport.torch.varlen_attention for torch tensors"
            )
        from flashport.kernels.contract.api import attention
    extra = dict(dropout_rate=dropout_rate, dropout_rng=dropout_rng) if dropout_rate else {}
    cu = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    return run_varlen(attention, query, key, value, **cu, backend=backend, contract=contract, extra=extra)
