"""``flashport.torch.attention(..., return_lse=True)``: the lse is differentiable.

Ring / context-parallel code merges partial results through lse, and FA3/FA4's lse carries a
gradient, so a loss built from ``out`` and ``lse`` must give the same gradients as the float64
reference differentiated by central differences.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from reference import reference_attention  # noqa: E402

import flashport.torch as ft  # noqa: E402
from flashport.torch import _checks, _native, _routing  # noqa: E402

GRAD_NAMES = ("query", "key", "value", "bias")
# (name, Sq, Sk, options, bias shape): the last has query rows that see no key (lse = -inf).
CASES = {
    "plain": (4, 5, {}, None),
    "causal_gqa_bias": (4, 6, {"causal": True}, (1, 4, 4, 6)),
    "softcap_window": (5, 5, {"softcap": 2.0, "window": (1, 1)}, None),
    "empty_rows": (6, 3, {"causal": True}, None),
}


@functools.cache
def inputs(name):
    sq, sk, _, bias_shape = CASES[name]
    rng = np.random.default_rng(7)
    x = {
        "query": rng.standard_normal((2, sq, 4, 8)),
        "key": rng.standard_normal((2, sk, 2, 8)),
        "value": rng.standard_normal((2, sk, 2, 8)),
    }
    if bias_shape:
        x["bias"] = rng.standard_normal(bias_shape)
    return x


def ref(x, options):
    x = dict(x)
    return reference_attention(x.pop("query"), x.pop("key"), x.pop("value"), **x, **options)


def loss_weights(name, use_out):
    """Cotangents for out and lse; rows with lse = -inf get weight 0 (their lse is not a number)."""
    options = CASES[name][2]
    out, lse = ref(inputs(name), options)
    rng = np.random.default_rng(3)
    g_out = rng.standard_normal(out.shape) if use_out else np.zeros(out.shape)
    g_lse = np.where(np.isneginf(lse), 0.0, rng.standard_normal(lse.shape))
    return g_out, g_lse


@functools.cache
def reference_grads(name, use_out):
    """Float64 gradients of ``sum(g_out * out) + sum(g_lse * lse)`` by central differences."""
    options = CASES[name][2]
    g_out, g_lse = loss_weights(name, use_out)
    x = {n: v.copy() for n, v in inputs(name).items()}

    def loss():
        out, lse = ref(x, options)
        return np.sum(g_out * out) + np.sum(g_lse * np.where(np.isneginf(lse), 0.0, lse))

    eps, grads = 1e-6, {}
    for n, value in x.items():
        flat, grad = value.reshape(-1), np.zeros(value.size)
        for i in range(value.size):
            keep = flat[i]
            flat[i] = keep + eps
            plus = loss()
            flat[i] = keep - eps
            minus = loss()
            flat[i] = keep
            grad[i] = (plus - minus) / (2 * eps)
        grads[n] = grad.reshape(value.shape)
    return grads


def torch_loss(name, backend, use_out):
    x = {n: torch.tensor(v, dtype=torch.float32, requires_grad=True) for n, v in inputs(name).items()}
    out, lse = ft.attention(**x, **CASES[name][2], backend=backend, return_lse=True, layout="BSHD")
    g_out, g_lse = (torch.from_numpy(g).float() for g in loss_weights(name, use_out))
    finite_lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    loss = (finite_lse * g_lse).sum() + ((out * g_out).sum() if use_out else 0.0)
    return x, lse, loss


@pytest.mark.parametrize("use_out", [True, False], ids=["out_and_lse", "lse_only"])
@pytest.mark.parametrize("backend", ["auto", "xla", "blockwise", "torch"])
@pytest.mark.parametrize("name", list(CASES))
def test_lse_gradients_match_finite_differences(name, backend, use_out):
    x, lse, loss = torch_loss(name, backend, use_out)
    assert lse.requires_grad
    loss.backward()
    for n, want in reference_grads(name, use_out).items():
        # lse does not depend on value: the pure-torch path leaves its grad None, JAX gives zeros.
        got = torch.zeros_like(x[n]) if x[n].grad is None and n == "value" and not use_out else x[n].grad
        assert got is not None and torch.isfinite(got).all(), n
        np.testing.assert_allclose(got.numpy(), want, atol=2e-4, rtol=2e-4, err_msg=n)


def test_cuda_auto_skips_flash_attn_when_lse_needs_a_gradient():
    """flash-attn's backward ignores the lse cotangent, so auto runs the exact (differentiable) math
    path instead; without gradients flash-attn still serves the call."""
    from test_torch_adapter import FakeFlashAttn

    q, k = (torch.randn(1, 4, 2, 8, dtype=torch.bfloat16) for _ in range(2))
    fake = FakeFlashAttn()
    _routing.cuda_attention(_checks.check(q, k, k, return_lse=True), True, flash=fake)
    assert len(fake.calls) == 1
    q.requires_grad_(True)
    _, lse = _routing.cuda_attention(_checks.check(q, k, k, return_lse=True), True, flash=fake)
    assert len(fake.calls) == 1 and lse.requires_grad
    lse.sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0


def test_explicit_flash_attn_refuses_a_backward_through_lse(monkeypatch):
    from test_torch_adapter import FakeFlashAttn

    monkeypatch.setattr(_native, "import_flash_attn", FakeFlashAttn)
    q = torch.randn(1, 4, 2, 8, dtype=torch.bfloat16, requires_grad=True)
    _, lse = ft.attention(
        q, q.detach(), q.detach(), backend="flash_attn", return_lse=True, layout="BSHD"
    )  # fake: detached math
    with pytest.raises(RuntimeError, match=r"lse without gradient.*backend='auto'"):
        lse.sum().backward()
