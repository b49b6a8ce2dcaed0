"""Drop-ins for FlashAttention-4 (``flash_attn.cute``) on :func:`flashport.torch.attention`.

``from flashport.integrations.flash_attn4_compat import flash_attn_func`` (the import path that
re-exports this module) replaces
``from flash_attn.cute import flash_attn_func``. FA4's functions **always** return ``(out, lse)``
(``return_lse`` only decides whether FA4 computes lse; here lse is always computed). Semantics:
``[B, S, H, D]``, ``1/sqrt(D)`` default scale, bottom-right causal, contiguous GQA, softcap 0.0 =
off; ``window_size`` spells "unbounded" ``None``, and ``(l, r)`` with ``l + r < 0`` is unbounded
(a negative side next to a finite one raises: FA4 builds disagree on it). Everything after
``q, k, v`` is keyword-only, because FA4's parameter order changed between releases (a positional
call fails instead of binding the wrong parameter). lse is the contract's float32 ``[B, H, Sq]``
(``[H, total_q]`` for varlen). ``qv``, sinks, score/mask mods, block sparsity and
``seqused_*``/``page_table`` raise ``NotImplementedError``; tuning arguments are ignored.
"""

from __future__ import annotations

from flashport.integrations.flash_attn.core import varlen_core, with_signature

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]

TUNING = ("num_splits", "pack_gqa", "deterministic", "max_seqlen_q", "max_seqlen_k")


def fa4_window(window_size):
    """FA4 ``window_size`` as the contract's ``window`` (None = no window).

    Raises:
      ValueError: for a negative side next to a finite one.
    """
    if window_size is None:
        return None
    left, right = window_size
    if left is not None and right is not None and left + right < 0:
        return None
    if any(side is not None and side < 0 for side in (left, right)):
        raise ValueError(f"window_size={tuple(window_size)} mixes a negative bound with a finite one")
    return None if left is None and right is None else (left, right)


def _check(extra):
    """Ignore tuning keywords; raise for any other FA4 feature that was passed (not None)."""
    for name, value in extra.items():
        if name not in TUNING and value is not None and value is not False:
            raise NotImplementedError(f"FlashAttention-4 {name}= is not supported by flashport's drop-in")


_DEFAULTS = {
    "cu_seqlens_q": None,
    "cu_seqlens_k": None,
    "softmax_scale": None,
    "causal": False,
    "window_size": (None, None),
    "softcap": 0.0,
    "return_lse": False,
}
_TAIL = "softmax_scale causal window_size softcap return_lse **extra"


def _contract(softmax_scale, causal, window_size, softcap):
    """The contract's scale and band keywords from FA4's."""
    return dict(scale=softmax_scale, causal=causal, window=fa4_window(window_size), softcap=softcap or None)


@with_signature(f"q k v * {_TAIL}", _DEFAULTS)
def flash_attn_func(q, k, v, extra, return_lse, **options):
    """FA4 ``flash_attn_func``: q [B, Sq, H, D], k/v [B, Sk, Hk, D] -> ``(out, lse [B, H, Sq])``."""
    import flashport.torch

    _check(extra)
    contract = _contract(**options)
    return flashport.torch.attention(
        q, k, v, **contract, align="bottom_right", layout="BSHD", return_lse=True
    )


@with_signature(f"q k v * cu_seqlens_q cu_seqlens_k {_TAIL}", _DEFAULTS)
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, extra, return_lse, **options):
    """FA4 ``flash_attn_varlen_func``: q [total_q, H, D], k/v [total_k, Hk, D] -> ``(out, lse [H, total_q])``."""
    _check(extra)
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise NotImplementedError(
            "FlashAttention-4 varlen without cu_seqlens_q/cu_seqlens_k is not supported"
        )
    return varlen_core(q, k, v, cu_seqlens_q, cu_seqlens_k, **_contract(**options), return_lse=True)
