"""FlashAttention-3 ``flash_attn_with_kvcache`` with its full behaviour, on :func:`flashport.torch.attention`.

FA3 (``hopper/flash_attn_interface.py`` and its ``test_flash_attn_kvcache``) keeps FA2's cache
semantics (:mod:`.kvcache`: rows written **in place** at
``cache_seqlens``, ``cache_batch_idx``, ``cache_leftpad``, per-sequence bottom-right causal/window,
fused rotary) and adds:

* ``page_table`` (FA2's ``block_table``); with ``cache_batch_idx`` too, sequence ``b`` uses the
  page-table row ``cache_batch_idx[b]``;
* varlen decode: ``q`` [total_q, H, D] split by ``cu_seqlens_q`` (``max_seqlen_q`` is required), new
  rows ``k``/``v`` [total_new, Hk, D] split by ``cu_seqlens_k_new``; causal/window are bottom-right
  on each sequence's own query count; ``out`` is [total_q, H, Dv] and lse [H, total_q];
* ``rotary_seqlens`` [B]: the rotary position of the first new row (default ``cache_seqlens``): new
  key ``t`` is rotated at ``rotary_seqlens[b] + t`` and query ``i`` at ``rotary_seqlens[b] + i``
  (causal or local) or ``rotary_seqlens[b]``, whatever row the key is written to. "Local" is decided
  on the window as ``flash_api.cpp`` normalises it (:func:`rotates_per_row`): a window that covers
  every key counts as none, so its queries all sit at ``rotary_seqlens[b]``;
* lse is FA3's (``softmax.h`` ``finalize``, ``epilogue_fwd.hpp`` ``store_zero``): natural log,
  float32, **-inf** for a row that sees no key (FA2 writes +inf there), and +inf on every row only
  when there is no key row at all (an empty cache and no new rows: ``mha_fwd``'s early exit);
* ``qv`` [.., H, Dv] (MLA): scores ``q·k + qv·v`` with the default scale ``(D + Dv) ** -0.5``,
  computed exactly as attention of ``[q, qv]`` over ``[k, v]`` (concatenated on the last axis).
"""

from __future__ import annotations

from flashport.integrations.flash_attn.core import cache_lengths
from flashport.integrations.flash_attn.kvcache import CacheRows, apply_rotary, check_kvcache_arguments
from flashport.kernels.semantics.visibility import band_visible

NAME = "flash_attn_with_kvcache"


def pad_varlen(x, cu_seqlens):
    """``x`` [total, ...] split by ``cu_seqlens`` [B + 1] -> (``[B, L, ...]`` zero-padded, lengths [B],
    valid [B, L]), with ``L`` the longest sequence."""
    import torch

    cu = cu_seqlens.to(device=x.device, dtype=torch.long)
    lengths = cu[1:] - cu[:-1]
    longest = int(lengths.max()) if lengths.numel() else 0
    valid = torch.arange(longest, device=x.device)[None, :] < lengths[:, None]
    out = x.new_zeros(lengths.numel(), longest, *x.shape[1:])
    out[valid] = x[int(cu[0]) : int(cu[-1])]
    return out, lengths, valid


def unpad_varlen(x, valid, cu_seqlens, total):
    """The rows ``valid`` of ``x`` [B, L, ...] back in the packed [total, ...] layout."""
    out = x.new_zeros(total, *x.shape[2:])
    out[int(cu_seqlens[0]) : int(cu_seqlens[-1])] = x[valid]
    return out


def rotates_per_row(causal, window_size, seqlen_q, seqlen_k):
    """Whether FA3 rotates query ``i`` at ``start + i`` (True) or every query at ``start`` (False).

    FA3's kernel picks the fixed position unless it runs causal or local, and it decides that after
    ``flash_api.cpp`` normalises the window: a left edge ``>= seqlen_k - 1`` and a right edge
    ``>= seqlen_q - 1`` (``seqlen_q``: ``max_seqlen_q`` for varlen, ``seqlen_k``: the cache length)
    become unbounded, then ``causal`` sets the right edge to 0. The mask is the same either way; only
    the rotary position of the queries depends on it.
    """
    left, right = (int(w) for w in window_size)
    left = -1 if left >= seqlen_k - 1 else left
    right = -1 if right >= seqlen_q - 1 else right
    right = 0 if causal else right
    return left >= 0 or right >= 0


