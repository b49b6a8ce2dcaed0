"""Compile cost of ``backend="auto"`` against the backend it picks, side by side.

``auto`` dispatches per platform when the program is lowered; only the branch of this process's
platform is traced, the others are deferred until a module is lowered for them
(``kernels/contract/deferred.py``). This measures what that leaves: trace + lower + compile seconds of
``jax.jit(f)`` with ``backend="auto"`` and with the backend auto picks here named explicitly, for
the forward and for ``jax.grad``, in alternating rounds (JAX's caches cleared before each
measurement), and reports the median ratio. Goal: auto / direct <= 1.2x.

    python benchmarks/auto_compile.py            # S = 2048, 3 rounds (about 3 minutes on 2 cores)
    python benchmarks/auto_compile.py --rounds 1 --sizes 1024
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import flashport
from flashport.kernels.contract import api, deferred, registry

B, HQ, HKV, D = 1, 8, 2, 64
CASES = {
    "causal gqa": dict(causal=True),
    "window softcap": dict(window=(256, 0), softcap=30.0),
}
GOAL = 1.2


def compile_seconds(backend: str, sq: int, options: dict, grad: bool) -> float:
    """Seconds to trace, lower and compile one fresh jit of the call (caches cleared first)."""
    jax.clear_caches()
    q = jax.ShapeDtypeStruct((B, sq, HQ, D), jnp.float32)
    kv = jax.ShapeDtypeStruct((B, sq, HKV, D), jnp.float32)

    def loss(q, k, v):
        return flashport.attention(q, k, v, backend=backend, **options).sum()

    f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)) if grad else loss)
    start = time.perf_counter()
    f.trace(q, kv, kv).lower().compile()
    return time.perf_counter() - start


def picked(sq: int, options: dict) -> str:
    """The backend ``auto`` picks on this platform for the call."""
    x = jnp.zeros((B, sq, HQ, D), jnp.float32)
    kv = jnp.zeros((B, sq, HKV, D), jnp.float32)
    _, call = api.prepare(x, kv, kv, **options)
    return registry.choose(deferred.host_platform(), call)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(
        f"jax {jax.__version__}, platform {deferred.host_platform()}, {args.rounds} alternating rounds, median s"
    )
    header = f"{'S':>5}  {'case':<15} {'pass':<8} {'direct backend':<14} {'direct s':>9} {'auto s':>8} {'auto/direct':>12}"
    print(header)
    ratios = []
    for sq in args.sizes:
        for name, options in CASES.items():
            direct = picked(sq, options)
            for grad in (False, True):
                times: dict[str, list[float]] = {"auto": [], direct: []}
                for r in range(args.rounds):
                    for backend in ("auto", direct) if r % 2 == 0 else (direct, "auto"):
                        times[backend].append(compile_seconds(backend, sq, options, grad))
                a, d = statistics.median(times["auto"]), statistics.median(times[direct])
                ratios.append(a / d)
                print(
                    f"{sq:>5}  {name:<15} {'grad' if grad else 'forward':<8} {direct:<14} {d:>9.2f} {a:>8.2f} "
                    f"{a / d:>11.2f}x"
                )
    worst = max(ratios)
    print(f"worst auto/direct {worst:.2f}x; goal <= {GOAL}x: {'met' if worst <= GOAL else 'NOT met'}")


if __name__ == "__main__":
    main()
