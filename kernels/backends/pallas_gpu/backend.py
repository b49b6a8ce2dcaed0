"""The ``pallas_gpu`` and ``pallas_gpu_interpret`` backends: flashport's own Pallas (Triton) GPU
flash attention, forward and backward, serving every contract feature.

Both run the same kernels (:mod:`~flashport.kernels.backends.pallas_gpu.forward`,
:mod:`~flashport.kernels.backends.pallas_gpu.backward`); ``pallas_gpu_interpret`` runs them with ``interpret=True``
on CPU for tests and debugging and is never picked by ``auto``.

What this module adds around the kernels:

* padding: sequences to whole blocks (padded keys and queries are hidden by a position test in the
  kernels, never by an O(S²) bias) and head dims to a power of two >= 16 (Triton tiles);
* operand preparation: the boolean mask travels as int8, the dropout seed becomes per-row hashes
  (O(S), :func:`~flashport.kernels.backends.pallas_gpu.tiling.dropout_rows`) that the kernels finish per key;
* a ``custom_vjp``: the forward saves ``out`` and ``lse`` (O(S)); the backward runs a dK/dV kernel
  (grid over key blocks and kv heads, looping over the group's query heads: no atomics) and a dQ
  kernel that also produces the bias gradient, reduced here to the bias's broadcast shape.

Options (``registry.use("pallas_gpu", block_q=64)``): ``block_q``/``block_k`` (forward tiles,
defaults 128/64), ``block_q_bwd``/``block_k_bwd`` (backward tiles, defaults 64/64), all powers of two
>= 16; ``num_warps`` (default 4 for head_dim <= 64, else 8) and ``num_stages`` (default 2).

Precision: see :mod:`~flashport.kernels.backends.pallas_gpu.tiling` (float32 accumulation; float32 inputs
without TF32).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flashport.kernels.backends.pallas_gpu.backward import dbias_layout, dkv_call, dq_call
from flashport.kernels.backends.pallas_gpu.forward import forward_call
from flashport.kernels.backends.pallas_gpu.tiling import (
    MIN_BLOCK,
    Geometry,
    dropout_rows,
    mod_class_input,
    next_power_of_two,
)
from flashport.kernels.backends.pallas_platform import cuda_only
from flashport.kernels.contract import registry
from flashport.kernels.contract.spec import FEATURES, AttentionSpec
from flashport.kernels.semantics.padding import pad_broadcastable, pad_to

MAX_HEAD_DIM = 256  # beyond this a tile pair no longer fits shared memory with useful blocks
DEFAULTS = {
    "block_q": 128,
    "block_k": 64,
    "block_q_bwd": 64,
    "block_k_bwd": 64,
    "num_warps": None,
    "num_stages": 2,
}


@dataclasses.dataclass(frozen=True)
class Config:
    """Static configuration of one call (hashable: the nondiff argument of the custom_vjp)."""

    spec: AttentionSpec
    block_q: int
    block_k: int
    block_q_bwd: int
    block_k_bwd: int
    num_warps: int | None
    num_stages: int
    interpret: bool

    mods: Any = None  # Geometry.mods: the static part of the call's user mods, or None

    def geometry(self, backward: bool) -> Geometry:
        """Forward or backward tiling."""
        if backward:
            g = Geometry.make(self.spec, self.block_q_bwd, self.block_k_bwd)
        else:
            g = Geometry.make(self.spec, self.block_q, self.block_k)
        return dataclasses.replace(g, mods=self.mods)

    def warps(self, head_dim: int) -> int:
        """Triton warps per program."""
        return self.num_warps if self.num_warps is not None else (4 if head_dim <= 64 else 8)


def resolve_options(options: dict, name: str) -> dict:
    """Validate backend options; returns every option with defaults filled in.

    Raises ValueError naming the option and the fix.
    """
    unknown = set(options) - set(DEFAULTS)
    if unknown:
        raise ValueError(
            f"backend {name!r} takes options {', '.join(DEFAULTS)}; got unknown {sorted(unknown)}"
        )
    out = dict(DEFAULTS, **options)
    for key in ("block_q", "block_k", "block_q_bwd", "block_k_bwd"):
        value = out[key]
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, np.integer))
            or value < MIN_BLOCK
            or (value & (value - 1))
        ):
            raise ValueError(
                f"{name} option {key} must be a power of two >= {MIN_BLOCK} (Triton tile sizes), got {value!r}; "
                f"e.g. registry.use({name!r}, {key}=64)"
            )
        out[key] = int(value)
    warps = out["num_warps"]
    if warps is not None and (
        isinstance(warps, bool) or not isinstance(warps, (int, np.integer)) or warps not in (1, 2, 4, 8, 16)
    ):
        raise ValueError(
            f"{name} option num_warps must be one of 1, 2, 4, 8, 16 (or None for the default), got {warps!r}"
        )
    stages = out["num_stages"]
    if isinstance(stages, bool) or not isinstance(stages, (int, np.integer)) or stages < 1:
        raise ValueError(f"{name} option num_stages must be a positive int (e.g. 2 or 3), got {stages!r}")
    return out


def _pad_head(x):
    return pad_to(x, 3, max(MIN_BLOCK, next_power_of_two(x.shape[3])))


def _operands(g: Geometry, q, k, v, bias, mask, q_seg, kv_seg, seed, mods=None):
    """Padded operands by name, in the order the kernels take them (the user mods' arrays last, as
    ``mod<n>``, at least 1-D)."""
    b, hq = q.shape[:2]
    consts = () if mods is None else (*mods.score_consts, *mods.mask_consts)
    arrays = {f"mod{n}": jnp.asarray(c).reshape(jnp.shape(c) or (1,)) for n, c in enumerate(consts)}
    if g.mods is not None and g.mods[4]:
        arrays["mod_classes"] = mod_class_input(g, mods.blocks)
    return {
        "q": _pad_head(pad_to(q, 2, g.sqp)),
        "k": _pad_head(pad_to(k, 2, g.skp)),
        "v": _pad_head(pad_to(v, 2, g.skp)),
        "bias": pad_broadcastable(bias, {2: g.sqp, 3: g.skp}),
        "mask": None if mask is None else pad_broadcastable(mask.astype(jnp.int8), {2: g.sqp, 3: g.skp}),
        "q_seg": None if q_seg is None else pad_to(q_seg, 1, g.sqp),
        "kv_seg": None if kv_seg is None else pad_to(kv_seg, 1, g.skp),
        "rows": None if g.spec.dropout_rate == 0 else dropout_rows(seed, b, hq, g.sqp),
        **arrays,
    }


def _launch(cfg: Config, call, g: Geometry, named: dict, **kwargs):
    """Run kernel builder ``call(g, named, interpret=..., **kwargs)``; for the real backend through
    :data:`~flashport.kernels.backends.pallas_platform.cuda_only` (Triton on CUDA, interpreter elsewhere)."""
    names = [n for n, x in named.items() if x is not None]

    def make(interpret):
        def run(*arrays):
            res = call(g, dict(zip(names, arrays, strict=False)), interpret=interpret, **kwargs)
            return tuple(x for x in res if x is not None)

        return run

    arrays = [named[n] for n in names]
    return make(True)(*arrays) if cfg.interpret else cuda_only(make, *arrays)


def _forward(cfg: Config, q, k, v, bias, mask, q_seg, kv_seg, seed, mods=None):
    g = cfg.geometry(backward=False)
    named = _operands(g, q, k, v, bias, mask, q_seg, kv_seg, seed, mods)
    out, lse = _launch(
        cfg,
        forward_call,
        g,
        named,
        group=q.shape[1] // k.shape[1],
        out_dtype=q.dtype,
        num_warps=cfg.warps(named["q"].shape[3]),
        num_stages=cfg.num_stages,
    )
    sq, dv = q.shape[2], v.shape[3]
    return out[:, :, :sq, :dv], lse[:, :, :sq]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg: Config, q, k, v, bias, mask, q_seg, kv_seg, seed, mods=None):
    return _forward(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, mods)


def _attention_fwd(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, mods=None):
    out, lse = _forward(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, mods)
    return (out, lse), (q, k, v, bias, mask, q_seg, kv_seg, seed, out, lse, mods)


def _attention_bwd(cfg: Config, residuals, cotangents):
    """dq, dk, dv, dbias from the kernels; the gradients of the score_mod's arrays (with mods) from
    the blockwise backend's pass over the tiles (:func:`flashport.kernels.backends.blockwise.mods_cotangent`)."""
    q, k, v, bias, mask, q_seg, kv_seg, seed, out, lse, mods = residuals
    d_out, d_lse = cotangents
    g = cfg.geometry(backward=True)
    group = q.shape[1] // k.shape[1]
    # dlogits = P * (dP - delta) with delta = rowsum(dO * O) - dlse: the lse cotangent folds in.
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - d_lse
    named = _operands(g, q, k, v, bias, mask, q_seg, kv_seg, seed, mods)
    named.update(
        do=_pad_head(pad_to(d_out.astype(q.dtype), 2, g.sqp)),
        lse=pad_to(jnp.where(jnp.isneginf(lse), 0.0, lse), 2, g.sqp),
        delta=pad_to(delta, 2, g.sqp),
    )
    tuning = dict(group=group, num_warps=cfg.warps(named["q"].shape[3]), num_stages=cfg.num_stages)
    dk, dv = _launch(cfg, dkv_call, g, named, **tuning)
    dq, *dbias_tiles = _launch(cfg, dq_call, g, named, **tuning)
    dbias_tiles = dbias_tiles[0] if dbias_tiles else None
    sq, sk, d = q.shape[2], k.shape[2], q.shape[3]
    dq, dk, dv = dq[:, :, :sq, :d], dk[:, :, :sk, :d], dv[:, :, :sk, : v.shape[3]]
    dbias = None if bias is None else _reduce_dbias(dbias_tiles, bias.shape, sq, sk).astype(bias.dtype)
    if mods is None:
        return dq, dk, dv, dbias, None, None, None, None, None
    from flashport.kernels.backends.blockwise import mods_cotangent

    arrays = (q, k, v, bias, mask, q_seg, kv_seg, seed, out, lse, d_out, d_lse)
    return dq, dk, dv, dbias, None, None, None, None, mods_cotangent(*arrays, spec=cfg.spec, mods=mods)


