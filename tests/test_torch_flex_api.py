"""``flashport.torch.flex_attention`` / ``create_block_mask``: torch's FlexAttention API on every route.

The CPU route is torch's own FlexAttention; the JAX routes (an explicit JAX backend here, the same
code the TPU routes take) trace the torch mods into JAX. Outputs and lse are compared with the
float64 reference (tests/reference.py) given the same mods written in numpy, and gradients with
torch autograd through a float64 materialized softmax.
"""

from __future__ import annotations

import numpy as np
import pytest
from reference import reference_attention

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")

import flashport.torch as ft  # noqa: E402

B, H, HKV, S, D = 2, 4, 2, 24, 16
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])
DOCS = torch.tensor([0] * 7 + [1] * 10 + [2] * 7)
TABLE = torch.linspace(-1.0, 1.0, 2 * S - 1)


def alibi(s, b, h, i, j):
    return s + SLOPES[h] * (j - i)


def relative_bias(s, b, h, i, j):
    return s + TABLE[i - j + S - 1]


def softcap(s, b, h, i, j):
    return 4.0 * torch.tanh(s / 4.0)


def documents(b, h, i, j):
    return (DOCS[i] == DOCS[j]) & (j <= i)


def prefix_lm(b, h, i, j):
    return (j <= i) | (j < 5)


def sliding_window(b, h, i, j):
    return (i - j <= 4) & (j <= i)


SCORE_MODS = {
    "alibi": (alibi, lambda s, b, h, i, j: s + SLOPES.numpy()[h] * (j - i)),
    "relative_bias": (relative_bias, lambda s, b, h, i, j: s + TABLE.numpy()[i - j + S - 1]),
    "softcap": (softcap, lambda s, b, h, i, j: 4.0 * np.tanh(s / 4.0)),
    "none": (None, None),
}
MASK_MODS = {
    "documents": (documents, lambda b, h, i, j: (DOCS.numpy()[i] == DOCS.numpy()[j]) & (j <= i)),
    "prefix_lm": (prefix_lm, lambda b, h, i, j: (j <= i) | (j < 5)),
    "sliding_window": (sliding_window, lambda b, h, i, j: (i - j <= 4) & (j <= i)),
    "none": (None, None),
}


def _inputs(hkv=H, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=g)
    k = torch.randn(B, hkv, S, D, generator=g)
    v = torch.randn(B, hkv, S, D, generator=g)
    return q, k, v


@pytest.mark.parametrize("backend", ["auto", "xla", "blockwise"])
@pytest.mark.parametrize(
    ("score", "mask"),
    [
        ("alibi", "documents"),
        ("relative_bias", "prefix_lm"),
        ("softcap", "sliding_window"),
        ("alibi", "none"),
        ("none", "documents"),
    ],
)
def test_flex_attention_matches_reference(score, mask, backend):
    q, k, v = _inputs(hkv=HKV)
    score_mod, score_ref = SCORE_MODS[score]
    mask_mod, mask_ref = MASK_MODS[mask]
    block_mask = None if mask_mod is None else ft.create_block_mask(mask_mod, None, None, S, S, device="cpu")
    out, lse = ft.flex_attention(
        q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True, return_lse=True, backend=backend
    )
    want, want_lse = reference_attention(
        q.numpy(), k.numpy(), v.numpy(), layout="BHSD", score_mod=score_ref, mask_mod=mask_ref
    )
    np.testing.assert_allclose(out.numpy(), want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", ["auto", "xla", "blockwise"])
def test_jax_route_gradients_match_torch_autograd(backend):
    """Explicit JAX backends, and ``auto`` on CPU with gradients (torch has no CPU flex backward)."""
    q, k, v = _inputs()
    block_mask = ft.create_block_mask(documents, None, None, S, S, device="cpu")
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = ft.flex_attention(*leaves, score_mod=alibi, block_mask=block_mask, backend=backend)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * d_out).sum().backward()

    ref = [x.double().clone().requires_grad_() for x in (q, k, v)]
    s = ref[0] @ ref[1].transpose(-1, -2) / D**0.5
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    s = s + SLOPES.double()[None, :, None, None] * (j - i)
    s = s.masked_fill(~documents(None, None, i, j), float("-inf"))
    want = torch.softmax(s, dim=-1) @ ref[2]
    (want * d_out.double()).sum().backward()
    np.testing.assert_allclose(out.detach().numpy(), want.detach().numpy(), rtol=2e-5, atol=2e-5)
    for got, r in zip(leaves, ref, strict=True):
        np.testing.assert_allclose(got.grad.numpy(), r.grad.numpy(), rtol=1e-4, atol=1e-4)


def test_create_block_mask_is_torchs_on_the_cpu_for_a_missing_gpu():
    block_mask = ft.create_block_mask(
        documents, None, None, S, S, device="cuda" if not torch.cuda.is_available() else "cpu", BLOCK_SIZE=8
    )
    want = flex.create_block_mask(documents, None, None, S, S, device="cpu", BLOCK_SIZE=8)
    assert type(block_mask) is type(want)
    assert torch.equal(block_mask.kv_num_blocks, want.kv_num_blocks)
    assert torch.equal(block_mask.full_kv_num_blocks, want.full_kv_num_blocks)
    assert block_mask.sparsity() == want.sparsity()


def test_jax_route_refuses_what_it_cannot_trace():
    q, k, v = _inputs()
    with pytest.raises(TypeError, match="cannot trace into JAX"):
        ft.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: torch.erf(s), backend="xla")
    with pytest.raises(TypeError, match="branches on a traced value"):
        ft.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s if i > j else s * 2, backend="xla")
    learned = SLOPES.clone().requires_grad_()
    with pytest.raises(TypeError, match="requires grad"):
        ft.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + learned[h], backend="xla")
    with pytest.raises(ValueError, match="enable_gqa"):
        ft.flex_attention(q, *_inputs(hkv=HKV)[1:], backend="xla")
