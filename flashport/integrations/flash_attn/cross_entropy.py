"""``flash_attn.ops.triton.cross_entropy.cross_entropy_loss`` without flash-attn (plain torch).

flash-attn's function runs a Triton kernel; its meaning (flash-attn 2.8.3, the function's
docstring and its autograd Function), per row ``i`` of ``logits`` ``[N, V]`` with ``z = logit_scale
* logits`` in fp32 and ``lse = logsumexp(z)``:

* ``losses[i] = lse - (1 - label_smoothing) * z[label] - label_smoothing * sum(z) / V``, plus the
  z-loss ``lse_square_scale * lse ** 2``, which is also returned alone as ``z_losses[i]`` (fp32,
  not differentiable); rows whose label is ``ignore_index`` get 0 in both;
* ``precomputed_lse`` ``[N]`` replaces the computed ``lse`` only when ``logit_scale == 1`` and
  ``label_smoothing == 0`` (it is ignored otherwise);
* the gradient with respect to ``logits`` is ``dloss * logit_scale * (p * (1 + 2 *
  lse_square_scale * lse) - (1 - label_smoothing) * onehot(label) - label_smoothing / V)`` with ``p =
  exp(z - lse)`` (0 on ignored rows), in ``logits``' dtype; ``inplace_backward=True`` writes it into
  ``logits``' storage (saving memory) instead of a new tensor.

Tensor parallelism over the vocabulary (``process_group``) is not replicated: the drop-in raises
``NotImplementedError`` for a process group.
"""

from __future__ import annotations

import functools

__all__ = ["cross_entropy_loss"]


@functools.cache
def _function():
    import torch

    class CrossEntropyLoss(torch.autograd.Function):
        """Forward and backward of flash-attn's fused cross entropy, as the module docstring says."""

        @staticmethod
        def forward(
            ctx,
            logits,
            labels,
            precomputed_lse,
            smoothing,
            logit_scale,
            lse_square_scale,
            ignore_index,
            inplace_backward,
        ):
            n_rows, n_cols = logits.shape
            if labels.shape != (n_rows,):
                raise ValueError(f"labels must have shape ({n_rows},), got {tuple(labels.shape)}")
            z = logits.float() * logit_scale
            if precomputed_lse is not None and logit_scale == 1.0 and smoothing == 0.0:
                if precomputed_lse.shape != (n_rows,):
                    raise ValueError(f"precomputed_lse must have shape ({n_rows},)")
                lse = precomputed_lse.float()
            else:
                lse = torch.logsumexp(z, dim=-1)
            ignored = labels == ignore_index
            picked = z.gather(1, labels.clamp(0, n_cols - 1).long()[:, None])[:, 0]
            losses = lse - (1.0 - smoothing) * picked
            if smoothing > 0.0:
                losses = losses - smoothing * z.sum(dim=-1) / n_cols
            z_losses = (
                lse_square_scale * lse.square() if lse_square_scale != 0.0 else torch.zeros_like(losses)
            )
            losses = (losses + z_losses).masked_fill(ignored, 0.0)
            z_losses = z_losses.masked_fill(ignored, 0.0)
            ctx.save_for_backward(logits, lse, labels)
            ctx.mark_non_differentiable(z_losses)
            ctx.smoothing, ctx.logit_scale, ctx.lse_square_scale = smoothing, logit_scale, lse_square_scale
            ctx.ignore_index, ctx.inplace_backward = ignore_index, inplace_backward
            return losses, z_losses

        @staticmethod
        def backward(ctx, grad_losses, grad_z_losses):
            del grad_z_losses  # z_losses are only for logging
            logits, lse, labels = ctx.saved_tensors
            n_cols = logits.shape[1]
            probs = torch.exp(logits.float() * ctx.logit_scale - lse[:, None])
            probs = probs * (1.0 + 2.0 * ctx.lse_square_scale * lse[:, None])
            hit = torch.arange(n_cols, device=logits.device)[None, :] == labels[:, None]
            probs = probs - (1.0 - ctx.smoothing) * hit.to(probs.dtype) - ctx.smoothing / n_cols
            dloss = grad_losses.float().masked_fill(labels == ctx.ignore_index, 0.0)
            grad = (dloss[:, None] * ctx.logit_scale) * probs
            if ctx.inplace_backward:
                logits.copy_(grad)
                return logits, None, None, None, None, None, None, None
            return grad.to(logits.dtype), None, None, None, None, None, None, None

    return CrossEntropyLoss


def cross_entropy_loss(
    logits,
    labels,
    precomputed_lse=None,
    label_smoothing=0.0,
    logit_scale=1.0,
    lse_square_scale=0.0,
    ignore_index=-100,
    inplace_backward=False,
    process_group=None,
):
    """flash-attn's ``cross_entropy_loss`` (module docstring): ``(losses, z_losses)``, both ``[N]``
    fp32.

    Raises:
      NotImplementedError: for a ``process_group`` (vocabulary split across ranks).
    """
    if process_group is not None:
        raise NotImplementedError("flashport's cross_entropy_loss does not split the vocabulary across ranks")
    return _function().apply(
        logits,
        labels,
        precomputed_lse,
        label_smoothing,
        logit_scale,
        lse_square_scale,
        ignore_index,
        inplace_backward,
    )
