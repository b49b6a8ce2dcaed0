"""flashport.attention (auto on CPU) vs jax.nn.dot_product_attention(implementation="xla").

B=1, H=8, D=64, float32, causal; S in 1024..8192. Each (implementation, S) runs in its own process
so its peak RSS is its own; both implementations are measured in the same run, one after the other.
Prints median forward times, peak memory, the ratios, and the fraction of this machine's measured
f32 matmul throughput that flashport reaches (causal FLOPs = 2·B·H·S²·D). A second table shows
forward+backward scratch memory (compiled memory analysis) and peak RSS at S up to 16384.

    python benchmarks/attention_cpu.py                  # full table (jax.nn at 8192 takes ~30 s a call)
    python benchmarks/attention_cpu.py --sizes 1024 2048 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

B, H, D = 1, 8, 64


def _worker(impl: str, seq: int, repeats: int, train: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import flashport

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((B, seq, H, D)), jnp.float32) for _ in range(3))
    if impl == "flashport":
        attn = lambda q, k, v: flashport.attention(q, k, v, causal=True)  # noqa: E731
    else:
        attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")  # noqa: E731
    if train:
        fn = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v)), argnums=(0, 1, 2)))
    else:
        fn = jax.jit(attn)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    temp = fn.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes
    jax.block_until_ready(fn(q, k, v))  # compile + warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(q, k, v))
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "median_s": statistics.median(times),
        "times": times,
        "peak_rss": peak,
        "base_rss": base_rss,
        "temp_bytes": temp,
    }


def _run(impl: str, seq: int, repeats: int, train: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--worker", impl, str(seq), str(repeats)] + (
        ["--train"] if train else []
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{impl} S={seq} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _matmul_gflops() -> float:
    import jax
    import jax.numpy as jnp

    a = jnp.ones((4096, 4096), jnp.float32)
    f = jax.jit(lambda a, b: a @ b)
    f(a, a).block_until_ready()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        f(a, a).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * 4096**3 / statistics.median(times) / 1e9


def _attention_matmul_gflops(seq: int = 4096) -> float:
    """Throughput of attention's two matmuls alone (QKᵀ, then ·V; no softmax) at B=1, H, D.

    The contraction over D=64 has far less reuse than a square matmul, so this is the roofline the
    attention shapes can reach on this CPU.
    """
    import jax
    import jax.numpy as jnp

    x = jnp.ones((B, H, seq, D), jnp.float32)
    f = jax.jit(lambda q: jnp.einsum("bhqk,bhkd->bhqd", jnp.einsum("bhqd,bhkd->bhqk", q, q), q))
    f(x).block_until_ready()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return 4 * B * H * seq * seq * D / statistics.median(times) / 1e9


def main() -> None:
    """Run the side-by-side benchmark and print the tables."""
    from rich.console import Console
    from rich.table import Table

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--train-sizes", type=int, nargs="*", default=[4096, 8192, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    console = Console(width=150)
    # In a child process: Linux carries a parent's peak RSS into its children, so the parent stays
    # small (it never imports jax) and every measurement runs in a process of its own.
    proc = subprocess.run(
        [sys.executable, __file__, "--worker-matmul"], capture_output=True, text=True, check=True
    )
    peak, shaped = json.loads(proc.stdout.strip().splitlines()[-1])
    console.print(
        f"f32 4096² matmul on this machine: {peak:.1f} GFLOP/s ({os.cpu_count()} cores); "
        f"attention-shaped matmuls (QKᵀ·V, D={D}, no softmax): {shaped:.1f} GFLOP/s"
    )

    table = Table(title=f"forward, causal, B={B} H={H} D={D} f32: flashport (auto) vs jax.nn (xla)")
    for col in (
        "S",
        "jax.nn s",
        "flashport s",
        "speedup",
        "jax.nn peak MB",
        "flashport peak MB",
        "memory ratio",
        "flashport GFLOP/s",
        "of matmul peak",
        "of attn-shaped",
    ):
        table.add_column(col, justify="right")
    for seq in args.sizes:
        ref = _run("jax.nn", seq, args.repeats)
        ours = _run("flashport", seq, args.repeats)
        gflops = 2 * B * H * seq * seq * D / ours["median_s"] / 1e9
        table.add_row(
            str(seq),
            f"{ref['median_s']:.3f}",
            f"{ours['median_s']:.3f}",
            f"{ref['median_s'] / ours['median_s']:.1f}x",
            f"{ref['peak_rss'] / 1e6:.0f}",
            f"{ours['peak_rss'] / 1e6:.0f}",
            f"{ours['peak_rss'] / ref['peak_rss']:.0%}",
            f"{gflops:.1f}",
            f"{gflops / peak:.0%}",
            f"{gflops / shaped:.0%}",
        )
    console.print(table)

    if args.train_sizes:
        train = Table(title="forward+backward (flashport auto): memory stays linear in S")
        for col in ("S", "median s", "compiled scratch MB", "scratch / S (KB)", "peak RSS MB"):
            train.add_column(col, justify="right")
        for seq in args.train_sizes:
            r = _run("flashport", seq, 1, train=True)
            train.add_row(
                str(seq),
                f"{r['median_s']:.2f}",
                f"{r['temp_bytes'] / 1e6:.1f}",
                f"{r['temp_bytes'] / seq / 1e3:.1f}",
                f"{r['peak_rss'] / 1e6:.0f}",
            )
        console.print(train)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker-matmul":
        print(json.dumps([_matmul_gflops(), _attention_matmul_gflops()]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print(json.dumps(_worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), "--train" in sys.argv)))
    else:
        main()