def _reduce_dbias(tiles, bias_shape, sq, sk):
    """The dQ kernel's bias-gradient tiles (layout of :func:`dbias_layout`) -> the bias's own shape."""
    layout = dbias_layout(bias_shape)
    if layout == "full":
        x = tiles[:, :, :sq, :sk]
    elif layout == "keys":
        x = jnp.sum(tiles, axis=2, keepdims=True)[..., :sk]
    else:  # "rows": [B, Hq, sqp] row sums
        x = tiles[:, :, :sq, None]
        if bias_shape[2] == 1:
            x = jnp.sum(x, axis=2, keepdims=True)
    if bias_shape[0] == 1:
        x = jnp.sum(x, axis=0, keepdims=True)
    if bias_shape[1] == 1:
        x = jnp.sum(x, axis=1, keepdims=True)
    return x


_attention.defvjp(_attention_fwd, _attention_bwd)


def _make_backend_fn(name: str, interpret: bool):
    def fn(q, k, v, bias, mask, q_seg, kv_seg, seed, *, spec: AttentionSpec, options, mods=None):
        opts = resolve_options(dict(options), name)
        if q.shape[2] == 0:  # no queries: nothing to launch (a grid of size 0 is not a kernel)
            b, hq = q.shape[:2]
            return jnp.zeros((b, hq, 0, v.shape[3]), q.dtype), jnp.zeros((b, hq, 0), jnp.float32)
        cfg = Config(spec=spec, interpret=interpret, **opts)
        if mods is not None:
            shapes = tuple(jnp.shape(c) for c in (*mods.score_consts, *mods.mask_consts))
            rows = 0 if mods.mask is None or mods.blocks is None else mods.blocks.classes.shape[0]
            cfg = dataclasses.replace(cfg, mods=(mods.score, len(mods.score_consts), mods.mask, shapes, rows))
        return _attention(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, mods)

    fn.__name__ = f"{name}_attention"
    fn.__doc__ = (
        f"The ``{name}`` backend over the canonical arrays; returns ``(out, lse)``. Options are "
        "validated (with the fix named in the error) before anything is traced."
    )
    return fn


