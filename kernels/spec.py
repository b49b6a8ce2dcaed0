"""The normalized call that every backend receives: :class:`AttentionSpec` plus canonical arrays.

``flashport.attention`` validates user input, converts it to the canonical form below and hands it
to a backend. Backends never see layouts, ``None`` scales or unnormalized windows.

Canonical arrays (all backends):

* ``q``: [B, Hq, Sq, D]; ``k``, ``v``: [B, Hkv, Sk, D] (``BHSD``). Hq % Hkv == 0; query head h uses
  kv head ``h // (Hq // Hkv)``.
* ``bias``: float, rank 4, each dim either 1 or the full size of [B, Hq, Sq, Sk] (not broadcast).
* ``mask``: bool, rank 4, same rule as ``bias``.
* ``q_segment_ids`` [B, Sq] / ``kv_segment_ids`` [B, Sk], int32, both or neither.
* ``seed``: uint32 [2], the dropout seed words (see :mod:`flashport.kernels.dropout`); ``None``
  unless ``spec.dropout_rate > 0``.

Backends return ``(out, lse)``: ``out`` [B, Hq, Sq, D] in ``q.dtype`` and ``lse`` float32 [B, Hq, Sq].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from flashport.kernels.visibility import band_visible

# Features a call can need; backends declare which they support (see registry.BackendInfo).
FEATURES = (
    "causal",
    "window",
    "align_bottom_right",
    "softcap",
    "bias",
    "bias_grad",  # gradients w.r.t. bias: needed where JAX differentiates it (kernels/bias_grad.py)
    "mask",
    "segment_ids",
    "gqa",
    "return_lse",
    "dropout",
    "float32",
    "bfloat16",
    "float16",
)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Static (hashable) parameters of one attention call, normalized from the user's arguments.

    Attributes:
      scale: multiplier of Q·Kᵀ (already resolved from ``None`` to 1/sqrt(D)).
      causal: keep keys ``j <= i + offset``.
      window_left / window_right: ``None`` for unbounded, else the inclusive reach of the window.
      offset: key position of query 0 (Sk - Sq for bottom-right alignment, 0 for top-left).
      softcap: ``None`` or the tanh cap applied to the scaled scores.
      seq_q / seq_k: the true (unpadded) sequence lengths.
      dropout_rate: probability of zeroing an entry of the normalized probabilities (kept ones are
        scaled by 1 / (1 - rate)); the mask is :mod:`flashport.kernels.dropout`'s hash of the seed
        the backend receives as its ``seed`` array. 0.0 means no dropout (``seed`` is None).
    """

    scale: float
    causal: bool
    window_left: int | None
    window_right: int | None
    offset: int
    softcap: float | None
    seq_q: int
    seq_k: int
    dropout_rate: float = 0.0

    @property
    def has_positional_mask(self) -> bool:
        """True when causal or a window restricts which key positions a query sees."""
        return self.causal or self.window_left is not None or self.window_right is not None

    def key_range(self, q_lo: int, q_hi: int) -> tuple[int, int]:
        """Return the half-open range of key positions that queries ``[q_lo, q_hi)`` may see.

        Only causal/window structure is used (masks, bias and segment ids may hide more). The range is
        clipped to ``[0, seq_k)`` and may be empty (lo >= hi).
        """
        lo, hi = 0, self.seq_k
        right = self.window_right
        if self.causal:
            right = 0 if right is None else min(right, 0)
        if right is not None:
            hi = min(hi, q_hi - 1 + self.offset + right + 1)
        if self.window_left is not None:
            lo = max(lo, q_lo + self.offset - self.window_left)
        return lo, hi

    def query_range(self, k_lo: int, k_hi: int) -> tuple[int, int]:
        """Return the half-open range of query positions that may see keys ``[k_lo, k_hi)``."""
        lo, hi = 0, self.seq_q
        right = self.window_right
        if self.causal:
            right = 0 if right is None else min(right, 0)
        if right is not None:  # j <= i + offset + right  <=>  i >= j - offset - right
            lo = max(lo, k_lo - self.offset - right)
        if self.window_left is not None:  # j >= i + offset - left  <=>  i <= j - offset + left
            hi = min(hi, k_hi - 1 - self.offset + self.window_left + 1)
        return lo, hi


def positional_visible(spec: AttentionSpec, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    """Boolean array: which (query, key) positions causal/window structure keeps.

    ``q_pos`` and ``k_pos`` are integer arrays that broadcast against each other (e.g. [bq, 1] and
    [1, bk]). Positions beyond the true lengths are hidden too, so padded blocks are safe.
    """
    in_range = (q_pos < spec.seq_q) & (k_pos < spec.seq_k)
    return band_visible(
        q_pos + spec.offset,
        k_pos,
        causal=spec.causal,
        left=spec.window_left,
        right=spec.window_right,
        visible=in_range,
    )


def apply_softcap(spec: AttentionSpec, s: jax.Array) -> jax.Array:
    """Return ``softcap * tanh(s / softcap)`` (or ``s`` when no softcap is set)."""
    if spec.softcap is None:
        return s
    return spec.softcap * jnp.tanh(s / spec.softcap)
