"""Per-device memory of ring attention vs the unsharded call, from XLA's compiled memory analysis.

Runs on a CPU host with 8 fake devices (``--xla_force_host_platform_device_count=8``, set below
before JAX starts). Nothing is executed: each program is compiled and
``compiled.memory_analysis()`` reports, per device, the scratch (``temp_size_in_bytes``) and the
argument/output sizes. Programs: the plain ``flashport.attention`` on one device (unsharded), the
same call on sequence-sharded inputs (the partitioner gathers K/V on every shard), and
``flashport.ring_attention`` over the 8 shards (contiguous and zigzag), forward and forward+backward
(value_and_grad of a sum). The last column is each program's scratch over the unsharded one's.

Usage: python benchmarks/ring_cpu.py [--seq 32768] [--heads 8] [--kv-heads 2] [--dim 64]
       [--dtype float32|bfloat16] [--backend blockwise] [--forward-only]
"""

from __future__ import annotations

import argparse
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flashport


def measure(fn, *args):
    """Compile ``fn`` for ``args`` (ShapeDtypeStructs); return (temp, argument, output) bytes per device."""
    compiled = jax.jit(fn).lower(*args).compile()
    mem = compiled.memory_analysis()
    hlo = compiled.as_text()
    return mem.temp_size_in_bytes, mem.argument_size_in_bytes, mem.output_size_in_bytes, "all-gather" in hlo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=None, help="GQA: kv heads (default: --heads)")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--forward-only", action="store_true")
    parser.add_argument("--backend", default="blockwise")
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

    def ring(layout):
        def fn(q, k, v):
            return flashport.ring_attention(
                q, k, v, mesh=mesh, axis_name="seq", causal=True, backend=args.backend, seq_layout=layout
            )

        return fn

    def train(fn):
        return jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v)), argnums=(0, 1, 2))

    rows = []
    programs = [
        ("unsharded, 1 device", contract, plain),
        ("seq-sharded, gathered", contract, sharded),
        (f"ring contiguous, {n} shards", ring("contiguous"), sharded),
        (f"ring zigzag, {n} shards", ring("zigzag"), sharded),
    ]
    for kind in ("forward",) if args.forward_only else ("forward", "fwd+bwd"):
        base = None
        for name, fn, x in programs:
            temp, arg, out, gathers = measure(fn if kind == "forward" else train(fn), *x)
            base = temp if base is None else base
            rows.append((kind, name, temp, arg, out, gathers, temp / base))
    print(
        f"causal attention, B=1, S={args.seq}, Hq={args.heads}, Hkv={kv_shape[2]}, D={args.dim}, {args.dtype}, "
        f"backend={args.backend}; "
        f"per-device bytes from compiled.memory_analysis()"
    )
    print(
        "| pass | program | temp (scratch) MiB | arguments MiB | outputs MiB | all-gather in HLO | temp / unsharded |"
    )
    print("|---|---|---|---|---|---|---|")
    for kind, name, temp, arg, out, gathers, ratio in rows:
        print(
            f"| {kind} | {name} | {temp / 2**20:.1f} | {arg / 2**20:.1f} | {out / 2**20:.1f} | "
            f"{'yes' if gathers else 'no'} | {ratio:.3f} |"
        )


if __name__ == "__main__":
    main()
