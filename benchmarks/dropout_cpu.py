"""What the contract's dropout costs: the blockwise backend on CPU with and without dropout.

B=1, H=8, D=64, float32, causal. For each S, forward and forward+backward are timed with
``dropout_rate=0`` and ``dropout_rate=0.1`` alternately in one process (so machine noise hits both
alike); the table shows medians and the ratio dropout / no dropout, plus XLA's compiled scratch
memory for both (dropout regenerates its mask per tile, so it must add no O(S²) memory).

    python benchmarks/dropout_cpu.py                   # S = 2048, 8192 (the issue's target: <= 1.25x at 8192)
    python benchmarks/dropout_cpu.py --sizes 1024 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

B, H, D = 1, 8, 64
RATE = 0.1


def _functions(seq: int):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import flashport

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((B, seq, H, D)), jnp.float32) for _ in range(3))
    key = jax.random.key(0)

    def attn(rate):
        return lambda q, k, v: flashport.attention(
            q, k, v, causal=True, backend="blockwise", dropout_rate=rate, dropout_rng=key if rate else None
        )

    fns = {}
    for rate in (0.0, RATE):
        fwd = jax.jit(attn(rate))
        loss = attn(rate)
        train = jax.jit(jax.grad(lambda q, k, v, f=loss: jnp.sum(f(q, k, v)), argnums=(0, 1, 2)))
        fns[("forward", rate)] = fwd
        fns[("fwd+bwd", rate)] = train
    return fns, (q, k, v)


def _time(fn, args, repeats):
    import jax

    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    """Print the side-by-side table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    print(
        f"blockwise backend, B={B} H={H} D={D} float32 causal; dropout_rate={RATE} vs 0; "
        f"medians of {args.repeats} alternating runs"
    )
    print(
        f"{'S':>6} {'pass':>8} {'no dropout s':>13} {'dropout s':>10} {'ratio':>6} {'scratch MiB (0 / p)':>20}"
    )
    for seq in args.sizes:
        fns, xs = _functions(seq)
        for kind in ("forward", "fwd+bwd"):
            base, drop = fns[(kind, 0.0)], fns[(kind, RATE)]
            scratch = [
                f.lower(*xs).compile().memory_analysis().temp_size_in_bytes / 2**20 for f in (base, drop)
            ]
            t_base, t_drop = [], []
            for _ in range(args.repeats):  # alternate so drift hits both
                t_base += _time(base, xs, 1)
                t_drop += _time(drop, xs, 1)
            mb, md = statistics.median(t_base), statistics.median(t_drop)
            print(
                f"{seq:>6} {kind:>8} {mb:>13.3f} {md:>10.3f} {md / mb:>6.2f} "
                f"{scratch[0]:>9.1f} / {scratch[1]:<8.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
