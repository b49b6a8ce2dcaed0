"""The torch-native paths: exact float32 math, torch SDPA and flash-attn, all on a validated CanonicalCall.

Each function takes a :class:`flashport.torch._checks.CanonicalCall` and returns ``(out, lse)`` with ``out``
in the call's layout and dtype and ``lse`` float32 [B, Hq, Sq] (``None`` where the path has none).
Which of them ``backend="auto"`` runs for CUDA tensors is decided in :mod:`flashport.torch._routing`.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch

from flashport.kernels.contract.spec import apply_softcap, positional_visible
from flashport.kernels.semantics.block_ranges import reach
from flashport.torch import _dropout
from flashport.torch._checks import CanonicalCall

log = logging.getLogger("flashport")

# flash-attn 2 limits (flash_api.cpp): half precision only, head_dim <= 256.
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256
# torch's own SDPA (what torch.nn.functional binds at torch's import), never a run-time patch of
# F.scaled_dot_product_attention: flashport's paths compute the contract themselves, and the SDPA
# drop-in (flashport.integrations.sdpa_compat) is where a patch is honoured.
TORCH_SDPA = torch._C._nn.scaled_dot_product_attention
# SDPA takes enable_gqa from torch 2.5; older versions get K/V repeated.
SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


# Why SDPA and flash-attn cannot run dropout with the contract's semantics.
DROPOUT_REASON = (
    "{name} draws its own dropout mask, which cannot reproduce the contract's (a position "
    "hash of the seed words drawn from generator, identical on every backend)"
)


# ------------------------------------------------------------------------------------ helpers


def _group(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """A rank-4 [B|1, Hq|1, ...] tensor -> rank 5 [B|1, Hkv|1, G|1, ...] grouped like the queries."""
    b, h = x.shape[:2]
    if h == 1:
        return x.unsqueeze(2)
    return x.reshape(b, hkv, h // hkv, *x.shape[2:])


def visible(call: CanonicalCall) -> torch.Tensor | None:
    """Boolean [B|1, Hq|1, Sq, Sk]: which keys each query may see (None when every key is visible)."""
    p = call.spec
    device = call.q.device
    keep = None
    if p.has_positional_mask:
        i = torch.arange(p.seq_q, device=device)[:, None]
        j = torch.arange(p.seq_k, device=device)[None, :]
        keep = positional_visible(p, i, j).expand(p.seq_q, p.seq_k)[None, None]
    if call.mask is not None:
        keep = call.mask if keep is None else keep & call.mask
    if call.q_seg is not None and call.kv_seg is not None:  # both or neither (checked)
        same = (call.q_seg[:, :, None] == call.kv_seg[:, None, :])[:, None]
        keep = same if keep is None else keep & same
    return keep


def _to_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """[B, H, S, D] -> the user's layout."""
    return x.transpose(1, 2) if layout == "BSHD" else x


# ------------------------------------------------------------------------------------ math


