"""libtpu compile time of a BSHD call: token-major kernels (the default) against heads-major ones.

Compiles ``flashport.attention`` (bf16, causal, ``pallas_tpu``) forward and ``grad`` deviceless
(``get_topology_desc``: no TPU needed) for each configuration twice in one process, with the default
layout (token-major when ``kernels/backends/pallas_tpu/layout.py`` picks it) and with ``read_bshd=False``
(heads-major: transposes around the kernels), and prints the process CPU seconds of lowering +
compiling each (``time.process_time``: all threads; wall time depends on the host's load) and the
number of transpose/copy ops of a whole [B, S, H, D] operand in the optimized HLO.

Run: ``ALLOW_MULTIPLE_LIBTPU_LOAD=1 python benchmarks/tpu_compile_time.py`` (needs
``jax[tpu]`` at the installed jax version); results in ``benchmarks/results/tpu_compile_time.txt``.
"""

from __future__ import annotations

import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import flashport
from flashport.kernels.contract import registry

TOPOLOGIES = {"v5e": "v5e:2x2", "v6e": "v6e:2x2"}
# (chip, B, S, Hq, Hkv): the v6e shape and a v5e GQA 8/2 call.
CONFIGS = [("v6e", 1, 4096, 8, 8), ("v5e", 2, 2048, 8, 2)]
REPEATS = 3


def _sharding(gen: str) -> NamedSharding:
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(TOPOLOGIES[gen], "tpu").devices
    return NamedSharding(jax.sharding.Mesh(np.array(devices[:1]), ("x",)), PartitionSpec())


def compile_seconds(gen: str, b: int, s: int, hq: int, hkv: int, options: dict) -> tuple[float, float, int]:
    """CPU seconds to lower + compile the forward and the gradient, and the whole-operand relayouts
    (transpose/copy ops producing a [B, S, H, D] or [B, H, S, D] bf16 array) in both HLOs."""
    sharding = _sharding(gen)
    q = jax.ShapeDtypeStruct((b, s, hq, 128), jnp.bfloat16, sharding=sharding)
    kv = jax.ShapeDtypeStruct((b, s, hkv, 128), jnp.bfloat16, sharding=sharding)
    backend = registry.use("pallas_tpu", **options)

    def fwd(q, k, v):
        return flashport.attention(q, k, v, causal=True, backend=backend)

    def loss(q, k, v):
        return jnp.sum(fwd(q, k, v).astype(jnp.float32))

    seconds, relayouts = [], 0
    for fn in (fwd, jax.grad(loss, argnums=(0, 1, 2))):
        start = time.process_time()
        text = jax.jit(fn).trace(q, kv, kv).lower(lowering_platforms=("tpu",)).compile().as_text()
        seconds.append(time.process_time() - start)
        shapes = {f"{b},{s},{h},128" for h in (hq, hkv)} | {f"{b},{h},{s},128" for h in (hq, hkv)}
        for line in text.splitlines():
            m = re.search(r"= bf16\[([\d,]+)\]\S* (copy|transpose|fusion)\(", line)
            relayouts += bool(m and m.group(1) in shapes and "custom-call" not in line)
    return seconds[0], seconds[1], relayouts


def main() -> None:
    """Print the table: per configuration and layout, median CPU seconds over ``REPEATS`` runs."""
    print(f"libtpu compile CPU seconds (median of {REPEATS}; forward / gradient / total), bf16 causal BSHD")
    for gen, b, s, hq, hkv in CONFIGS:
        totals = {}
        for name, options in (
            ("default (token-major)", {}),
            ("read_bshd=False (heads-major)", {"read_bshd": False}),
        ):
            runs = [compile_seconds(gen, b, s, hq, hkv, options) for _ in range(REPEATS)]
            fwd = statistics.median(r[0] for r in runs)
            grad = statistics.median(r[1] for r in runs)
            totals[name] = fwd + grad
            print(
                f"{gen} B={b} S={s} H={hq}/{hkv} {name}: {fwd:.1f} / {grad:.1f} / {fwd + grad:.1f} s; "
                f"whole-operand relayouts in the HLOs: {runs[0][2]}"
            )
        default, heads_major = totals.values()
        print(f"  token-major / heads-major compile CPU time: {default / heads_major:.2f}x")


if __name__ == "__main__":
    main()