pallas_gpu_attention = _make_backend_fn("pallas_gpu", interpret=False)
pallas_gpu_interpret_attention = _make_backend_fn("pallas_gpu_interpret", interpret=True)


def check_call(call) -> str | None:
    """Limits features cannot express: head dims up to :data:`MAX_HEAD_DIM`."""
    d, dv = call.q_shape[3], call.v_head_dim
    if max(d, dv) > MAX_HEAD_DIM:
        return f"head_dim {max(d, dv)} > {MAX_HEAD_DIM} (Triton tiles would not fit shared memory)"
    return None


# Deliberately parallel registrations (here and in kernels/backends/pallas_tpu/backend.py): each backend
# declares the same BackendInfo fields; the values are what differ.
registry.register(
    registry.BackendInfo(
        name="pallas_gpu",
        description="flashport's Pallas (Triton) GPU flash attention: forward + dK/dV and dQ kernels, "
        "causal/window/segment-id block skipping, GQA via index maps, every contract feature; CUDA only.",
        platforms=("cuda",),
        features=frozenset(FEATURES),
        fn=pallas_gpu_attention,
        check=check_call,
        is_available=registry.cuda_present,
        interpret=registry.InterpretTwin(
            description="The pallas_gpu kernels run by the Pallas interpreter on CPU (slow; for tests "
            "and debugging, never chosen by auto).",
            fn=pallas_gpu_interpret_attention,
        ),
    )
)
