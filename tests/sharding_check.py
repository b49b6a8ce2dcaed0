"""Run in a subprocess with 8 fake CPU devices: sharded inputs give the unsharded result.

Usage: python tests/sharding_check.py BACKEND   (prints "ok" and exits 0 on success).
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flashport
from flashport.kernels.contract import registry


def main(backend_name: str) -> None:
    backend = (
        registry.use("blockwise", block_q=16, block_k=16) if backend_name == "blockwise" else backend_name
    )
    assert len(jax.devices()) == 8, jax.devices()
    rng = np.random.default_rng(0)
    b, s, h, hkv, d = 4, 40, 8, 4, 16
    q = jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, s, hkv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, s, hkv, d)), jnp.float32)
    seg = jnp.asarray(np.sort(rng.integers(0, 2, (b, s)), axis=1), jnp.int32)

    def loss(q, k, v):
        out = flashport.attention(
            q, k, v, causal=True, softcap=5.0, q_segment_ids=seg, kv_segment_ids=seg, backend=backend
        )
        return jnp.sum(out * out), out

    grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    (_, want_out), want_grads = grad_fn(q, k, v)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("batch", "heads"))
    for spec in (P("batch", None, "heads", None), P("batch"), P(None, None, "heads", None)):
        shard = NamedSharding(mesh, spec)
        qs, ks, vs = (jax.device_put(x, shard) for x in (q, k, v))
        (_, out), grads = grad_fn(qs, ks, vs)
        np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
        for got, want in zip(grads, want_grads, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1])
