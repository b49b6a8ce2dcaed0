"""The TPU compiler's static LLO profile (``estimated_cycles`` per HLO op), and what it counts.

libtpu writes one ``<hlo op>_static_llo_profile.textproto`` per op it compiles when
``LIBTPU_INIT_ARGS=--xla_jf_dump_static_llo_profile_to=DIR`` is set before it starts; compiling
deviceless (``get_topology_desc``, no TPU) is enough. :func:`enable` sets the flag (call it before
anything touches a TPU backend or topology), :func:`compile_profiled` compiles one function and
returns ``{hlo op: estimated cycles}``.

Run as a script, it calibrates the estimate (``python benchmarks/llo_profile.py [--gen v6e]``):

1. a synthetic Pallas kernel over a 64-step grid whose 512x512 matmul body is gated by a condition:
   always, never (provably, ``i < 0``), on the grid index (``i < N/4``, ``i < N/2``,
   ``i % 2 == 0``) and on a scalar-prefetched value (``flag[i] > 0``, ``flag[i] == 0``);
2. JAX's own Pallas flash attention (causal skipping by grid-index arithmetic) and splash attention
   (causal skipping by its scalar-prefetched block-mask tables), causal vs non-causal, 512 blocks.

What it shows (``benchmarks/results/llo_profile_calibration.txt``, ``kernels/README.md``): the
estimate walks the grid step by step and scales with the number of grid steps; conditions on grid
indices that it can bound (``i < c``) count the gated body only for the steps that take it; a
condition it cannot bound (``i % 2``) counts as always taken; and **scalar-prefetched values read as
0**: a body gated on ``flag[i] > 0`` costs nothing, one gated on ``flag[i] == 0`` costs every step.
Kernels that drive their tiles from prefetched tables (splash, flashport's ``pallas_tpu``) are
therefore estimated as if the tables were zeros: their causal and non-causal estimates coincide and
the tile compute they gate is not in the number. XLA ops around a kernel (copies, transposes) and
kernels gated by grid arithmetic (JAX's flash attention) are estimated as they run.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

FLAG = "--xla_jf_dump_static_llo_profile_to"
TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
_dir: list[str] = []


def enable(directory: str | None = None) -> str:
    """Ask libtpu to dump static LLO profiles into ``directory`` (a new temp dir by default).

    Must run before libtpu initializes (before the first TPU topology, device or compile).
    """
    directory = directory or tempfile.mkdtemp(prefix="flashport_llo_")
    os.environ["LIBTPU_INIT_ARGS"] = f"{os.environ.get('LIBTPU_INIT_ARGS', '')} {FLAG}={directory}".strip()
    _dir[:] = [directory]
    return directory


def one_chip(gen: str):
    """A one-device sharding on a TPU of generation ``gen`` (deviceless, from its topology)."""
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(TOPOLOGIES[gen], "tpu").devices
    return jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(devices[:1]), ("x",)), jax.sharding.PartitionSpec()
    )


def compile_profiled(fn, *specs):
    """Compile ``jax.jit(fn)`` for TPU on ``specs`` (ShapeDtypeStructs with a TPU sharding).

    Returns ``(compiled, {hlo op name: estimated cycles})``; the profile dict is empty unless
    :func:`enable` ran first.
    """
    directory = _dir[0] if _dir else None
    if directory:
        for path in glob.glob(os.path.join(directory, "*")):
            os.remove(path)
    compiled = jax.jit(fn).trace(*specs).lower(lowering_platforms=("tpu",)).compile()
    cycles: dict[str, int] = {}
    for path in glob.glob(os.path.join(directory, "*")) if directory else ():
        with open(path) as f:
            for name, value in re.findall(r'hlo_op_name: "([^"]+)"\s+estimated_cycles: (\d+)', f.read()):
                cycles[name] = int(value)
    return compiled, cycles


def gated_kernel(condition: str, steps: int = 64, tile: int = 512):
    """A Pallas TPU kernel whose per-step matmul runs under ``condition`` (see the module docstring)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    def kernel(flags_ref, x_ref, y_ref, o_ref):
        i = pl.program_id(0)
        conditions = {
            "always": None,
            "never (i < 0)": i < 0,
            "i < N/4": i < steps // 4,
            "i < N/2": i < steps // 2,
            "i % 2 == 0": i % 2 == 0,
            "prefetched flag[i] > 0": flags_ref[i] > 0,
            "prefetched flag[i] == 0": flags_ref[i] == 0,
        }
        cond = conditions[condition]

        def body():
            o_ref[...] = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

        if cond is None:
            body()
            return
        pl.when(cond)(body)
        pl.when(jnp.logical_not(cond))(lambda: o_ref.__setitem__(..., jnp.zeros_like(o_ref)))

    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(steps,),
        in_specs=[
            pl.BlockSpec((tile, tile), lambda i, f: (i, 0)),
            pl.BlockSpec((tile, tile), lambda i, f: (0, 0)),
        ],
        out_specs=pl.BlockSpec((tile, tile), lambda i, f: (i, 0)),
    )
    out = jax.ShapeDtypeStruct((steps * tile, tile), jnp.float32)
    return pl.pallas_call(kernel, grid_spec=spec, out_shape=out)


