"""TransformerEngine-JAX's Flax ``DotProductAttention`` module on the flashport contract.

``transformer_engine.jax.flax.DotProductAttention`` (MaxText, MaxDiffusion) needs TransformerEngine,
which only builds for NVIDIA GPUs. :class:`DotProductAttention` here is a ``flax.linen`` module with
its fields (TransformerEngine 2.18: configuration at construction) and its ``__call__`` (tensors),
and runs :func:`flashport.attention` on any platform. Semantics (TE's docstrings and
``transformer_engine/jax/flax/transformer.py``, ``transformer_engine/jax/attention.py``):

* ``qkv_layout`` (case-insensitive): ``bshd_bshd_bshd`` (separate ``[b, s, h, d]`` tensors),
  ``bs3hd`` (``query`` is ``[b, s, 3, h, d]``; ``key``/``value`` are ignored), ``bshd_bs2hd`` (``key``
  is ``[b, s, 2, h, d]``; ``value`` is ignored); ``transpose_batch_sequence=True`` swaps the first two
  axes of the inputs and of the output (``[s, b, ...]``). The output is ``[b, s, h, d]`` (or
  ``[s, b, h, d]``) in the query's dtype;
* ``attn_mask_type``: ``'no_mask'``; ``'causal'`` (top-left: query ``i`` sees keys ``j <= i``);
  ``'causal_bottom_right'``; ``'padding'``; ``'padding_causal'`` / ``'causal_padding'``;
  ``'padding_causal_bottom_right'`` (and TE's other spellings of these). The ``mask`` (or
  ``sequence_descriptor``) array is **True/non-zero = masked out**, broadcastable to
  ``[b, 1, s_q, s_kv]`` (a ``[b, 1, 1, s_q, s_kv]`` mask with singleton middle axes is accepted); it
  is ignored for ``'no_mask'`` and the causal-only types, and for the padding types it is combined
  with the causal mask where the type names one (as documented and as TE's fused backend does; its
  unfused backend applies the mask alone);
* a :class:`~flashport.integrations.transformer_engine_compat.SequenceDescriptor` instead of the
  mask array (padding types): ``from_seqlens`` -- query
  ``i`` of row ``b`` sees key ``j`` when ``i < q_seqlens[b]`` and ``j < kv_seqlens[b]``;
  ``from_segment_ids_and_pos`` (BSHD and THD packing) -- when the segment ids are equal and not 0
  (0 = padding), causal and window by the segment positions (``pos_q >= pos_kv``), TE's definition
  in its fused-attention tests (``make_mask``);
* ``scale_factor=None`` means ``1/sqrt(head_dim)`` (the query's last axis for separate tensors, the
  ``head_dim`` field for packed layouts);
* ``window_size=(left, right)``: query ``i`` sees keys in ``[i - left, i + right]`` (inclusive,
  measured from the diagonal of the mask type's alignment; a negative side is unbounded);
* ``attn_bias_type``: ``None`` (``'post_scale_bias'`` when a ``bias`` is passed, else ``'no_bias'``),
  ``'no_bias'``, ``'post_scale_bias'`` (``softmax(scale * q.k + bias)``), ``'pre_scale_bias'``
  (``softmax(scale * (q.k + bias))``);
* GQA: ``key``/``value`` with fewer heads, contiguous query groups (query head ``h`` uses kv head
  ``h // (h_q // h_kv)``), as in the contract;
* ``attention_dropout > 0`` and ``deterministic=False``: the contract's dropout with the rate and
  ``1 / (1 - rate)`` scaling and a key from ``self.make_rng(dropout_rng_name)`` (a different random
  mask than cuDNN's, as any two dropout draws are);
* ``float32_logits``, ``dtype``, ``max_segments_per_seq``, ``context_parallel_axis``,
  ``context_parallel_strategy`` and ``context_checkpoint_name`` change no value: the contract
  always forms the logits and softmax in float32, and a context-parallel run computes the same
  attention over the whole sequence.

What raises ``NotImplementedError`` naming the argument: THD layouts without segment ids and
positions, ``SequenceDescriptor.from_seqlens_and_offsets`` descriptors, TE's own
``SequenceDescriptor`` objects, the padding bottom-right mask types with a mask or descriptor (TE's
fused backend aligns them to each sequence's own lengths), ``softmax_type`` other than
``'vanilla'``, ``score_mod``/``score_mod_bprop`` (cuDNN frontend callbacks), and
``context_parallel_causal_load_balanced=True`` with a causal mask type while the
``context_parallel_axis`` of the current mesh has more than one device and no segment positions are
given (the sequence is then in TE's load-balanced order, whose causal mask is not by position in the
array).

Known deviation: a query row that sees no key returns 0 (the contract's value for an empty row);
TE's unfused backend returns the mean of ``value`` there and its fused backend leaves padding the
caller discards.
"""

