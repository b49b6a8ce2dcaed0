"""Validation for the torch-native paths (math, SDPA, flash-attn), without importing jax.

The JAX path validates inside ``flashport.attention``; the torch-native paths use :func:`check`,
whose messages follow the JAX API's wording so users see the same errors on every device.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import torch

LAYOUTS = ("BSHD", "BHSD")
ALIGNS = ("bottom_right", "top_left")
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
    """A validated call in canonical form: q/k/v as [B, H, S, D] views, bias/mask rank 4 (unbroadcast)."""

    params: Params
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    bias: torch.Tensor | None
    mask: torch.Tensor | None
    q_seg: torch.Tensor | None
    kv_seg: torch.Tensor | None
    layout: str


def check(query, key, value, *, scale=None, causal=False, window=None, align="bottom_right", softcap=None,
          bias=None, mask=None, q_segment_ids=None, kv_segment_ids=None, layout="BSHD", return_lse=False) -> Call:
    """Validate the contract's arguments for torch tensors and return the canonical :class:`Call`.

    Raises:
      TypeError / ValueError naming the offending argument and what was expected.
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        check_tensor(name, x)
    layout = _check_choice("layout", layout, LAYOUTS)
    align = _check_choice("align", align, ALIGNS)
    _check_bool("return_lse", return_lse)
    q, k, v = (x.transpose(1, 2) if layout == "BSHD" else x for x in (query, key, value))
    _check_qkv(q, k, v, layout)
    batch, hq, sq, dim = q.shape
    sk = k.shape[2]
    left, right = _check_window(window)
    params = Params(
        scale=_check_scale(scale, dim),
        causal=_check_bool("causal", causal),
        left=left,
        right=right,
        offset=(sk - sq) if align == "bottom_right" else 0,
        softcap=_check_softcap(softcap),
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
    )


def check_tensor(name, x):
    """Raise unless ``x`` is a rank-4 float32/bfloat16/float16 torch tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim != 4:
        raise ValueError(f"{name} must have rank 4 ([batch, seq, heads, head_dim] for BSHD), got shape {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")


def _check_choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; use one of {', '.join(map(repr, allowed))}")
    return value


def _check_bool(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a Python bool (static), got {type(value).__name__}")
    return value


def _check_qkv(q, k, v, layout):
    names = "[batch, seq, heads, head_dim]" if layout == "BSHD" else "[batch, heads, seq, head_dim]"

    def show(x):  # in the user's layout
        return tuple(x.transpose(1, 2).shape) if layout == "BSHD" else tuple(x.shape)

    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"query, key and value must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"query, key and value must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.shape[0] != k.shape[0] or k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"key and value must match query's batch and each other's {names[1:-1]} except head_dim; "
            f"got query {show(q)}, key {show(k)}, value {show(v)}"
        )
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"key head_dim must equal query head_dim: query {show(q)} vs key {show(k)}")
    hq, hkv = q.shape[1], k.shape[1]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"key/value heads ({hkv}) must divide query heads ({hq}) for GQA/MQA")


def _check_scale(scale, dim):
    if scale is None:
        return 1.0 / math.sqrt(dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a static Python float (or None for 1/sqrt(head_dim)), got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


def _check_softcap(softcap):
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a static positive float or None, got {type(softcap).__name__}")
    if not softcap > 0:
        raise ValueError(f"softcap must be > 0 (or None to disable), got {softcap}")
    return float(softcap)


def _check_window(window):
    if window is None:
        return None, None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window must be a (left, right) pair of ints or None, e.g. window=(128, 0); got {window!r}")
    sides = []
    for side, value in zip(("left", "right"), window):
        if value is None:
            sides.append(None)
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"window {side} must be an int or None, got {value!r}")
        if value < 0:
            raise ValueError(f"window {side} must be >= 0 (None for unbounded), got {value}; flash-attn's -1 means None")
        sides.append(int(value))
    return tuple(sides)


def _check_broadcast(name, x, full, device, *, floating):
    """Left-pad ``x`` to rank 4 and check each dim is 1 or the full size; dims stay unbroadcast."""
    if x is None:
        return None
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if floating and not x.is_floating_point():
        raise TypeError(f"{name} must be a float array (additive), got {x.dtype}; for a boolean mask pass mask=")
    if not floating and x.dtype != torch.bool:
        raise TypeError(f"{name} must be boolean (True = attend), got {x.dtype}; for an additive mask pass bias=")
    if x.device != device:
        raise ValueError(f"{name} must be on query's device {device}, got {x.device}")
    if x.ndim > 4:
        raise ValueError(f"{name} must broadcast to [B, Hq, Sq, Sk] = {list(full)}, got rank {x.ndim} shape {tuple(x.shape)}")
    x = x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))
    for size, want in zip(x.shape, full):
        if size not in (1, want):
            raise ValueError(f"{name} of shape {tuple(x.shape)} does not broadcast to [B, Hq, Sq, Sk] = {list(full)}")
    return x


def _check_segments(q_seg, kv_seg, batch, sq, sk, device):
    if q_seg is None and kv_seg is None:
        return None, None
    if q_seg is None or kv_seg is None:
        raise ValueError("q_segment_ids and kv_segment_ids must be given together (pass both, or neither)")
    for name, ids, seq in (("q_segment_ids", q_seg, sq), ("kv_segment_ids", kv_seg, sk)):
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(ids).__name__}")
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer array, got {ids.dtype}")
        if tuple(ids.shape) != (batch, seq):
            raise ValueError(f"{name} must have shape [batch, seq] = {[batch, seq]}, got {tuple(ids.shape)}")
        if ids.device != device:
            raise ValueError(f"{name} must be on query's device {device}, got {ids.device}")
    return q_seg, kv_seg
