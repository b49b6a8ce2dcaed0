"""cuDNN eligibility without a GPU: the cudnn backend's check refuses bias/mask shapes cuDNN cannot
take (so ``auto`` falls back and ``backend="cudnn"`` refuses before lowering), and ``auto``'s CUDA
choice never lands on a backend whose check refuses the call.

cuDNN (through ``jax.nn.dot_product_attention``) takes a bias of shape [B or 1, H or 1, Sq, Sk] and
raises "Bias must have same seq length as QKV" for one broadcast over queries or keys.
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import pytest

from flashport.kernels import api, cudnn, registry

B, SQ, SK, H, D = 2, 8, 16, 4, 64
FULL = (B, H, SQ, SK)


def broadcast_shapes():
    """Every shape broadcastable to FULL: each dim 1 or full, at ranks 2-4 (left-padded)."""
    for rank in (2, 3, 4):
        yield from itertools.product(*[(1, n) for n in FULL[-rank:]])


def call_with(bias_shape=None, mask_shape=None, causal=False):
    q = jnp.zeros((B, SQ, H, D), jnp.bfloat16)
    k = jnp.zeros((B, SK, H, D), jnp.bfloat16)
    bias = None if bias_shape is None else jnp.zeros(bias_shape, jnp.float32)
    mask = None if mask_shape is None else jnp.ones(mask_shape, bool)
    return api.prepare(q, k, k, bias=bias, mask=mask, causal=causal, align="top_left")[1]


@pytest.fixture
def with_gpu(monkeypatch):
    """Pretend a CUDA device is present so the shape rules are what decide."""
    monkeypatch.setattr(cudnn, "gpu_present", lambda: True)


@pytest.mark.parametrize("shape", list(broadcast_shapes()), ids=str)
def test_cudnn_check_takes_only_biases_spanning_both_sequence_axes(with_gpu, shape):
    padded = (1,) * (4 - len(shape)) + shape
    cudnn_can = padded[2:] == (SQ, SK)  # batch and head may broadcast; Sq and Sk may not
    reason = cudnn.check_call(call_with(bias_shape=shape))
    assert (reason is None) == cudnn_can, reason
    if not cudnn_can:
        assert "bias" in reason and str(list(padded)) in reason


@pytest.mark.parametrize("shape", list(broadcast_shapes()), ids=str)
@pytest.mark.parametrize("kind", ["bias", "mask"])
def test_auto_on_cuda_never_picks_a_backend_that_refuses(with_gpu, kind, shape):
    call = call_with(**{f"{kind}_shape": shape}, causal=True)
    name, why = registry.choose("cuda", call)
    assert registry.missing_features(registry.get(name), call) == [], (name, why)
    cudnn_ok = not registry.missing_features(registry.get("cudnn"), call)
    assert (name == "cudnn") == cudnn_ok
    if kind == "bias" and (1,) * (4 - len(shape)) + shape == (B, 1, 1, SK):  # key padding bias
        assert name != "cudnn" and "bias of shape" in why


def test_explicit_cudnn_refuses_a_key_padding_bias_before_lowering(with_gpu):
    q = jnp.zeros((B, SQ, H, D), jnp.bfloat16)
    k = jnp.zeros((B, SK, H, D), jnp.bfloat16)
    with pytest.raises(
        ValueError, match=r"backend='cudnn' does not support this call: bias of shape \[2, 1, 1, 16\]"
    ):
        api.attention(q, k, k, bias=jnp.zeros((B, 1, 1, SK)), backend="cudnn")
