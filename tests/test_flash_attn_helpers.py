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
