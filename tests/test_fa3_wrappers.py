"""Thin FlashAttention-3 wrappers (``def f(*args, **kwargs): out = fa3(*args, **kwargs)``) port to
flashport's FA3 drop-in only when the wrapper normalizes FA3's two return conventions itself; the
ported wrapper is executed against float64 references of the FA3 API (FA2 semantics, FA3's
argument order)."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from flashport import rules as registry
from flashport.rewriter.engine.pipeline import transform_source
from flashport.rules.base import RuleOptions

torch = pytest.importorskip("torch")

from ported_code import port_and_run, rand  # noqa: E402
from torch_semantics_reference import flash_attn_ref, flash_attn_varlen_ref  # noqa: E402

WRAPPERS = """
import functools

from flash_attn_interface import flash_attn_func as _fa3_func
from flash_attn_interface import flash_attn_varlen_func as _fa3_varlen


@functools.wraps(_fa3_varlen)
def flash_attn_varlen_func(*args, **kwargs):
    output = _fa3_varlen(*args, **kwargs)
    if isinstance(output, tuple):
        # for FA3 before 2025-07-11
        return output[0]
    return output


def flash_attn_func(*args, **kwargs):
    out = _fa3_func(*args, **kwargs)
    return out[0] if isinstance(out, tuple) else out
"""


def close(got, want, atol=2e-5):
    assert torch.allclose(got.double(), want, atol=atol), float((got.double() - want).abs().max())


def test_normalizing_wrappers_port_and_compute_fa3():
    namespace, code = port_and_run(WRAPPERS, "call")
    assert "flash_attn3_compat.flash_attn_varlen_func(*args, **kwargs)" in code
    assert "@functools.wraps(flashport.integrations.flash_attn3_compat.flash_attn_varlen_func)" in code
    q, k, v = rand(2, 5, 4, 8), rand(2, 7, 2, 8, seed=1), rand(2, 7, 2, 8, seed=2)
    want = flash_attn_ref(q, k, v, causal=True, softmax_scale=0.3)
    # FA3's 4th positional is softmax_scale; the wrapper returns out even when lse is asked for
    close(namespace["flash_attn_func"](q, k, v, 0.3, True), want)
    close(namespace["flash_attn_func"](q, k, v, softmax_scale=0.3, causal=True, return_attn_probs=True), want)
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
    qp, kp, vp = rand(5, 4, 8, seed=3), rand(9, 2, 8, seed=4), rand(9, 2, 8, seed=5)
    want = flash_attn_varlen_ref(qp, kp, vp, cu_q, cu_k, causal=True, window_size=(2, -1))
    got = namespace["flash_attn_varlen_func"](qp, kp, vp, cu_q, cu_k, 3, 5, causal=True, window_size=(2, -1))
    close(got, want)
    got = namespace["flash_attn_varlen_func"](
        q=qp, k=kp, v=vp, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=3, max_seqlen_k=5,
        causal=True, window_size=(2, -1), return_attn_probs=True,
    )  # fmt: skip
    close(got, want)
    # an older release's positions land on FA3-only parameters of the drop-in: loud, not silent
    with pytest.raises(NotImplementedError):
        namespace["flash_attn_func"](q, k, v, 0.3, True, None, None, None, (-1, -1))


def _sites(source: str):
    result = transform_source(
        textwrap.dedent(source).encode(), "case.py", registry.all_rules(), RuleOptions()
    )
    return {(s.line, s.status): s.reason for s in result.sites}


def test_wrappers_that_do_not_normalize_stay():
    sites = _sites(
        """
        from flash_attn_interface import flash_attn_varlen_func, flash_attn_with_kvcache

        def passthrough(*args, **kwargs):
            return flash_attn_varlen_func(*args, **kwargs)

        def keeps_tuple(*args, **kwargs):
            out = flash_attn_varlen_func(*args, **kwargs)
            if isinstance(out, tuple):
                return out
            return out

        def cache(*args, **kwargs):
            return flash_attn_with_kvcache(*args, **kwargs)

        def vendor(q, k, v, cu, m, **kwargs):
            return flash_attn_varlen_func(q, k, v, cu, cu, m, m, return_softmax_lse=True, **kwargs)
        """
    )
    assert "does not normalize the result" in sites[(5, "refused")]
    assert "does not normalize the result" in sites[(8, "refused")]
    # the cache call's return type never changed: its splat ports whatever the wrapper does with it
    # return_softmax_lse= is sgl-kernel's build: its drop-in returns what the keyword asks for
    assert (17, "rewrite") in sites
    assert [key for key in sites if key[1] == "rewrite"] == [(14, "rewrite"), (17, "rewrite")]


def test_a_wrapper_that_keeps_another_item_stays():
    sites = _sites(
        """
        from flash_attn_interface import flash_attn_func

        def lse_only(*args, **kwargs):
            out = flash_attn_func(*args, **kwargs)
            if isinstance(out, tuple):
                out = out[1]
            return out
        """
    )
    assert "does not normalize the result" in sites[(5, "refused")]


SGL_BUILD = """
from flash_attn_interface import flash_attn_varlen_func


