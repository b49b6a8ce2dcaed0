"""``flash_attn.bert_padding`` without flash-attn: unpad/pad helpers for the varlen convention.

Drop-in for ``from flash_attn.bert_padding import unpad_input, pad_input, index_first_axis`` (the
module imports flash-attn's CUDA extension; these are plain torch). Signatures and return values
follow flash-attn 2.8.3: :func:`unpad_input` returns **five** values (``seqused`` was added in
2.7.0; code written against older releases unpacks four and must drop the last).
"""

from __future__ import annotations

__all__ = ["index_first_axis", "index_put_first_axis", "pad_input", "rearrange", "unpad_input"]


def rearrange(tensor, pattern, **axes_lengths):
    """``einops.rearrange``, which ``flash_attn.bert_padding`` re-exports (flash-attn depends on
    einops; code that imported it from there needs einops, not flash-attn)."""
    import einops

    return einops.rearrange(tensor, pattern, **axes_lengths)


def index_first_axis(input, indices):
    """Rows ``indices`` of ``input`` along its first axis (``input[indices]``, differentiable).

    Args:
      input: [N, ...] tensor.
      indices: int tensor [M] of row indices.

    Returns:
      [M, ...] tensor.
    """
    return input.index_select(0, indices)


def index_put_first_axis(values, indices, first_axis_dim):
    """A zero tensor of ``first_axis_dim`` rows with ``values`` written at rows ``indices``.

    Args:
      values: [M, ...] tensor.
      indices: int tensor [M].
      first_axis_dim: the number of rows of the result.

    Returns:
      [first_axis_dim, ...] tensor of ``values``' dtype and device (differentiable in ``values``).
    """
    import torch

    out = torch.zeros(first_axis_dim, *values.shape[1:], dtype=values.dtype, device=values.device)
    return out.index_put((indices,), values)


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """Pack the valid tokens of a padded batch (flash-attn ``bert_padding.unpad_input``).

    Args:
      hidden_states: [batch, seqlen, ...].
      attention_mask: [batch, seqlen], bool or int, 1 = valid token.
      unused_mask: optional [batch, seqlen], 1 = allocated but unused (kept in the packed tensor and
        counted in ``cu_seqlens``, not in ``seqused``).

    Returns:
      ``(hidden [total, ...], indices [total] (int64, into the flattened batch*seqlen),
      cu_seqlens [batch + 1] (int32), max_seqlen (int), seqused [batch] (int32))``.
    """
    import torch

    masks = attention_mask if unused_mask is None else attention_mask + unused_mask
    seqlens = masks.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(masks.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item())
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen, used


def pad_input(hidden_states, indices, batch, seqlen):
    """Scatter packed tokens back into a zero-padded batch (flash-attn ``bert_padding.pad_input``).

    Args:
      hidden_states: [total, ...] packed tokens.
      indices: [total] positions in the flattened ``batch * seqlen`` batch (from :func:`unpad_input`).
      batch, seqlen: the padded shape.

    Returns:
      [batch, seqlen, ...] with zeros at the padding positions.
    """
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