from __future__ import annotations

__all__ = ["DotProductAttention"]

import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

import flashport
from flashport.integrations.transformer_engine_compat import (
    _BIAS_TYPES,
    _LAYOUTS,
    _MASK_TYPES,
    _THD_LAYOUTS,
    SequenceDescriptor,
    _attend_mask,
    _refuse_load_balanced_order,
    _window,
)


class DotProductAttention(nn.Module):
    """TransformerEngine-JAX's ``DotProductAttention`` (same fields, call and meaning; the module
    docstring) on :func:`flashport.attention`. It has no parameters.

    ``transpose_batch_sequence=None`` means ``False``, as in TransformerEngine 2.10 and later
    (earlier releases defaulted to ``True``; the codemod only rewrites constructions that state it).
    """

    head_dim: int
    num_attention_heads: int
    num_gqa_groups: int | None = None
    attention_dropout: float = 0.0
    attn_mask_type: str = "causal"
    attn_bias_type: str | None = None
    dtype: Any = None
    dropout_rng_name: str = "dropout"
    float32_logits: bool = False
    qkv_layout: str = "bshd_bshd_bshd"
    scale_factor: float | None = None
    transpose_batch_sequence: bool | None = None
    window_size: tuple[int, int] | None = None
    max_segments_per_seq: int | None = 1
    context_parallel_causal_load_balanced: bool = False
    context_parallel_axis: str = ""
    context_parallel_strategy: str = "DEFAULT"
    context_checkpoint_name: str = "context"
    softmax_type: str = "vanilla"
    score_mod: Callable | None = None
    score_mod_bprop: Callable | None = None

    @nn.compact
    def __call__(
        self,
        query,
        key,
        value,
        sequence_descriptor=None,
        bias=None,
        *,
        deterministic: bool = False,
        mask=None,
        score_mod_tensors=None,
        score_mod_bprop_tensors=None,
    ):
        """Attention of ``query`` over ``key``/``value`` in the layout of ``qkv_layout``; ``mask``
        (or ``sequence_descriptor``) True/non-zero = masked out; ``deterministic`` disables dropout."""
        if mask is not None:
            if sequence_descriptor is not None:
                raise ValueError("sequence_descriptor and mask cannot be provided at the same time.")
            sequence_descriptor = mask
        self._check_supported(score_mod_tensors, score_mod_bprop_tensors)
        layout = self.qkv_layout.upper()
        align, padding = _MASK_TYPES[self.attn_mask_type]
        bias_type = self._bias_type(bias)

        if self.transpose_batch_sequence:
            query, key, value = (None if t is None else jnp.swapaxes(t, 0, 1) for t in (query, key, value))
        if layout in ("BS3HD", "T3HD"):
            query, key, value = (query[..., i, :, :] for i in range(3))
        elif layout in ("BSHD_BS2HD", "THD_T2HD"):
            key, value = key[..., 0, :, :], key[..., 1, :, :]
        head_dim_qk = query.shape[-1] if layout in ("BSHD_BSHD_BSHD", "THD_THD_THD") else self.head_dim
        scale = 1.0 / math.sqrt(head_dim_qk) if self.scale_factor is None else self.scale_factor
        if bias_type == "PRE_SCALE_BIAS":
            bias = bias * scale
        elif bias_type == "NO_BIAS":
            bias = None

        attend, by_position = None, False
        if padding and sequence_descriptor is not None:
            if align == "bottom_right":
                raise NotImplementedError(
                    f"attn_mask_type={self.attn_mask_type!r} with a mask or sequence_descriptor: TE's fused "
                    "backend aligns the bottom-right diagonal to each sequence's own lengths; not supported "
                    "by flashport's DotProductAttention"
                )
            if isinstance(sequence_descriptor, SequenceDescriptor):
                attend = sequence_descriptor._attend(query.shape[1], key.shape[1], align, self.window_size)
                by_position = sequence_descriptor.segment_ids is not None
            else:
                attend = _attend_mask(sequence_descriptor)
        if layout in _THD_LAYOUTS and not by_position:
            raise NotImplementedError(
                f"qkv_layout={self.qkv_layout!r} (THD sequence packing) needs a padding mask type and a "
                "SequenceDescriptor.from_segment_ids_and_pos in flashport's DotProductAttention"
            )
        if by_position:  # causal and window are by segment position, in the mask
            align = None
        if align is not None and self.context_parallel_causal_load_balanced:
            _refuse_load_balanced_order(self.context_parallel_axis)

        dropout_rate, dropout_rng = 0.0, None
        if not deterministic and self.attention_dropout > 0.0:
            dropout_rate, dropout_rng = self.attention_dropout, self.make_rng(self.dropout_rng_name)

        out = flashport.attention(
            query,
            key,
            value,
            scale=scale,
            causal=align is not None,
            align=align or "top_left",
            window=None if by_position else _window(self.window_size),
            bias=bias,
            mask=attend,
            layout="BSHD",
            dropout_rate=dropout_rate,
            dropout_rng=dropout_rng,
        )
        if self.transpose_batch_sequence:
            out = jnp.swapaxes(out, 0, 1)
        return out

    def _check_supported(self, score_mod_tensors, score_mod_bprop_tensors) -> None:
        """Raise for the configurations the contract cannot run with TE's meaning."""
        if self.attn_mask_type not in _MASK_TYPES:
            raise ValueError(f"Unsupported attn_mask_type={self.attn_mask_type!r}")
        layout = self.qkv_layout.upper()
        if layout not in _LAYOUTS + _THD_LAYOUTS:
            raise ValueError(f"Unsupported qkv_layout={self.qkv_layout!r}")
        if self.softmax_type != "vanilla":
            raise NotImplementedError(
                f"softmax_type={self.softmax_type!r} (attention sink) is not supported by flashport's "
                "DotProductAttention"
            )
        for name, given in (
            ("score_mod", self.score_mod),
            ("score_mod_bprop", self.score_mod_bprop),
            ("score_mod_tensors", score_mod_tensors),
            ("score_mod_bprop_tensors", score_mod_bprop_tensors),
        ):
            if given is not None:
                raise NotImplementedError(
                    f"{name}= (a cuDNN frontend score callback) is not supported by flashport's "
                    "DotProductAttention"
                )

    def _bias_type(self, bias) -> str:
        """TE's bias type: the field, or ``POST_SCALE_BIAS``/``NO_BIAS`` by whether a bias is given."""
        if self.attn_bias_type is None:
            return "NO_BIAS" if bias is None else "POST_SCALE_BIAS"
        kind = self.attn_bias_type.upper()
        if kind not in _BIAS_TYPES:
            raise ValueError(f"Unsupported attn_bias_type={self.attn_bias_type!r}")
        if (kind == "NO_BIAS") != (bias is None):
            raise ValueError(
                f"attn_bias_type={self.attn_bias_type!r} with bias={'None' if bias is None else 'an array'}"
            )
        return kind
