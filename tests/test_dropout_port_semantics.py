"""Ported dropout at p > 0 runs on the contract's dropout (``flashport.torch.attention(dropout_p=,
generator=)``).

Needs the contract's dropout (merged separately): until then every test here fails with
``TypeError: attention() got an unexpected keyword argument 'dropout_p'``.

* Rewritten code (FPA001/FPA002/FPA101/FPA110) and the drop-ins (``flash_attn_compat``,
  ``xformers_compat``) draw from torch's default generator: seeded with ``torch.manual_seed(s)``
  they give exactly what ``flashport.torch.attention(..., dropout_p=p, generator=g)`` gives with
  ``g`` seeded ``s``.
* Keep-mask statistics against the definition (flash-attn / SDPA / xformers): with uniform
  attention (q = 0) and one-hot values, every output entry is ``keep / (Sk * (1 - p))`` -- dropout on
  the normalized probabilities with 1/(1-p) scaling -- and about ``1 - p`` of them are kept.
"""

from __future__ import annotations

import textwrap

import pytest

torch = pytest.importorskip("torch")

import flashport  # noqa: E402
import flashport.torch  # noqa: E402
from flashport import rules as registry  # noqa: E402
from flashport.integrations import flash_attn_compat, xformers_compat  # noqa: E402
from flashport.rewriter.engine.pipeline import transform_source  # noqa: E402
from flashport.rules.base import RuleOptions  # noqa: E402

P = 0.25


def rewrite_and_load(source: str) -> dict:
    """Rewrite ``source`` (every call must port) and exec it without its GPU imports."""
    result = transform_source(
        textwrap.dedent(source).encode(), "case.py", registry.all_rules(), RuleOptions()
    )
    assert result.new is not None and all(s.status == "rewrite" for s in result.sites), result.sites
    code = "\n".join(
        line
        for line in result.new.decode().splitlines()
        if not line.startswith(("from flash_attn", "import xformers"))
    )
    namespace: dict = {}
    exec(compile(code, "rewritten.py", "exec"), namespace)
    return namespace


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def seeded(seed):
    return torch.Generator().manual_seed(seed)


def test_rewritten_calls_draw_like_the_contract_with_a_seeded_generator():
    ns = rewrite_and_load("""
        import torch.nn.functional as F
        import xformers.ops as xops
        from flash_attn import flash_attn_func, flash_attn_qkvpacked_func

        def fa(q, k, v, p):
            return flash_attn_func(q, k, v, dropout_p=p, causal=True)

        def packed(qkv, training, p):
            return flash_attn_qkvpacked_func(qkv, p if training else 0.0)

        def sdpa(q, k, v, p):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p)

        def xformers(q, k, v, p):
            return xops.memory_efficient_attention(q, k, v, p=p)
    """)
    q, k, v = rand(2, 5, 4, 8), rand(2, 7, 2, 8, seed=1), rand(2, 7, 2, 8, seed=2)
    torch.manual_seed(3)
    got = ns["fa"](q, k, v, P)
    want = flashport.torch.attention(q, k, v, causal=True, layout="BSHD", dropout_p=P, generator=seeded(3))
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert not torch.allclose(
        got, flashport.torch.attention(q, k, v, causal=True, layout="BSHD")
    )  # dropout ran

    qkv = rand(2, 6, 3, 2, 8, seed=4)
    torch.manual_seed(5)
    got = ns["packed"](qkv, True, P)
    want = flashport.torch.attention(*qkv.unbind(2), layout="BSHD", dropout_p=P, generator=seeded(5))
    torch.testing.assert_close(got, want, atol=0, rtol=0)

    x = rand(1, 2, 6, 8, seed=6)
    torch.manual_seed(7)
    got = ns["sdpa"](x, x, x, P)
    want = flashport.torch.attention(
        x, x, x, align="top_left", layout="BHSD", dropout_p=P, generator=seeded(7)
    )
    torch.testing.assert_close(got, want, atol=0, rtol=0)

    torch.manual_seed(8)
    got = ns["xformers"](q, k, v, P)
    want = flashport.torch.attention(q, k, v, layout="BSHD", dropout_p=P, generator=seeded(8))
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_drop_ins_pass_dropout_to_the_contract():
    q, k, v = rand(2, 5, 4, 8), rand(2, 7, 2, 8, seed=1), rand(2, 7, 2, 8, seed=2)
    torch.manual_seed(11)
    got = flash_attn_compat.flash_attn_func(q, k, v, P, causal=True)
    want = flashport.torch.attention(q, k, v, causal=True, layout="BSHD", dropout_p=P, generator=seeded(11))
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.manual_seed(12)
    got = xformers_compat.memory_efficient_attention(q, k, v, p=P)
    want = flashport.torch.attention(q, k, v, layout="BSHD", dropout_p=P, generator=seeded(12))
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def _uniform_one_hot(batch, heads, s_q, s_k):
    """q = 0 (every key weighs 1/Sk) and v = one-hot keys: out[..., j] = weight of key j after dropout."""
    q = torch.zeros(batch, s_q, heads, 4)
    k = rand(batch, s_k, heads, 4, seed=1)
    v = torch.eye(s_k).expand(batch, heads, s_k, s_k).transpose(1, 2).contiguous()
    return q, k, v


