"""flash-attn ``flash_attn_with_kvcache`` with its full behaviour, on :func:`flashport.torch.attention`.

flash-attn (2.8.3, ``flash_fwd_kernel.h`` for the rotary and left-padding offsets):

* new rows ``k``/``v`` [B, S_new, Hk, D] are written **in place** into ``k_cache``/``v_cache`` at
  rows ``cache_seqlens[b] .. cache_seqlens[b] + S_new`` of cache row ``cache_batch_idx[b]`` (or of
  the pages ``block_table[b]`` for a paged cache ``[num_blocks, page, Hk, D]``);
* with ``rotary_cos``/``rotary_sin`` [seqlen_ro, rotary_dim / 2] the new keys are rotated at
  positions ``cache_seqlens[b] + t`` before they are stored, and the queries at
  ``cache_seqlens[b] + i`` (causal or local) or all at ``cache_seqlens[b]`` (otherwise);
  ``rotary_interleaved`` pairs dims (0, 1), (2, 3)... else (i, i + rotary_dim / 2) (GPT-NeoX);
* sequence ``b`` attends keys ``cache_leftpad[b] <= j < cache_seqlens[b] + S_new``, causal/window
  bottom-right on that range (query ``i`` sees ``j <= i + cache_seqlens[b] + S_new - S_q``).
"""

from __future__ import annotations

from flashport.integrations.flash_attn.core import (
    cache_lengths,
    flash_attn_window,
    kvcache_mask,
    lse_like_flash_attn,
)

__all__ = ["CacheRows", "apply_rotary", "check_kvcache_arguments", "flash_attn_with_kvcache"]


def apply_rotary(x, cos, sin, positions, interleaved):
    """Rotate the first ``2 * cos.shape[-1]`` dims of ``x`` [B, S, H, D] at ``positions`` [B, S].

    Args:
      x: [B, S, H, D]. cos, sin: [seqlen_ro, rotary_dim / 2]. positions: int [B, S].
      interleaved: pair dims (2i, 2i + 1) instead of (i, i + rotary_dim / 2).

    Returns:
      ``x`` with its rotary dims rotated, in ``x``'s dtype (computed in float32 or wider).
    """
    import torch

    half = cos.shape[-1]
    wide = torch.promote_types(x.dtype, torch.float32)
    c = cos[positions].to(wide)[:, :, None, :]
    s = sin[positions].to(wide)[:, :, None, :]
    rot, rest = x[..., : 2 * half].to(wide), x[..., 2 * half :]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
    else:
        a, b = rot[..., :half], rot[..., half:]
        out = torch.cat([a * c - b * s, a * s + b * c], dim=-1)
    return torch.cat([out.to(x.dtype), rest], dim=-1)


