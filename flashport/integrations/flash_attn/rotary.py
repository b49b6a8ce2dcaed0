"""``flash_attn.layers.rotary.apply_rotary_emb`` without flash-attn (plain torch).

flash-attn's function runs a Triton kernel (``flash_attn.ops.triton.rotary``); its meaning is the
module's own reference ``apply_rotary_emb_torch`` plus per-sequence positions (flash-attn 2.8.3,
``flash_attn/layers/rotary.py`` docstring):

* ``x``: ``[B, S, H, D]``, or ``[total, H, D]`` with ``cu_seqlens`` ``(B + 1,)`` (positions restart
  at each sequence); ``cos``/``sin``: ``[S_rotary, rotary_dim / 2]``; the first ``rotary_dim``
  features of ``x`` are rotated, the rest pass through;
* token ``t`` of sequence ``b`` uses row ``t + seqlen_offsets[b]`` (an int offset applies to every
  sequence); a position past the table's rows is left unrotated (the kernel loads ``cos = 1``,
  ``sin = 0`` there);
* ``interleaved=False`` rotates the halves ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)``
  (GPT-NeoX); ``True`` rotates even/odd pairs (GPT-J);
* ``inplace=True`` writes the result into ``x`` and returns it; gradients flow through torch.

The module's other public names follow the same file: ``apply_rotary_emb_qkv_`` and
``apply_rotary_emb_kv_`` rotate the query and key parts of a packed ``qkv`` / ``kv`` in place, and
``RotaryEmbedding`` is the ``nn.Module`` that builds the cos/sin tables (attributes and private
methods kept, so subclasses that override ``_update_cos_sin_cache`` keep working).
"""

from __future__ import annotations

import functools

__all__ = [
    "RotaryEmbedding",  # noqa: F822 (built on first use by the module __getattr__)
    "apply_rotary_emb",
    "apply_rotary_emb_func",
    "apply_rotary_emb_kv_",
    "apply_rotary_emb_qkv_",
]


def _positions(x, seqlen_offsets, cu_seqlens):
    """Row of the cos/sin table for every token: [B, S] (dense) or [total] (varlen)."""
    import torch

    device = x.device
    if cu_seqlens is None:
        batch, seqlen = x.shape[0], x.shape[1]
        positions = torch.arange(seqlen, device=device)[None, :].expand(batch, seqlen)
        offsets = torch.as_tensor(seqlen_offsets, device=device).reshape(-1, 1)
        return positions + offsets
    starts = cu_seqlens.to(device=device, dtype=torch.long)
    lengths = starts[1:] - starts[:-1]
    sequence = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
    positions = torch.arange(x.shape[0], device=device) - starts[:-1][sequence]
    offsets = torch.as_tensor(seqlen_offsets, device=device).reshape(-1)
    return positions + (offsets[sequence] if offsets.numel() > 1 else offsets)


