"""flashport's Pallas TPU kernel vs splash vs JAX's Pallas flash attention vs jax.nn XLA, on TPU.

On a TPU host it times every configuration, forward and forward+backward (``value_and_grad`` of a
sum), causal and not, MHA and GQA, S = 2k..32k (bf16, D = 128, B = 1): the implementations run
round-robin, one call each per round (side by side), and each reports the median over ``--reps``
rounds after warm-up, its TFLOP/s (model FLOPs: ``4·B·Hq·S²·D``, halved for causal, x3.5 with the
backward) and the % of its chip's bf16 peak (:data:`PEAK_BF16_TFLOPS`), and its ratio to splash.

    python benchmarks/tpu_bench.py [--seqs 2048 8192] [--reps 20] [--impls flashport splash]

On a host without a TPU, ``--compile-only`` compiles every configuration deviceless with libtpu
for ``--gen`` and prints what a compiler can tell: whether it compiles, its HBM scratch
(``memory_analysis``), and the static LLO profile (``estimated_cycles``) of the attention kernel and
of the ops around it (``benchmarks/llo_profile.py`` establishes what that estimate counts: it reads
scalar-prefetched tables as zeros, so for splash and flashport the kernel column is grid overhead,
not tile compute; the ops around the kernel, e.g. BSHD transposes, are estimated as they run).

    python benchmarks/tpu_bench.py --compile-only [--gen v6e] [--seqs 2048 4096]

Implementations (all bf16; every one gets its inputs in its own layout, so no transposes are timed
except where a layout is the point):

* ``flashport``: ``flashport.attention(layout="BHSD", backend=use("pallas_tpu", generation=...))``;
* ``flashport_bshd``: the same on BSHD inputs (the contract's default layout and flash-attn's) with
  the option ``read_bshd=False``: transposed to BHSD around the kernels;
* ``flashport_bshd_direct``: BSHD inputs with the default options (the kernels read and write the
  caller's arrays, token-major);
* ``splash``: ``flashport.attention(layout="BHSD", backend="splash")``, JAX's splash attention
  (``kernels/backends/splash.py``), default 512 blocks;
* ``jax_flash``: ``jax.experimental.pallas.ops.tpu.flash_attention`` with 512 blocks (its 128
  defaults are the README's "floor"); no GQA, so K/V are repeated to the query heads (counted);
* ``xla``: ``jax.nn.dot_product_attention(implementation="xla")`` (materialized scores: expect
  out-of-memory at long S).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.table import Table

import flashport
from flashport.kernels.contract import registry

# bf16 dense peak per chip, TFLOP/s (vendor figures; v7x = Ironwood / TPU7x)
PEAK_BF16_TFLOPS = {"v4": 275.0, "v5e": 197.0, "v5p": 459.0, "v6e": 918.0, "v7x": 2307.0}
DEVICE_KINDS = {
    "TPU v4": "v4",
    "TPU v5 lite": "v5e",
    "TPU v5e": "v5e",
    "TPU v5": "v5p",
    "TPU v5p": "v5p",
    "TPU v6 lite": "v6e",
    "TPU v6e": "v6e",
    "TPU7x": "v7x",
}
IMPLS = ("flashport", "flashport_bshd", "flashport_bshd_direct", "splash", "jax_flash", "xla")
SEQS = (2048, 4096, 8192, 16384, 32768)
HEADS = ((8, 8), (32, 8))  # (query heads, kv heads): MHA and GQA 4:1
BLOCK = 512


@dataclasses.dataclass(frozen=True)
class Config:
    """One benchmark point (B = 1, D = 128, bf16)."""

    seq: int
    heads: int
    kv_heads: int
    causal: bool
    backward: bool
    dim: int = 128

    @property
    def flops(self) -> float:
        """Model FLOPs: 4·Hq·S²·D, halved for causal, x3.5 with the backward (2.5x forward)."""
        f = 4.0 * self.heads * self.seq * self.seq * self.dim
        return f * (0.5 if self.causal else 1.0) * (3.5 if self.backward else 1.0)

    @property
    def name(self) -> str:
        """A short label for the tables."""
        mode = "fwd+bwd" if self.backward else "fwd"
        return f"S={self.seq} H={self.heads}/{self.kv_heads} {'causal' if self.causal else 'full'} {mode}"


def configs(seqs, heads=HEADS, masks=("full", "causal"), modes=("fwd", "fwd+bwd")) -> list[Config]:
    """Every configuration over ``seqs`` x ``heads`` x ``masks`` x ``modes``."""
    return [
        Config(s, hq, hkv, mask == "causal", mode == "fwd+bwd")
        for s in seqs
        for hq, hkv in heads
        for mask in masks
        for mode in modes
    ]


def generation() -> str | None:
    """This host's TPU generation from its first device, or None without a TPU."""
    kinds = [d.device_kind for d in jax.devices() if d.platform == "tpu"]
    return DEVICE_KINDS.get(kinds[0], "v7x") if kinds else None


