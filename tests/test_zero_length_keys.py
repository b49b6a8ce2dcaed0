"""Zero-length key sequences (Sk == 0): every query row sees no key, so the contract's answer is
out = 0, lse = -inf and zero gradients, on every backend, the torch adapter and varlen.

The reference is the float64 reference for the same rows with one key that a mask hides: a row
that sees no key must not care how many hidden keys there are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import reference_attention

import flashport

BACKENDS = ["auto", "xla", "blockwise", "pallas_tpu_interpret"]
B, SQ, HQ, HKV, D, DV = 2, 3, 4, 2, 8, 16


def expected():
    """float64 reference of the same query rows with one key, hidden by the mask."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, SQ, HQ, D))
    k, v = rng.standard_normal((B, 1, HKV, D)), rng.standard_normal((B, 1, HKV, DV))
    return reference_attention(q, k, v, mask=np.zeros((SQ, 1), bool))


def inputs(dtype=jnp.float32):
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((B, SQ, HQ, D)), dtype)
    return q, jnp.zeros((B, 0, HKV, D), dtype), jnp.zeros((B, 0, HKV, DV), dtype)


@pytest.mark.parametrize(
    "options",
    [{}, {"causal": True}, {"window": (1, 1), "softcap": 5.0}],
    ids=["plain", "causal", "window_softcap"],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_jax_backends_return_zeros_and_neg_inf_lse(backend, options):
    want_out, want_lse = expected()
    q, k, v = inputs()
    out, lse = flashport.attention(q, k, v, backend=backend, return_lse=True, **options)
    assert out.shape == want_out.shape and out.dtype == q.dtype
    np.testing.assert_array_equal(np.asarray(out), want_out)
    np.testing.assert_array_equal(np.asarray(lse), want_lse)

    def loss(q, k, v):
        out, lse = flashport.attention(q, k, v, backend=backend, return_lse=True, **options)
        return out.sum() + jnp.where(jnp.isinf(lse), 0.0, lse).sum()

    dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert not np.asarray(dq).any() and dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize("backend", BACKENDS)
def test_bias_mask_and_segments_with_no_keys(backend):
    q, k, v = inputs(jnp.bfloat16)
    out = flashport.attention(
        q,
        k,
        v,
        bias=jnp.zeros((B, 1, SQ, 0)),
        mask=jnp.zeros((SQ, 0), bool),
        q_segment_ids=jnp.zeros((B, SQ), jnp.int32),
        kv_segment_ids=jnp.zeros((B, 0), jnp.int32),
        backend=backend,
    )
    np.testing.assert_array_equal(np.asarray(out, np.float64), expected()[0])


def test_varlen_with_no_keys():
    q, _, _ = inputs()
    q = q.reshape(B * SQ, HQ, D)
    k, v = jnp.zeros((0, HKV, D), jnp.float32), jnp.zeros((0, HKV, DV), jnp.float32)
    cu_q, cu_k = jnp.array([0, SQ, 2 * SQ], jnp.int32), jnp.zeros((B + 1,), jnp.int32)
    out = flashport.varlen_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    np.testing.assert_array_equal(np.asarray(out), expected()[0].reshape(B * SQ, HQ, DV))


@pytest.mark.parametrize("backend", ["auto", "torch", "sdpa", "xla", "blockwise"])
def test_torch_adapter_with_no_keys(backend):
    torch = pytest.importorskip("torch")
    import flashport.torch as ft

    q = torch.from_numpy(np.array(inputs()[0])).requires_grad_(True)
    k, v = torch.zeros(B, 0, HKV, D, requires_grad=True), torch.zeros(B, 0, HKV, DV, requires_grad=True)
    want_out, want_lse = expected()
    if backend == "sdpa":  # SDPA has no lse
        out, lse = ft.attention(q, k, v, backend=backend, layout="BSHD"), torch.from_numpy(want_lse)
    else:
        out, lse = ft.attention(q, k, v, backend=backend, return_lse=True, layout="BSHD")
    np.testing.assert_array_equal(out.detach().numpy(), want_out)
    np.testing.assert_array_equal(lse.detach().numpy(), want_lse)
    out.sum().backward()
    assert q.grad is not None and not q.grad.any()


def test_torch_cuda_auto_route_with_no_keys():
    """The CUDA auto route (run here on CPU tensors) takes the math path instead of SDPA/flash-attn."""
    torch = pytest.importorskip("torch")
    from flashport.torch import _checks, _routing

    q = torch.from_numpy(np.array(inputs()[0]))
    k, v = torch.zeros(B, 0, HKV, D), torch.zeros(B, 0, HKV, DV)
    out, lse = _routing.cuda_attention(_checks.check(q, k, v, return_lse=True), True, flash=None)
    want_out, want_lse = expected()
    np.testing.assert_array_equal(out.numpy(), want_out)
    np.testing.assert_array_equal(lse.numpy(), want_lse)
