"""flash-attn's ``flash_attn_with_kvcache`` as a functional call on the flashport contract.

``flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=..., causal=...)`` (flash-attn
2.2+) writes the new keys/values into the caches **in place** at rows ``cache_seqlens[b] ..
cache_seqlens[b] + S_new`` and attends over the first ``cache_seqlens[b] + S_new`` keys of sequence
``b``, with causal/window aligned **bottom-right per sequence** (query ``i`` sees key ``j`` when
``j <= i + L_b - S_q`` for ``L_b`` the sequence's key count). :func:`kvcache_attention` computes the
same output without mutating anything: the new rows go into a copy of each cache (the copy is
returned with ``return_cache=True``), and the per-sequence lengths and alignment become a boolean
mask. Works on torch tensors (through :func:`flashport.torch.attention`).
"""

from __future__ import annotations


def _as_lengths(cache_seqlens, batch, device):
    import torch

    if isinstance(cache_seqlens, torch.Tensor):
        return cache_seqlens.to(device=device, dtype=torch.long).reshape(-1).expand(batch)
    return torch.full((batch,), int(cache_seqlens), dtype=torch.long, device=device)


def kvcache_mask(lengths, s_q, s_k, *, causal=False, window=None):
    """Boolean mask [B, 1, s_q, s_k]: key ``j < lengths[b]``, causal/window bottom-right per sequence.

    Args:
      lengths: int tensor [B], the number of valid keys of each sequence.
      s_q, s_k: query length and cache length.
      causal: keep ``j <= i + lengths[b] - s_q``.
      window: ``(left, right)`` inclusive around ``i + lengths[b] - s_q``; None on a side = unbounded.
    """
    import torch

    i = torch.arange(s_q, device=lengths.device)[None, :, None]
    j = torch.arange(s_k, device=lengths.device)[None, None, :]
    row = i + (lengths - s_q)[:, None, None]
    mask = j < lengths[:, None, None]
    if causal:
        mask = mask & (j <= row)
    if window is not None:
        left, right = window
        if left is not None:
            mask = mask & (j >= row - left)
        if right is not None:
            mask = mask & (j <= row + right)
    return mask[:, None]


def kvcache_attention(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None, scale=None, causal=False,
                      window=None, softcap=None, return_lse=False, return_cache=False, backend="auto"):
    """flash-attn ``flash_attn_with_kvcache`` semantics without in-place updates.

    Args:
      q: [B, S_q, H, D]. k_cache, v_cache: [B, S_cache, Hk, D] (Hk divides H).
      k, v: optional new rows [B, S_new, Hk, D], inserted at ``cache_seqlens[b]`` into a copy.
      cache_seqlens: int or int tensor [B]: keys already in the cache (None = the whole cache;
        then ``k``/``v`` must be None).
      scale, softcap: as :func:`flashport.torch.attention` (None = 1/sqrt(D) / off).
      causal, window: bottom-right per sequence (flash-attn >= 2.1).
      return_lse: also return the float32 log-sum-exp [B, H, S_q].
      return_cache: also return the updated ``(k_cache, v_cache)`` copies.
      backend: passed to :func:`flashport.torch.attention`.

    Returns:
      ``out`` [B, S_q, H, D]; with ``return_lse`` ``(out, lse)``; with ``return_cache`` the caches are
      appended: ``(out, k_cache, v_cache)`` or ``(out, lse, k_cache, v_cache)``.

    Raises:
      ValueError: ``k`` without ``v`` (or the reverse), new rows without ``cache_seqlens``, or new
        rows that do not fit in the cache.
    """
    import torch

    import flashport.torch

    batch, s_cache = k_cache.shape[0], k_cache.shape[1]
    if (k is None) != (v is None):
        raise ValueError("kvcache_attention: pass both k and v, or neither")
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("kvcache_attention: new k/v rows need cache_seqlens (where to insert them)")
        lengths = torch.full((batch,), s_cache, dtype=torch.long, device=q.device)
    else:
        lengths = _as_lengths(cache_seqlens, batch, q.device)
    if k is not None:
        s_new = k.shape[1]
        if s_new and int(lengths.max()) + s_new > s_cache:
            raise ValueError(f"kvcache_attention: cache_seqlens + S_new = {int(lengths.max()) + s_new} exceeds the cache length {s_cache}")
        rows = (lengths[:, None] + torch.arange(s_new, device=q.device)[None, :]).clamp(max=s_cache - 1)
        index = rows[:, :, None, None]
        k_cache = k_cache.scatter(1, index.expand(-1, -1, *k.shape[2:]), k)
        v_cache = v_cache.scatter(1, index.expand(-1, -1, *v.shape[2:]), v)
        lengths = lengths + s_new
    mask = kvcache_mask(lengths, q.shape[1], s_cache, causal=causal, window=window)
    result = flashport.torch.attention(q, k_cache, v_cache, scale=scale, softcap=softcap, mask=mask,
                                       layout="BSHD", backend=backend, return_lse=return_lse)
    result = result if isinstance(result, tuple) else (result,)
    if return_cache:
        result = result + (k_cache, v_cache)
    return result[0] if len(result) == 1 else result
