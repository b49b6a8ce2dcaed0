"""Drop-ins for FlashAttention-3 (``flash_attn_interface``, Hopper build) on :func:`flashport.torch.attention`.

``from flashport.integrations.flash_attn3_compat import flash_attn_func`` replaces
``from flash_attn_interface import flash_attn_func``. Signatures and return types follow FA3 after
2025-07-11: ``out``, or ``(out, softmax_lse)`` with ``return_attn_probs=True`` (before that date FA3
always returned ``(out, lse)``; code written against it must pass ``return_attn_probs=True``). The
semantics are FA2's: ``[B, S, H, D]``, ``1/sqrt(D)`` default scale, bottom-right causal and
inclusive window (-1 = unbounded), softcap 0.0 = off, contiguous GQA; lse is float32 ``[B, H, Sq]``
(``[H, total_q]`` for varlen) and +inf for a row that sees no key, as FA3's kernel writes it.
FA3 has no dropout. Tuning arguments (``num_splits``, ``pack_gqa``, ``deterministic``,
``sm_margin``) are ignored; ``qv``, FP8 descales, ``attention_chunk`` and ``seqused_*`` raise
``NotImplementedError``.
"""

from __future__ import annotations

from flashport.integrations.flash_attn_compat import _lse_like_flash_attn, _window, varlen_core

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]


def _unsupported(**given):
    """Raise NotImplementedError naming the first FA3-only feature that was passed."""
    for name, value in given.items():
        off = value is None or value is False or (isinstance(value, (int, float)) and value == 0)
        if not off:
            raise NotImplementedError(f"FlashAttention-3 {name}= is not supported by flashport's drop-in")


# The public functions below mirror FlashAttention-3's signatures one for one (a drop-in must accept
# exactly what the original accepts): their parameter lists are deliberately parallel.
def flash_attn_func(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
):
    """FA3 ``flash_attn_func``: q [B, Sq, H, D], k/v [B, Sk, Hk, D] -> out, or ``(out, lse)``."""
    import flashport.torch

    _unsupported(
        qv=qv, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, attention_chunk=attention_chunk
    )
    result = flashport.torch.attention(
        q,
        k,
        v,
        scale=softmax_scale,
        causal=causal,
        window=_window(window_size),
        softcap=softcap or None,
        align="bottom_right",
        layout="BSHD",
        return_lse=bool(return_attn_probs),
    )
    return (result[0], _lse_like_flash_attn(result[1])) if return_attn_probs else result


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    seqused_q=None,
    seqused_k=None,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
):
    """FA3 ``flash_attn_varlen_func``: q [total_q, H, D], k/v [total_k, Hk, D] -> out, or ``(out, lse [H, total_q])``."""
    _unsupported(
        seqused_q=seqused_q,
        seqused_k=seqused_k,
        qv=qv,
        q_descale=q_descale,
        k_descale=k_descale,
        v_descale=v_descale,
        attention_chunk=attention_chunk,
    )
    result = varlen_core(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        scale=softmax_scale,
        causal=causal,
        window=_window(window_size),
        softcap=softcap or None,
        return_lse=bool(return_attn_probs),
    )
    return (result[0], _lse_like_flash_attn(result[1])) if return_attn_probs else result
