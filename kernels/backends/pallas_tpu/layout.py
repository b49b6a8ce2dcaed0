"""Which operand layout a BSHD call's kernels take by default: an HBM byte model.

Token-major (the caller's BSHD arrays, :class:`~flashport.kernels.backends.pallas_tpu.specs.Operands`) saves
the transposes around the kernels: each of them reads and writes a whole operand (forward: Q, K, V
and the output; backward: Q, K, V, dO and dQ, dK, dV). But a token-major step holds every head of its
rows in VMEM, so its blocks can be smaller than the heads-major ones (many heads, small VMEM: v4,
v5p), and a kernel re-streams its streamed operand once per resident block (forward and dQ: K/V
once per query block; dK/dV: Q and dO once per key block). The default takes token-major unless the
extra streaming outweighs the transposes.
"""

from __future__ import annotations

import jax.numpy as jnp

from flashport.kernels.backends.pallas_tpu.tiling import Geometry, round_up

LANES = 128


def streamed_bytes(kind: str, g: Geometry, q, k, v) -> int:
    """HBM bytes kernel ``kind`` (``"fwd"``, ``"dq"``, ``"dkv"``) streams past its resident blocks,
    for canonical [B, H, S, D] ``q, k, v``, without segment-id skipping."""
    b, hq, hkv = q.shape[0], q.shape[1], k.shape[1]
    width = round_up(q.shape[3], LANES) + round_up(v.shape[3], LANES)
    itemsize = jnp.dtype(q.dtype).itemsize
    if kind == "dkv":  # Q and dO past resident K/V
        tiles = sum(hi - lo for lo, hi in zip(g.col_lo, g.col_hi, strict=True))
        return b * hq * tiles * g.bq * width * itemsize
    return b * hkv * g.visited_tiles * g.bk * width * itemsize  # K/V past resident Q


def transposed_bytes(kinds, q, k, v) -> int:
    """HBM bytes of the transposes around kernels ``kinds`` on the heads-major path (read + write):
    the forward's Q, K, V in and output back; the backward's Q, K, V, dO in and dQ, dK, dV back."""
    out = q.shape[0] * q.shape[1] * q.shape[2] * v.shape[3]
    qkv = q.size + k.size + v.size
    moved = qkv + out if "fwd" in kinds else 2 * qkv + out
    return 2 * moved * jnp.dtype(q.dtype).itemsize


def token_major_pays(geometry, kinds, q, k, v) -> bool:
    """Whether token-major kernels ``kinds`` move no more modelled HBM bytes than heads-major ones
    plus the transposes; ``geometry(kind, token_major)`` gives each kernel's fitted tiling."""
    extra = sum(
        streamed_bytes(kind, geometry(kind, True), q, k, v)
        - streamed_bytes(kind, geometry(kind, False), q, k, v)
        for kind in kinds
    )
    return extra <= transposed_bytes(kinds, q, k, v)
