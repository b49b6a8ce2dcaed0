"""TransformerEngine-JAX's functional attention pieces on the flashport contract: ``fused_attn``
(TransformerEngine 2.0's signature), the ``SequenceDescriptor`` that ``DotProductAttention`` reads,
and the ``AttnBiasType``/``AttnMaskType``/``QKVLayout``/``CPStrategy`` enums (TE's own where it is
installed, else enums of the same member names). They need jax only; the Flax module is
:mod:`flashport.integrations.transformer_engine_flax`, whose docstring gives the meaning both follow
(mask types, ``mask`` True = masked out, layouts, bias types, windows, dropout, what raises).
"""

from __future__ import annotations

__all__ = ["AttnBiasType", "AttnMaskType", "CPStrategy", "QKVLayout", "SequenceDescriptor", "fused_attn"]

import dataclasses
import enum
from typing import Any

import jax
import jax.numpy as jnp

import flashport

_BIAS_TYPES = ("NO_BIAS", "PRE_SCALE_BIAS", "POST_SCALE_BIAS")
_MASK_MEMBERS = {  # AttnMaskType member -> attn_mask_type string
    "NO_MASK": "no_mask",
    "PADDING_MASK": "padding",
    "CAUSAL_MASK": "causal",
    "PADDING_CAUSAL_MASK": "padding_causal",
    "CAUSAL_BOTTOM_RIGHT_MASK": "causal_bottom_right",
    "PADDING_CAUSAL_BOTTOM_RIGHT_MASK": "padding_causal_bottom_right",
}
_LAYOUTS = ("BSHD_BSHD_BSHD", "BS3HD", "BSHD_BS2HD")
_THD_LAYOUTS = ("THD_THD_THD", "T3HD", "THD_T2HD")

try:  # TE's own enums where it is installed: a member the codemod moved here means the same to TE
    from transformer_engine.jax.attention import AttnBiasType, AttnMaskType, CPStrategy, QKVLayout
except ImportError:  # no TransformerEngine: enums of the same member names
    AttnBiasType = enum.Enum("AttnBiasType", _BIAS_TYPES)  # type: ignore[misc,no-redef]
    AttnMaskType = enum.Enum("AttnMaskType", tuple(_MASK_MEMBERS))  # type: ignore[misc,no-redef]
    QKVLayout = enum.Enum("QKVLayout", (*_LAYOUTS, *_THD_LAYOUTS))  # type: ignore[misc,no-redef]
    CPStrategy = enum.Enum("CPStrategy", ("DEFAULT", "ALL_GATHER", "RING"))  # type: ignore[no-redef]


_MASK_TYPES = {  # TE's canonicalize_attn_mask_type spellings -> (causal alignment or None, padding)
    "no_mask": (None, False),
    "padding": (None, True),
    "causal": ("top_left", False),
    "causal_bottom_right": ("bottom_right", False),
    "bottom_right_causal": ("bottom_right", False),
    "padding_causal": ("top_left", True),
    "causal_padding": ("top_left", True),
    "padding_causal_bottom_right": ("bottom_right", True),
    "causal_padding_bottom_right": ("bottom_right", True),
    "bottom_right_causal_padding": ("bottom_right", True),
    "bottom_right_padding_causal": ("bottom_right", True),
}


def _attend_mask(masked_out):
    """The contract's mask (True = attend) from TE's (True/non-zero = masked out)."""
    if not hasattr(masked_out, "shape") or not hasattr(masked_out, "dtype"):
        raise NotImplementedError(
            f"sequence_descriptor of type {type(masked_out).__name__}: pass a mask array or a "
            "flashport.integrations.transformer_engine_compat.SequenceDescriptor"
        )
    masked_out = jnp.asarray(masked_out)
    while masked_out.ndim > 4 and masked_out.shape[1] == 1:
        masked_out = jnp.squeeze(masked_out, axis=1)
    if masked_out.ndim > 4:
        raise ValueError(f"mask of shape {masked_out.shape} is not broadcastable to [b, 1, s_q, s_kv]")
    return masked_out == 0


