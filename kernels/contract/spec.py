"""The normalized call that every backend receives: :class:`AttentionSpec` plus canonical arrays.

This module imports no framework: the JAX API and the torch adapter both build their spec with
:func:`make_spec`, and :func:`positional_visible` / :func:`apply_softcap` / :func:`softcap_grad`
work on any array namespace.

``flashport.attention`` validates user input, converts it to the canonical form below and hands it
to a backend. Backends never see layouts (beyond the spec's optional ``layout`` hint), ``None``
scales or unnormalized windows.

Canonical arrays (all backends):

* ``q``: [B, Hq, Sq, D]; ``k``, ``v``: [B, Hkv, Sk, D] (``BHSD``). Hq % Hkv == 0; query head h uses
  kv head ``h // (Hq // Hkv)``.
* ``bias``: float, rank 4, each dim either 1 or the full size of [B, Hq, Sq, Sk] (not broadcast).
* ``mask``: bool, rank 4, same rule as ``bias``.
* ``q_segment_ids`` [B, Sq] / ``kv_segment_ids`` [B, Sk], int32, both or neither.
* ``seed``: uint32 [2], the dropout seed words (see :mod:`flashport.kernels.semantics.dropout`); ``None``
  unless ``spec.dropout_rate > 0``.

Backends return ``(out, lse)``: ``out`` [B, Hq, Sq, D] in ``q.dtype`` and ``lse`` float32 [B, Hq, Sq].
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flashport.kernels.contract import checks
from flashport.kernels.semantics.visibility import band_visible

# Features a call can need; backends declare which they support (see registry.BackendInfo).
FEATURES = (
    "causal",
    "window",
    "align_bottom_right",
    "softcap",
    "bias",
    "bias_grad",  # gradients w.r.t. bias: needed where JAX differentiates it (kernels/semantics/bias_grad.py)
    "mask",
    "segment_ids",
    "gqa",
    "return_lse",
    "dropout",
    "float32",
    "bfloat16",
    "float16",
    "score_mod",  # a FlexAttention score_mod (kernels/semantics/mods.py); backends with it take mods=
    "mask_mod",  # a FlexAttention mask_mod / block mask (kernels/semantics/mods.py, kernels/semantics/block_mask.py)
)
# The features of user functions traced into the tiles; a backend declaring them takes ``mods=``.
MOD_FEATURES = frozenset({"score_mod", "mask_mod"})


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
        scaled by 1 / (1 - rate)); the mask is :mod:`flashport.kernels.semantics.dropout`'s hash of the seed
        the backend receives as its ``seed`` array. 0.0 means no dropout (``seed`` is None).
      layout: a hint, not semantics: the layout the caller's arrays had before ``flashport.attention``
        transposed them to canonical BHSD (``"BSHD"`` or ``"BHSD"``). A backend that can read that
        layout directly transposes back, which XLA cancels against the API's transpose (the
        ``pallas_tpu`` kernels read BSHD this way). Backends may ignore it.
      lse_used: a hint: ``False`` when the caller discards the lse (no ``return_lse``). A backend may
        then skip writing it in a forward that computes no gradient; a forward for a gradient still
        saves it.
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
    layout: str = "BHSD"
    lse_used: bool = True

    @property
    def has_positional_mask(self) -> bool:
        """True when causal or a window restricts which key positions a query sees."""
        return self.causal or self.window_left is not None or self.window_right is not None

    @property
    def positional_features(self) -> frozenset[str]:
        """The :data:`FEATURES` its causal/window structure asks of a backend (``causal``, ``window``,
        ``align_bottom_right``)."""
        needs = {
            "causal": self.causal,
            "window": self.window_left is not None or self.window_right is not None,
            "align_bottom_right": self.has_positional_mask and self.offset != 0,
        }
        return frozenset(name for name, needed in needs.items() if needed)


def make_spec(
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    *,
    scale: float | None,
    causal: bool,
    window: tuple[int | None, int | None] | None,
    align: str,
    softcap: float | None,
    dropout_rate: float = 0.0,
) -> AttentionSpec:
    """Validate the static options of one call and normalize them: the one builder of :class:`AttentionSpec`.

    ``q_shape`` = (B, Hq, Sq, D) and ``k_shape`` = (B, Hkv, Sk, D) are canonical (already checked);
    the keywords are those of :func:`flashport.attention` (``dropout_rate`` validated by the caller,
    whose argument name differs between the JAX and torch APIs). Used by ``flashport.attention``
    and the torch adapter alike, so both run the same spec.

    Raises:
      TypeError / ValueError naming the argument (:mod:`flashport.kernels.contract.checks`).
    """
    align = checks.check_choice("align", align, checks.ALIGNS)
    left, right = checks.check_window(window)
    sq, sk = q_shape[2], k_shape[2]
    return AttentionSpec(
        scale=checks.check_scale(scale, q_shape[3]),
        causal=checks.check_bool("causal", causal),
        window_left=left,
        window_right=right,
        offset=(sk - sq) if align == "bottom_right" else 0,
        softcap=checks.check_softcap(softcap),
        seq_q=sq,
        seq_k=sk,
        dropout_rate=float(dropout_rate),
    )


def positional_visible(spec: AttentionSpec, q_pos: Any, k_pos: Any) -> Any:
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


def apply_softcap(spec: AttentionSpec, s: Any, xp: Any) -> Any:
    """Return ``softcap * tanh(s / softcap)`` (or ``s`` when no softcap is set).

    ``xp`` is the array namespace of ``s`` (``jax.numpy``, ``torch``, ``numpy``: anything with ``tanh``).
    """
    if spec.softcap is None:
        return s
    return spec.softcap * xp.tanh(s / spec.softcap)


def softcap_grad(spec: AttentionSpec, raw: Any, xp: Any) -> Any:
    """d softcap(raw) / d raw, ``1 - tanh(raw / softcap)**2`` (``None`` without softcap); ``xp`` as above."""
    if spec.softcap is None:
        return None
    t = xp.tanh(raw / spec.softcap)
    return 1.0 - t * t
