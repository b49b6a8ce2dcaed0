"""The FlashAttention-3 ``flash_attn_with_kvcache`` drop-in
(``flashport.integrations.flash_attn3_compat``) against a float64 reference written here from FA3's
docstring and its ``test_flash_attn_kvcache`` (not from flashport).

The reference loops over every (batch, head, query), lists the keys each query may see, adds
``qv . v`` to the score where FA3 does, rotates with complex numbers and writes the new cache rows one
by one into float64 copies. Inputs are float32, references float64 of the same values. The in-place
update is checked on the very tensors the caller passed.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from flashport.integrations import flash_attn3_compat as fa3  # noqa: E402

ATOL = 3e-5


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed + 11 * len(shape)))


def close(got, want, atol=ATOL):
    assert got.shape == want.shape, (got.shape, want.shape)
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=0)


def close_lse(got, want):
    """lse: the same infinities, sign included (FA3 writes -inf for a row that sees no key:
    ``hopper/softmax.h`` ``finalize``, ``epilogue_fwd.hpp`` ``store_zero``), else close."""
    assert got.dtype == torch.float32, got.dtype
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got[torch.isinf(got)].double(), want[torch.isinf(want)])
    close(torch.where(torch.isinf(got), 0, got), torch.where(torch.isinf(want), 0, want))


def rotate(x, cos, sin, positions, interleaved):
    """Rotate the first ``2 * cos.shape[1]`` dims of x [B, S, H, D] at ``positions[b][s]`` (complex)."""
    x = x.double().clone()
    half = cos.shape[1]
    for b, row in enumerate(positions):
        for s, p in enumerate(row):
            turn = torch.complex(cos[p].double(), sin[p].double())
            for h in range(x.shape[2]):
                if interleaved:
                    z = torch.complex(x[b, s, h, 0 : 2 * half : 2], x[b, s, h, 1 : 2 * half : 2]) * turn
                    x[b, s, h, 0 : 2 * half : 2], x[b, s, h, 1 : 2 * half : 2] = z.real, z.imag
                else:
                    z = torch.complex(x[b, s, h, :half], x[b, s, h, half : 2 * half]) * turn
                    x[b, s, h, :half], x[b, s, h, half : 2 * half] = z.real, z.imag
    return x


def reference(q, k_cache, v_cache, k=None, v=None, *, lengths, **kw):
    """FA3 ``flash_attn_with_kvcache`` by hand over a dense [B_cache, S, Hk, D] cache.

    ``kw``: qv, causal, window, rotary=(cos, sin, interleaved), rotary_starts, batch_idx, leftpad,
    scale, softcap. Returns ``(out [B, Sq, H, Dv], lse [B, H, Sq], k_cache', v_cache')`` float64.
    """
    kc, vc = k_cache.double().clone(), v_cache.double().clone()
    batch, sq = q.shape[:2]
    q = q.double()
    rows = list(range(batch)) if kw.get("batch_idx") is None else [int(i) for i in kw["batch_idx"]]
    s_new = 0 if k is None else k.shape[1]
    causal, window = kw.get("causal", False), kw.get("window", (-1, -1))
    if kw.get("rotary") is not None:
        cos, sin, interleaved = kw["rotary"]
        starts = kw.get("rotary_starts") or lengths
        # flash_api.cpp mha_fwd normalises the window first (an edge past every key: unbounded, then
        # causal sets right = 0); the kernel rotates the queries per row only if it is then causal or
        # local, else all at the start position (rotary.h FixedPosition).
        left = -1 if window[0] >= kc.shape[1] - 1 else window[0]
        right = -1 if window[1] >= sq - 1 else window[1]
        local = causal or left >= 0 or right >= 0
        k = rotate(k, cos, sin, [[n + t for t in range(s_new)] for n in starts], interleaved)
        q = rotate(q, cos, sin, [[n + (i if local else 0) for i in range(sq)] for n in starts], interleaved)
    for b, n in enumerate(lengths):
        for t in range(s_new):
            kc[rows[b], n + t], vc[rows[b], n + t] = k[b, t].double(), v[b, t].double()
    out, lse = _attend(q, kc[rows], vc[rows], [n + s_new for n in lengths], kw)
    return out, lse, kc, vc


def _attend(q, keys, values, ends, kw):
    qv = None if kw.get("qv") is None else kw["qv"].double()
    batch, sq, heads, d = q.shape
    hk, dv = keys.shape[2], values.shape[-1]
    scale = kw.get("scale") or (d + (0 if qv is None else dv)) ** -0.5
    left, right = kw.get("window", (-1, -1))
    right = 0 if kw.get("causal") else right
    start = [0] * batch if kw.get("leftpad") is None else [int(x) for x in kw["leftpad"]]
    out = torch.zeros(batch, sq, heads, dv, dtype=torch.float64)
    lse = torch.full((batch, heads, sq), -math.inf, dtype=torch.float64)  # FA3: -inf for no key
    for b in range(batch):
        for h in range(heads):
            kh = h // (heads // hk)
            for i in range(sq):
                centre = i + ends[b] - sq
                seen = [
                    j
                    for j in range(start[b], ends[b])
                    if (left < 0 or j >= centre - left) and (right < 0 or j <= centre + right)
                ]
                if not seen:
                    continue
                s = torch.stack([q[b, i, h] @ keys[b, j, kh] for j in seen])
                if qv is not None:
                    s = s + torch.stack([qv[b, i, h] @ values[b, j, kh] for j in seen])
                s = scale * s
                if kw.get("softcap"):
                    s = kw["softcap"] * torch.tanh(s / kw["softcap"])
                lse[b, h, i] = torch.logsumexp(s, 0)
                out[b, i, h] = torch.softmax(s, 0) @ values[b, seen, kh]
    return out, lse


def rotary_tables(length, rotary_dim):
    angles = torch.arange(length)[:, None] * (0.7 ** torch.arange(rotary_dim // 2))[None]
    return angles.cos(), angles.sin()


@pytest.mark.parametrize(
    "causal, window, interleaved",
    [(True, (-1, -1), True), (False, (-1, -1), False), (False, (2, 1), True)],
)
def test_in_place_update_rotary_gqa_and_lse(causal, window, interleaved):
    q, k, v = rand(2, 2, 4, 16), rand(2, 2, 2, 16, seed=1), rand(2, 2, 2, 16, seed=2)
    k_cache, v_cache = rand(2, 9, 2, 16, seed=3), rand(2, 9, 2, 16, seed=4)
    cos, sin = rotary_tables(12, 8)
    lengths, starts = torch.tensor([3, 5], dtype=torch.int32), torch.tensor([6, 1], dtype=torch.int32)
    want, want_lse, want_k, want_v = reference(
        q, k_cache, v_cache, k, v, lengths=[3, 5], causal=causal, window=window,
        rotary=(cos, sin, interleaved), rotary_starts=[6, 1],
    )  # fmt: skip
    out, lse, *rest = fa3.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lengths,
        rotary_seqlens=starts, causal=causal, window_size=window, rotary_interleaved=interleaved,
        num_splits=3, pack_gqa=True, return_softmax_lse=True,
    )  # fmt: skip
    close(k_cache, want_k)  # the caller's caches now hold the rotated new keys, in place
    close(v_cache, want_v)
    close(out, want)
    close_lse(lse, want_lse)
    assert [r.numel() for r in rest] == [0, 0]  # FA3's split-KV accumulators: empty without splits


def test_batch_idx_leftpad_softcap_scale_and_reads():
    q, k, v = rand(2, 1, 2, 8), rand(2, 1, 2, 8, seed=1), rand(2, 1, 2, 8, seed=2)
    k_cache, v_cache = rand(3, 6, 2, 8, seed=3), rand(3, 6, 2, 8, seed=4)
    idx, leftpad = torch.tensor([2, 0], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32)
    want, _, want_k, want_v = reference(
        q, k_cache, v_cache, k, v, lengths=[4, 4], causal=True, batch_idx=idx, leftpad=leftpad,
        softcap=0.8, scale=0.5,
    )  # fmt: skip
    out = fa3.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=4, cache_batch_idx=idx, cache_leftpad=leftpad,
        causal=True, softcap=0.8, softmax_scale=0.5,
    )  # fmt: skip
    close(out, want)
    close(k_cache, want_k)
    close(v_cache, want_v)
    before = k_cache.clone()
    read = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([2, 6]))
    assert torch.equal(k_cache, before)  # no new rows: nothing is written
    close(read, reference(q, k_cache, v_cache, lengths=[2, 6])[0])


def paged(logical, table, page):
    """The [num_pages, page, Hk, D] cache holding ``logical`` [B, S, Hk, D] through ``table``."""
    pages = torch.zeros(int(table.max()) + 2, page, *logical.shape[2:])
    for b in range(table.shape[0]):
        for r in range(logical.shape[1]):
            pages[table[b, r // page], r % page] = logical[b, r]
    return pages


def test_paged_cache_matches_the_dense_cache():
    page, batch = 3, 2
    q, k, v = rand(batch, 2, 2, 8), rand(batch, 2, 1, 8, seed=1), rand(batch, 2, 1, 8, seed=2)
    logical_k, logical_v = rand(3, 9, 1, 8, seed=3), rand(3, 9, 1, 8, seed=4)
    table = torch.tensor([[4, 0, 2], [1, 5, 3], [6, 7, 8]], dtype=torch.int32)
    idx = torch.tensor([2, 0], dtype=torch.int32)  # with a page table, picks page-table rows
    k_pages, v_pages = paged(logical_k, table, page), paged(logical_v, table, page)
    lengths = torch.tensor([3, 6], dtype=torch.int32)
    want, want_lse, want_k, _ = reference(
        q, logical_k, logical_v, k, v, lengths=[3, 6], causal=True, batch_idx=idx
    )
    options = dict(cache_seqlens=lengths, cache_batch_idx=idx, causal=True, return_softmax_lse=True)
    out, lse, *_ = fa3.flash_attn_with_kvcache(q, k_pages, v_pages, k, v, page_table=table, **options)
    dense_k, dense_v = logical_k.clone(), logical_v.clone()
    dense, dense_lse, *_ = fa3.flash_attn_with_kvcache(q, dense_k, dense_v, k, v, **options)
    close(out, want)
    close_lse(lse, want_lse)
    torch.testing.assert_close(out, dense, atol=1e-6, rtol=0)  # paged and dense agree
    torch.testing.assert_close(lse, dense_lse, atol=1e-6, rtol=0)
    for row in range(3):  # the new rows landed in the right pages of the right page-table row
        for r in range(9):
            close(k_pages[table[row, r // page], r % page], want_k[row, r])
        close(dense_k[row], want_k[row])


def test_varlen_decode():
    cu_q = torch.tensor([0, 1, 4], dtype=torch.int32)  # query counts 1 and 3
    cu_new = torch.tensor([0, 2, 3], dtype=torch.int32)  # new-row counts 2 and 1
    q, k, v = rand(4, 4, 8), rand(3, 2, 8, seed=1), rand(3, 2, 8, seed=2)
    k_cache, v_cache = rand(2, 7, 2, 8, seed=3), rand(2, 7, 2, 8, seed=4)
    cos, sin = rotary_tables(10, 4)
    want_k, want_v = k_cache.double().clone(), v_cache.double().clone()
    outs, lses = [], []
    for b, n in enumerate([2, 3]):  # each sequence on its own, as a batch of one
        qs, ks, vs = (x[int(c[b]) : int(c[b + 1])][None] for x, c in ((q, cu_q), (k, cu_new), (v, cu_new)))
        out, lse, kc, vc = reference(
            qs,
            want_k[b : b + 1],
            want_v[b : b + 1],
            ks,
            vs,
            lengths=[n],
            causal=True,
            rotary=(cos, sin, False),
        )
        want_k[b], want_v[b] = kc[0], vc[0]
        outs.append(out[0])
        lses.append(lse[0])
    out, lse, *_ = fa3.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=torch.tensor([2, 3]),
        cu_seqlens_q=cu_q, cu_seqlens_k_new=cu_new, max_seqlen_q=3, causal=True,
        rotary_interleaved=False, return_softmax_lse=True,
    )  # fmt: skip
    close(out, torch.cat(outs))
    close_lse(lse, torch.cat(lses, dim=1))  # FA3's varlen lse is [H, total_q]
    close(k_cache, want_k)
    close(v_cache, want_v)
    # no new rows: FA3's mha_fwd reads cu_seqlens_k_new only with k_new, so it is ignored
    before = k_cache.clone()
    out = fa3.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=torch.tensor([4, 5]), cu_seqlens_q=cu_q, cu_seqlens_k_new=cu_new,
        max_seqlen_q=3, causal=True,
    )  # fmt: skip
    assert torch.equal(k_cache, before)
    for b, n in enumerate([4, 5]):
        qs = q[int(cu_q[b]) : int(cu_q[b + 1])][None]
        close(
            out[int(cu_q[b]) : int(cu_q[b + 1])],
            reference(qs, k_cache[b : b + 1], v_cache[b : b + 1], lengths=[n], causal=True)[0][0],
        )


def test_qv_adds_its_scores_with_the_combined_default_scale():
    q, qv = rand(2, 2, 4, 8), rand(2, 2, 4, 6, seed=5)  # MLA: qk head dim 8, value head dim 6
    k_cache, v_cache = rand(2, 5, 1, 8, seed=3), rand(2, 5, 1, 6, seed=4)
    k, v = rand(2, 1, 1, 8, seed=1), rand(2, 1, 1, 6, seed=2)
    lengths = torch.tensor([1, 4], dtype=torch.int32)
    want, want_lse, want_k, want_v = reference(q, k_cache, v_cache, k, v, lengths=[1, 4], qv=qv, causal=True)
    out, lse, *_ = fa3.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, qv=qv, cache_seqlens=lengths, causal=True, return_softmax_lse=True
    )
    close(out, want)
    close_lse(lse, want_lse)
    close(k_cache, want_k)
    close(v_cache, want_v)


# FA3's signature, parameter by parameter (hopper/flash_attn_interface.py flash_attn_with_kvcache).
FA3_SIGNATURE = [
    ("q", None), ("k_cache", None), ("v_cache", None), ("k", None), ("v", None), ("qv", None),
    ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None),
    ("cache_leftpad", None), ("page_table", None), ("cu_seqlens_q", None), ("cu_seqlens_k_new", None),
    ("max_seqlen_q", None), ("rotary_seqlens", None), ("q_descale", None), ("k_descale", None),
    ("v_descale", None), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
    ("attention_chunk", 0), ("softcap", 0.0), ("rotary_interleaved", True),
    ("scheduler_metadata", None), ("num_splits", 0), ("pack_gqa", None), ("sm_margin", 0),
    ("return_softmax_lse", False),
]  # fmt: skip


def test_positional_call_binds_like_fa3():
    """Same names, order and defaults as FA3; a positional call puts qv 6th and rotary_cos 7th."""
    import inspect

    params = inspect.signature(fa3.flash_attn_with_kvcache).parameters.values()
    got = [(p.name, None if p.default is inspect.Parameter.empty else p.default) for p in params]
    assert got == FA3_SIGNATURE
    q, qv = rand(1, 2, 2, 16), rand(1, 2, 2, 16, seed=5)
    k, v = rand(1, 2, 2, 16, seed=1), rand(1, 2, 2, 16, seed=2)
    k_cache, v_cache = rand(1, 6, 2, 16, seed=3), rand(1, 6, 2, 16, seed=4)
    cos, sin = rotary_tables(8, 16)
    want, _, want_k, _ = reference(q, k_cache, v_cache, k, v, lengths=[3], qv=qv, rotary=(cos, sin, True))
    out = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, qv, cos, sin, torch.tensor([3]))
    close(out, want)
    close(k_cache, want_k)


def test_lse_of_a_row_that_sees_no_key_is_minus_inf_and_plus_inf_without_any_key():
    """FA3 writes -inf (softmax.h finalize / store_zero) with out 0; only with no key row at all
    (an empty cache and no new rows) does mha_fwd skip the kernel and fill lse with +inf."""
    q = rand(2, 3, 2, 8)
    k_cache, v_cache = rand(2, 5, 1, 8, seed=3), rand(2, 5, 1, 8, seed=4)
    leftpad = torch.tensor([0, 2], dtype=torch.int32)  # sequence 1: no valid key at all
    want, want_lse, _, _ = reference(q, k_cache, v_cache, lengths=[1, 2], causal=True, leftpad=leftpad)
    assert bool((want_lse[0, :, :2] == -math.inf).all()) and bool((want_lse[1] == -math.inf).all())
    out, lse, *_ = fa3.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=torch.tensor([1, 2]), cache_leftpad=leftpad, causal=True,
        return_softmax_lse=True,
    )  # fmt: skip
    close(out, want)
    close_lse(lse, want_lse)
    out, lse, *_ = fa3.flash_attn_with_kvcache(q, k_cache[:, :0], v_cache[:, :0], return_softmax_lse=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert lse.shape == (2, 2, 3) and bool((lse == math.inf).all())


@pytest.mark.parametrize(
    "causal, window, per_row",
    [
        (False, (8, 2), False),  # left >= S_cache - 1 and right >= S_q - 1: no window for FA3
        (False, (-1, 5), False),
        (False, (7, 2), True),  # the left edge can cut: local
        (False, (8, 1), True),  # the right edge can cut: local
        (True, (8, 2), True),  # causal
    ],
)
def test_rotary_query_positions_follow_fa3s_normalised_window(causal, window, per_row):
    """Queries rotate at start + i only when FA3 runs causal or local after normalising the window."""
    q, k, v = rand(2, 3, 2, 16), rand(2, 3, 1, 16, seed=1), rand(2, 3, 1, 16, seed=2)
    k_cache, v_cache = rand(2, 9, 1, 16, seed=3), rand(2, 9, 1, 16, seed=4)
    cos, sin = rotary_tables(9, 8)
    want, want_lse, want_k, _ = reference(
        q, k_cache, v_cache, k, v, lengths=[2, 4], causal=causal, window=window, rotary=(cos, sin, False)
    )
    out, lse, *_ = fa3.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=torch.tensor([2, 4]),
        causal=causal, window_size=window, rotary_interleaved=False, return_softmax_lse=True,
    )  # fmt: skip
    close(out, want)
    close_lse(lse, want_lse)
    close(k_cache, want_k)
    starts = [[n + (i if per_row else 0) for i in range(3)] for n in (2, 4)]
    other = [[n + (0 if per_row else i) for i in range(3)] for n in (2, 4)]
    qr = rotate(q, cos, sin, starts, False)
    assert not torch.allclose(qr, rotate(q, cos, sin, other, False))  # the choice matters here


def test_leftpad_window_and_rotary_offsets_follow_fa3s_test_reference():
    """FA3's own reference (test_util.attention_ref / construct_local_mask): with cache_leftpad the
    key columns count from leftpad, ``sk`` is the number of valid keys, causal/window are
    bottom-right on (sk, sq); the new rows land at cache_seqlens and rotate from cache_seqlens."""
    q, k, v = rand(2, 2, 2, 16), rand(2, 2, 2, 16, seed=1), rand(2, 2, 2, 16, seed=2)
    k_cache, v_cache = rand(2, 10, 2, 16, seed=3), rand(2, 10, 2, 16, seed=4)
    lengths, leftpad = [5, 3], [2, 1]
    cos, sin = rotary_tables(12, 16)
    out = fa3.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=torch.tensor(lengths),
        cache_leftpad=torch.tensor(leftpad, dtype=torch.int32), causal=True, window_size=(2, 5),
    )  # fmt: skip
    qr = rotate(q, cos, sin, [[n + i for i in range(2)] for n in lengths], True)
    kr = rotate(k, cos, sin, [[n + t for t in range(2)] for n in lengths], True)
    want = torch.zeros(2, 2, 2, 16, dtype=torch.float64)
    for b in range(2):
        keys, values = k_cache[b].double().clone(), v_cache[b].double().clone()
        keys[lengths[b] : lengths[b] + 2], values[lengths[b] : lengths[b] + 2] = kr[b], v[b].double()
        close(k_cache[b, lengths[b] : lengths[b] + 2], kr[b])  # written in place at cache_seqlens
        sk = lengths[b] + 2 - leftpad[b]  # valid keys
        for i in range(2):
            centre = i + sk - 2  # causal: right = 0; window left 2, relative to leftpad
            cols = [c for c in range(sk) if centre - 2 <= c <= centre]
            s = torch.stack([qr[b, i, h] @ keys[leftpad[b] + c, h] for h in range(2) for c in cols])
            s = (s / 4.0).reshape(2, len(cols))
            p = torch.softmax(s, -1)
            for h in range(2):
                want[b, i, h] = p[h] @ values[[leftpad[b] + c for c in cols], h]
    close(out, want)


def test_qv_softcap_gqa_and_window():
    """MLA ``qv`` with softcap: FA3 caps ``scale * (q.k + qv.v)`` (attention_ref: qv is added before
    the tanh), GQA heads grouped contiguously, window bottom-right."""
    q, qv = rand(1, 3, 4, 8), rand(1, 3, 4, 16, seed=5)
    k_cache, v_cache = rand(1, 7, 2, 8, seed=3), rand(1, 7, 2, 16, seed=4)
    want, want_lse, _, _ = reference(q, k_cache, v_cache, lengths=[6], qv=qv, softcap=0.5, window=(2, 0))
    out, lse, *_ = fa3.flash_attn_with_kvcache(
        q, k_cache, v_cache, qv=qv, cache_seqlens=6, softcap=0.5, window_size=(2, 0), return_softmax_lse=True
    )
    close(out, want)
    close_lse(lse, want_lse)


def test_rejects_what_fa3_rejects_or_flashport_cannot_do():
    q, cache = rand(1, 1, 2, 8), rand(1, 4, 2, 8)
    with pytest.raises(NotImplementedError, match="k_descale"):
        fa3.flash_attn_with_kvcache(q, cache, cache, k_descale=torch.ones(1))
    with pytest.raises(NotImplementedError, match="attention_chunk"):
        fa3.flash_attn_with_kvcache(q, cache, cache, attention_chunk=64)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        fa3.flash_attn_with_kvcache(q[0], cache, cache, cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="both k and v"):
        fa3.flash_attn_with_kvcache(q, cache, cache, k=cache[:, :1], cache_seqlens=1)
    with pytest.raises(ValueError, match="exceeds"):
        fa3.flash_attn_with_kvcache(q, cache, cache, cache[:, :2], cache[:, :2], cache_seqlens=3)
    with pytest.raises(ValueError, match="cache_seqlens"):
        fa3.flash_attn_with_kvcache(q, cache, cache, cache[:, :1], cache[:, :1])


# ----------------------------------------------------------------------------------- through the codemod

PORTED = """
import functools