def _window(window_size):
    """TE's ``(left, right)`` window (negative = unbounded) as the contract's (``None`` = unbounded)."""
    if window_size is None:
        return None
    left, right = window_size
    left = None if left < 0 else int(left)
    right = None if right < 0 else int(right)
    return None if left is None and right is None else (left, right)


def _refuse_load_balanced_order(axis: str) -> None:
    """Raise when the sequence is in TE's load-balanced context-parallel order (more than one device on
    ``axis`` of the current mesh): the causal mask is then not by position in the array."""
    if not axis:
        return
    size = _mesh_axis_size(axis)
    if size == 1:
        return
    raise NotImplementedError(
        f"context_parallel_causal_load_balanced=True with context_parallel_axis={axis!r} "
        f"({'not found in the current mesh' if size is None else f'{size} devices'}): the sequence is "
        "in TransformerEngine's load-balanced order, which flashport's DotProductAttention does not undo"
    )


def _mesh_axis_size(axis: str) -> int | None:
    """The size of ``axis`` in the current (abstract, then physical) mesh; None when no mesh has it."""
    abstract = jax.sharding.get_abstract_mesh()
    if not abstract.empty and axis in abstract.axis_names:
        return int(abstract.shape[axis])
    try:
        from jax._src import mesh as mesh_lib

        physical = mesh_lib.thread_resources.env.physical_mesh
    except (ImportError, AttributeError):
        return None
    if not physical.empty and axis in physical.axis_names:
        return int(physical.shape[axis])
    return None


def _pair(value):
    """TE's ``_expand_to_pair``: one array for both query and key/value, or a ``(q, kv)`` pair."""
    if isinstance(value, tuple):
        if len(value) != 2:
            raise ValueError("Input tuple must have exactly 2 elements.")
        return value
    return value, value


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SequenceDescriptor:
    """TransformerEngine-JAX's ``SequenceDescriptor`` (2.18): the sequences of a batch, as per-row
    lengths or as segment ids and positions, each a ``(query, key/value)`` pair. Build it with the
    factories; ``DotProductAttention`` (:mod:`flashport.integrations.transformer_engine_flax`) reads
    it with TE's meaning."""

    seqlens: Any = None
    seq_offsets: Any = None
    segment_ids: Any = None
    segment_pos: Any = None

    @classmethod
    def from_seqlens(cls, seqlens):
        """Per-row lengths (non-packed): ``seqlens`` is ``[batch]`` or a ``(q, kv)`` pair of them."""
        return cls(seqlens=_pair(seqlens))

    @classmethod
    def from_seqlens_and_offsets(cls, seqlens, seq_offsets):
        """Packed sequences as lengths and offsets (THD); ``DotProductAttention`` raises for it."""
        return cls(seqlens=_pair(seqlens), seq_offsets=_pair(seq_offsets))

    @classmethod
    def from_segment_ids_and_pos(cls, segment_ids, segment_pos=None):
        """Segment ids (``[batch, seqlen]``, from 1; 0 = padding) and the position of each token in
        its segment, each an array or a ``(q, kv)`` pair. ``segment_pos`` is required (TE 2.18)."""
        if segment_pos is None:
            raise ValueError("segment_pos is now required; generate the segment_pos explicitly.")
        return cls(segment_ids=_pair(segment_ids), segment_pos=_pair(segment_pos))

    def _attend(self, sq: int, sk: int, align: str | None, window_size):
        """The contract's mask (True = attend) ``[b, 1, sq, sk]``: the lengths' padding; or the
        segments with causal (``align`` not None, top-left) and window by position."""
        if self.seq_offsets is not None:
            raise NotImplementedError(
                "SequenceDescriptor.from_seqlens_and_offsets (THD lengths and offsets) is not supported by "
                "flashport's DotProductAttention; use from_segment_ids_and_pos"
            )
        if self.segment_ids is None:
            q_len, kv_len = (jnp.asarray(n) for n in self.seqlens)
            q_ok = jnp.arange(sq)[None, :] < q_len[:, None]
            kv_ok = jnp.arange(sk)[None, :] < kv_len[:, None]
            return (q_ok[:, :, None] & kv_ok[:, None, :])[:, None]
        q_ids, kv_ids = (jnp.asarray(x) for x in self.segment_ids)
        q_pos, kv_pos = (jnp.asarray(x) for x in self.segment_pos)
        keep = (q_ids[:, :, None] == kv_ids[:, None, :]) & (q_ids[:, :, None] != 0)
        pos_q, pos_kv = q_pos[:, :, None], kv_pos[:, None, :]
        if align is not None:
            keep &= pos_q >= pos_kv
        window = _window(window_size)
        if window is not None:
            left, right = window
            if left is not None:
                keep &= pos_kv >= pos_q - left
            if right is not None:
                keep &= pos_kv <= pos_q + right
        return keep[:, None]