def shapes(impl: str, cfg: Config) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(q shape, k/v shape) in the implementation's own layout."""
    if impl in ("flashport_bshd", "flashport_bshd_direct", "xla"):
        return (1, cfg.seq, cfg.heads, cfg.dim), (1, cfg.seq, cfg.kv_heads, cfg.dim)
    return (1, cfg.heads, cfg.seq, cfg.dim), (1, cfg.kv_heads, cfg.seq, cfg.dim)


def attention_fn(impl: str, cfg: Config, gen: str):
    """``fn(q, k, v) -> out`` of one implementation for ``cfg``."""
    if impl in ("flashport", "flashport_bshd", "flashport_bshd_direct"):
        backend = registry.use("pallas_tpu", generation=gen, read_bshd=impl != "flashport_bshd")
        layout = "BHSD" if impl == "flashport" else "BSHD"
        return lambda q, k, v: flashport.attention(q, k, v, causal=cfg.causal, layout=layout, backend=backend)
    if impl == "splash":
        return lambda q, k, v: flashport.attention(
            q, k, v, causal=cfg.causal, layout="BHSD", backend="splash"
        )
    if impl == "xla":
        return lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=cfg.causal, implementation="xla"
        )
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    b = min(BLOCK, cfg.seq)
    blocks = fa.BlockSizes(b, b, b, 1, b, b, b, b, b, b, b)
    group = cfg.heads // cfg.kv_heads

    def jax_flash(q, k, v):
        k, v = (jnp.repeat(x, group, axis=1) for x in (k, v))
        return fa.flash_attention(q, k, v, causal=cfg.causal, sm_scale=cfg.dim**-0.5, block_sizes=blocks)

    return jax_flash


def program(impl: str, cfg: Config, gen: str):
    """The benchmarked function: the forward, or ``value_and_grad`` of its float32 sum."""
    fn = attention_fn(impl, cfg, gen)
    if not cfg.backward:
        return fn
    return jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))


def specs(impl: str, cfg: Config, sharding=None):
    """ShapeDtypeStructs of (q, k, v)."""
    qs, ks = shapes(impl, cfg)
    return tuple(jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for s in (qs, ks, ks))


def _time_round(fns, inputs) -> dict[str, float]:
    """One call of every compiled function, in turn; seconds each."""
    times = {}
    for impl, fn in fns.items():
        start = time.perf_counter()
        jax.block_until_ready(fn(*inputs[impl]))
        times[impl] = time.perf_counter() - start
    return times


def time_config(cfg: Config, impls, gen: str, reps: int) -> dict[str, float | str]:
    """Median seconds per implementation (or the error that stopped it), measured round-robin."""
    rng = np.random.default_rng(0)
    fns, inputs, results = {}, {}, {}
    for impl in impls:
        try:
            qs, ks = shapes(impl, cfg)
            inputs[impl] = [jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in (qs, ks, ks)]
            fns[impl] = jax.jit(program(impl, cfg, gen)).lower(*inputs[impl]).compile()
            jax.block_until_ready(fns[impl](*inputs[impl]))  # warm-up
        except Exception as err:  # noqa: BLE001 - report and go on (e.g. XLA out of memory)
            results[impl] = f"{type(err).__name__}: {str(err).splitlines()[0][:60]}"
            fns.pop(impl, None)
            inputs.pop(impl, None)
    rounds = [_time_round(fns, inputs) for _ in range(reps)]
    for impl in fns:
        results[impl] = statistics.median(r[impl] for r in rounds)
    return results