def math_attention(call: CanonicalCall) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact contract semantics in plain torch ops; float32 softmax and accumulation, autograd-friendly.

    GQA stays grouped ([B, Hkv, G, Sq, D] against [B, Hkv, Sk, D]), so K/V are never repeated. Rows
    with no visible key give 0 output, lse = -inf and zero (finite) gradients. Both outputs are
    differentiable. With ``call.dropout_p`` > 0 the normalized probabilities are multiplied by the
    contract's keep-mask (:func:`flashport.torch._dropout.keep_mask` of ``call.seed``) and scaled
    by ``1 / (1 - p)``; lse is that of the scores. float64 inputs (internal callers such as
    gradcheck) are computed in float64.
    """
    p = call.spec
    b, hq, sq, d = call.q.shape
    hkv = call.k.shape[1]
    acc = torch.float64 if call.q.dtype == torch.float64 else torch.float32
    q = call.q.to(acc).reshape(b, hkv, hq // hkv, sq, d)
    s = torch.einsum("bhgqd,bhkd->bhgqk", q, call.k.to(acc)) * p.scale
    s = apply_softcap(p, s, torch)
    if call.bias is not None:
        s = s + _group(call.bias.to(acc), hkv)
    keep = visible(call)
    if keep is not None:
        s = s.masked_fill(~_group(keep, hkv), float("-inf"))
    # The max only stabilizes exp (softmax is invariant to it), so it needs no gradient.
    # amax has no identity for Sk == 0; the -inf row max then gives out 0 and lse -inf as for any empty row.
    m = (
        s.amax(dim=-1, keepdim=True).detach()
        if s.shape[-1]
        else s.new_full((*s.shape[:-1], 1), float("-inf"))
    )
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    l = e.sum(dim=-1, keepdim=True)
    nonempty = l > 0
    weights = e
    if call.dropout_p > 0:
        if call.seed is None:
            raise ValueError("dropout_p > 0 needs the call's seed words (draw them with _dropout.draw_words)")
        kept = _dropout.keep_mask(call.seed, call.dropout_p, b, hq, sq, call.k.shape[2], call.q.device)
        weights = e * (_group(kept, hkv).to(acc) * (1.0 / (1.0 - call.dropout_p)))
    out = torch.einsum("bhgqk,bhkd->bhgqd", weights, call.v.to(acc)) / torch.where(
        nonempty, l, torch.ones_like(l)
    )
    # Differentiable; the inner where keeps log's gradient finite on rows with no key.
    lse = torch.where(nonempty, m + torch.log(torch.where(nonempty, l, torch.ones_like(l))), float("-inf"))
    out = out.reshape(b, hq, sq, -1).to(call.q.dtype)
    return _to_layout(out, call.layout), lse.reshape(b, hq, sq)


# ------------------------------------------------------------------------------------ SDPA


def sdpa_unsupported(call: CanonicalCall, return_lse: bool) -> str | None:
    """Why torch SDPA cannot run ``call`` with the contract's semantics (None when it can)."""
    if call.dropout_p > 0:
        return "dropout_p > 0: " + DROPOUT_REASON.format(name="SDPA")
    if return_lse:
        return LSE_REASON
    if call.spec.softcap is not None:
        return SOFTCAP_REASON
    return None


WINDOW_REASON = "a window (SDPA takes it only as an O(Sq*Sk) mask)"
SEGMENTS_REASON = "segment ids (SDPA takes them only as an O(Sq*Sk) mask)"
LSE_REASON = "return_lse (SDPA returns no log-sum-exp)"
SOFTCAP_REASON = "softcap (SDPA has no tanh capping)"


def cpu_sdpa_excluded(window, softcap, segment_ids, return_lse: bool) -> str | None:
    """A reason of :func:`cpu_sdpa_unsupported` read off the keyword values as given, before any
    validation (None when they leave SDPA possible): such calls go straight to the JAX path, which
    validates them, instead of being validated here first and again there."""
    if return_lse is True:
        return LSE_REASON
    if softcap is not None:
        return SOFTCAP_REASON
    if any(ids is not None for ids in segment_ids):
        return SEGMENTS_REASON
    if isinstance(window, (tuple, list)) and any(w is not None for w in window):
        return WINDOW_REASON
    return None


def cpu_sdpa_unsupported(call: CanonicalCall, return_lse: bool) -> str | None:
    """Why ``auto`` on CPU tensors keeps ``call`` off torch SDPA (None: SDPA computes it exactly).

    SDPA's CPU flash kernel takes what it can express without a materialized positional mask:
    no or top-left causal (``is_causal``; any alignment when Sq == Sk), any scale, GQA/MQA
    (``enable_gqa``, K/V not repeated), a bias of the query's dtype (with its gradient) and boolean
    masks (both already [.., Sq, Sk] tensors). Windows, segment ids and bottom-right causal with
    Sq != Sk would need an O(Sq·Sk) mask, and softcap, dropout with the contract's keep-mask and
    ``return_lse`` are not SDPA's to give: those keep the JAX path (O(S) memory).
    """
    reason = sdpa_unsupported(call, return_lse)
    if reason:
        return reason
    p = call.spec
    if p.window_left is not None or p.window_right is not None:
        return WINDOW_REASON
    if call.q_seg is not None:
        return SEGMENTS_REASON
    if p.causal and p.offset != 0:
        return f"bottom-right causal with Sq={p.seq_q} != Sk={p.seq_k} (SDPA's is_causal is top-left)"
    if call.bias is not None and call.bias.dtype != call.q.dtype:
        return f"a {call.bias.dtype} bias with {call.q.dtype} queries (SDPA would round the bias)"
    if p.seq_q == 0 or p.seq_k == 0:
        return "an empty sequence"
    return None


