"""The ``cpu_native`` backend: FlashAttention-2 as a native CPU kernel behind ``jax.ffi``.

``flash_cpu.cc`` (built on first use by :mod:`.build`) holds a forward that returns ``(out, lse)``
and a residual backward that returns ``(dq, dk, dv)``; this module wraps them in a ``custom_vjp``
(``ffi_call`` with ``vmap_method="broadcast_all"``: a vmapped call folds its batch into the
kernel's). Supported: float32, causal / sliding window / full, either alignment, GQA, any sequence
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


def _forward_call(q, k, v, spec, opts):
    shape = q.shape[:-1] + (v.shape[-1],)
    return jax.ffi.ffi_call(
        "flashport_cpu_forward",
        (jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct(q.shape[:-1], jnp.float32)),
        vmap_method="broadcast_all",
    )(q, k, v, **_attrs(spec, opts, False))


def _backward_call(q, k, v, out, lse, d_out, d_lse, spec, opts):
    return jax.ffi.ffi_call(
        "flashport_cpu_backward",
        (
            jax.ShapeDtypeStruct(q.shape, jnp.float32),
            jax.ShapeDtypeStruct(k.shape, jnp.float32),
            jax.ShapeDtypeStruct(v.shape, jnp.float32),
        ),
        vmap_method="broadcast_all",
    )(q, k, v, out, lse, d_out, d_lse, **_attrs(spec, opts, True))


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
        q, k, v, out.astype(jnp.float32), lse, d_out.astype(jnp.float32), d_lse, spec, opts
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
