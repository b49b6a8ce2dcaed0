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
"""

from __future__ import annotations

__all__ = ["apply_rotary_emb", "apply_rotary_emb_func"]


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
