"""flash-attn's fused cross entropy and sequence-parallel collectives, as drop-ins: the loss against a
float64 reference written from ``cross_entropy_loss``'s docstring (smoothed negative log-likelihood
plus z-loss, ignored rows zero), its gradient against float64 autograd of that reference, and the
collectives in a two-process gloo group against the concatenation / sum they document."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flashport.integrations import cross_entropy, distributed  # noqa: E402


def _reference_losses(logits, labels, smoothing, scale, z_scale, ignore_index, lse=None):
    """float64: lse - (1 - s) z[label] - s mean(z) + z_scale lse^2 with z = scale * logits; 0 where ignored."""
    z = logits.double() * scale
    lse = torch.logsumexp(z, dim=-1) if lse is None else lse.double()
    safe = labels.clamp(min=0)
    nll = lse - (1 - smoothing) * z[torch.arange(len(labels)), safe] - smoothing * z.mean(dim=-1)
    zl = z_scale * lse**2
    keep = labels != ignore_index
    return torch.where(keep, nll + zl, 0.0), torch.where(keep, zl, 0.0)


def _case(seed, rows=6, vocab=11):
    rng = np.random.default_rng(seed)
    logits = torch.from_numpy(rng.standard_normal((rows, vocab)) * 3).float()
    labels = torch.from_numpy(rng.integers(0, vocab, rows))
    labels[2] = -100
    return logits, labels


# fp32 forward and gradient: measured error up to ~7e-7
TOL = 3e-6


@pytest.mark.parametrize(
    ("smoothing", "scale", "z_scale"), [(0.0, 1.0, 0.0), (0.1, 0.5, 1e-2), (0.0, 2.0, 1e-3)]
)
def test_cross_entropy_matches_the_reference_and_its_gradient(smoothing, scale, z_scale):
    logits, labels = _case(1)
    x = logits.clone().requires_grad_()
    losses, z_losses = cross_entropy.cross_entropy_loss(
        x, labels, label_smoothing=smoothing, logit_scale=scale, lse_square_scale=z_scale
    )
    want, want_z = _reference_losses(logits, labels, smoothing, scale, z_scale, -100)
    assert losses.dtype == torch.float32 and z_losses.dtype == torch.float32
    np.testing.assert_allclose(losses.detach().numpy(), want.numpy(), atol=TOL, rtol=TOL)
    np.testing.assert_allclose(z_losses.numpy(), want_z.numpy(), atol=TOL, rtol=TOL)
    assert not z_losses.requires_grad
    cotangent = torch.linspace(0.5, 1.5, len(labels))
    (grad,) = torch.autograd.grad((losses * cotangent).sum(), x)
    reference = logits.double().requires_grad_()
    (want_grad,) = torch.autograd.grad(
        (_reference_losses(reference, labels, smoothing, scale, z_scale, -100)[0] * cotangent.double()).sum(),
        reference,
    )
    np.testing.assert_allclose(grad.numpy(), want_grad.numpy(), atol=TOL)
    assert not grad[2].any()  # an ignored row has no gradient


def test_cross_entropy_precomputed_lse_and_inplace_backward():
    logits, labels = _case(2)
    shifted = torch.logsumexp(logits, dim=-1) + 0.25  # a made-up lse shows which one is used
    losses, _ = cross_entropy.cross_entropy_loss(logits, labels, precomputed_lse=shifted)
    want, _ = _reference_losses(logits, labels, 0.0, 1.0, 0.0, -100, lse=shifted)
    np.testing.assert_allclose(losses.numpy(), want.numpy(), atol=TOL)
    smoothed, _ = cross_entropy.cross_entropy_loss(
        logits, labels, precomputed_lse=shifted, label_smoothing=0.1
    )
    np.testing.assert_allclose(
        smoothed.numpy(), _reference_losses(logits, labels, 0.1, 1.0, 0.0, -100)[0].numpy(), atol=TOL
    )  # ignored with smoothing, as flash-attn does

    x = logits.clone().requires_grad_()
    work = x * 1.0  # a non-leaf, as model logits are
    losses, _ = cross_entropy.cross_entropy_loss(work, labels, inplace_backward=True)
    (grad,) = torch.autograd.grad(losses.sum(), x)
    reference = logits.double().requires_grad_()
    (want_grad,) = torch.autograd.grad(
        _reference_losses(reference, labels, 0.0, 1.0, 0.0, -100)[0].sum(), reference
    )
    np.testing.assert_allclose(grad.numpy(), want_grad.numpy(), atol=TOL)
    np.testing.assert_allclose(work.detach().numpy(), want_grad.numpy(), atol=TOL)  # written in place


def test_cross_entropy_refuses_a_vocabulary_split():
    logits, labels = _case(3)
    with pytest.raises(NotImplementedError):
        cross_entropy.cross_entropy_loss(logits, labels, process_group=object())


def _collectives(rank, world, init, folder):
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        x = (torch.arange(6.0).reshape(3, 2) + 10 * rank).requires_grad_()
        gathered = distributed.all_gather(x, None)
        (grad,) = torch.autograd.grad((gathered * torch.arange(1.0, 13.0).reshape(6, 2)).sum(), x)
        y = torch.full((4, 2), float(rank + 1))
        scattered = distributed.reduce_scatter(y, None)
        summed, _ = distributed.all_reduce_raw(torch.full((2,), float(rank + 1)), None)
        np.savez(
            os.path.join(folder, f"rank{rank}.npz"),
            gathered=gathered.detach().numpy(),
            grad=grad.numpy(),
            scattered=scattered.numpy(),
            summed=summed.numpy(),
        )
    finally:
        torch.distributed.destroy_process_group()


def test_collectives_in_a_two_process_group(tmp_path):
    import torch.multiprocessing as mp

    init = f"file://{os.path.join(tmp_path, 'rendezvous')}"
    mp.spawn(_collectives, args=(2, init, str(tmp_path)), nprocs=2, join=True)  # spawn: no fork
    base = np.arange(6.0).reshape(3, 2)
    weights = np.arange(1.0, 13.0).reshape(6, 2)
    for rank in (0, 1):
        saved = np.load(os.path.join(tmp_path, f"rank{rank}.npz"))
        gathered, grad, scattered, summed = (saved[k] for k in ("gathered", "grad", "scattered", "summed"))
        np.testing.assert_array_equal(gathered, np.concatenate([base, base + 10]))
        # backward of a gather: the sum over ranks of each rank's cotangent, this rank's block
        np.testing.assert_array_equal(grad, 2 * weights[3 * rank : 3 * rank + 3])
        np.testing.assert_array_equal(scattered, np.full((2, 2), 3.0))
        np.testing.assert_array_equal(summed, np.full((2,), 3.0))