def attend(q, k, v, cu_q, cu_k, mq, mk, want_lse, **kwargs):
    output = flash_attn_varlen_func(
        q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq, max_seqlen_k=mk,
        softmax_scale=0.3, causal=True, return_softmax_lse=want_lse, **kwargs,
    )
    if want_lse:
        output, lse, *rest = output
        return output, lse
    return output
"""


def test_return_softmax_lse_ports_to_the_sgl_kernel_build():
    """``return_softmax_lse=`` (sgl-kernel's build of flash_attn_interface, as sglang's vendor
    backends call it): the drop-in returns out, or (out, lse [H, total_q], *rest), as the keyword
    says at run time; out and lse against the float64 reference, per sequence."""
    import numpy as np
    from reference import reference_attention

    namespace, code = port_and_run(SGL_BUILD, "call")
    assert "flash_attn3_compat.sgl_flash_attn_varlen_func(" in code
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
    q, k, v = rand(5, 4, 8, seed=3), rand(9, 2, 8, seed=4), rand(9, 2, 8, seed=5)
    outs, lses = [], []
    for b in range(2):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        out, lse = reference_attention(
            *(np.float64(x[None, s].numpy()) for x, s in ((q, qs), (k, ks), (v, ks))), scale=0.3, causal=True
        )
        outs.append(torch.from_numpy(np.asarray(out))[0])
        lses.append(torch.from_numpy(np.asarray(lse))[0])
    want_out, want_lse = torch.cat(outs), torch.cat(lses, dim=1)
    close(namespace["attend"](q, k, v, cu_q, cu_k, 3, 5, False), want_out)
    out, lse = namespace["attend"](q, k, v, cu_q, cu_k, 3, 5, True)
    close(out, want_out)
    assert lse.shape == (4, 5) and lse.dtype == torch.float32
    close(lse, want_lse, atol=1e-5)
    # a feature the drop-in lacks, passed through the splat, is loud
    with pytest.raises(NotImplementedError):
        namespace["attend"](q, k, v, cu_q, cu_k, 3, 5, False, sinks=torch.zeros(4))


def test_sgl_kernel_build_features_without_a_port_stay():
    sites = _sites(
        """
        from flash_attn_interface import flash_attn_varlen_func

        def paged(q, k, v, cu, m, table):
            return flash_attn_varlen_func(q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu, page_table=table, return_softmax_lse=True)

        def positional(q, k, v, cu, m):
            return flash_attn_varlen_func(q, k, v, cu, cu, m, m, None, None, None, return_softmax_lse=True)
        """
    )
    assert "page_table" in sites[(5, "refused")]
    assert "after max_seqlen_k" in sites[(8, "refused")]


def test_a_name_also_bound_to_sgl_kernels_build_takes_its_convention():
    """The platform branches of one import bind the name to sgl-kernel's build and to
    flash_attn_interface's (a vendor copy): the call is written for sgl-kernel's convention (out
    unless return_softmax_lse=True), so even a splat ports to that build's drop-in."""
    sites = _sites(
        """
        import torch

        if torch.version.hip is None:
            from sgl_kernel.flash_attn import flash_attn_varlen_func
        else:
            from flash_attn_interface import flash_attn_varlen_func

        def attend(*args, **kwargs):
            return flash_attn_varlen_func(*args, **kwargs)
        """
    )
    assert [key for key in sites if key[1] != "rewrite"] == []
    assert (10, "rewrite") in sites


FA4_WRAPPER = """
from flash_attn.cute.interface import flash_attn_varlen_func as cute_varlen_func


def flash_attn_varlen_func(*args, **kwargs):
    output = cute_varlen_func(*args, **kwargs)
    return output[0] if isinstance(output, tuple) else output
"""


def test_fa4_varlen_splat_wrapper_ports_and_computes():
    """FA4's varlen function always returns (out, lse): a splat wrapper's call goes to the drop-in,
    which binds it at run time (a 4th positional raises, as the drop-in takes only q, k, v so)."""
    namespace, code = port_and_run(FA4_WRAPPER, "call")
    assert "flash_attn4_compat.flash_attn_varlen_func(*args, **kwargs)" in code
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
    q, k, v = rand(5, 4, 8, seed=3), rand(9, 2, 8, seed=4), rand(9, 2, 8, seed=5)
    want = flash_attn_varlen_ref(q, k, v, cu_q, cu_k, causal=True, softmax_scale=0.3)
    got = namespace["flash_attn_varlen_func"](
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, softmax_scale=0.3
    )
    close(got, want)
    with pytest.raises(TypeError):
        namespace["flash_attn_varlen_func"](q, k, v, cu_q, cu_k)