import torch
from flash_attn_interface import flash_attn_with_kvcache as _flash_attn_with_kvcache
from flash_attn_3.flash_attn_interface import flash_attn_with_kvcache as flash_attn3_with_kvcache


@functools.wraps(_flash_attn_with_kvcache)
def flash_attn_with_kvcache(*args, **kwargs):
    output = _flash_attn_with_kvcache(*args, **kwargs)
    return output


KERNELS = {"fa3": _flash_attn_with_kvcache}


class Decoder:
    def __init__(self, pages, page, heads_k, dim):
        self.k_pages = torch.zeros(pages, page, heads_k, dim)
        self.v_pages = torch.zeros(pages, page, heads_k, dim)

    def step(self, q, k, v, lengths, table):
        flash_attn_args = {
            "q": q,
            "k_cache": self.k_pages,
            "v_cache": self.v_pages,
            "k": k,
            "v": v,
            "cache_seqlens": lengths,
            "causal": True,
            "page_table": table,
            "num_splits": 0,
        }
        return flash_attn3_with_kvcache(**flash_attn_args)

    def explicit(self, q, k, v, lengths, table):
        return _flash_attn_with_kvcache(
            q, self.k_pages, self.v_pages, k, v, cache_seqlens=lengths, page_table=table, causal=True
        )
