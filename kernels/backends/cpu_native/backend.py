"""The ``cpu_native`` backend: FlashAttention-2 as a native CPU kernel behind ``jax.ffi``.

``flash_cpu.cc`` (built on first use by :mod:`.build`) holds a forward that returns ``(out, lse)``
and a residual backward that returns ``(dq, dk, dv)``; this module wraps them in a ``custom_vjp``
(two primitives lowering to the FFI targets; a vmapped call folds its batch into the
kernel's); a ``jax.export`` of it serializes the blockwise computation instead (see
:func:`_native_primitive`). Supported: float32, causal / sliding window / full, either alignment, GQA, any sequence
length and head dim, lse output. Anything else (bias, masks, segment ids, dropout, softcap,
score/mask mods, 16-bit dtypes) is a missing feature, so ``auto`` passes to ``blockwise``; so does a
machine where the kernel cannot be built (``check`` gives the reason).

Options: ``block_q``, ``block_k`` (forward tile; defaults below), ``bwd_block_q``, ``bwd_block_k``
and ``num_threads`` (0: one per hardware thread), e.g.
``flashport.kernels.contract.registry.use("cpu_native", num_threads=1)``.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from flashport.kernels.backends import blockwise
from flashport.kernels.backends.cpu_native import build
from flashport.kernels.contract import deferred, registry
from flashport.kernels.contract.call import Call
from flashport.kernels.contract.spec import AttentionSpec

# Tile sizes measured on a 2-core Zen 4 host at S=4096, D=64, causal (the benchmark's config).
DEFAULTS = {"block_q": 64, "block_k": 512, "bwd_block_q": 128, "bwd_block_k": 128, "num_threads": 0}
# auto on CPU: below this many keys the materialized xla path is faster (fwd+bwd CPU time, H=8,
# D=64, causal: Sk=8 xla 0.10 ms vs 0.31 ms here, the kernel's threads cost more than the work;
# Sk=128 2.6 vs 2.0 ms; Sk=1024 193 vs 51 ms).
MIN_KEYS = 128
FEATURES = frozenset({"causal", "window", "align_bottom_right", "gqa", "return_lse", "float32"})


def _attrs(spec: AttentionSpec, opts: dict, backward: bool) -> dict:
    prefix, opts = ("bwd_" if backward else ""), dict(opts)
    return {
        "scale": np.float32(spec.scale),
        "causal": np.int64(spec.causal),
        "left": np.int64(-1 if spec.window_left is None else spec.window_left),
        "right": np.int64(-1 if spec.window_right is None else spec.window_right),
        "offset": np.int64(spec.offset),
        "block_q": np.int64(opts[prefix + "block_q"]),
        "block_k": np.int64(opts[prefix + "block_k"]),
        "num_threads": np.int64(opts["num_threads"]),
    }


def _options(options) -> dict:
    unknown = set(options) - set(DEFAULTS)
    if unknown:
        raise ValueError(
            f"backend 'cpu_native' takes options {sorted(DEFAULTS)}; got unknown {sorted(unknown)}"
        )
    opts = {**DEFAULTS, **options}
    for name, value in opts.items():
        low = 0 if name == "num_threads" else 1
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"cpu_native option {name} must be an int >= {low}, got {value!r}")
    return opts


def _require_built() -> None:
    _, reason = build.load()
    if reason:
        raise RuntimeError(f"backend 'cpu_native' is unavailable: {reason}")


def _forward_shapes(q, v):
    out = jax.core.ShapedArray(q.shape[:-1] + (v.shape[-1],), jnp.float32)
    return out, jax.core.ShapedArray(q.shape[:-1], jnp.float32)


def _flat_batch(fn, *arrays):
    """``fn`` over arrays whose extra leading (vmapped) dims are folded into the batch dim (the
    first array is q, [..., B, H, S, D]), its results unfolded back."""
    lead = arrays[0].shape[: arrays[0].ndim - 3]
    results = fn(*(a.reshape((-1,) + a.shape[len(lead) :]) for a in arrays))
    return [r.reshape(lead + r.shape[1:]) for r in results]


def _portable_forward(q, k, v, *, spec, opts):
    def run(q, k, v):
        return blockwise.blockwise_attention(q, k, v, None, None, None, None, None, spec=spec, options={})

    return _flat_batch(run, q, k, v)


def _portable_backward(q, k, v, out, lse, d_out, d_lse, *, spec, opts):
    def run(q, k, v, out, lse, d_out, d_lse):
        none = (None,) * 5
        return blockwise.blockwise_attention_backward(
            q, k, v, *none, out, lse, d_out, d_lse, spec=spec, options={}
        )[:3]

    return _flat_batch(run, q, k, v, out, lse, d_out, d_lse)


def _native_primitive(name: str, target: str, abstract, portable, backward: bool):
    """A primitive that lowers to the FFI target ``target``, or to ``portable`` (the blockwise
    backend's XLA computation of the same values) when the program is exported (``jax.export``:
    the serialized module must run where flashport registered no kernel) or lowered for more
    platforms than the CPU (a ``platform_dependent`` branch is lowered for each of them)."""
    prim = Primitive(name)
    prim.multiple_results = True
    prim.def_impl(lambda *args, **params: jax.jit(functools.partial(prim.bind, **params))(*args))
    prim.def_abstract_eval(lambda *args, spec, opts: abstract(*args))

    def lowering(ctx, *args, spec, opts):
        module = ctx.module_context
        if module.lowering_parameters.for_export or tuple(module.platforms) != ("cpu",):
            return mlir.lower_fun(functools.partial(portable, spec=spec, opts=opts), multiple_results=True)(
                ctx, *args
            )
        return jax.ffi.ffi_lowering(target)(ctx, *args, **_attrs(spec, dict(opts), backward))

    def batch(args, dims, *, spec, opts):
        # Every operand gets the vmapped dim in front (the kernel folds leading dims into its batch).
        size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
        args = [batching.bdim_at_front(a, d, size) for a, d in zip(args, dims, strict=True)]
        return prim.bind(*args, spec=spec, opts=opts), (0,) * len(abstract(*args))

    mlir.register_lowering(prim, lowering)
    batching.primitive_batchers[prim] = batch
    return prim


_forward_p = _native_primitive(
    "flashport_cpu_native_forward",
    "flashport_cpu_forward",
    lambda q, k, v: _forward_shapes(q, v),
    _portable_forward,
    backward=False,
)
_backward_p = _native_primitive(
    "flashport_cpu_native_backward",
    "flashport_cpu_backward",
    lambda q, k, v, *rest: tuple(jax.core.ShapedArray(a.shape, jnp.float32) for a in (q, k, v)),
    _portable_backward,
    backward=True,
)


def _forward_call(q, k, v, spec, opts):
    return tuple(_forward_p.bind(q, k, v, spec=spec, opts=opts))


def _backward_call(q, k, v, out, lse, d_out, d_lse, spec, opts):
    return tuple(_backward_p.bind(q, k, v, out, lse, d_out, d_lse, spec=spec, opts=opts))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attention(q, k, v, spec, opts):
    return _forward_call(q, k, v, spec, opts)


def _attention_fwd(q, k, v, spec, opts):
    out, lse = _forward_call(q, k, v, spec, opts)
    return (out, lse), (q, k, v, out, lse)


def _attention_bwd(spec, opts, residuals, cotangents):
    q, k, v, out, lse = residuals
    d_out, d_lse = cotangents
    return _backward_call(q, k, v, out, lse, d_out.astype(jnp.float32), d_lse, spec, opts)


_attention.defvjp(_attention_fwd, _attention_bwd)


def native_attention(q, k, v, bias, mask, q_seg, kv_seg, seed, *, spec: AttentionSpec, options):
    """The native kernel over the canonical arrays (float32, no bias/mask/segments/dropout); returns
    ``(out, lse)``, differentiable (its backward is :func:`native_attention_backward`'s kernel)."""
    opts = _options(options)
    _require_built()
    return _attention(q, k, v, spec, tuple(sorted(opts.items())))


def native_attention_backward(
    q, k, v, bias, mask, q_seg, kv_seg, seed, out, lse, d_out, d_lse, *, spec: AttentionSpec, options
):
    """The residual backward: ``(dq, dk, dv, None)`` from ``out`` and ``lse`` without a forward."""
    opts = _options(options)
    _require_built()
    dq, dk, dv = _backward_call(
        q,
        k,
        v,
        out.astype(jnp.float32),
        lse,
        d_out.astype(jnp.float32),
        d_lse,
        spec,
        tuple(sorted(opts.items())),
    )
    return dq, dk, dv, None


def _check(call: Call) -> str | None:
    # Build only where CPU programs run by default: on an accelerator host the CPU branch is rarely
    # lowered, and blockwise serves it without a compiler.
    if deferred.host_platform() != "cpu":
        return "native CPU kernel not built on a non-CPU host"
    _, reason = build.load()
    return reason


def _prefer(call: Call) -> str | None:
    if call.kv_shape[2] < MIN_KEYS:
        return f"Sk={call.kv_shape[2]} < {MIN_KEYS}: the materialized xla path is faster"
    return None


registry.register(
    registry.BackendInfo(
        name="cpu_native",
        description="FlashAttention-2 as a native C++ CPU kernel (jax.ffi, built on first use); "
        "float32, causal/window, GQA; O(S) memory.",
        platforms=("cpu",),
        features=FEATURES,
        fn=native_attention,
        check=_check,
        prefer=_prefer,
        is_available=lambda: build.load()[1] is None,
        backward=native_attention_backward,
    )
)


def workspace_bytes(q_shape, kv_shape, v_head_dim: int, *, backward: bool, options=None, threads=None) -> int:
    """Bytes the kernel allocates inside one call (XLA's memory statistics cannot see into an FFI
    call): packed K^T (and V^T), per-row vectors, per-thread tiles and, in the backward, one dQ
    accumulator per thread. Mirrors the allocations in ``flash_cpu.cc``; canonical BHSD shapes."""
    opts = _options(options or {})
    b, hq, sq, d = q_shape
    hkv, sk = kv_shape[1], kv_shape[2]
    dv = v_head_dim
    threads = threads or opts["num_threads"] or os.cpu_count() or 1
    panel_keys = -(-sk // 64) * 64
    if not backward:
        bq, bk = opts["block_q"], -(-opts["block_k"] // 64) * 64
        tiles = bq * d + bq * bk + bq * dv + 2 * bq
        return 4 * (b * hkv * panel_keys * d + threads * tiles)
    bq, bk = opts["bwd_block_q"], -(-opts["bwd_block_k"] // 64) * 64
    tiles = bq * d + 2 * bq * bk + bk * (d + dv) + b * hq * sq * d
    return 4 * (b * hkv * panel_keys * (d + dv) + 2 * b * hq * sq + threads * tiles)
