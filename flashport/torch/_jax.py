"""The JAX paths: torch tensors through ``flashport.attention``, differentiable through ``jax.vjp``.

A *runner* moves arrays between torch and JAX for one kind of device:

* :class:`DLPackRunner` (plain CPU tensors, or any device JAX shares over DLPack): zero-copy both
  ways for contiguous tensors; the forward keeps its ``jax.vjp`` closure for the backward.
* :class:`CallJaxRunner` (torch_xla via ``torch_xla.core.xla_builder.call_jax``, torchax via
  ``torchax.interop.call_jax``): the bridge stages :func:`jax_forward` / :func:`jax_backward` into the
  torch program. A bridge cannot carry a JAX VJP closure from the forward to the backward, so the
  backward is :func:`flashport.attention_backward` on the forward's residuals (inputs, ``out``,
  ``lse``): the backend's own flash backward, no recomputed forward.

:class:`JaxAttention` is the ``torch.autograd.Function`` both share; both ``out`` and ``lse`` are
differentiable (ring / context-parallel code merges partial results through lse). Nothing here imports jax at
module import time.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class StaticKeywords:
    """A call's static keywords as one hashable leaf that is not callable.

    torchax's ``call_jax`` turns every callable among its arguments into a torch function of torchax
    tensors, which would make the traced ``score_mod`` / ``mask_mod`` torch code; one opaque leaf
    crosses it untouched, and :func:`jax_forward` / :func:`jax_backward` (stable functions, as the
    bridges' caches need) unpack it."""

    items: tuple

    @classmethod
    def of(cls, keywords: dict) -> StaticKeywords:
        """The keywords, packed."""
        return cls(tuple(sorted(keywords.items())))


def unpack_static(static: dict[str, Any]) -> dict[str, Any]:
    """``static`` with a :class:`StaticKeywords` under ``static_keywords`` spread into it."""
    packed = static.pop("static_keywords", None)
    return {**static, **dict(packed.items)} if packed is not None else static


def jax_forward(q, k, v, bias, mask, q_seg, kv_seg, seed=None, **static):
    """``flashport.attention`` on JAX arrays with ``return_lse=True``; returns ``(out, lse)``.

    ``seed`` is None or the dropout seed words as int32 [2] bit patterns (``static`` then holds
    ``dropout_rate``); they become the raw uint32 key ``dropout_rng``. Module-level (a stable object)
    because torch_xla caches its compiled computation per function.
    """
    from flashport.kernels.contract.api import attention

    static = unpack_static(static)
    if seed is not None:
        import jax
        import jax.numpy as jnp

        static = dict(static, dropout_rng=jax.lax.bitcast_convert_type(seed, jnp.uint32))
    return attention(
        q, k, v, bias=bias, mask=mask, q_segment_ids=q_seg, kv_segment_ids=kv_seg, return_lse=True, **static
    )


def jax_backward(q, k, v, bias, mask, q_seg, kv_seg, seed, out, lse, d_out, d_lse, **static):
    """``(dq, dk, dv, dbias)`` for the cotangents ``(d_out, d_lse)`` of :func:`jax_forward`'s
    ``(out, lse)`` (dbias is None without a bias), from the forward's residuals ``out`` and ``lse``
    through :func:`flashport.attention_backward` (the chosen backend's residual backward; the
    forward is not run again). ``seed`` is the forward's dropout seed (the same mask) or None."""
    from flashport.kernels.contract.backward import attention_backward

    static = unpack_static(static)
    if seed is not None:
        import jax
        import jax.numpy as jnp

        static = dict(static, dropout_rng=jax.lax.bitcast_convert_type(seed, jnp.uint32))
    return attention_backward(
        q,
        k,
        v,
        out,
        lse,
        d_out,
        d_lse,
        bias=bias,
        mask=mask,
        q_segment_ids=q_seg,
        kv_segment_ids=kv_seg,
        **static,
    )


def _out_and_lse(q, k, v, bias, mask, q_seg, kv_seg, seed, static):
    return jax_forward(q, k, v, bias, mask, q_seg, kv_seg, seed, **static)


def to_jax(t: torch.Tensor | None):
    """A torch tensor as a JAX array over the same memory (DLPack); copies only non-contiguous tensors."""
    if t is None:
        return None
    import jax

    return jax.dlpack.from_dlpack(t.detach().contiguous())


def to_torch(a) -> torch.Tensor | None:
    """A JAX array as a torch tensor over the same memory (DLPack)."""
    if a is None:
        return None
    a.block_until_ready()
    return torch.from_dlpack(a)


class DLPackRunner:
    """Runs the JAX implementation on arrays shared with torch through DLPack (zero-copy)."""

    name = "dlpack"

    def forward(self, args, static, need_grad):
        """Return ``(out, lse, state)``; ``state`` is the VJP closure when gradients are needed."""
        import jax

        q, k, v, bias, mask, q_seg, kv_seg, seed = (to_jax(a) for a in args)
        if need_grad:
            f = functools.partial(
                _out_and_lse, mask=mask, q_seg=q_seg, kv_seg=kv_seg, seed=seed, static=static
            )
            (out, lse), vjp = jax.vjp(f, q, k, v, bias)
        else:
            (out, lse), vjp = jax_forward(q, k, v, bias, mask, q_seg, kv_seg, seed, **static), None
        return to_torch(out), to_torch(lse), vjp

    def backward(self, state, saved, d_out, d_lse, static):
        """``(dq, dk, dv, dbias)`` from the forward's VJP closure (``saved`` is unused)."""
        return tuple(to_torch(g) for g in state((to_jax(d_out), to_jax(d_lse))))


class CallJaxRunner:
    """Runs the JAX implementation through a bridge ``call(fn, args, kwargs)`` that takes and returns
    torch tensors (torch_xla's or torchax's ``call_jax``)."""

    def __init__(self, name, call):
        self.name = name
        self.call = call

    def forward(self, args, static, need_grad):
        """Return ``(out, lse, None)``."""
        out, lse = self.call(jax_forward, tuple(args), dict(static))
        return out, lse, None

    def backward(self, state, saved, d_out, d_lse, static):
        """``(dq, dk, dv, dbias)`` by staging :func:`jax_backward` through the bridge; ``saved`` is
        the forward's inputs followed by its ``out`` and ``lse`` (the residuals)."""
        cotangents = (d_out.contiguous(), d_lse.contiguous())
        return tuple(self.call(jax_backward, (*saved, *cotangents), dict(static)))


def torch_xla_runner() -> CallJaxRunner:
    """The runner for torch_xla tensors (PyTorch on TPU): ``torch_xla.core.xla_builder.call_jax``.

    Raises:
      ImportError when torchax cannot be imported: torch_xla's ``call_jax`` needs it (without it,
      torch_xla raises a bare ``AssertionError: Jax is required for this feature``).
    """
    from torch_xla.core import xla_builder

    try:
        import torchax.interop  # noqa: F401  (call_jax converts dtypes and arrays through torchax)
    except ImportError as err:
        raise ImportError(
            "flashport.torch.attention on torch_xla tensors runs through torch_xla's call_jax, which needs "
            f"the torchax package (pip install torchax; tested: torch_xla 2.9.0 + torchax 0.0.13): {err}"
        ) from err

    def call(fn, args, kwargs):
        # torch_xla 2.9 caches one traced computation per input signature but keeps a single output
        # tree per function (the last traced), so a backward without bias (dbias None) after one with
        # a bias would unflatten 3 outputs into 4 slots. Keying the cache on which arguments are None
        # gives each output structure its own entry.
        key = (fn.__module__, fn.__qualname__, tuple(a is None for a in args))
        return xla_builder.call_jax(fn, args, kwargs, name="flashport_attention", override_hash=key)

    return CallJaxRunner("torch_xla", call)


def torchax_runner() -> CallJaxRunner:
    """The runner for torchax tensors (PyTorch on JAX): ``torchax.interop.call_jax``."""
    from torchax import interop

    def call(fn, args, kwargs):
        return interop.call_jax(fn, *args, static_keywords=StaticKeywords.of(kwargs))

    return CallJaxRunner("torchax", call)


class JaxAttention(torch.autograd.Function):
    """``(out, lse)`` from a runner; the backward is the JAX VJP of both outputs."""

    @staticmethod
    def forward(ctx, runner, static, need_grad, q, k, v, bias, mask, q_seg, kv_seg, seed=None):
        """Run the JAX forward; keep what the backward needs when ``need_grad`` (the caller's grad
        mode and requires_grad: ``ctx.needs_input_grad`` ignores ``torch.no_grad()``). ``seed``: the
        dropout seed words (int32 [2]) or None; saved so the backward regenerates the same mask."""
        out, lse, state = runner.forward((q, k, v, bias, mask, q_seg, kv_seg, seed), static, need_grad)
        ctx.runner, ctx.static, ctx.state = runner, static, state
        if need_grad:
            # Saving inputs and out (which JAX's residuals may alias) makes torch reject in-place
            # changes to them between forward and backward instead of silently using new values.
            ctx.save_for_backward(q, k, v, bias, mask, q_seg, kv_seg, seed, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        """Gradients for query, key, value and bias from the JAX VJP of ``out`` and ``lse``."""
        # torch materializes an unused output's cotangent as zeros, so both are tensors here.
        # saved: the forward's inputs (seed included), then its residuals out and lse.
        dq, dk, dv, dbias = ctx.runner.backward(ctx.state, tuple(ctx.saved_tensors), d_out, d_lse, ctx.static)
        return None, None, None, dq, dk, dv, dbias, None, None, None, None