"""


def test_ported_wrappers_and_paged_decoder_fill_the_cache_in_place():
    """megatron-style ``f(**flash_attn_args)`` with a page table, an lmdeploy-style ``@functools.wraps``
    splat wrapper, a dispatch-table value and an explicit paged call: all ported to the FA3 drop-in;
    step after step the caller's pages fill in place and each output matches the reference."""
    from ported_code import port_and_run

    namespace, code = port_and_run(PORTED, "call")
    assert "flash_attn_interface" not in code and "flash_attn_3" not in code, code
    assert code.count("flash_attn3_compat.flash_attn_with_kvcache") == 5  # wraps, splat, table, dict, call
    page, table = 2, torch.tensor([[3, 0, 5], [1, 4, 2]], dtype=torch.int32)
    decoder = namespace["Decoder"](6, page, 1, 8)
    want_k, want_v = (
        torch.zeros(2, 6, 1, 8, dtype=torch.float64),
        torch.zeros(2, 6, 1, 8, dtype=torch.float64),
    )
    calls = [
        decoder.step,
        decoder.explicit,
        lambda q, k, v, n, t: namespace["flash_attn_with_kvcache"](
            q, decoder.k_pages, decoder.v_pages, k, v, cache_seqlens=n, page_table=t, causal=True
        ),
        lambda q, k, v, n, t: namespace["KERNELS"]["fa3"](
            q, decoder.k_pages, decoder.v_pages, k, v, cache_seqlens=n, page_table=t, causal=True
        ),
    ]
    for step, call in enumerate(calls):
        q, k, v = (
            rand(2, 1, 2, 8, seed=step),
            rand(2, 1, 1, 8, seed=10 + step),
            rand(2, 1, 1, 8, seed=20 + step),
        )
        lengths = torch.tensor([step, step + 1], dtype=torch.int32)
        out = call(q, k, v, lengths, table)
        want, _, want_k, want_v = reference(q, want_k, want_v, k, v, lengths=lengths.tolist(), causal=True)
        close(out, want)
        for b in range(2):
            for r in range(6):
                close(decoder.k_pages[table[b, r // page], r % page], want_k[b, r])
                close(decoder.v_pages[table[b, r // page], r % page], want_v[b, r])