def _sink_reference(q, k_cache, v_cache, lengths, sinks, scale):
    """Materialized float64 attention over each sequence's cached rows (bottom-right causal, GQA)
    with a per-head sink logit in the softmax that carries no value."""
    q, k_cache, v_cache, sinks = (np.float64(x.numpy()) for x in (q, k_cache, v_cache, sinks))
    batch, queries, heads, _ = q.shape
    group = heads // k_cache.shape[2]
    out = np.zeros((batch, queries, heads, v_cache.shape[-1]))
    for b, n in enumerate(lengths):
        for h in range(heads):
            keys, values = k_cache[b, :n, h // group], v_cache[b, :n, h // group]
            scores = scale * q[b, :, h] @ keys.T
            visible = np.arange(n)[None, :] <= (n - queries + np.arange(queries))[:, None]
            scores = np.where(visible, scores, -np.inf)
            full = np.concatenate([scores, np.full((queries, 1), sinks[h])], axis=1)
            weights = np.exp(full - full.max(axis=1, keepdims=True))
            weights /= weights.sum(axis=1, keepdims=True)
            out[b, :, h] = weights[:, :n] @ values
    return out


SGL_KVCACHE = """
from flash_attn_interface import flash_attn_with_kvcache


def decode(q, k_cache, v_cache, lengths, sinks):
    return flash_attn_with_kvcache(
        q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=lengths, softmax_scale=0.3, causal=True,
        sinks=sinks,
    )
"""


def test_sinks_port_to_the_sgl_kernel_cache_build():
    """``sinks=`` (sgl-kernel's build, as sglang's MUSA backend passes it): the drop-in folds each
    head's sink logit into the softmax; against a materialized float64 reference."""

    namespace, code = port_and_run(SGL_KVCACHE, "call")
    assert "flash_attn3_compat.sgl_flash_attn_with_kvcache(" in code
    q, k_cache, v_cache = rand(2, 3, 4, 8, seed=6), rand(2, 6, 2, 8, seed=7), rand(2, 6, 2, 8, seed=8)
    sinks = rand(4, seed=9) * 2
    lengths = torch.tensor([4, 6], dtype=torch.int32)
    got = namespace["decode"](q, k_cache, v_cache, lengths, sinks)
    want = _sink_reference(q, k_cache, v_cache, (4, 6), sinks, 0.3)
    close(got, torch.from_numpy(want), atol=1e-5)
    without = namespace["decode"](q, k_cache, v_cache, lengths, None)
    assert (got - without).abs().max() > 1e-2  # the sinks matter in this case


def test_sgl_kernel_cache_build_refusals():
    sites = _sites(
        """
        from flash_attn_interface import flash_attn_with_kvcache

        def fp8(q, kc, vc, n, scales):
            return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n, q_descale=scales[0], sinks=None)
        """
    )
    assert "FP8" in sites[(5, "refused")]


def test_scheduler_metadata_ports_to_a_plan_of_none():
    """FA3's ``get_scheduler_metadata`` (the plan passed as ``scheduler_metadata=``) goes to its
    drop-in, which returns None ("plan each call"); the cache call that receives it computes the
    float64 reference; an argument FA3 lacks stays."""
    namespace, code = port_and_run(
        """
        from flash_attn_interface import flash_attn_with_kvcache, get_scheduler_metadata

        def decode(q, k_cache, v_cache, lengths):
            plan = get_scheduler_metadata(
                batch_size=q.shape[0], max_seqlen_q=q.shape[1], max_seqlen_k=k_cache.shape[1],
                num_heads_q=q.shape[2], num_heads_kv=k_cache.shape[2], headdim=q.shape[3],
                cache_seqlens=lengths, causal=True,
            )
            return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True,
                                           softmax_scale=0.3, scheduler_metadata=plan), plan
        """,
        "call",
    )
    assert "flash_attn3_compat.get_scheduler_metadata(" in code
    q, k_cache, v_cache = rand(2, 3, 4, 8, seed=6), rand(2, 6, 2, 8, seed=7), rand(2, 6, 2, 8, seed=8)
    out, plan = namespace["decode"](q, k_cache, v_cache, torch.tensor([4, 6], dtype=torch.int32))
    assert plan is None
    want = _sink_reference(q, k_cache, v_cache, (4, 6), torch.full((4,), -1e9), 0.3)  # no sink weight
    close(out, torch.from_numpy(want), atol=1e-5)
    sites = _sites(
        """
        from flash_attn_interface import get_scheduler_metadata

        def plan(n, lengths):
            return get_scheduler_metadata(n, 1, 64, 8, 8, 128, lengths, splits=2)
        """
    )
    assert "unknown argument 'splits'" in sites[(5, "refused")]