class CacheRows:
    """Where logical row ``r`` of sequence ``b`` lives in a (possibly paged or batch-indexed) cache."""

    def __init__(self, k_cache, batch, cache_batch_idx, block_table):
        import torch

        device = k_cache.device
        self.direct = False
        if block_table is not None:
            if cache_batch_idx is not None:
                raise ValueError(
                    "flash_attn_with_kvcache: cache_batch_idx is not supported with a paged cache (block_table)"
                )
            self.page = k_cache.shape[1]
            self.length = block_table.shape[1] * self.page
            self.table = block_table.to(device=device, dtype=torch.long)
        else:
            self.page = None
            self.length = k_cache.shape[1]
            self.direct = cache_batch_idx is None  # sequence b is cache row b: read a view, no copy
            self.rows = (
                torch.arange(batch, device=device)
                if cache_batch_idx is None
                else cache_batch_idx.to(device=device, dtype=torch.long)
            )

    def index(self, rows):
        """(first-axis index, second-axis index) of logical ``rows`` [B, L] in the cache tensor."""
        if self.page is None:
            return self.rows[:, None].expand_as(rows), rows
        return self.table.gather(1, rows // self.page), rows % self.page

    def read(self, cache, batch):
        """The logical cache [B, length, Hk, D] (a view of the first B rows, else a gathered copy)."""
        import torch

        if self.page is None and self.direct:
            return cache[:batch]
        rows = torch.arange(self.length, device=cache.device)[None, :].expand(batch, -1)
        return cache[self.index(rows)]

    def write(self, cache, rows, new):
        """Write ``new`` [B, S_new, Hk, D] at logical ``rows`` [B, S_new], in place."""
        first, second = self.index(rows)
        cache.index_put_(
            (first.reshape(-1), second.reshape(-1)), new.reshape(-1, *new.shape[2:]).to(cache.dtype)
        )


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """flash-attn 2.x ``flash_attn_with_kvcache`` (module docstring), updating the caches in place.

    Args:
      q: [B, S_q, H, D]. k_cache, v_cache: [B_cache, S_cache, Hk, D], or [num_blocks, page, Hk, D]
        with ``block_table`` [B, max_blocks] (int). k, v: optional new rows [B, S_new, Hk, D].
      rotary_cos, rotary_sin: optional [seqlen_ro, rotary_dim / 2] (only with ``k``/``v``).
      cache_seqlens: int or int [B]: rows already in the cache (None = the whole cache).
      cache_batch_idx: optional int [B]: cache row of each sequence. cache_leftpad: optional int
        [B]: first valid row of each sequence.
      softmax_scale, causal, window_size, softcap: as flash-attn (bottom-right, -1 = unbounded, 0 = off).
      rotary_interleaved: see the module docstring. num_splits: ignored (kernel tuning).
      alibi_slopes: not supported (raises). return_softmax_lse: also return lse [B, H, S_q] (float32;
        +inf for a row that sees no key, as flash-attn).

    Returns:
      ``out`` [B, S_q, H, D], or ``(out, softmax_lse)``.

    Raises:
      ValueError: ``k`` without ``v``, rotary without new rows, rows that do not fit the cache.
      NotImplementedError: ``alibi_slopes``.
    """
    import flashport.torch

    check_kvcache_arguments(k, v, rotary_cos, rotary_sin, alibi_slopes)
    batch = q.shape[0]
    cache = CacheRows(k_cache, batch, cache_batch_idx, block_table)
    lengths = cache_lengths(cache_seqlens, batch, cache.length, q.device)
    window = flash_attn_window(window_size)
    if k is not None:
        rotary = None if rotary_cos is None else (rotary_cos, rotary_sin, rotary_interleaved)
        q, lengths = _append(
            cache, (k_cache, v_cache), q, (k, v), lengths, rotary, local=causal or window is not None
        )
    keys, values = cache.read(k_cache, batch), cache.read(v_cache, batch)
    mask = _visible(cache, lengths, q.shape[1], causal, window, cache_leftpad)
    options = dict(scale=softmax_scale, softcap=softcap or None, mask=mask, layout="BSHD")
    result = flashport.torch.attention(q, keys, values, **options, return_lse=return_softmax_lse)
    return (result[0], lse_like_flash_attn(result[1])) if return_softmax_lse else result


def check_kvcache_arguments(k, v, rotary_cos, rotary_sin, alibi_slopes):
    """Raise for the argument combinations flash-attn rejects (or flashport does not support)."""
    if alibi_slopes is not None:
        raise NotImplementedError(
            "flash_attn_with_kvcache: alibi_slopes is not supported by flashport's drop-in"
        )
    if (k is None) != (v is None):
        raise ValueError("flash_attn_with_kvcache: pass both k and v, or neither")
    if (rotary_cos is None) != (rotary_sin is None) or (rotary_cos is not None and k is None):
        raise ValueError("flash_attn_with_kvcache: rotary_cos and rotary_sin go together, and need new k/v")


def _append(cache, caches, q, new, lengths, rotary, *, local):
    """Write the new rows ``new`` = (k, v) into ``caches`` = (k_cache, v_cache) after ``lengths``,
    rotating them (and ``q``) first when ``rotary`` = (cos, sin, interleaved) is given.

    Returns ``(q, lengths)``: the (rotated) queries and the cache lengths after the append.
    """
    import torch

    k, v = new
    batch, s_q = q.shape[:2]
    s_new = k.shape[1]
    if s_new and int(lengths.max()) + s_new > cache.length:
        raise ValueError(
            f"flash_attn_with_kvcache: cache_seqlens + S_new = {int(lengths.max()) + s_new} "
            f"exceeds the cache length {cache.length}"
        )
    rows = lengths[:, None] + torch.arange(s_new, device=q.device)[None, :]
    if rotary is not None:
        cos, sin, interleaved = rotary
        k = apply_rotary(k, cos, sin, rows, interleaved)
        q_pos = lengths[:, None] + (torch.arange(s_q, device=q.device)[None, :] if local else 0)
        q = apply_rotary(q, cos, sin, q_pos.expand(batch, s_q), interleaved)
    cache.write(caches[0], rows, k)
    cache.write(caches[1], rows, v)
    return q, lengths + s_new


def _visible(cache, lengths, s_q, causal, window, cache_leftpad):
    """Boolean [B, 1, S_q, cache.length]: the keys each query sees (``kvcache_mask``, left padding)."""
    import torch

    mask = kvcache_mask(lengths, s_q, cache.length, causal=causal, window=window)
    if cache_leftpad is None:
        return mask
    start = cache_leftpad.to(device=lengths.device, dtype=torch.long)
    key_pos = torch.arange(cache.length, device=lengths.device)[None, None, None, :]
    return mask & (key_pos >= start[:, None, None, None])
