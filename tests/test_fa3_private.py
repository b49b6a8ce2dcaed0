"""FlashAttention-3's private kernels: the drop-ins per FA3 build against float64 references (out,
lse, gradients written into the given buffers), and which build's drop-in a call is ported to."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from flashport import rules as registry
from flashport.rewriter.engine.pipeline import transform_source
from flashport.rules.base import RuleOptions

torch = pytest.importorskip("torch")

from ported_code import rand  # noqa: E402
from reference import reference_attention, reference_attention_vjp  # noqa: E402

from flashport.integrations import flash_attn3_compat as fa3  # noqa: E402

ATOL = 2e-5


def close(got, want, atol=ATOL):
    got = got.detach().double().numpy()
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, atol=atol, rtol=1e-4)


def test_dense_forward_and_backward_of_the_latest_and_an_older_build():
    q, k, v = rand(2, 5, 4, 8), rand(2, 7, 2, 8, seed=1), rand(2, 7, 2, 8, seed=2)
    dout = rand(2, 5, 4, 8, seed=3)
    contract = dict(scale=0.3, causal=True, window=(2, None))
    want, want_lse = reference_attention(q.numpy(), k.numpy(), v.numpy(), **contract)
    out, lse, out_accum, lse_accum = fa3._flash_attn_forward(
        q, k, v, softmax_scale=0.3, causal=True, window_size_left=2, window_size_right=-1
    )
    close(out, want)
    close(lse, want_lse)
    assert out_accum.numel() == 0 and lse_accum.numel() == 0
    # the 2025-03-15 build: 25 positionals, window_size a pair (Open-Sora's call)
    older = fa3._flash_attn_forward_v2025_03_15(q, k, v, *([None] * 19), 0.3, True, (2, -1))
    close(older[0], want)
    close(older[1], want_lse)
    gq, gk, gv, _ = reference_attention_vjp(q.numpy(), k.numpy(), v.numpy(), dout.numpy(), **contract)
    dq, dk, dv = torch.full_like(q, 7.0), torch.full_like(k, 7.0), torch.full_like(v, 7.0)
    softmax_d = fa3._flash_attn_backward(
        dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, softmax_scale=0.3, is_causal=True, window_size_left=2
    )
    for got, grad in ((dq, gq), (dk, gk), (dv, gv)):
        close(got, grad)
    close(softmax_d, np.einsum("bqhd,bqhd->bhq", dout.double().numpy(), want))
    # before 2025-07-24 the backward returned (dq, dk, dv, softmax_d); before 2025-07-16 window_size
    buffers = [torch.zeros_like(x) for x in (q, k, v)]
    result = fa3._flash_attn_backward_v2025_03_01(
        dout, q, k, v, out, lse, *([None] * 6), *buffers, 0.3, True, (2, -1)
    )
    assert result[0] is buffers[0] and len(result) == 4
    for got, grad in zip(buffers, (gq, gk, gv), strict=True):
        close(got, grad)


def test_varlen_and_cache_forwards():
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
    q, k, v = rand(5, 4, 8, seed=3), rand(9, 2, 8, seed=4), rand(9, 2, 8, seed=5)
    out, lse, *_ = fa3._flash_attn_forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=3,
                                           max_seqlen_k=5, softmax_scale=0.3, causal=True)  # fmt: skip
    for b in range(2):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        want, want_lse = reference_attention(
            q[None, qs].numpy(), k[None, ks].numpy(), v[None, ks].numpy(), scale=0.3, causal=True
        )
        close(out[qs], want[0])
        close(lse[:, qs], want_lse[0])
    # seqused_k without cu_seqlens_k: the cache lengths (FA3's flash_attn_with_kvcache calls it so)
    q, k_cache, v_cache = rand(2, 1, 4, 8, seed=6), rand(2, 6, 2, 8, seed=7), rand(2, 6, 2, 8, seed=8)
    lengths = torch.tensor([3, 6], dtype=torch.int32)
    out, lse, *_ = fa3._flash_attn_forward(q, k_cache, v_cache, seqused_k=lengths, softmax_scale=0.3)
    for b, n in enumerate((3, 6)):
        want, want_lse = reference_attention(
            q[b : b + 1].numpy(), k_cache[b : b + 1, :n].numpy(), v_cache[b : b + 1, :n].numpy(), scale=0.3
        )
        close(out[b : b + 1], want)
        close(lse[b : b + 1], want_lse)
    with pytest.raises(NotImplementedError):
        fa3._flash_attn_forward_v2025_01_07(q, k_cache, v_cache, *([None] * 18), 0.3, False, (-1, -1), 4)


def _sites(source: str):
    result = transform_source(
        textwrap.dedent(source).encode(), "case.py", registry.all_rules(), RuleOptions()
    )
    return {(s.line, s.kind, s.status): (s.reason or " ".join(s.notes)) for s in result.sites}


def test_calls_go_to_the_build_whose_signature_they_fit():
    sites = _sites(
        """
        import inspect
        from flash_attn_interface import _flash_attn_backward, _flash_attn_forward

        def positional(q, k, v):
            out, lse, *_ = _flash_attn_forward(q, k, v, None, None, None, None, None, None, None, None, None, None, None, None, None, None, None, None, None, None, None, 0.3, False, (-1, -1))
            return out

        def keywords(q, k, v):
            out, lse, *_ = _flash_attn_forward(q=q, k=k, v=v, softmax_scale=0.3, causal=True, window_size=(-1, -1), attention_chunk=0)
            return out

        def backward(dout, q, k, v, out, lse, dq, dk, dv):
            _flash_attn_backward(dout, q, k, v, out, lse, None, None, None, None, None, None, dq, dk, dv, 0.3, False, (-1, -1))

        def used_backward(dout, q, k, v, out, lse, dq, dk, dv):
            return _flash_attn_backward(dout, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None, sequed_q=None, sequed_k=None, max_seqlen_q=None, max_seqlen_k=None, dq=dq, dk=dk, dv=dv, softmax_scale=0.3, is_causal=False)

        def build_2024(q, k, v):
            out, q, k, v, out_padded, lse, s = _flash_attn_forward(q, k, v, 0.3, True)
            return out

        def probed(q, k, v, **candidates):
            names = inspect.signature(_flash_attn_forward).parameters
            out, *unused = _flash_attn_forward(**{n: candidates[n] for n in names if n in candidates})
            return out

        def positional_splat(q, k, v, *rest):
            return _flash_attn_forward(q, k, v, *rest)

        def named_out(q, k, v):
            out, lse, *_ = _flash_attn_forward(q, k, v, out=None, softmax_scale=0.3, window_size_left=-1, window_size_right=-1)
            return out
        """
    )
    assert "_flash_attn_forward_v2025_03_15" in sites[(6, "call", "rewrite")]  # 2025-02-07 to 03-15
    # window_size a pair but k_new ... causal omitted: the builds that have window_size require them
    assert "fits no FA3 build" in sites[(10, "call", "refused")]
    assert "_flash_attn_backward_v2025_03_01" in sites[(14, "call", "rewrite")]
    # its result is used: (dq, dk, dv, softmax_d) until 2025-07-24, softmax_d after
    assert "ambiguous" in sites[(17, "call", "refused")]
    assert "not the 4" in sites[(20, "call", "refused")]  # FA3's 2024 builds returned 7 values
    assert (24, "reference", "rewrite") in sites
    assert "bound at run time" in sites[(25, "call", "rewrite")]
    assert "*args splat" in sites[(29, "call", "refused")]
    # out=None (the forward's optional buffer, renamed out_ on 2025-11-21): the build before
    assert "_flash_attn_forward_v2025_08_06" in sites[(32, "call", "rewrite")]
