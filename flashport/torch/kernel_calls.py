"""flashport's JAX forward and backward as plain kernel calls on torch tensors (no autograd).

The public bridge for code that drives the attention kernels itself, as flash-attn's private kernel
entry points do (``flashport.integrations.flash_attn.private``): :func:`forward` and
:func:`backward` run :func:`flashport.torch._jax.jax_forward` / ``jax_backward`` on CPU tensors
through DLPack and on torch_xla / torchax tensors through their JAX bridges, and return torch
tensors; the caller's ``torch.autograd.Function`` owns the graph. :func:`check_dropout_p` and
:func:`dropout_seed` are the contract's dropout checks and seed words as
:func:`flashport.torch.attention` draws them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from flashport.torch import _dropout, _jax, device_kind

__all__ = ["backward", "check_dropout_p", "dropout_seed", "forward"]


def _run(fn: Callable[..., Any], args: Sequence[Any], static: dict[str, Any]) -> tuple[Any, ...]:
    """``fn`` (a JAX function of :mod:`flashport.torch._jax`) on torch tensors; torch results."""
    kind = device_kind(args[0])
    if kind in ("xla", "torchax"):
        runner = _jax.torch_xla_runner() if kind == "xla" else _jax.torchax_runner()
        return tuple(runner.call(fn, tuple(args), dict(static)))
    return tuple(_jax.to_torch(x) for x in fn(*(_jax.to_jax(a) for a in args), **static))


def forward(args: Sequence[Any], static: dict[str, Any]) -> tuple[Any, ...]:
    """``(out, lse)`` of the contract for ``args`` = (q, k, v, bias, mask, q_segment_ids,
    kv_segment_ids, seed) (None for an absent one) and the contract's static keywords ``static``."""
    return _run(_jax.jax_forward, args, static)


def backward(args: Sequence[Any], static: dict[str, Any]) -> tuple[Any, ...]:
    """``(dq, dk, dv, dbias)`` from the forward's inputs (as :func:`forward` takes them), its
    residuals ``out`` and ``lse`` and the cotangents ``d_out``, ``d_lse``, appended to ``args`` in
    that order; the forward is not run again."""
    return _run(_jax.jax_backward, args, static)


def check_dropout_p(dropout_p: Any) -> float:
    """Validate ``dropout_p`` as :func:`flashport.torch.attention` does (a real number in [0, 1))."""
    return _dropout.check_p(dropout_p)


def dropout_seed(like: torch.Tensor) -> torch.Tensor:
    """Fresh dropout seed words from torch's default generator, as the int32 [2] tensor the kernels
    take, made like ``like`` (same device and tensor type)."""
    return _dropout.seed_tensor(_dropout.draw_words(None), like.detach())
