"""The flash-attn drop-in (``flashport.integrations.flash_attn_compat``) against float64 references
written here from flash-attn 2.8.3's documentation and kernel (not from flashport).

The references loop over every (batch, head, query) and list the keys each query may see; rotary
embeddings are applied as complex rotations; the KV cache update is an explicit row-by-row copy.
Inputs are float32 (what the drop-in runs on the CPU), references float64 of the same values.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from flashport.integrations import flash_attn_compat as fa  # noqa: E402

ATOL = 2e-5


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed + 7 * len(shape)))


def reference(q, k, v, *, allowed, scale=None, softcap=0.0, bias=None):
    """float64 attention over [B, Sq, H, D] / [B, Sk, Hk, D] (contiguous GQA).

    ``allowed(b, i, j)`` says whether query ``i`` of batch ``b`` sees key ``j``; ``bias(b, h, i, j)``
    is added to the (soft-capped) score. Returns ``(out [B, Sq, H, D], lse [B, H, Sq])`` with
    out = 0 and lse = +inf for a row that sees no key (flash-attn's convention).
    """
    q, k, v = (x.double() for x in (q, k, v))
    b_, sq, h_, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = d**-0.5 if scale is None else scale
    out = torch.zeros(b_, sq, h_, v.shape[-1], dtype=torch.float64)
    lse = torch.full((b_, h_, sq), math.inf, dtype=torch.float64)
    for b in range(b_):
        for h in range(h_):
            kh = h // (h_ // hk)
            for i in range(sq):
                keys = [j for j in range(sk) if allowed(b, i, j)]
                if not keys:
                    continue
                s = torch.stack([scale * q[b, i, h] @ k[b, j, kh] for j in keys])
                if softcap:
                    s = softcap * torch.tanh(s / softcap)
                if bias is not None:
                    s = s + torch.tensor([bias(b, h, i, j) for j in keys], dtype=torch.float64)
                lse[b, h, i] = torch.logsumexp(s, 0)
                out[b, i, h] = torch.softmax(s, 0) @ v[b, keys, kh]
    return out, lse


def band(sq, sk, causal=False, window=(-1, -1), top_left=False):
    """flash-attn's visibility: causal and window around ``i + sk - sq`` (bottom-right) or ``i``."""
    left, right = window
    if causal:
        right = 0

    def allowed(b, i, j):
        centre = i if top_left else i + sk - sq
        return (left < 0 or j >= centre - left) and (right < 0 or j <= centre + right)

    return allowed


def close(got, want, atol=ATOL):
    assert got.shape == want.shape, (got.shape, want.shape)
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=0)


# ----------------------------------------------------------------------------------- dense


DENSE = [  # (Sq, Sk, H, Hk, kwargs)
    (3, 7, 4, 2, dict(causal=True)),
    (6, 4, 2, 1, dict(causal=True)),  # Sq > Sk: the first rows see no key (0, lse +inf)
    (5, 5, 2, 2, dict(window_size=(1, 2), softmax_scale=0.3)),
    (4, 6, 2, 2, dict(causal=True, window_size=(2, -1), softcap=0.7)),
    (4, 6, 2, 2, dict()),
]


@pytest.mark.parametrize("sq, sk, h, hk, kwargs", DENSE, ids=lambda x: str(x))
def test_flash_attn_func_and_packed_variants(sq, sk, h, hk, kwargs):
    q, k, v = rand(2, sq, h, 8), rand(2, sk, hk, 8, seed=1), rand(2, sk, hk, 8, seed=2)
    allowed = band(sq, sk, kwargs.get("causal", False), kwargs.get("window_size", (-1, -1)))
    want, want_lse = reference(
        q, k, v, allowed=allowed, scale=kwargs.get("softmax_scale"), softcap=kwargs.get("softcap", 0.0)
    )
    close(fa.flash_attn_func(q, k, v, **kwargs), want)
    out, lse, probs = fa.flash_attn_func(q, k, v, 0.0, return_attn_probs=True, **kwargs)
    close(out, want)
    assert (
        probs.shape == (0,) and probs.dtype == q.dtype and lse.dtype == torch.float32
    )  # flash-attn's empty S_dmask
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    close(torch.where(torch.isinf(lse), 0, lse), torch.where(torch.isinf(want_lse), 0, want_lse))
    close(fa.flash_attn_kvpacked_func(q, torch.stack([k, v], 2), **kwargs), want)
    if sq == sk and h == hk:
        close(fa.flash_attn_qkvpacked_func(torch.stack([q, k, v], 2), **kwargs), want)