GATES = (
    "always",
    "never (i < 0)",
    "i < N/4",
    "i < N/2",
    "i % 2 == 0",
    "prefetched flag[i] > 0",
    "prefetched flag[i] == 0",
)


def calibrate_gates(sharding, steps: int = 64, tile: int = 512) -> list[tuple[str, int]]:
    """``[(condition, estimated cycles)]`` of :func:`gated_kernel` for every condition."""
    flags = jax.ShapeDtypeStruct((steps,), jnp.int32, sharding=sharding)
    x = jax.ShapeDtypeStruct((steps * tile, tile), jnp.bfloat16, sharding=sharding)
    y = jax.ShapeDtypeStruct((tile, tile), jnp.bfloat16, sharding=sharding)
    return [(c, sum(compile_profiled(gated_kernel(c, steps, tile), flags, x, y)[1].values())) for c in GATES]


def reference_kernels(causal: bool, seq: int, heads: int = 8, dim: int = 128, block: int = 512):
    """``{name: fn(q, k, v)}``: JAX's flash attention and splash attention (BHSD, bf16, ``block`` tiles)."""
    from jax.experimental.pallas.ops.tpu import flash_attention as fa
    from jax.experimental.pallas.ops.tpu import splash_attention as sp

    fa_blocks = fa.BlockSizes(
        block_q=block,
        block_k_major=block,
        block_k=block,
        block_b=1,
        block_q_major_dkv=block,
        block_k_major_dkv=block,
        block_k_dkv=block,
        block_q_dkv=block,
        block_k_major_dq=block,
        block_k_dq=block,
        block_q_dq=block,
    )
    mask = sp.CausalMask((seq, seq)) if causal else sp.FullMask((seq, seq))
    with jax.ensure_compile_time_eval():
        splash = sp.make_splash_mha(
            sp.MultiHeadMask([mask] * heads),
            block_sizes=sp.BlockSizes(*(block,) * 8),
            head_shards=1,
            q_seq_shards=1,
        )
    scale = dim**-0.5
    return {
        "jax_flash": lambda q, k, v: fa.flash_attention(
            q, k, v, causal=causal, sm_scale=scale, block_sizes=fa_blocks
        ),
        "splash": lambda q, k, v: jax.vmap(splash)(q * jnp.asarray(scale, q.dtype), k, v),
    }


def kernel_ops(cycles: dict[str, int]) -> set[str]:
    """The attention kernels (Mosaic custom calls) among a program's ops."""
    names = ("flash", "splash", "flashport")
    return {op for op in cycles if any(n in op for n in names)}


def kernel_cycles(cycles: dict[str, int]) -> int:
    """Estimated cycles of the attention kernels (Mosaic custom calls) among a program's ops."""
    return sum(cycles[op] for op in kernel_ops(cycles))


def main() -> None:
    """Print the calibration tables (about two minutes on 2 CPU cores)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gen", default="v6e", choices=sorted(TOPOLOGIES))
    args = parser.parse_args()
    enable()
    sharding = one_chip(args.gen)
    print(f"static LLO profile calibration, {args.gen} (deviceless libtpu compile)\n")
    print("1. gated matmul kernel: 64 grid steps, 512x512x512 bf16 matmul per step under the condition")
    gates = dict(calibrate_gates(sharding))
    base, full = gates["never (i < 0)"], gates["always"]
    for condition, cycles in gates.items():
        print(
            f"   {condition:<26} {cycles:>9,} cycles  (gated part counted: {(cycles - base) / (full - base):.2f})"
        )
    print("\n2. attention kernels, B=1 H=8 D=128 bf16, 512 blocks: kernel cycles, causal / non-causal")
    for seq in (2048, 4096):
        q = jax.ShapeDtypeStruct((1, 8, seq, 128), jnp.bfloat16, sharding=sharding)
        runs = {c: reference_kernels(c, seq) for c in (False, True)}
        for name in runs[False]:
            full_c, causal_c = (
                kernel_cycles(compile_profiled(runs[c][name], q, q, q)[1]) for c in (False, True)
            )
            steps = 8 * (seq // 512) ** 2
            print(
                f"   {name:<10} S={seq:<6} non-causal {full_c:>9,} ({full_c / steps:,.0f}/grid step)  "
                f"causal {causal_c:>9,}  ratio {causal_c / full_c:.2f}"
            )


if __name__ == "__main__":
    main()