def fused_attn(
    qkv,
    bias,
    mask,
    seed,
    attn_bias_type,
    attn_mask_type,
    qkv_layout,
    scaling_factor,
    dropout_probability,
    is_training,
    window_size=None,
    context_parallel_strategy=CPStrategy.DEFAULT,
    context_parallel_causal_load_balanced=False,
    context_parallel_axis="",
):
    """TransformerEngine-JAX 2.0's ``fused_attn`` (its signature; ``mask`` is the third parameter)
    on :func:`flashport.attention`, with the meaning of TE's ``DotProductAttention``
    (:mod:`flashport.integrations.transformer_engine_flax`): ``qkv`` is ``(qkv_packed,)``, ``(query, kv_packed)`` or ``(query, key, value)`` by
    ``qkv_layout``, ``[b, s, h, d]``; ``mask`` (True = masked out) is read for the padding mask types
    only; ``bias`` by ``attn_bias_type``; ``scaling_factor`` multiplies ``q.k``; dropout at
    ``dropout_probability`` when ``is_training``, keyed by ``seed`` (a PRNG key or its uint32 data;
    TE seeds cuDNN with its first two words, the mask drawn here differs). THD layouts raise
    ``NotImplementedError``."""
    layout = qkv_layout.name
    if layout in _THD_LAYOUTS:
        raise NotImplementedError(
            f"fused_attn qkv_layout=QKVLayout.{layout} (THD sequence packing) is not supported by flashport"
        )
    if layout == "BS3HD":
        (packed,) = qkv
        query, key, value = (packed[..., i, :, :] for i in range(3))
    elif layout == "BSHD_BS2HD":
        query, packed = qkv
        key, value = packed[..., 0, :, :], packed[..., 1, :, :]
    else:
        query, key, value = qkv
    align, padding = _MASK_TYPES[_MASK_MEMBERS[attn_mask_type.name]]
    kind = attn_bias_type.name if attn_bias_type is not None else "NO_BIAS"
    if kind == "NO_BIAS":
        bias = None
    elif kind == "PRE_SCALE_BIAS":
        bias = bias * scaling_factor
    attend = None
    if padding and mask is not None:
        if align == "bottom_right":
            raise NotImplementedError(
                f"fused_attn attn_mask_type=AttnMaskType.{attn_mask_type.name} with a mask: TE aligns the "
                "bottom-right diagonal to each sequence's own lengths; not supported by flashport"
            )
        attend = _attend_mask(mask)
    if align is not None and context_parallel_causal_load_balanced:
        _refuse_load_balanced_order(context_parallel_axis)
    dropout_rate, dropout_rng = 0.0, None
    if is_training and dropout_probability > 0:
        if seed is None:
            raise ValueError("seed is not allowed to be None when dropout is enabled.")
        dropout_rate, dropout_rng = dropout_probability, _key(seed)
    return flashport.attention(
        query,
        key,
        value,
        scale=scaling_factor,
        causal=align is not None,
        align=align or "top_left",
        window=_window(window_size),
        bias=bias,
        mask=attend,
        layout="BSHD",
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
    )


def _key(seed):
    """A PRNG key from TE's ``seed``: a key, or key data whose first two uint32 words TE reads."""
    seed = jnp.asarray(seed)
    if jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
        return seed.reshape(-1)[0]
    return jax.random.wrap_key_data(seed.reshape(-1)[:2].astype(jnp.uint32), impl="threefry2x32")