def _positions(start, count, steps, local):
    """Rotary positions [B, steps]: ``start[b] + t`` (or ``start[b]`` when not ``local``) for the
    ``t < count[b]`` valid rows, 0 for padding (so padding never indexes past ``rotary_cos``)."""
    import torch

    t = torch.arange(steps, device=start.device)[None, :]
    positions = start[:, None] + (t if local else 0 * t)
    return torch.where(t < count[:, None], positions, 0)


def append(cache, caches, new, counts, lengths):
    """Write the valid rows of ``new`` = (k, v) [B, S_new, Hk, D] (the first ``counts[b]`` of each
    sequence) into ``caches`` = (k_cache, v_cache) at rows ``lengths[b] ..``, in place.

    Returns the cache lengths after the append. Raises ValueError when the rows do not fit.
    """
    import torch

    s_new = new[0].shape[1]
    ends = lengths + counts
    if ends.numel() and int(ends.max()) > cache.length:
        raise ValueError(
            f"{NAME}: cache_seqlens + the new rows = {int(ends.max())} exceeds the cache length {cache.length}"
        )
    t = torch.arange(s_new, device=lengths.device)[None, :]
    valid = t < counts[:, None]
    first, second = cache.index((lengths[:, None] + t).clamp(max=max(cache.length - 1, 0)))
    for target, rows in zip(caches, new, strict=True):
        target.index_put_((first[valid], second[valid]), rows[valid].to(target.dtype))
    return ends


def visible(length, lengths, q_lengths, s_q, causal, window, leftpad):
    """Boolean [B, 1, s_q, length]: key ``j`` of sequence ``b`` is valid when ``leftpad[b] <= j <
    lengths[b]``; causal/window bottom-right on the sequence's own query count ``q_lengths[b]``."""
    import torch

    i = torch.arange(s_q, device=lengths.device)[None, :, None]
    j = torch.arange(length, device=lengths.device)[None, None, :]
    diag = i + (lengths - q_lengths)[:, None, None]
    left, right = window if window is not None else (None, None)
    keep = band_visible(diag, j, causal=causal, left=left, right=right, visible=j < lengths[:, None, None])
    if leftpad is not None:
        keep = keep & (j >= leftpad.to(device=lengths.device, dtype=torch.long)[:, None, None])
    return keep[:, None]


def check(k, v, rotary, cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, cache_seqlens):
    """Raise ValueError for the combinations FA3 rejects or leaves undefined. ``cu_seqlens_k_new``
    without new rows is ignored, as ``mha_fwd`` reads it only inside its ``k_new`` branch."""
    check_kvcache_arguments(k, v, *rotary, None)
    if cu_seqlens_q is not None and max_seqlen_q is None:
        raise ValueError(f"{NAME}: cu_seqlens_q needs max_seqlen_q (as FlashAttention-3 requires)")
    if k is not None and cache_seqlens is None:
        raise ValueError(f"{NAME}: new k/v rows need cache_seqlens (where to write them)")


def cache_view(k_cache, q, cu_seqlens_q, cache_seqlens, cache_batch_idx, page_table):
    """(:class:`.kvcache.CacheRows` over the caches, rows already cached per sequence [B]); with both a page
    table and ``cache_batch_idx``, sequence ``b`` uses page-table row ``cache_batch_idx[b]`` (FA3)."""
    batch = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
    if page_table is not None and cache_batch_idx is not None:
        page_table, cache_batch_idx = page_table[cache_batch_idx.long()], None
    cache = CacheRows(k_cache, batch, cache_batch_idx, page_table)
    return cache, cache_lengths(cache_seqlens, batch, cache.length, q.device)


def no_key_rows(k_cache, k):
    """True when FA3 sees no key row at all: an empty cache (``k_cache.shape[1] == 0``: rows, or the
    page size) and no new rows. ``mha_fwd`` then skips the kernel and returns out 0, lse +inf."""
    return k_cache.shape[1] == 0 and (k is None or k.shape[:-2].numel() == 0)


