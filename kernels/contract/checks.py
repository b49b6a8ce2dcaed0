"""Argument checks of the attention contract that need no array library.

Shared by ``flashport.attention`` (JAX) and ``flashport.torch.attention`` so both give the same
errors, word for word; importing this module imports neither jax nor torch. Shapes are canonical
(BHSD) tuples; array-specific checks (dtypes, devices) stay with each frontend.
"""

from __future__ import annotations

import math
import numbers

LAYOUTS = ("BSHD", "BHSD")
ALIGNS = ("bottom_right", "top_left")


def check_choice(name, value, allowed):
    """Return ``value`` if it is one of ``allowed``; else ValueError listing them."""
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; use one of {', '.join(map(repr, allowed))}")
    return value


def check_bool(name, value) -> bool:
    """Return ``value`` as a bool if it is a (static) Python or numpy bool; else TypeError."""
    if not isinstance(value, bool) and type(value).__name__ != "bool_":
        raise TypeError(f"{name} must be a Python bool (static), got {type(value).__name__}")
    return bool(value)


def check_scale(scale, head_dim: int) -> float:
    """Resolve ``scale`` (None -> 1/sqrt(head_dim)); it must be a static finite real number."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(
            f"scale must be a static Python float (or None for 1/sqrt(head_dim)), got {type(scale).__name__}"
        )
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


def check_softcap(softcap) -> float | None:
    """``softcap`` must be None or a static positive real number."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a static positive float or None, got {type(softcap).__name__}")
    if not float(softcap) > 0:
        raise ValueError(f"softcap must be > 0 (or None to disable), got {softcap}")
    return float(softcap)


def check_window(window) -> tuple[int | None, int | None]:
    """``window`` must be None or a (left, right) pair of non-negative ints / None; returns the pair."""
    if window is None:
        return None, None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(
            f"window must be a (left, right) pair of ints or None, e.g. window=(128, 0); got {window!r}"
        )
    sides: list[int | None] = []
    for side, value in zip(("left", "right"), window, strict=False):
        if value is None:
            sides.append(None)
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"window {side} must be an int or None, got {value!r}")
        if value < 0:
            raise ValueError(
                f"window {side} must be >= 0 (None for unbounded), got {value}; flash-attn's -1 means None"
            )
        sides.append(int(value))
    return sides[0], sides[1]


def check_head_shapes(q_shape, k_shape, v_shape, layout: str) -> None:
    """Check canonical [B, H, S, D] shapes of query, key and value against each other (GQA rules)."""
    names = "[batch, seq, heads, head_dim]" if layout == "BSHD" else "[batch, heads, seq, head_dim]"

    def show(shape):  # in the user's layout
        shape = tuple(shape)
        return (shape[0], shape[2], shape[1], shape[3]) if layout == "BSHD" else shape

    if q_shape[0] != k_shape[0] or tuple(k_shape[:3]) != tuple(v_shape[:3]):
        raise ValueError(
            f"key and value must match query's batch and each other's {names[1:-1]} except head_dim; "
            f"got query {show(q_shape)}, key {show(k_shape)}, value {show(v_shape)}"
        )
    if q_shape[3] != k_shape[3]:
        raise ValueError(
            f"key head_dim must equal query head_dim: query {show(q_shape)} vs key {show(k_shape)}"
        )
    hq, hkv = q_shape[1], k_shape[1]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"key/value heads ({hkv}) must divide query heads ({hq}) for GQA/MQA")


def broadcast_shape(name: str, shape, full) -> tuple[int, ...]:
    """Left-pad a bias/mask ``shape`` to rank 4; each dim must be 1 or the full [B, Hq, Sq, Sk] size."""
    shape = tuple(shape)
    if len(shape) > 4:
        raise ValueError(
            f"{name} must broadcast to [B, Hq, Sq, Sk] = {list(full)}, got rank {len(shape)} shape {shape}"
        )
    shape = (1,) * (4 - len(shape)) + shape
    for size, want in zip(shape, full, strict=False):
        if size not in (1, want):
            raise ValueError(f"{name} of shape {shape} does not broadcast to [B, Hq, Sq, Sk] = {list(full)}")
    return shape


def check_segments_given(q_segment_ids, kv_segment_ids) -> bool:
    """Return whether segment ids are given; both or neither must be."""
    if q_segment_ids is None and kv_segment_ids is None:
        return False
    if q_segment_ids is None or kv_segment_ids is None:
        raise ValueError("q_segment_ids and kv_segment_ids must be given together (pass both, or neither)")
    return True


def check_segment_shape(name: str, shape, batch: int, seq: int) -> None:
    """Segment ids must be [batch, seq]."""
    if tuple(shape) != (batch, seq):
        raise ValueError(f"{name} must have shape [batch, seq] = {[batch, seq]}, got {tuple(shape)}")


MASK_DTYPE_ERROR = "{name} must be boolean (True = attend), got {dtype}; for an additive mask pass bias="
BIAS_DTYPE_ERROR = "{name} must be a float array (additive), got {dtype}; for a boolean mask pass mask="
