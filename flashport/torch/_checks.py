"""Validation for the torch-native paths (math, SDPA, flash-attn), without importing jax.

The JAX path validates inside ``flashport.attention``; the torch-native paths use :func:`check`.
Both share the framework-free checks of :mod:`flashport.kernels.checks`, so users see the same errors on every device.
"""

from __future__ import annotations

import dataclasses

import torch

from flashport.kernels import checks
from flashport.kernels.checks import ALIGNS, LAYOUTS

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class Params:
    """The static part of a call, normalized (the torch twin of ``flashport.kernels.spec.AttentionSpec``).

    ``left``/``right`` are the window reaches (``None`` = unbounded, causal not folded in);
    query i sits at key position ``i + offset``.
    """

    scale: float
    causal: bool
    left: int | None
    right: int | None
    offset: int
    softcap: float | None
    seq_q: int
    seq_k: int

    @property
    def right_reach(self) -> int | None:
        """The window's right reach with causal folded in (``None`` = unbounded)."""
        if self.causal:
            return 0 if self.right is None else min(self.right, 0)
        return self.right

    @property
    def positional(self) -> bool:
        """Whether causal or a window hides any key positions."""
        return self.causal or self.left is not None or self.right is not None


@dataclasses.dataclass(frozen=True)
class Call:
    """A validated call in canonical form: q/k/v as [B, H, S, D] views, bias/mask rank 4 (unbroadcast).

    ``dropout_p`` > 0 comes with ``seed``, the two uint32 seed words of the contract's keep-mask
    (:mod:`flashport.torch._dropout`).
    """

    params: Params
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    bias: torch.Tensor | None
    mask: torch.Tensor | None
    q_seg: torch.Tensor | None
    kv_seg: torch.Tensor | None
    layout: str
    dropout_p: float = 0.0
    seed: tuple[int, int] | None = None


def check(
    query,
    key,
    value,
    *,
    scale=None,
    causal=False,
    window=None,
    align="bottom_right",
    softcap=None,
    bias=None,
    mask=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    layout="BSHD",
    return_lse=False,
    dropout_p=0.0,
    seed=None,
) -> Call:
    """Validate the contract's arguments for torch tensors and return the canonical :class:`Call`.

    ``dropout_p`` is validated by the caller (:func:`flashport.torch._dropout.check_p`); ``seed``
    (the drawn words) is required when it is > 0.

    Raises:
      TypeError / ValueError naming the offending argument and what was expected.
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        check_tensor(name, x)
    layout = checks.check_choice("layout", layout, LAYOUTS)
    align = checks.check_choice("align", align, ALIGNS)
    checks.check_bool("return_lse", return_lse)
    q, k, v = (x.transpose(1, 2) if layout == "BSHD" else x for x in (query, key, value))
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"query, key and value must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"query, key and value must be on one device, got {q.device}, {k.device}, {v.device}"
        )
    checks.check_head_shapes(q.shape, k.shape, v.shape, layout)
    batch, hq, sq, dim = q.shape
    sk = k.shape[2]
    left, right = checks.check_window(window)
    params = Params(
        scale=checks.check_scale(scale, dim),
        causal=checks.check_bool("causal", causal),
        left=left,
        right=right,
        offset=(sk - sq) if align == "bottom_right" else 0,
        softcap=checks.check_softcap(softcap),
        seq_q=sq,
        seq_k=sk,
    )
    full = (batch, hq, sq, sk)
    q_seg, kv_seg = _check_segments(q_segment_ids, kv_segment_ids, batch, sq, sk, query.device)
    return Call(
        params=params,
        q=q,
        k=k,
        v=v,
        bias=_check_broadcast("bias", bias, full, query.device, floating=True),
        mask=_check_broadcast("mask", mask, full, query.device, floating=False),
        q_seg=q_seg,
        kv_seg=kv_seg,
        layout=layout,
        dropout_p=dropout_p,
        seed=seed if dropout_p > 0 else None,
    )


def check_tensor(name, x):
    """Raise unless ``x`` is a rank-4 float32/bfloat16/float16 torch tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim != 4:
        raise ValueError(
            f"{name} must have rank 4 ([batch, seq, heads, head_dim] for BSHD), got shape {tuple(x.shape)}"
        )
    if x.dtype not in DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")


def _check_broadcast(name, x, full, device, *, floating):
    """Left-pad ``x`` to rank 4 and check each dim is 1 or the full size; dims stay unbroadcast."""
    if x is None:
        return None
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if floating and not x.is_floating_point():
        raise TypeError(checks.BIAS_DTYPE_ERROR.format(name=name, dtype=x.dtype))
    if not floating and x.dtype != torch.bool:
        raise TypeError(checks.MASK_DTYPE_ERROR.format(name=name, dtype=x.dtype))
    if x.device != device:
        raise ValueError(f"{name} must be on query's device {device}, got {x.device}")
    return x.reshape(checks.broadcast_shape(name, x.shape, full))


def _check_segments(q_seg, kv_seg, batch, sq, sk, device):
    if not checks.check_segments_given(q_seg, kv_seg):
        return None, None
    for name, ids, seq in (("q_segment_ids", q_seg, sq), ("kv_segment_ids", kv_seg, sk)):
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(ids).__name__}")
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer array, got {ids.dtype}")
        checks.check_segment_shape(name, ids.shape, batch, seq)
        if ids.device != device:
            raise ValueError(f"{name} must be on query's device {device}, got {ids.device}")
    return q_seg, kv_seg
