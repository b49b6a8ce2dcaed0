"""flash-attn's non-attention helpers that model code imports beside the attention call: the rotary
embedding drop-in against a float64 reference written from flash-attn's docstring (a rotation of
feature pairs by the angle of the token's position, as complex multiplication), and
``bert_padding.rearrange`` delegating to einops."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flashport.integrations import bert_padding, rotary  # noqa: E402


def _rand(*shape, seed):
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape))


def _reference(x, angles, interleaved, positions):
    """float64: pairs of the first 2 * angles.shape[-1] features rotated by angles[position]
    (positions past the table: unrotated), as complex numbers; the rest unchanged."""
    x = x.double().numpy()
    half = angles.shape[-1]
    out = x.copy()
    for index in np.ndindex(*positions.shape):
        p = int(positions[index])
        if p >= angles.shape[0]:
            continue
        turn = np.exp(1j * angles[p].numpy())
        row = x[index]  # [H, D]
        if interleaved:
            z = (row[:, 0 : 2 * half : 2] + 1j * row[:, 1 : 2 * half : 2]) * turn
            out[index][:, 0 : 2 * half : 2], out[index][:, 1 : 2 * half : 2] = z.real, z.imag
        else:
            z = (row[:, :half] + 1j * row[:, half : 2 * half]) * turn
            out[index][:, :half], out[index][:, half : 2 * half] = z.real, z.imag
    return out


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("offsets", [0, 3, "per_batch"])
def test_rotary_dense_matches_the_reference(interleaved, offsets):
    x = _rand(2, 5, 3, 10, seed=1)
    angles = _rand(7, 3, seed=2)  # rotary_dim 6 of 10; 7 table rows, so some positions run past it
    seqlen_offsets = torch.tensor([1, 4]) if offsets == "per_batch" else offsets
    out = rotary.apply_rotary_emb(x, angles.cos(), angles.sin(), interleaved, seqlen_offsets=seqlen_offsets)
    shift = np.array([1, 4]) if offsets == "per_batch" else np.array([offsets, offsets])
    positions = np.arange(5)[None, :] + shift[:, None]
    np.testing.assert_allclose(out.numpy(), _reference(x, angles, interleaved, positions), atol=1e-12)


def test_rotary_varlen_restarts_positions_per_sequence_and_runs_in_place():
    x = _rand(7, 2, 8, seed=3)
    angles = _rand(6, 4, seed=4)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    want = _reference(x, angles, False, np.array([0, 1, 2, 0, 1, 2, 3]) + 2)
    got = x.clone()
    returned = rotary.apply_rotary_emb(
        got, angles.cos(), angles.sin(), inplace=True, seqlen_offsets=2, cu_seqlens=cu
    )
    assert returned is got
    np.testing.assert_allclose(got.numpy(), want, atol=1e-12)


def test_rotary_gradient_is_the_inverse_rotation():
    x = _rand(1, 4, 2, 8, seed=5).requires_grad_()
    angles = _rand(4, 4, seed=6)
    cotangent = _rand(1, 4, 2, 8, seed=7)
    (grad,) = torch.autograd.grad(
        (rotary.apply_rotary_emb(x, angles.cos(), angles.sin()) * cotangent).sum(), x
    )
    # a rotation's transpose is the rotation by the opposite angle
    want = _reference(cotangent, -angles, False, np.arange(4)[None, :])
    np.testing.assert_allclose(grad.numpy(), want, atol=1e-12)
    assert rotary.apply_rotary_emb_func is rotary.apply_rotary_emb


def test_bert_padding_rearrange_is_einops_rearrange(monkeypatch):
    calls = []
    fake = types.ModuleType("einops")
    fake.rearrange = lambda tensor, pattern, **axes: calls.append((tensor, pattern, axes)) or "done"
    monkeypatch.setitem(sys.modules, "einops", fake)
    assert bert_padding.rearrange("t", "(b s) d -> b s d", b=2) == "done"
    assert calls == [("t", "(b s) d -> b s d", {"b": 2})]


def _rotary_module_reference(x, dim, base, interleaved, positions, magnitude=None):
    """float64, from flash-attn's RotaryEmbedding docstring: feature pair i of the first ``dim``
    features turns by ``position * base ** (-2 i / dim)``; with XPos (``magnitude``: [S, dim / 2])
    it is also scaled."""
    inv_freq = base ** (-np.arange(0, dim, 2) / dim)
    angles = torch.from_numpy(np.arange(positions.max() + 1)[:, None] * inv_freq)
    out = _reference(x, angles, interleaved, positions)
    if magnitude is None:
        return out
    pairs = (
        (slice(0, dim, 2), slice(1, dim, 2)) if interleaved else (slice(0, dim // 2), slice(dim // 2, dim))
    )
    for index in np.ndindex(*positions.shape):
        for part in pairs:
            out[index][:, part] *= magnitude[int(positions[index])]
    return out


def _xpos(seqlen, dim, scale_base):
    """XPos's per-pair scale at every cached position: ((2 i + 0.4 dim) / (1.4 dim)) ** ((p - L // 2) / scale_base)."""
    zeta = (np.arange(0, dim, 2) + 0.4 * dim) / (1.4 * dim)
    return zeta[None, :] ** ((np.arange(seqlen)[:, None] - seqlen // 2) / scale_base)


# the tables are built in fp32 (pos_idx_in_fp32, as flash-attn does): measured error ~1.4e-7
ROTARY_MODULE_TOL = 5e-7


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_module_rotates_packed_qkv_in_place(interleaved):
    module = rotary.RotaryEmbedding(8, base=100.0, interleaved=interleaved)
    qkv = _rand(2, 5, 3, 2, 12, seed=11)
    original = qkv.clone()
    returned = module(qkv, seqlen_offset=2)
    assert returned is qkv
    positions = np.arange(5)[None, :].repeat(2, 0) + 2
    for part in (0, 1):
        want = _rotary_module_reference(original[:, :, part], 8, 100.0, interleaved, positions)
        np.testing.assert_allclose(qkv[:, :, part].numpy(), want, atol=ROTARY_MODULE_TOL)
    np.testing.assert_array_equal(qkv[:, :, 2].numpy(), original[:, :, 2].numpy())


def test_rotary_module_grouped_heads_and_xpos_keys():
    """MQA/GQA packing ([B, S, Hq + 2 Hk, D] with num_heads_q) and a separate kv with XPos: queries
    scaled up, keys scaled down."""
    module = rotary.RotaryEmbedding(6, scale_base=4.0)
    qkv = _rand(1, 4, 4 + 2 * 1, 6, seed=12)
    original = qkv.clone()
    module(qkv, num_heads_q=4)
    positions = np.arange(4)[None, :]
    magnitude = _xpos(4, 6, 4.0)
    np.testing.assert_allclose(
        qkv[:, :, :4].numpy(),
        _rotary_module_reference(original[:, :, :4], 6, 10000.0, False, positions, magnitude),
        atol=ROTARY_MODULE_TOL,
    )
    np.testing.assert_allclose(
        qkv[:, :, 4:5].numpy(),
        _rotary_module_reference(original[:, :, 4:5], 6, 10000.0, False, positions, 1 / magnitude),
        atol=ROTARY_MODULE_TOL,
    )
    np.testing.assert_array_equal(qkv[:, :, 5:].numpy(), original[:, :, 5:].numpy())

    q, kv = _rand(1, 4, 2, 6, seed=13), _rand(1, 4, 2, 2, 6, seed=14)
    q0, kv0 = q.clone(), kv.clone()
    fresh = rotary.RotaryEmbedding(6, scale_base=4.0)
    got_q, got_kv = fresh(q, kv)
    assert got_q is q and got_kv is kv
    np.testing.assert_allclose(
        q.numpy(),
        _rotary_module_reference(q0, 6, 10000.0, False, positions, magnitude),
        atol=ROTARY_MODULE_TOL,
    )
    np.testing.assert_allclose(
        kv[:, :, 0].numpy(),
        _rotary_module_reference(kv0[:, :, 0], 6, 10000.0, False, positions, 1 / magnitude),
        atol=ROTARY_MODULE_TOL,
    )
    np.testing.assert_array_equal(kv[:, :, 1].numpy(), kv0[:, :, 1].numpy())


def test_rotary_module_keeps_flash_attns_cache_attributes_for_subclasses():
    """Subclasses in the wild override _update_cos_sin_cache and read these attributes."""
    module = rotary.RotaryEmbedding(4)
    module(_rand(1, 3, 3, 1, 4, seed=15))
    assert module._seq_len_cached == 3 and module._cos_cached.shape == (3, 2)
    assert module._cos_k_cached is None and module.inv_freq.dtype == torch.float32
    assert isinstance(module, torch.nn.Module) and "inv_freq" not in module.state_dict()