def run_timed(cfgs, impls, reps: int) -> None:
    """Time every configuration on this host's TPU and print the table."""
    gen = generation()
    if gen is None:
        raise SystemExit("no TPU on this host: use --compile-only")
    peak = PEAK_BF16_TFLOPS[gen]
    table = Table(
        title=f"attention on {jax.devices()[0].device_kind} ({gen}, peak {peak:.0f} TFLOP/s bf16), median of {reps}"
    )
    for col in ("config", "impl", "ms", "TFLOP/s", "% peak", "vs splash"):
        table.add_column(col)
    for cfg in cfgs:
        results = time_config(cfg, impls, gen, reps)
        for impl in impls:
            r = results[impl]
            if isinstance(r, str):
                table.add_row(cfg.name, impl, r, "", "", "")
                continue
            tflops = cfg.flops / r / 1e12
            ref = results.get("splash")
            ratio = f"{ref / r:.2f}x" if isinstance(ref, float) else ""
            table.add_row(
                cfg.name, impl, f"{r * 1e3:.3f}", f"{tflops:.1f}", f"{100 * tflops / peak:.1f}", ratio
            )
    Console(width=160).print(table)


def compile_config(impl: str, cfg: Config, gen: str, sharding) -> tuple[tuple[str, ...], dict[str, int]]:
    """(status, scratch MiB, kernel cycles, cycles around the kernel) of one deviceless compile.

    Returned with the ``{hlo op: estimated cycles}`` of the ops around the kernel (empty on failure).
    """
    import llo_profile

    try:
        compiled, cycles = llo_profile.compile_profiled(program(impl, cfg, gen), *specs(impl, cfg, sharding))
    except Exception as err:  # noqa: BLE001 - report and go on (e.g. VMEM or HBM overflow)
        return (f"{type(err).__name__}: {str(err).splitlines()[0][:70]}", "", "", ""), {}
    scratch = compiled.memory_analysis().temp_size_in_bytes / 2**20
    kernel = llo_profile.kernel_cycles(cycles)
    around = {op: c for op, c in cycles.items() if c and op not in llo_profile.kernel_ops(cycles)}
    return ("ok", f"{scratch:,.0f}", f"{kernel:,}", f"{sum(cycles.values()) - kernel:,}"), around


def run_compile_only(cfgs, impls, gen: str, ops: bool = False) -> None:
    """Compile every configuration for ``gen`` without a TPU; print one line per compile as it ends.

    With ``ops``, each line is followed by the ops around the kernel with their estimated cycles.
    """
    import llo_profile

    llo_profile.enable()
    sharding = llo_profile.one_chip(gen)
    print(
        f"deviceless libtpu compile for {gen}: HBM scratch and static LLO estimated cycles (B=1, D=128, bf16)"
    )
    row = "{:<34} {:<15} {:<8} {:>12} {:>20} {:>26}"
    print(
        row.format(
            "config", "impl", "compile", "scratch MiB", "kernel est. cycles", "around kernel est. cycles"
        )
    )
    for cfg in cfgs:
        for impl in impls:
            (status, *rest), around = compile_config(impl, cfg, gen, sharding)
            print(row.format(cfg.name, impl, status if status == "ok" else "FAILED", *rest), flush=True)
            if ops and around:
                listed = ", ".join(f"{op} {c:,}" for op, c in sorted(around.items(), key=lambda x: -x[1]))
                print(f"    around: {listed}", flush=True)
            if status != "ok":
                print(f"    {status}", flush=True)
    print(
        "\nkernel est. cycles: for splash and flashport (tiles driven by scalar-prefetched tables, which the "
        "estimator reads as 0)\nthis is grid overhead only, not tile compute; jax_flash (gated by grid-index "
        "arithmetic) includes its compute.\nSee benchmarks/llo_profile.py and kernels/README.md."
    )


def main() -> None:
    """Parse the command line and run the timed or the compile-only benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true", help="no TPU: compile deviceless with libtpu")
    parser.add_argument("--gen", default="v6e", choices=sorted(PEAK_BF16_TFLOPS.keys() - {"v7x"}))
    parser.add_argument("--seqs", type=int, nargs="+", default=list(SEQS))
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument(
        "--heads", nargs="+", default=[f"{q}/{k}" for q, k in HEADS], help="query/kv heads, e.g. 8/8 32/8"
    )
    parser.add_argument("--masks", nargs="+", default=["full", "causal"], choices=["full", "causal"])
    parser.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument(
        "--ops", action="store_true", help="compile-only: list the ops around the kernel and their cycles"
    )
    args = parser.parse_args()
    heads = [tuple(int(n) for n in h.split("/")) for h in args.heads]
    cfgs = configs(args.seqs, heads, args.masks, args.modes)
    if args.compile_only:
        run_compile_only(cfgs, args.impls, args.gen, args.ops)
    else:
        run_timed(cfgs, args.impls, args.reps)


if __name__ == "__main__":
    main()