def sdpa_attention(call: CanonicalCall) -> tuple[torch.Tensor, None]:
    """torch SDPA with the contract's semantics made explicit.

    Causal top-left (or Sq == Sk) uses ``is_causal``; bottom-right alignment with Sq != Sk, windows,
    masks and segment ids become one boolean mask; a bias becomes the float mask. Rows with no
    visible key are given one dummy key and zeroed afterwards, so output and gradients are 0 on
    every SDPA backend (fused kernels included), never NaN.
    """
    p = call.spec
    q, k, v = call.q, call.k, call.v
    kwargs: dict[str, Any] = {"scale": p.scale}
    if q.shape[1] != k.shape[1] and SDPA_GQA:
        kwargs["enable_gqa"] = True
    elif q.shape[1] != k.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    only_causal = reach(p) == (None, 0)
    if only_causal and p.offset == 0 and call.bias is None and call.mask is None and call.q_seg is None:
        kwargs["is_causal"] = True  # SDPA's own (top-left) causal: lets its fused kernels run
        keep = rows = None
    else:
        keep, rows = visible(call), None
        if keep is not None:
            rows = keep.any(dim=-1, keepdim=True)
            keep = keep | ~rows
    attn_mask = keep
    if call.bias is not None:
        attn_mask = call.bias.to(q.dtype)
        if keep is not None:
            attn_mask = attn_mask.masked_fill(~keep, float("-inf"))
    out = TORCH_SDPA(q, k, v, attn_mask=attn_mask, **kwargs)
    if rows is not None:
        out = out * rows.to(out.dtype)
    return _to_layout(out, call.layout), None


# ------------------------------------------------------------------------------------ flash-attn


def import_flash_attn():
    """The installed ``flash_attn`` module, or None."""
    try:
        return importlib.import_module("flash_attn")
    except ImportError:
        return None


def flash_window(call: CanonicalCall) -> tuple[bool, tuple[int, int]] | str:
    """``(causal, window_size)`` for flash-attn 2 (bottom-right anchored, -1 = unbounded), or a reason.

    Bottom-right calls map directly. Top-left calls with Sq != Sk shift the window by Sk - Sq, which
    is only expressible while both reaches stay >= 0.
    """
    p = call.spec
    delta = p.seq_k - p.seq_q
    if p.offset == delta or not p.has_positional_mask:
        left, right = p.window_left, p.window_right
        return p.causal, (-1 if left is None else left, -1 if right is None else right)
    # flash-attn keeps i + delta - L' <= j <= i + delta + R'; the contract keeps i + offset - L ...
    left, right = reach(p)
    left = None if left is None else left + delta - p.offset
    right = None if right is None else right + p.offset - delta
    if (left is not None and left < 0) or (right is not None and right < 0):
        return f"align='top_left' with Sq={p.seq_q} != Sk={p.seq_k} is not a flash-attn window"
    return False, (-1 if left is None else left, -1 if right is None else right)


def flash_unsupported(call: CanonicalCall) -> str | None:
    """Why flash-attn 2 cannot run ``call`` (None when it can; segment ids go to the varlen API)."""
    if call.dropout_p > 0:
        return "dropout_p > 0: " + DROPOUT_REASON.format(name="flash-attn")
    if call.q.dtype not in FLASH_DTYPES:
        return f"dtype {call.q.dtype} (flash-attn takes float16/bfloat16)"
    if call.q.shape[-1] > FLASH_MAX_HEAD_DIM:
        return f"head_dim {call.q.shape[-1]} > {FLASH_MAX_HEAD_DIM}"
    if call.v.shape[-1] != call.q.shape[-1]:
        return "value head_dim differs from query head_dim"
    if call.bias is not None:
        return "bias"
    if call.mask is not None:
        return "mask"
    window = flash_window(call)
    if isinstance(window, str):
        return window
    if call.q_seg is not None:
        return varlen_unsupported(call)
    return None


