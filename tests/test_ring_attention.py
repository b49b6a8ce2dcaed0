"""Sequence-parallel (ring) attention: ``flashport.ring_attention`` and ``flashport.seq_layout``.

Numerics run in subprocesses with 8 fake CPU devices (``tests/ring_check.py``; XLA_FLAGS must be
set before JAX initialises): forward, lse and gradients (with an lse cotangent) against the float64
reference on the gathered arrays, for the blockwise ring engine, the Pallas TPU interpreter and the
xla backend (backend-call engine), contiguous and zigzag layouts, BSHD and BHSD, float32 and
bfloat16, and batch/head sharding on a second mesh axis. The compiled program is checked for the
absence of any all-gather (K/V only travel by collective-permute). The TPU export runs in-process
over an abstract 8-device mesh. Layout helpers, the static plan and the errors run in-process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, Mesh

import flashport
from flashport.kernels.contract.spec import AttentionSpec
from flashport.kernels.parallel import ring

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)
import ring_check  # noqa: E402  (only its CASES table; importing it leaves the device count alone)


def _run(args, timeout=900):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)


# Each case compiles a ring for 8 devices (7-40 s on 2 cores): the default run takes a
# representative few (offsets + GQA + softcap, zigzag with bottom-right and segments, a second mesh
# axis, BHSD, bfloat16, the Pallas TPU interpreter and the backend-call engine, auto-dispatch,
# score_mod / mask_mod at global positions, ring steps a mask_mod skips);
# `pytest -m slow` runs the rest.
DEFAULT_CASES = (
    "causal_gqa_softcap",
    "zigzag_bottom_right_segments",
    "batch_sharded_zigzag",
    "bhsd_br_window_gqa",
    "bf16_zigzag_causal_gqa",
    "interpret_zigzag_br_segments",
    "xla_backend_calls_window",
    "auto_dispatch",
    "auto_axes_jit",
    "mods",
    "mods_skip",
)


@pytest.mark.parametrize(
    "case",
    [
        case if case in DEFAULT_CASES else pytest.param(case, marks=pytest.mark.slow)
        for case in [*sorted(ring_check.CASES), *ring_check.CHECKS]
    ],
)
def test_ring_matches_reference_on_8_devices(case):
    proc = _run([os.path.join(TESTS, "ring_check.py"), case])
    assert proc.returncode == 0 and f"{case} ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]


HLO_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import flashport
    from flashport.kernels.contract import registry

    mesh = Mesh(np.array(jax.devices()), ("seq",))
    shard = NamedSharding(mesh, P(None, "seq", None, None))
    x = jax.ShapeDtypeStruct((1, 1024, 2, 32), jnp.float32, sharding=shard)
    backend = registry.use("blockwise", block_q=64, block_k=64)

    def ring_loss(q, k, v, backend=backend):
        out = flashport.ring_attention(q, k, v, mesh=mesh, axis_name="seq", causal=True, backend=backend,
                                       seq_layout="zigzag")
        return jnp.sum(out)

    def calls_loss(q, k, v):  # the backend-call engine
        return ring_loss(q, k, v, backend="xla")

    def auto_loss(q, k, v):  # the plain contract on sequence-sharded inputs: the ring, decided when partitioning
        return jnp.sum(flashport.attention(q, k, v, causal=True, backend=backend))

    def gathered_loss(q, k, v):  # K/V replicated first: the contract gathers the sequence
        k, v = (jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P())) for x in (k, v))
        return jnp.sum(flashport.attention(q, k, v, causal=True, backend=backend))

    for name, loss in (("ring", ring_loss), ("calls", calls_loss), ("auto", auto_loss), ("gathered", gathered_loss)):
        for kind, fn in (("fwd", loss), ("grad", jax.grad(loss, argnums=(0, 1, 2)))):
            hlo = jax.jit(fn).lower(x, x, x).compile().as_text()
            print(name, kind, "all-gather" in hlo, "collective-permute" in hlo)
    """
)


def test_compiled_ring_holds_no_all_gather():
    proc = _run(["-c", HLO_SCRIPT])
    assert proc.returncode == 0, proc.stderr[-6000:]
    lines = dict((" ".join(line.split()[:2]), line.split()[2:]) for line in proc.stdout.splitlines())
    for kind in ("fwd", "grad"):
        # ring (both engines): K/V move only by collective-permute, never gathered
        assert lines[f"ring {kind}"] == ["False", "True"], proc.stdout
        assert lines[f"calls {kind}"] == ["False", "True"], proc.stdout
        assert lines[f"auto {kind}"] == ["False", "True"], proc.stdout
        # the control shows the HLO check can fail: with K/V replicated first the call gathers
        assert lines[f"gathered {kind}"][0] == "True", proc.stdout


def _abstract_tpu_mesh(n=8):
    return AbstractMesh(
        (n,),
        ("seq",),
        (AxisType.Explicit,),
        abstract_device=AbstractDevice(device_kind="TPU v6 lite", num_cores=1, platform="tpu"),
    )