@pytest.mark.parametrize("causal", [False, True])
def test_alibi_slopes_follow_flash_attn(causal):
    """flash-attn docs: ``-slope * |i + Sk - Sq - j|`` is added to score (i, j); per-batch slopes too."""
    q, k, v = rand(2, 3, 2, 8), rand(2, 5, 2, 8, seed=1), rand(2, 5, 2, 8, seed=2)
    slopes = torch.tensor([[0.5, 0.25], [1.0, 0.125]])
    want, want_lse = reference(
        q, k, v, allowed=band(3, 5, causal), bias=lambda b, h, i, j: -float(slopes[b, h]) * abs(i + 5 - 3 - j)
    )
    out, lse, _ = fa.flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes, return_attn_probs=True)
    close(out, want)
    if not causal:  # causal: the kernel adds slope * j, the same softmax with a per-row shifted lse
        close(lse, want_lse)
    close(
        fa.flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes[0]),
        reference(
            q, k, v, allowed=band(3, 5, causal), bias=lambda b, h, i, j: -float(slopes[0, h]) * abs(i + 2 - j)
        )[0],
    )


# ----------------------------------------------------------------------------------- varlen


def varlen_reference(q, k, v, cu_q, cu_k, top_left=False, **kwargs):
    """Each sequence on its own (its own Sq, Sk); rows past cu_q[-1] are 0."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    lse = torch.full((q.shape[1], q.shape[0]), math.inf, dtype=torch.float64)
    for b in range(len(cu_q) - 1):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        sq, sk = qs.stop - qs.start, ks.stop - ks.start
        allowed = band(sq, sk, kwargs.get("causal", False), kwargs.get("window_size", (-1, -1)), top_left)
        o, s = reference(
            q[None, qs], k[None, ks], v[None, ks], allowed=allowed, scale=kwargs.get("softmax_scale")
        )
        out[qs], lse[:, qs] = o[0], s[0]
    return out, lse


CU_Q, CU_K = torch.tensor([0, 2, 5, 6], dtype=torch.int32), torch.tensor([0, 4, 7, 11], dtype=torch.int32)


def varlen_alibi_reference(q, k, v, slopes, causal):
    """flash-attn's varlen ALiBi: ``-slope * |i + Sk_b - Sq_b - j|`` within each sequence (positions
    restart per sequence); ``slopes`` [H] or [B, H]."""
    want = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    want_lse = torch.full((q.shape[1], q.shape[0]), math.inf, dtype=torch.float64)
    for b in range(len(CU_Q) - 1):
        qs, ks = slice(int(CU_Q[b]), int(CU_Q[b + 1])), slice(int(CU_K[b]), int(CU_K[b + 1]))
        sq, sk = qs.stop - qs.start, ks.stop - ks.start
        slope = slopes[b] if slopes.ndim == 2 else slopes
        o, s = reference(
            q[None, qs],
            k[None, ks],
            v[None, ks],
            allowed=band(sq, sk, causal),
            bias=lambda _b, h, i, j, sq=sq, sk=sk, slope=slope: -float(slope[h]) * abs(i + sk - sq - j),
        )
        want[qs], want_lse[:, qs] = o[0], s[0]
    return want, want_lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_batch", [False, True])
def test_varlen_alibi_per_sequence(causal, per_batch):
    """The varlen drop-ins add ALiBi per sequence, as flash-attn's kernel does."""
    q, k, v = rand(7, 2, 8), rand(11, 2, 8, seed=1), rand(11, 2, 8, seed=2)
    slopes = torch.tensor([[0.5, 0.25], [1.0, 0.125], [0.75, 2.0]])
    slopes = slopes if per_batch else slopes[1]
    want, want_lse = varlen_alibi_reference(q, k, v, slopes, causal)
    out, lse, _ = fa.flash_attn_varlen_func(
        q, k, v, CU_Q, CU_K, 3, 4, causal=causal, alibi_slopes=slopes, return_attn_probs=True
    )
    close(out, want)
    if not causal:  # causal: the kernel adds slope * j, the same softmax with a per-row shifted lse
        close(lse[:, :6], want_lse[:, :6])
    assert bool(torch.isinf(lse[:, 6]).all()) and not out[6].any()  # the padding row past cu_q[-1]
    packed = fa.flash_attn_varlen_kvpacked_func(
        q, torch.stack([k, v], 1), CU_Q, CU_K, 3, 4, causal=causal, alibi_slopes=slopes
    )
    close(packed, want)