def varlen_unsupported(call: CanonicalCall) -> str | None:
    """Segment ids fit flash-attn's varlen API only as self-attention packing.

    That is: Sq == Sk, identical query and key ids, and each id one contiguous run per row (the
    contract lets separate runs with the same id see each other; varlen cannot). Checking the ids
    reads them back from the device.
    """
    ids, kv_ids = call.q_seg, call.kv_seg
    if ids is None or kv_ids is None:  # both or neither (checked): no ids, nothing to refuse
        return None
    if call.spec.seq_q != call.spec.seq_k or not torch.equal(ids, kv_ids):
        return "segment ids other than self-attention packing (Sq == Sk, equal q/kv ids)"
    runs = 1 + (ids[:, 1:] != ids[:, :-1]).sum(dim=-1)
    ordered = ids.sort(dim=-1).values
    distinct = 1 + (ordered[:, 1:] != ordered[:, :-1]).sum(dim=-1)
    if not bool((runs == distinct).all()):
        return "segment ids that repeat an id in separate runs"
    return None


def lse_needs_grad(call: CanonicalCall, return_lse: bool) -> bool:
    """Whether the lse this call returns must carry a gradient (grad mode on and an input requires it)."""
    return (
        return_lse
        and torch.is_grad_enabled()
        and any(x is not None and x.requires_grad for x in (call.q, call.k, call.v, call.bias))
    )


class _LseWithoutGrad(torch.autograd.Function):
    """flash-attn's lse joined to the graph so that backpropagating through it raises instead of
    silently contributing no gradient (flash-attn 2's backward ignores the lse cotangent)."""

    @staticmethod
    def forward(ctx, lse, anchor):
        """Return ``lse`` unchanged; ``anchor`` (the query) only puts it on the autograd graph."""
        return lse.clone()

    @staticmethod
    def backward(ctx, d_lse):
        """Refuse: the lse gradient cannot be computed from flash-attn's outputs."""
        raise RuntimeError(
            "backend='flash_attn' returns an lse without gradient (flash-attn's backward ignores it), "
            "but the loss depends on lse; use backend='auto' or 'torch' for a differentiable lse"
        )


def flash_attention(call: CanonicalCall, flash, return_lse: bool):
    """Run ``call`` through flash-attn 2 (``flash_attn_func``, or ``flash_attn_varlen_func`` for
    packed segments); the caller has checked :func:`flash_unsupported`."""
    p = call.spec
    fits = flash_window(call)
    if isinstance(fits, str):
        raise ValueError(f"backend='flash_attn' does not support this call: {fits}")
    causal, window = fits
    q, k, v = (x.transpose(1, 2) for x in (call.q, call.k, call.v))  # BSHD, flash-attn's layout
    kwargs: dict[str, Any] = {
        "dropout_p": 0.0,
        "softmax_scale": p.scale,
        "causal": causal,
        "window_size": window,
    }
    if p.softcap is not None:
        kwargs["softcap"] = p.softcap
    if return_lse:
        kwargs["return_attn_probs"] = True
    if call.q_seg is None:
        result = flash.flash_attn_func(q, k, v, **kwargs)
        out, lse = (result[0], result[1]) if return_lse else (result, None)
    else:
        out, lse = _flash_varlen(flash, call.q_seg, q, k, v, kwargs, return_lse)
    if lse is not None:  # flash-attn reports +inf for rows with no key; the contract says -inf
        lse = torch.where(torch.isposinf(lse), float("-inf"), lse.float())
        if lse_needs_grad(call, return_lse):
            lse = _LseWithoutGrad.apply(lse, call.q)
    return _to_layout(out.transpose(1, 2), call.layout), lse


def _flash_varlen(
    flash: Any,
    ids: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kwargs: dict[str, Any],
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """flash-attn's varlen API over the runs of equal query ids ``ids`` [B, S] (self-attention packing)."""
    b, s = ids.shape
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    begin = torch.nonzero(starts.reshape(-1)).reshape(-1)
    cu = torch.cat([begin, begin.new_tensor([b * s])]).to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max())
    result = flash.flash_attn_varlen_func(
        q.reshape(b * s, *q.shape[2:]),
        k.reshape(b * s, *k.shape[2:]),
        v.reshape(b * s, *v.shape[2:]),
        cu,
        cu,
        max_len,
        max_len,
        **kwargs,
    )
    out = (result[0] if return_lse else result).reshape(b, s, *q.shape[2:3], v.shape[-1])
    lse = result[1].reshape(-1, b, s).transpose(0, 1) if return_lse else None  # [H, total] -> [B, H, S]
    return out, lse