@pytest.mark.parametrize("backend", ["pallas_tpu", "blockwise"])
@pytest.mark.parametrize("seq_layout", ["contiguous", "zigzag"])
def test_ring_exports_for_tpu_over_8_devices(seq_layout, backend):
    mesh = _abstract_tpu_mesh()
    q = jax.ShapeDtypeStruct((2, 8192, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 8192, 2, 128), jnp.bfloat16)

    def fwd(q, k, v):
        return flashport.ring_attention(
            q, k, v, mesh=mesh, axis_name="seq", causal=True, backend=backend, seq_layout=seq_layout
        )

    def loss(q, k, v):
        return jnp.sum(fwd(q, k, v).astype(jnp.float32))

    for fn in (fwd, jax.grad(loss, argnums=(0, 1, 2))):
        with jax.sharding.use_abstract_mesh(mesh):
            exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(q, kv, kv)
        text = exported.mlir_module()
        assert exported.nr_devices == 8
        assert ("tpu_custom_call" in text) == (backend == "pallas_tpu") and "collective_permute" in text
        assert "all_gather" not in text


# ---------------------------------------------------------------------------------- in-process


def test_zigzag_round_trip_and_order():
    x = np.arange(2 * 16 * 3).reshape(2, 16, 3)
    z = flashport.seq_layout.to_zigzag(x, 4, axis=1)
    chunks = z[0, :, 0].reshape(8, 2) // 3 // 2  # chunk index of each position (chunk size 2)
    np.testing.assert_array_equal(chunks[:, 0], [0, 7, 1, 6, 2, 5, 3, 4])
    np.testing.assert_array_equal(flashport.seq_layout.from_zigzag(z, 4, axis=1), x)
    np.testing.assert_array_equal(np.asarray(flashport.seq_layout.to_zigzag(jnp.asarray(x), 4)), z)
    with pytest.raises(ValueError, match=r"not a multiple of 2·n = 8"):
        flashport.seq_layout.to_zigzag(np.zeros((1, 12)), 4)


def test_plan_skips_invisible_pairs_and_balances_zigzag():
    spec = AttentionSpec(
        scale=1.0,
        causal=True,
        window_left=None,
        window_right=None,
        offset=0,
        softcap=None,
        seq_q=64,
        seq_k=64,
    )
    n = 8
    contiguous = ring.Plan.make(spec, n, "contiguous")
    assert contiguous.computed_pairs == n * (n + 1) // 2  # the lower triangle of chunk pairs
    # distinct branches: empty, full, diagonal
    assert sorted(sp is None for sp in contiguous.specs) == [False, False, True]
    zig = ring.Plan.make(spec, n, "zigzag")
    table = np.asarray(zig.table).reshape(n, 2, n, 2)
    work = [sum(zig.specs[i] is not None for i in table[r].ravel()) for r in range(n)]
    assert len(set(work)) == 1, work  # every shard computes the same number of piece pairs
    unbalanced = [
        sum(contiguous.specs[i] is not None for i in np.asarray(contiguous.table)[r]) for r in range(n)
    ]
    assert unbalanced == list(range(1, n + 1))


def test_local_spec_carries_offsets_and_windows():
    spec = AttentionSpec(
        scale=1.0, causal=False, window_left=5, window_right=2, offset=8, softcap=None, seq_q=32, seq_k=40
    )
    # query piece at 0, key piece at 10: local offset -2, query 0 sees local keys [-7, 0] -> partial
    local = ring.local_spec(spec, 4, 5, delta=0 - 10)
    assert local.offset == 8 + 0 - 10 and local.window_left == 5 and local.seq_q == 4 and local.seq_k == 5
    assert ring.local_spec(spec, 4, 5, delta=0 - 35) is None  # keys 35.. are beyond every window
    full = ring.local_spec(spec, 4, 5, delta=4 - 10)  # local window [i - 3, i + 4] covers keys 0..4
    assert (full.causal, full.window_left, full.window_right, full.offset) == (False, None, None, 0)


def _mesh1():
    return Mesh(np.array(jax.devices()[:1]), ("seq",))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(bias=np.zeros((1, 1, 8, 8), np.float32)), "does not take bias="),
        (dict(mask=np.ones((1, 1, 8, 8), bool)), "does not take mask="),
        (dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), "does not support dropout_rate"),
        (dict(axis_name="sequence"), "axis_name='sequence' is not an axis of the mesh"),
        (dict(seq_layout="striped"), "seq_layout must be one of"),
        (dict(seq_layout="zigzag", query=np.zeros((1, 7, 2, 8), np.float32)), "query's sequence length 7"),
    ],
)
def test_errors_name_the_argument(kwargs, match):
    args = dict(
        query=np.zeros((1, 8, 2, 8), np.float32),
        key=np.zeros((1, 8, 2, 8), np.float32),
        value=np.zeros((1, 8, 2, 8), np.float32),
        mesh=_mesh1(),
        axis_name="seq",
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        flashport.ring_attention(**args)


def test_one_shard_ring_is_the_contract():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 16, 2, 8)).astype(np.float32) for _ in range(3))
    got = flashport.ring_attention(q, k, v, mesh=_mesh1(), axis_name="seq", causal=True, backend="xla")
    from reference import reference_attention

    np.testing.assert_allclose(np.asarray(got), reference_attention(q, k, v, causal=True)[0], atol=2e-6)
