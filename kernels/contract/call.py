"""The static description of one attention call (:class:`Call`) and the canonical array tuple.

Shared by validation (:mod:`flashport.kernels.contract.validate`), the registry's ``check`` /
``prefer`` hooks (:mod:`flashport.kernels.contract.registry`) and dispatch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from flashport.kernels.contract.spec import AttentionSpec

# The canonical arrays a backend receives: (q, k, v, bias, mask, q_segment_ids, kv_segment_ids, seed).
CanonicalArrays = tuple[
    jax.Array,
    jax.Array,
    jax.Array,
    jax.Array | None,
    jax.Array | None,
    jax.Array | None,
    jax.Array | None,
    jax.Array | None,
]

DTYPES = {
    jnp.dtype(jnp.float32): "float32",
    jnp.dtype(jnp.bfloat16): "bfloat16",
    jnp.dtype(jnp.float16): "float16",
}

# Platforms `auto` dispatches between at lowering time.
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


@dataclasses.dataclass(frozen=True)
class Call:
    """Everything static about one call: what backends' ``check``/``prefer`` hooks look at.

    Shapes are canonical (BHSD): ``q_shape`` = (B, Hq, Sq, D), ``kv_shape`` = (B, Hkv, Sk, D).
    """

    spec: AttentionSpec
    features: frozenset[str]
    q_shape: tuple[int, ...]
    kv_shape: tuple[int, ...]
    v_head_dim: int
    dtype: str
    bias_shape: tuple[int, ...] | None
    layout: str = "BHSD"  # the caller's layout (the spec's ``layout`` hint for the backend)

    @classmethod
    def over(
        cls,
        spec: AttentionSpec,
        features: set[str] | frozenset[str],
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        bias_shape: tuple[int, ...] | None = None,
        layout: str = "BHSD",
    ) -> Call:
        """The call of ``spec`` with ``features`` over canonical (BHSD) ``q``, ``k``, ``v``: shapes,
        value head dim and dtype read from the arrays."""
        return cls(
            spec=spec,
            features=frozenset(features),
            q_shape=tuple(q.shape),
            kv_shape=tuple(k.shape),
            v_head_dim=v.shape[-1],
            dtype=DTYPES[q.dtype],
            bias_shape=bias_shape,
            layout=layout,
        )