def returned(out, lse):
    """FA3's ``return_softmax_lse=True`` result ``(out, softmax_lse, *rest)``: ``rest`` is its two
    split-KV accumulators, empty tensors when it does not split (flashport never does)."""
    import torch

    empty = torch.tensor([], device=out.device)
    return out, lse, empty, empty


def queries(q, qv, cu_seqlens_q, max_seqlen_q):
    """(q [B, L, H, D], qv or None, query counts [B], valid [B, L] or None) from FA3's dense or
    varlen (``cu_seqlens_q``) layout."""
    import torch

    if cu_seqlens_q is None:
        counts = torch.full((q.shape[0],), q.shape[1], dtype=torch.long, device=q.device)
        return q, qv, counts, None
    q, counts, valid = pad_varlen(q, cu_seqlens_q)
    if int(counts.max()) > int(max_seqlen_q):
        raise ValueError(f"{NAME}: max_seqlen_q={max_seqlen_q} is below the longest query sequence")
    return q, None if qv is None else pad_varlen(qv, cu_seqlens_q)[0], counts, valid


def new_rows(k, v, cu_seqlens_k_new, lengths):
    """(k, v [B, S_new, Hk, D], new-row counts [B]) from FA3's dense or varlen layout."""
    import torch

    if cu_seqlens_k_new is None:
        return k, v, torch.full_like(lengths, k.shape[1])
    k, counts, _ = pad_varlen(k, cu_seqlens_k_new)
    return k, pad_varlen(v, cu_seqlens_k_new)[0], counts


def run(q, caches, new, qv, *, cache, lengths, rotary, varlen, rotary_seqlens, leftpad, options):
    """FA3's ``flash_attn_with_kvcache`` once its arguments are checked (:mod:`.fa3`).

    Args:
      q: FA3's query (dense or varlen). caches: (k_cache, v_cache), updated in place. new: (k, v) or
        (None, None). qv: optional MLA query. cache: the :class:`.kvcache.CacheRows` view of the caches.
      lengths: rows already in each sequence's cache [B]. rotary: (cos, sin, interleaved) or None.
      varlen: (cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q). rotary_seqlens: optional [B].
      leftpad: optional [B]. options: scale, causal, window, softcap, return_lse, and
      rotate_per_row (:func:`rotates_per_row`).

    Returns:
      ``(out, lse)`` in FA3's layouts (lse None unless asked for; -inf for a row that sees no key).
    """
    import torch

    import flashport.torch

    cu_q, cu_k_new, max_q = varlen
    total_q = q.shape[0]
    q, qv, q_counts, q_valid = queries(q, qv, cu_q, max_q)
    local = options["rotate_per_row"]
    if new[0] is not None:
        k, v, counts = new_rows(*new, cu_k_new, lengths)
        if rotary is not None:
            cos, sin, interleaved = rotary
            start = lengths if rotary_seqlens is None else rotary_seqlens.to(lengths.device, torch.long)
            k = apply_rotary(k, cos, sin, _positions(start, counts, k.shape[1], True), interleaved)
            q = apply_rotary(q, cos, sin, _positions(start, q_counts, q.shape[1], local), interleaved)
        lengths = append(cache, caches, (k, v), counts, lengths)
    keys, values = cache.read(caches[0], q.shape[0]), cache.read(caches[1], q.shape[0])
    if qv is not None:  # q.k + qv.v, scaled by (D + Dv) ** -0.5 by default: one dot over [q, qv]
        q, keys = torch.cat([q, qv.to(q.dtype)], dim=-1), torch.cat([keys, values], dim=-1)
    mask = visible(cache.length, lengths, q_counts, q.shape[1], options["causal"], options["window"], leftpad)
    result = flashport.torch.attention(
        q,
        keys,
        values,
        scale=options["scale"],
        softcap=options["softcap"],
        mask=mask,
        layout="BSHD",
        return_lse=options["return_lse"],
    )
    out, lse = result if options["return_lse"] else (result, None)
    if q_valid is not None:
        out = unpad_varlen(out, q_valid, cu_q, total_q)
        lse = None if lse is None else unpad_varlen(lse.transpose(1, 2), q_valid, cu_q, total_q).T
    return out, lse