def _check_keep_statistics(out, s_k, p):
    kept_value = 1.0 / (s_k * (1 - p))
    kept = (out - kept_value).abs() < 1e-5
    dropped = out.abs() < 1e-6
    assert bool((kept | dropped).all()), "each weight is either dropped (0) or 1/Sk scaled by 1/(1-p)"
    fraction = kept.double().mean().item()
    sigma = (p * (1 - p) / out.numel()) ** 0.5
    assert abs(fraction - (1 - p)) < 5 * sigma, fraction


@pytest.mark.parametrize("entry", ["flash_attn_compat", "xformers_compat", "varlen"])
def test_keep_mask_statistics_and_scaling(entry):
    batch, heads, s_q, s_k = 1, 2, 64, 16
    q, k, v = _uniform_one_hot(batch, heads, s_q, s_k)
    torch.manual_seed(21)
    if entry == "flash_attn_compat":
        out = flash_attn_compat.flash_attn_func(q, k, v, dropout_p=P)
    elif entry == "xformers_compat":
        out = xformers_compat.memory_efficient_attention(q, k, v, p=P)
    else:
        cu_q = torch.tensor([0, 30, 64], dtype=torch.int32)
        cu_k = torch.tensor([0, 16, 32], dtype=torch.int32)
        k2 = torch.cat([k[0], k[0]])
        v2 = torch.cat([v[0], v[0]])
        out = flash_attn_compat.flash_attn_varlen_func(q[0], k2, v2, cu_q, cu_k, 34, 16, dropout_p=P)
        out = out[:, :, :s_k]
    _check_keep_statistics(out, s_k, P)


def test_transformers_attention_function_passes_dropout_on():
    """``attn_implementation="flashport"`` in training: the layer's dropout goes to the contract."""
    pytest.importorskip("transformers")
    from flashport.integrations.transformers import flashport_attention_forward

    q, k = rand(1, 4, 5, 8), rand(1, 2, 5, 8, seed=1)
    torch.manual_seed(31)
    got, _ = flashport_attention_forward(None, q, k, k, None, dropout=P, is_causal=False)
    want = flashport.torch.attention(
        q, k, k, align="top_left", layout="BHSD", dropout_p=P, generator=seeded(31)
    )
    torch.testing.assert_close(got, want.transpose(1, 2), atol=0, rtol=0)


def test_rewritten_varlen_call_with_dropout_runs_the_drop_in():
    ns = rewrite_and_load("""
        from flash_attn import flash_attn_varlen_func

        def attend(q, k, v, cu_q, cu_k, p):
            return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 4, dropout_p=p, causal=True)
    """)
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 4, 8], dtype=torch.int32)
    q, k, v = rand(5, 2, 8), rand(8, 1, 8, seed=1), rand(8, 1, 8, seed=2)
    torch.manual_seed(41)
    got = ns["attend"](q, k, v, cu_q, cu_k, P)
    torch.manual_seed(41)
    want = flash_attn_compat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 4, dropout_p=P, causal=True)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert not torch.allclose(
        got, flash_attn_compat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 4, causal=True)
    )