@pytest.mark.parametrize(
    "kwargs", [dict(causal=True), dict(window_size=(1, 0), softmax_scale=0.5), dict()], ids=str
)
def test_varlen_functions(kwargs):
    q, k, v = rand(7, 2, 8), rand(11, 1, 8, seed=1), rand(11, 1, 8, seed=2)  # one padding query row
    want, want_lse = varlen_reference(q, k, v, CU_Q, CU_K, **kwargs)
    close(fa.flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 3, 4, **kwargs), want)
    out, lse, _ = fa.flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 3, 4, return_attn_probs=True, **kwargs)
    assert lse.shape == (2, 7) and torch.isinf(lse[:, 6]).all()
    close(out, want)
    close(lse[:, :6], want_lse[:, :6])
    close(fa.flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], 1), CU_Q, CU_K, 3, 4, **kwargs), want)
    x = rand(6, 3, 2, 8, seed=3)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    close(
        fa.flash_attn_varlen_qkvpacked_func(x, cu, 4, **kwargs),
        varlen_reference(x[:, 0], x[:, 1], x[:, 2], cu, cu, **kwargs)[0],
    )


def test_varlen_paged_keys_through_block_table():
    """k/v as pages [num_blocks, page, Hk, D]; sequence b reads the pages block_table[b] in order."""
    page = 2
    k_packed, v_packed = rand(11, 1, 8, seed=1), rand(11, 1, 8, seed=2)
    table = torch.tensor([[5, 1], [0, 3], [4, 2]], dtype=torch.int32)
    k_pages, v_pages = torch.zeros(6, page, 1, 8), torch.zeros(6, page, 1, 8)
    for b in range(3):
        for r in range(int(CU_K[b + 1] - CU_K[b])):
            k_pages[table[b, r // page], r % page] = k_packed[CU_K[b] + r]
            v_pages[table[b, r // page], r % page] = v_packed[CU_K[b] + r]
    q = rand(7, 2, 8)
    got = fa.flash_attn_varlen_func(q, k_pages, v_pages, CU_Q, CU_K, 3, 4, causal=True, block_table=table)
    close(got, varlen_reference(q, k_packed, v_packed, CU_Q, CU_K, causal=True)[0])


def test_flash_attn_1_names_are_top_left_causal():
    q, k, v = rand(7, 2, 8), rand(11, 2, 8, seed=1), rand(11, 2, 8, seed=2)
    want = varlen_reference(q, k, v, CU_Q, CU_K, top_left=True, causal=True)[0]
    close(fa.flash_attn_unpadded_func(q, k, v, CU_Q, CU_K, 3, 4, 0.0, causal=True), want)
    close(
        fa.flash_attn_unpadded_kvpacked_func(q, torch.stack([k, v], 1), CU_Q, CU_K, 3, 4, 0.0, None, True),
        want,
    )
    bottom_right = varlen_reference(q, k, v, CU_Q, CU_K, causal=True)[0]
    assert not torch.allclose(want, bottom_right, atol=1e-3)  # the alignment is really tested
    x, cu = rand(6, 3, 2, 8, seed=3), torch.tensor([0, 2, 6], dtype=torch.int32)
    close(
        fa.flash_attn_unpadded_qkvpacked_func(x, cu, 4, 0.0, causal=True),
        varlen_reference(x[:, 0], x[:, 1], x[:, 2], cu, cu, top_left=True, causal=True)[0],
    )


# ----------------------------------------------------------------------------------- KV cache


def rotate(x, cos, sin, positions, interleaved):
    """Rotary embedding as complex multiplication: pairs (2i, 2i+1) or (i, i + rd/2) times e^{i theta}."""
    x = x.double()
    half = cos.shape[-1]
    out = x.clone()
    for b in range(x.shape[0]):
        for s in range(x.shape[1]):
            turn = torch.complex(cos[positions[b][s]].double(), sin[positions[b][s]].double())
            for h in range(x.shape[2]):
                if interleaved:
                    z = torch.complex(x[b, s, h, 0 : 2 * half : 2], x[b, s, h, 1 : 2 * half : 2]) * turn
                    out[b, s, h, 0 : 2 * half : 2], out[b, s, h, 1 : 2 * half : 2] = z.real, z.imag
                else:
                    z = torch.complex(x[b, s, h, :half], x[b, s, h, half : 2 * half]) * turn
                    out[b, s, h, :half], out[b, s, h, half : 2 * half] = z.real, z.imag
    return out


def kvcache_reference(
    q,
    k_cache,
    v_cache,
    k,
    v,
    lengths,
    *,
    causal=False,
    window=(-1, -1),
    rotary=None,
    interleaved=True,
    batch_idx=None,
    leftpad=None,
):
    """flash_attn_with_kvcache by hand: returns (out, lse, k_cache', v_cache')."""
    k_cache, v_cache = k_cache.double().clone(), v_cache.double().clone()
    batch, sq = q.shape[:2]
    rows = list(range(batch)) if batch_idx is None else [int(i) for i in batch_idx]
    start = [0] * batch if leftpad is None else [int(x) for x in leftpad]
    if rotary is not None:
        cos, sin = rotary
        k = rotate(k, cos, sin, [[n + t for t in range(k.shape[1])] for n in lengths], interleaved)
        local = causal or window != (-1, -1)
        q = rotate(q, cos, sin, [[n + (i if local else 0) for i in range(sq)] for n in lengths], interleaved)
    for b, n in enumerate(lengths):
        for t in range(k.shape[1]):
            k_cache[rows[b], n + t], v_cache[rows[b], n + t] = k[b, t].double(), v[b, t].double()
    ends = [n + k.shape[1] for n in lengths]
    keys, values = k_cache[rows], v_cache[rows]
    left, right = window
    if causal:
        right = 0

    def allowed(b, i, j):
        centre = i + ends[b] - sq
        return (
            start[b] <= j < ends[b]
            and (left < 0 or j >= centre - left)
            and (right < 0 or j <= centre + right)
        )

    out, lse = reference(q, keys, values, allowed=allowed)
    return out, lse, k_cache, v_cache


@pytest.mark.parametrize(
    "causal, window, interleaved", [(True, (-1, -1), True), (False, (-1, -1), False), (False, (2, 1), True)]
)
def test_with_kvcache_updates_in_place_with_rotary(causal, window, interleaved):
    q, k, v = rand(2, 2, 4, 16), rand(2, 2, 2, 16, seed=1), rand(2, 2, 2, 16, seed=2)
    k_cache, v_cache = rand(2, 8, 2, 16, seed=3), rand(2, 8, 2, 16, seed=4)
    angles = torch.arange(10)[:, None] * torch.tensor([1.0, 0.3, 0.1, 0.05])[None]
    cos, sin = angles.cos(), angles.sin()  # rotary_dim 8 of head dim 16
    lengths = torch.tensor([3, 5], dtype=torch.int32)
    want, want_lse, want_k, want_v = kvcache_reference(
        q,
        k_cache,
        v_cache,
        k,
        v,
        [3, 5],
        causal=causal,
        window=window,
        rotary=(cos, sin),
        interleaved=interleaved,
    )
    out, lse = fa.flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        k,
        v,
        rotary_cos=cos,
        rotary_sin=sin,
        cache_seqlens=lengths,
        causal=causal,
        window_size=window,
        rotary_interleaved=interleaved,
        return_softmax_lse=True,
    )
    close(k_cache, want_k)  # the caches were updated in place, with the rotated keys
    close(v_cache, want_v)
    close(out, want)
    close(lse, want_lse)


def test_with_kvcache_batch_idx_leftpad_and_int_seqlens():
    q, k, v = rand(2, 1, 2, 8), rand(2, 1, 2, 8, seed=1), rand(2, 1, 2, 8, seed=2)
    k_cache, v_cache = rand(3, 6, 2, 8, seed=3), rand(3, 6, 2, 8, seed=4)
    idx, leftpad = torch.tensor([2, 0], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32)
    want, _, want_k, want_v = kvcache_reference(
        q, k_cache, v_cache, k, v, [4, 4], causal=True, batch_idx=idx, leftpad=leftpad
    )
    out = fa.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=4, cache_batch_idx=idx, cache_leftpad=leftpad, causal=True
    )
    close(out, want)
    close(k_cache, want_k)
    close(v_cache, want_v)
    before = k_cache.clone()
    no_new = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([2, 6]))  # read only
    assert torch.equal(k_cache, before)
    close(no_new, reference(q, k_cache, v_cache, allowed=lambda b, i, j: j < [2, 6][b])[0])


def test_with_kvcache_paged_cache():
    page, batch = 4, 2
    q, k, v = rand(batch, 2, 2, 8), rand(batch, 2, 1, 8, seed=1), rand(batch, 2, 1, 8, seed=2)
    logical_k, logical_v = rand(batch, 8, 1, 8, seed=3), rand(batch, 8, 1, 8, seed=4)
    table = torch.tensor([[3, 0], [1, 2]], dtype=torch.int32)
    k_pages, v_pages = torch.zeros(4, page, 1, 8), torch.zeros(4, page, 1, 8)
    for b in range(batch):
        for r in range(8):
            k_pages[table[b, r // page], r % page] = logical_k[b, r]
            v_pages[table[b, r // page], r % page] = logical_v[b, r]
    want, _, want_k, _ = kvcache_reference(q, logical_k, logical_v, k, v, [3, 5], causal=True)
    out = fa.flash_attn_with_kvcache(
        q, k_pages, v_pages, k, v, cache_seqlens=torch.tensor([3, 5]), block_table=table, causal=True
    )
    close(out, want)
    for b in range(batch):  # the new rows landed in the right pages
        for r in range(8):
            close(k_pages[table[b, r // page], r % page], want_k[b, r])


def test_with_kvcache_rejects_what_flash_attn_rejects_or_we_cannot_do():
    q, cache = rand(1, 1, 2, 8), rand(1, 4, 2, 8)
    with pytest.raises(ValueError, match="both k and v"):
        fa.flash_attn_with_kvcache(q, cache, cache, k=cache[:, :1], cache_seqlens=1)
    with pytest.raises(ValueError, match="exceeds"):
        fa.flash_attn_with_kvcache(q, cache, cache, cache[:, :2], cache[:, :2], cache_seqlens=3)
    with pytest.raises(NotImplementedError, match="alibi"):
        fa.flash_attn_with_kvcache(q, cache, cache, alibi_slopes=torch.ones(2))


# ----------------------------------------------------------------------------------- bert_padding


def test_unpad_and_pad_input_round_trip():
    x = rand(2, 4, 3).requires_grad_()
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    packed, indices, cu, max_len, used = fa.unpad_input(x, mask)
    tokens = [x[b, s] for b in range(2) for s in range(4) if mask[b, s]]
    assert torch.equal(packed, torch.stack(tokens))
    assert indices.tolist() == [0, 1, 4, 5, 6] and cu.tolist() == [0, 2, 5] and cu.dtype == torch.int32
    assert max_len == 3 and used.tolist() == [2, 3]
    padded = fa.pad_input(packed, indices, 2, 4)
    assert torch.equal(padded, x * mask[..., None])
    padded.sum().backward()
    assert torch.equal(x.grad, mask[..., None].float().expand(2, 4, 3))
    assert torch.equal(fa.index_first_axis(x.reshape(8, 3), indices), packed)
    unused = torch.tensor([[0, 0, 1, 0], [0, 0, 0, 0]])
    _, indices, cu, _, used = fa.unpad_input(x, mask, unused)
    assert indices.tolist() == [0, 1, 2, 4, 5, 6] and cu.tolist() == [0, 3, 6] and used.tolist() == [2, 3]


# ----------------------------------------------------------------------------------- FA3 / FA4


def test_fa3_return_type_and_semantics():
    from flashport.integrations import flash_attn3_compat as fa3

    q, k, v = rand(2, 6, 4, 8), rand(2, 4, 2, 8, seed=1), rand(2, 4, 2, 8, seed=2)
    want, want_lse = reference(q, k, v, allowed=band(6, 4, True, (1, -1)), scale=0.4)
    out = fa3.flash_attn_func(q, k, v, 0.4, True, window_size=(1, -1))  # FA3's 4th positional is the scale
    close(out, want)
    out, lse = fa3.flash_attn_func(q, k, v, 0.4, True, window_size=(1, -1), return_attn_probs=True)
    close(out, want)
    # FA3 writes -inf for a row that sees no key (hopper/softmax.h finalize, epilogue_fwd.hpp
    # store_zero), not FA2's +inf; the reference's +inf rows are those rows
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse)) and bool(torch.isinf(lse).any())
    assert bool((lse[torch.isinf(lse)] == -math.inf).all())
    close(torch.where(torch.isinf(lse), 0, lse), torch.where(torch.isinf(want_lse), 0, want_lse))
    _, lse = fa3.flash_attn_func(q, k[:, :0], v[:, :0], return_attn_probs=True)  # no key row at all:
    assert bool((lse == math.inf).all())  # mha_fwd skips the kernel and fills lse with +inf
    qp, kp, vp = rand(7, 2, 8), rand(11, 1, 8, seed=1), rand(11, 1, 8, seed=2)
    want, want_lse = varlen_reference(qp, kp, vp, CU_Q, CU_K, causal=True)
    out, lse = fa3.flash_attn_varlen_func(qp, kp, vp, CU_Q, CU_K, 3, 4, causal=True, return_attn_probs=True)
    close(out, want)
    close(lse[:, :6], want_lse[:, :6])
    cu_q, cu_k = torch.tensor([0, 4, 6], dtype=torch.int32), torch.tensor([0, 1, 3], dtype=torch.int32)
    want, want_lse = varlen_reference(qp, kp, vp, cu_q, cu_k, causal=True)  # rows 0-2 see no key
    out, lse = fa3.flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, 4, 2, causal=True, return_attn_probs=True)
    close(out[:6], want[:6])
    assert torch.equal(lse[:, :6] == -math.inf, torch.isinf(want_lse[:, :6])) and bool(torch.isinf(lse).any())
    close(
        torch.where(torch.isinf(lse[:, :6]), 0, lse[:, :6]),
        torch.where(torch.isinf(want_lse), 0, want_lse)[:, :6],
    )
    with pytest.raises(NotImplementedError, match="seqused_k"):
        fa3.flash_attn_varlen_func(qp, kp, vp, CU_Q, CU_K, 3, 4, seqused_k=torch.tensor([1, 2, 3]))
    with pytest.raises(NotImplementedError, match="qv"):
        fa3.flash_attn_func(q, k, v, qv=q)


def test_fa4_always_returns_out_and_lse():
    from flashport.integrations import flash_attn4_compat as fa4

    q, k, v = rand(2, 3, 4, 8), rand(2, 5, 2, 8, seed=1), rand(2, 5, 2, 8, seed=2)
    for return_lse in (False, True):
        out, lse = fa4.flash_attn_func(q, k, v, causal=True, window_size=(1, None), return_lse=return_lse)
        want, want_lse = reference(q, k, v, allowed=band(3, 5, True, (1, -1)))
        close(out, want)
        close(lse, want_lse)
    out, _ = fa4.flash_attn_func(q, k, v, window_size=(-3, 1), num_splits=2)  # l + r < 0: unbounded
    close(out, reference(q, k, v, allowed=band(3, 5))[0])
    with pytest.raises(ValueError, match="negative"):
        fa4.flash_attn_func(q, k, v, window_size=(-1, 2))
    with pytest.raises(TypeError):
        fa4.flash_attn_func(q, k, v, None, True)  # FA4's 4th positional moved between releases
    with pytest.raises(NotImplementedError, match="learnable_sink"):
        fa4.flash_attn_func(q, k, v, learnable_sink=torch.zeros(4))
    qp, kp, vp = rand(7, 2, 8), rand(11, 1, 8, seed=1), rand(11, 1, 8, seed=2)
    out, lse = fa4.flash_attn_varlen_func(qp, kp, vp, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, causal=True)
    want, want_lse = varlen_reference(qp, kp, vp, CU_Q, CU_K, causal=True)
    close(out, want)
    close(lse[:, :6], want_lse[:, :6])


# ----------------------------------------------------------------------------------- through the codemod


def test_fpa007_drop_in_rewrite_keeps_the_in_place_decode_loop():
    """A decoder that keeps its caches on ``self`` (refused by the functional rewrite) is ported to the
    drop-in: step after step the caches fill in place and each output matches flash-attn's."""
    import textwrap

    from flashport import rules as registry
    from flashport.rewriter.engine.pipeline import transform_source
    from flashport.rules.base import RuleOptions

    source = textwrap.dedent("""
        import torch
        from flash_attn import flash_attn_with_kvcache

        class Decoder:
            def __init__(self):
                self.k_cache = torch.zeros(2, 6, 1, 8)
                self.v_cache = torch.zeros(2, 6, 1, 8)

            def step(self, q, k, v, lengths):
                return flash_attn_with_kvcache(q, self.k_cache, self.v_cache, k, v, cache_seqlens=lengths, causal=True)
    """)
    result = transform_source(source.encode(), "decoder.py", registry.all_rules(), RuleOptions())
    assert [s.status for s in result.sites] == ["rewrite"] and "drop-in" in result.sites[0].notes[0]
    code = result.new.decode()
    assert "flash_attn_compat.flash_attn_with_kvcache(" in code and "from flash_attn" not in code
    namespace: dict = {}
    exec(compile(code, "decoder.py", "exec"), namespace)
    decoder = namespace["Decoder"]()
    want_k, want_v = torch.zeros(2, 6, 1, 8), torch.zeros(2, 6, 1, 8)
    for step in range(3):
        q, k, v = (
            rand(2, 1, 2, 8, seed=step),
            rand(2, 1, 1, 8, seed=10 + step),
            rand(2, 1, 1, 8, seed=20 + step),
        )
        lengths = torch.tensor([step, step + 1], dtype=torch.int32)
        out = decoder.step(q, k, v, lengths)
        want, _, want_k, want_v = kvcache_reference(q, want_k, want_v, k, v, lengths.tolist(), causal=True)
        close(out, want)
        close(decoder.k_cache, want_k)
        close(decoder.v_cache, want_v)


def test_varlen_call_with_dropout_is_ported_to_the_drop_in():
    """FPA004-006 send a varlen call with dropout to the drop-in; in eval mode (dropout 0) it computes
    flash-attn's per-sequence result."""
    import textwrap

    from flashport import rules as registry
    from flashport.rewriter.engine.pipeline import transform_source
    from flashport.rules.base import RuleOptions

    source = textwrap.dedent("""
        from flash_attn import flash_attn_varlen_func, flash_attn_varlen_kvpacked_func

        def attend(q, k, v, cu_q, cu_k, training, p):
            a = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 4, dropout_p=p if training else 0.0, causal=True)
            b = flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], 1), cu_q, cu_k, 3, 4, p if training else 0.0)
            return a, b
    """)
    result = transform_source(source.encode(), "varlen.py", registry.all_rules(), RuleOptions())
    assert [s.status for s in result.sites] == ["rewrite", "rewrite"], result.sites
    code = result.new.decode()
    assert code.count("flash_attn_compat.flash_attn_varlen") == 2 and "from flash_attn" not in code
    namespace: dict = {"torch": torch}
    exec(compile(code, "varlen.py", "exec"), namespace)
    q, k, v = rand(7, 2, 8), rand(11, 1, 8, seed=1), rand(11, 1, 8, seed=2)
    a, b = namespace["attend"](q, k, v, CU_Q, CU_K, False, 0.3)
    close(a, varlen_reference(q, k, v, CU_Q, CU_K, causal=True)[0])
    close(b, varlen_reference(q, k, v, CU_Q, CU_K)[0])


def test_varlen_alibi_call_is_ported_to_the_drop_in():
    """FPA004 sends a varlen call with ALiBi (colossalai's inference prefill) to the drop-in."""
    import textwrap

    from flashport import rules as registry
    from flashport.rewriter.engine.pipeline import transform_source
    from flashport.rules.base import RuleOptions

    source = textwrap.dedent("""
        from flash_attn import flash_attn_varlen_func

        def prefill(q, k, v, cu_q, cu_k, slopes):
            return flash_attn_varlen_func(
                q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=3, max_seqlen_k=4,
                dropout_p=0.0, softmax_scale=None, causal=True, alibi_slopes=slopes,
            )
    """)
    result = transform_source(source.encode(), "alibi.py", registry.all_rules(), RuleOptions())
    assert [s.status for s in result.sites] == ["rewrite"], result.sites
    code = result.new.decode()
    assert "flash_attn_compat.flash_attn_varlen_func(" in code and "from flash_attn" not in code
    namespace: dict = {}
    exec(compile(code, "alibi.py", "exec"), namespace)
    q, k, v = rand(7, 2, 8), rand(11, 2, 8, seed=1), rand(11, 2, 8, seed=2)
    slopes = torch.tensor([0.5, 0.25])
    close(namespace["prefill"](q, k, v, CU_Q, CU_K, slopes), varlen_alibi_reference(q, k, v, slopes, True)[0])


def test_alibi_and_out_of_order_dropout_calls_are_ported_to_the_drop_in():
    """FPA001 sends ALiBi calls, and calls whose side-effecting dropout the explicit rewrite would
    move, to the drop-in: results match flash-attn and the arguments run in their source order."""
    import textwrap

    from flashport import rules as registry
    from flashport.rewriter.engine.pipeline import transform_source
    from flashport.rules.base import RuleOptions

    source = textwrap.dedent("""
        from flash_attn import flash_attn_func

        def alibi(q, k, v, slopes):
            return flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)

        def ordered(q, k, v, log):
            def note(name, value):
                log.append(name)
                return value
            return flash_attn_func(q, k, v, causal=note("causal", True), dropout_p=note("dropout", 0.0),
                                   softmax_scale=note("scale", 0.5))
    """)
    result = transform_source(source.encode(), "m.py", registry.all_rules(), RuleOptions())
    assert [s.status for s in result.sites] == ["rewrite", "rewrite"], result.sites
    assert all("drop-in" in s.notes[0] for s in result.sites)
    namespace: dict = {}
    exec(compile(result.new.decode(), "m.py", "exec"), namespace)
    q, k, v = rand(2, 3, 2, 8), rand(2, 5, 2, 8, seed=1), rand(2, 5, 2, 8, seed=2)
    slopes = torch.tensor([0.5, 0.25])
    close(
        namespace["alibi"](q, k, v, slopes),
        reference(
            q, k, v, allowed=band(3, 5, True), bias=lambda b, h, i, j: -float(slopes[h]) * abs(i + 2 - j)
        )[0],
    )
    log: list = []
    close(namespace["ordered"](q, k, v, log), reference(q, k, v, allowed=band(3, 5, True), scale=0.5)[0])
    assert log == ["causal", "dropout", "scale"]


def test_return_attn_probs_without_dropout_is_ported_to_the_drop_in():
    """flash-attn returns (out, softmax_lse, empty S_dmask) when dropout_p is 0: the drop-in reproduces
    the tuple, so a flag known only at run time ports (sglang's FA2 fallback passes return_softmax_lse)."""
    from ported_code import port_and_run

    source = """
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    def dense(q, k, v, want_lse):
        return flash_attn_func(q, k, v, softmax_scale=0.5, causal=True, return_attn_probs=want_lse)

    def packed(q, k, v, cu_q, cu_k, want_lse):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 4, causal=True, return_attn_probs=want_lse)
    """
    namespace, code = port_and_run(source, "call")
    assert code.count("flash_attn_compat.flash_attn") == 2
    q, k, v = rand(2, 3, 2, 8), rand(2, 5, 1, 8, seed=1), rand(2, 5, 1, 8, seed=2)
    want, want_lse = reference(q, k, v, allowed=band(3, 5, causal=True), scale=0.5)
    out, lse, s_dmask = namespace["dense"](q, k, v, True)
    close(out, want)
    close(lse, want_lse)
    assert s_dmask.numel() == 0
    close(namespace["dense"](q, k, v, False), want)
    q, k, v = rand(7, 2, 8), rand(11, 1, 8, seed=1), rand(11, 1, 8, seed=2)
    want, want_lse = varlen_reference(q, k, v, CU_Q, CU_K, causal=True)
    out, lse, s_dmask = namespace["packed"](q, k, v, CU_Q, CU_K, True)
    close(out, want)
    close(lse[:, :6], want_lse[:, :6])
    assert s_dmask.numel() == 0
