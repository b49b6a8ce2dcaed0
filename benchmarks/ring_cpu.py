"""Per-device memory of ring attention vs the unsharded call, from XLA's compiled memory analysis.

Runs on a CPU host with 8 fake devices (``--xla_force_host_platform_device_count=8``, set below
before JAX starts). Nothing is executed: each program is compiled and
``compiled.memory_analysis()`` reports, per device, the scratch (``temp_size_in_bytes``) and the
argument/output sizes, and the compiled HLO text gives the number of all-gather and
collective-permute ops. Programs: the plain ``flashport.attention`` on one device (unsharded); the
same call with K/V replicated first (the sequence gathered on every shard); the same call under
``jax.jit`` on sequence-sharded inputs the way users call it, over a plain ``Mesh`` (``Auto`` axes,
``NamedSharding`` in_shardings: the ring is decided when XLA partitions the program) and over an
explicit-axes mesh under ``jax.set_mesh``; and ``flashport.ring_attention`` over the 8 shards
(contiguous and zigzag). Forward and forward+backward (value_and_grad of a sum). The last column is
each program's scratch over the unsharded one's.

Usage: python benchmarks/ring_cpu.py [--seq 32768] [--heads 8] [--kv-heads 2] [--dim 64]
       [--dtype float32|bfloat16] [--backend auto] [--forward-only]
"""

from __future__ import annotations

import argparse
import os
import re

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flashport


def measure(fn, args, in_shardings=None, mesh=None):
    """Compile ``fn`` for ``args`` (ShapeDtypeStructs), under ``jax.set_mesh(mesh)`` if given; return
    per-device (temp, argument, output) bytes and the HLO's (all-gather, collective-permute) counts."""
    jitted = jax.jit(fn) if in_shardings is None else jax.jit(fn, in_shardings=in_shardings)
    if mesh is None:
        compiled = jitted.lower(*args).compile()
    else:
        with jax.set_mesh(mesh):
            compiled = jitted.lower(*args).compile()
    mem = compiled.memory_analysis()
    hlo = compiled.as_text()
    counts = tuple(len(re.findall(rf"\b{op}(-start)?\(", hlo)) for op in ("all-gather", "collective-permute"))
    return mem.temp_size_in_bytes, mem.argument_size_in_bytes, mem.output_size_in_bytes, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=None, help="GQA: kv heads (default: --heads)")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--forward-only", action="store_true")
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args()
    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("seq",))
    dtype = jnp.dtype(args.dtype)
    seq_sharded = NamedSharding(mesh, P(None, "seq", None, None))
    q_shape = (1, args.seq, args.heads, args.dim)
    kv_shape = (1, args.seq, args.kv_heads or args.heads, args.dim)
    plain = (jax.ShapeDtypeStruct(q_shape, dtype),) + (jax.ShapeDtypeStruct(kv_shape, dtype),) * 2
    sharded = (jax.ShapeDtypeStruct(q_shape, dtype, sharding=seq_sharded),) + (
        jax.ShapeDtypeStruct(kv_shape, dtype, sharding=seq_sharded),
    ) * 2

    def contract(q, k, v):
        return flashport.attention(q, k, v, causal=True, backend=args.backend)

    def gathered(q, k, v):
        k, v = (jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P())) for x in (k, v))
        return contract(q, k, v)

    explicit = jax.make_mesh((n,), ("seq",), axis_types=(jax.sharding.AxisType.Explicit,))
    explicit_sharded = tuple(
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(explicit, x.sharding.spec))
        for x in sharded
    )

    def ring(layout):
        def fn(q, k, v):
            return flashport.ring_attention(
                q, k, v, mesh=mesh, axis_name="seq", causal=True, backend=args.backend, seq_layout=layout
            )

        return fn

    def train(fn):
        return jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v)), argnums=(0, 1, 2))

    rows = []
    programs = [  # (name, fn, args, jit in_shardings, mesh to set)
        ("unsharded, 1 device", contract, plain, None, None),
        ("seq-sharded, K/V replicated first (gathered)", gathered, sharded, None, None),
        ("flashport.attention, jit + in_shardings, Auto axes", contract, plain, (seq_sharded,) * 3, None),
        ("flashport.attention, jit, Explicit axes (set_mesh)", contract, explicit_sharded, None, explicit),
        (f"ring_attention contiguous, {n} shards", ring("contiguous"), sharded, None, None),
        (f"ring_attention zigzag, {n} shards", ring("zigzag"), sharded, None, None),
    ]
    for kind in ("forward",) if args.forward_only else ("forward", "fwd+bwd"):
        base = None
        for name, fn, x, in_shardings, set_mesh in programs:
            temp, arg, out, counts = measure(
                fn if kind == "forward" else train(fn), x, in_shardings, set_mesh
            )
            base = temp if base is None else base
            rows.append((kind, name, temp, arg, out, counts, temp / base))
    print(
        f"causal attention, B=1, S={args.seq}, Hq={args.heads}, Hkv={kv_shape[2]}, D={args.dim}, {args.dtype}, "
        f"backend={args.backend}; "
        f"per-device bytes from compiled.memory_analysis()"
    )
    print(
        "| pass | program | temp (scratch) MiB | arguments MiB | outputs MiB | all-gathers | "
        "collective-permutes | temp / unsharded |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for kind, name, temp, arg, out, (gathers, permutes), ratio in rows:
        print(
            f"| {kind} | {name} | {temp / 2**20:.1f} | {arg / 2**20:.1f} | {out / 2**20:.1f} | "
            f"{gathers} | {permutes} | {ratio:.3f} |"
        )


if __name__ == "__main__":
    main()