def apply_rotary_emb(
    x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, max_seqlen=None
):
    """flash-attn's ``apply_rotary_emb`` (module docstring); ``max_seqlen`` only sizes the kernel."""
    import torch

    rotary = cos.shape[-1] * 2
    if rotary > x.shape[-1]:
        raise ValueError(f"rotary_dim {rotary} is larger than the head dim {x.shape[-1]}")
    positions = _positions(x, seqlen_offsets, cu_seqlens)
    inside = positions < cos.shape[0]
    rows = positions.clamp(max=cos.shape[0] - 1)
    c = torch.where(inside[..., None], cos[rows], torch.ones((), dtype=cos.dtype, device=cos.device))
    s = torch.where(inside[..., None], sin[rows], torch.zeros((), dtype=sin.dtype, device=sin.device))
    c, s = c[..., None, :].to(x.dtype), s[..., None, :].to(x.dtype)  # broadcast over heads
    part = x[..., :rotary]
    if interleaved:
        x1, x2 = part[..., 0::2], part[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = part[..., : rotary // 2], part[..., rotary // 2 :]
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    out = torch.cat((rotated, x[..., rotary:]), dim=-1)
    if inplace:
        x.copy_(out)
        return x
    return out


apply_rotary_emb_func = apply_rotary_emb  # flash-attn's alias, kept for backward compatibility


def apply_rotary_emb_qkv_(
    qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False, seqlen_offsets=0, num_heads_q=None
):
    """flash-attn's ``apply_rotary_emb_qkv_``: rotate, in place, the query (``cos``/``sin``) and key
    (``cos_k``/``sin_k``, default ``cos``/``sin``) parts of ``qkv`` and return ``qkv``.

    ``qkv``: ``[B, S, 3, H, D]``, or ``[B, S, num_heads_q + 2 * num_heads_k, D]`` with
    ``num_heads_q`` given (MQA/GQA); the value part is left as it is.
    """
    cos_k = cos if cos_k is None else cos_k
    sin_k = sin if sin_k is None else sin_k
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ValueError(f"qkv's third dimension must be 3, got {qkv.shape[2]}")
        q, k = qkv[:, :, 0], qkv[:, :, 1]
    else:
        if num_heads_q is None:
            raise ValueError("num_heads_q is required for a 4-dimensional qkv")
        num_heads_k = (qkv.shape[2] - num_heads_q) // 2
        if qkv.shape[2] != num_heads_q + 2 * num_heads_k:
            raise ValueError(f"{qkv.shape[2]} heads are not num_heads_q + 2 * num_heads_k")
        q, k = qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q : num_heads_q + num_heads_k]
    apply_rotary_emb(q, cos, sin, interleaved, inplace=True, seqlen_offsets=seqlen_offsets)
    apply_rotary_emb(k, cos_k, sin_k, interleaved, inplace=True, seqlen_offsets=seqlen_offsets)
    return qkv


def apply_rotary_emb_kv_(kv, cos, sin, interleaved=False, seqlen_offsets=0):
    """flash-attn's ``apply_rotary_emb_kv_``: rotate, in place, the key part ``kv[:, :, 0]`` of
    ``kv`` ``[B, S, 2, H, D]`` and return ``kv``."""
    apply_rotary_emb(kv[:, :, 0], cos, sin, interleaved, inplace=True, seqlen_offsets=seqlen_offsets)
    return kv


@functools.cache
def _rotary_embedding_class():
    import torch

    class RotaryEmbedding(torch.nn.Module):
        """flash-attn's ``RotaryEmbedding`` (the rotary embedding of RoFormer, with the XPos
        ``scale_base`` option): ``forward`` rotates ``qkv`` (and ``kv``) in place with tables it
        caches up to the longest sequence seen."""

        def __init__(
            self,
            dim: int,
            base=10000.0,
            interleaved=False,
            scale_base=None,
            pos_idx_in_fp32=True,
            device=None,
        ):
            """interleaved: GPT-J pairs instead of GPT-NeoX halves; scale_base: XPos scaling
            (queries times the scale, keys divided by it); pos_idx_in_fp32: positions in fp32
            whatever the buffers' dtype."""
            super().__init__()
            self.dim = dim
            self.base = float(base)
            self.pos_idx_in_fp32 = pos_idx_in_fp32
            inv_freq = self._compute_inv_freq(device)
            self.register_buffer("inv_freq", inv_freq, persistent=False)
            self.interleaved = interleaved
            self.scale_base = scale_base
            scale = (
                (torch.arange(0, dim, 2, device=device, dtype=torch.float32) + 0.4 * dim) / (1.4 * dim)
                if scale_base is not None
                else None
            )
            self.register_buffer("scale", scale, persistent=False)
            self._seq_len_cached = 0
            self._cos_cached = None
            self._sin_cached = None
            self._cos_k_cached = None
            self._sin_k_cached = None

        def _compute_inv_freq(self, device=None):
            return 1.0 / (
                self.base ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim)
            )

        def _update_cos_sin_cache(self, seqlen, device=None, dtype=None):
            # rebuilt when longer, on another device or dtype, or leaving inference mode
            if (
                seqlen > self._seq_len_cached
                or self._cos_cached is None
                or self._cos_cached.device != device
                or self._cos_cached.dtype != dtype
                or (self.training and self._cos_cached.is_inference())
            ):
                self._seq_len_cached = seqlen
                if self.pos_idx_in_fp32:
                    t = torch.arange(seqlen, device=device, dtype=torch.float32)
                    if self.inv_freq.dtype != torch.float32:
                        inv_freq = self._compute_inv_freq(device=device)
                    else:
                        inv_freq = self.inv_freq
                else:
                    t = torch.arange(seqlen, device=device, dtype=self.inv_freq.dtype)
                    inv_freq = self.inv_freq
                freqs = torch.outer(t, inv_freq)
                if self.scale is None:
                    self._cos_cached = torch.cos(freqs).to(dtype)
                    self._sin_cached = torch.sin(freqs).to(dtype)
                else:
                    power = (
                        torch.arange(seqlen, dtype=self.scale.dtype, device=self.scale.device) - seqlen // 2
                    ) / self.scale_base
                    scale = self.scale.to(device=power.device) ** power[:, None]
                    self._cos_cached = (torch.cos(freqs) * scale).to(dtype)
                    self._sin_cached = (torch.sin(freqs) * scale).to(dtype)
                    self._cos_k_cached = (torch.cos(freqs) / scale).to(dtype)
                    self._sin_k_cached = (torch.sin(freqs) / scale).to(dtype)

        def forward(self, qkv, kv=None, seqlen_offset=0, max_seqlen=None, num_heads_q=None):
            """qkv: ``[B, S, 3, H, D]`` (or ``[B, S, Hq + 2 Hk, D]`` with ``num_heads_q``) when
            ``kv`` is None, else q ``[B, S, H, D]`` and kv ``[B, S, 2, H, D]``; ``seqlen_offset``:
            an int or ``(B,)`` (then ``max_seqlen`` sizes the tables). Rotates in place; returns
            qkv, or (q, kv)."""
            seqlen = qkv.shape[1]
            if max_seqlen is not None:
                self._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
            elif isinstance(seqlen_offset, int):
                self._update_cos_sin_cache(seqlen + seqlen_offset, device=qkv.device, dtype=qkv.dtype)
            if kv is None:
                return apply_rotary_emb_qkv_(
                    qkv,
                    self._cos_cached,
                    self._sin_cached,
                    self._cos_k_cached,
                    self._sin_k_cached,
                    interleaved=self.interleaved,
                    seqlen_offsets=seqlen_offset,
                    num_heads_q=num_heads_q,
                )
            q = apply_rotary_emb(
                qkv,
                self._cos_cached,
                self._sin_cached,
                interleaved=self.interleaved,
                inplace=True,
                seqlen_offsets=seqlen_offset,
            )
            cos_k, sin_k = (
                (self._cos_cached, self._sin_cached)
                if self.scale is None
                else (self._cos_k_cached, self._sin_k_cached)
            )
            kv = apply_rotary_emb_kv_(
                kv, cos_k, sin_k, interleaved=self.interleaved, seqlen_offsets=seqlen_offset
            )
            return q, kv

    return RotaryEmbedding


def __getattr__(name):
    """``RotaryEmbedding`` is built on first use, so that importing this module does not import torch."""
    if name == "RotaryEmbedding":
        return _rotary_embedding_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
