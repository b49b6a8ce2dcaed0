"""Sharded inputs through the Pallas kernels: batch- and head-sharded arrays on an 8-device mesh.

XLA_FLAGS must be set before JAX initialises, so the check runs in a fresh subprocess with 8 fake
CPU devices. There the interpreter backend runs the kernels per shard through the backend's
``custom_partitioning`` wrapper (in a multi-device process it uses the discharge interpreter, see
``Config.interpret_mode``), and the result and gradients (including a batch-broadcast bias, whose
gradient needs a cross-shard sum) are compared with the float64 reference: forward 2e-5, gradients
1e-4 (float32). The output must keep the input's sharding (no silent gather to one device). The
dropout variant checks that every shard draws the global (batch, query head) mask.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import sys
    sys.path.insert(0, {tests!r})
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import flashport
    from flashport.kernels.contract import registry
    from reference import reference_attention, reference_attention_vjp, reduce_to_shape

    assert jax.device_count() == 8
    rng = np.random.default_rng(0)
    b, sq, sk, hq, hkv, d = 4, 40, 200, 4, 2, 64
    q = rng.standard_normal((b, sq, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, sk, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, sk, hkv, d)).astype(np.float32)
    d_out = rng.standard_normal((b, sq, hq, d)).astype(np.float32)
    bias = rng.standard_normal((1, hq, sq, sk)).astype(np.float32)
    seg = np.sort(rng.integers(0, 3, (b, sk)), axis=1).astype(np.int32)
    kw = dict(causal=True, q_segment_ids=seg[:, -sq:], kv_segment_ids=seg)
    drop, ref_drop = {{}}, {{}}
    if {dropout}:
        # The mask hashes the global batch row and query head: a shard using its local indices
        # would draw another shard's mask and miss the reference.
        drop = dict(dropout_rate=0.3, dropout_rng=jax.random.key(5))
        ref_drop = dict(dropout_rate=0.3, dropout_seed=(0, 5))
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    spec = NamedSharding(mesh, P("data", None, "model", None))
    put = lambda x, s: jax.device_put(x, s)
    backend = registry.use("pallas_tpu_interpret", block_q=32, block_k=128)

    def loss(q, k, v, bias):
        out = flashport.attention(q, k, v, bias=bias, backend=backend, **kw, **drop)
        return jnp.sum(out * d_out), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    (_, out), grads = step(put(q, spec), put(k, spec), put(v, spec),
                           put(bias, NamedSharding(mesh, P(None, "model"))))
    assert out.sharding.spec == P("data", None, "model"), out.sharding
    assert grads[0].sharding.spec == P("data", None, "model"), grads[0].sharding
    want = reference_attention(q, k, v, bias=bias, **kw, **ref_drop)[0]
    want_g = reference_attention_vjp(q, k, v, d_out, bias=bias, **kw, **ref_drop)

    def err(a, b):
        return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / max(1.0, np.max(np.abs(b))))

    assert err(out, want) < 2e-5, err(out, want)
    for name, g, w in zip("qkv", grads[:3], want_g[:3]):
        assert err(g, w) < 1e-4, (name, err(g, w))
    assert err(grads[3], reduce_to_shape(want_g[3], bias.shape)) < 1e-4
    print("SHARDED-OK")
    """
)


@pytest.mark.parametrize("dropout", [False, True], ids=["plain", "dropout"])
def test_batch_and_head_sharded_inputs_match_reference(dropout):
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    script = SCRIPT.format(tests=tests, dropout=dropout)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0 and "SHARDED-OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]
