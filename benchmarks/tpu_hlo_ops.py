"""The optimized HLO around the kernels of a BSHD call, readable without a TPU.

Compiles ``flashport.attention`` (bf16, causal, ``pallas_tpu``) on BSHD inputs deviceless
(``get_topology_desc``: no TPU needed) at the issue's shape (v6e, B = 1, S = 4096, H = 8, D = 128),
the inference forward and ``grad`` of a sum, once with the default options (token-major kernels where
``kernels/backends/pallas_tpu/layout.py`` picks them) and once with ``read_bshd=False`` (heads-major kernels
behind transposes), and prints every instruction of each program's entry computation: the ops that run
around and between the kernels (attributes, metadata and backend configs dropped).

Run: ``ALLOW_MULTIPLE_LIBTPU_LOAD=1 python benchmarks/tpu_hlo_ops.py [--gen v6e] [--seq 4096]
[--heads 8/8]`` (needs ``jax[tpu]`` at the installed jax version); results in
``benchmarks/results/tpu_hlo_ops_v6e.txt``.
"""

from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp
from llo_profile import TOPOLOGIES, one_chip

import flashport
from flashport.kernels.contract import registry

_DROP = re.compile(
    r",? (metadata|backend_config|frontend_attributes|custom_call_has_side_effect|sharding)=.*$"
)


def entry_ops(hlo_text: str) -> list[str]:
    """The instructions of the ENTRY computation of an optimized HLO module, without attributes."""
    lines = hlo_text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ENTRY "))
    ops = []
    for line in lines[start + 1 :]:
        if line.startswith("}"):
            break
        ops.append(_DROP.sub("", line.strip()))
    return ops


def programs(gen: str, seq: int, hq: int, hkv: int, read_bshd: bool | None) -> dict[str, str]:
    """``{"forward": hlo, "gradient": hlo}`` of a causal BSHD bf16 call compiled for chip ``gen``."""
    sharding = one_chip(gen)
    q = jax.ShapeDtypeStruct((1, seq, hq, 128), jnp.bfloat16, sharding=sharding)
    kv = jax.ShapeDtypeStruct((1, seq, hkv, 128), jnp.bfloat16, sharding=sharding)
    options = {} if read_bshd is None else {"read_bshd": read_bshd}
    backend = registry.use("pallas_tpu", generation=gen, **options)

    def fwd(q, k, v):
        return flashport.attention(q, k, v, backend=backend, causal=True)

    def loss(q, k, v):
        return jnp.sum(fwd(q, k, v).astype(jnp.float32))

    return {
        name: jax.jit(fn).trace(q, kv, kv).lower(lowering_platforms=("tpu",)).compile().as_text()
        for name, fn in (("forward", fwd), ("gradient", jax.grad(loss, argnums=(0, 1, 2))))
    }


def main() -> None:
    """Print the entry computations of the default and the ``read_bshd=False`` call."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gen", default="v6e", choices=sorted(TOPOLOGIES))
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", default="8/8", help="query/kv heads, e.g. 8/8 8/2")
    args = parser.parse_args()
    hq, hkv = (int(n) for n in args.heads.split("/"))
    for label, read_bshd in (("default options", None), ("read_bshd=False", False)):
        for name, text in programs(args.gen, args.seq, hq, hkv, read_bshd).items():
            print(f"== {args.gen} B=1 S={args.seq} H={hq}/{hkv} D=128 bf16 causal, {label}: {name} ==")
            print("\n".join(entry_ops(text)), end="\n\n", flush=True)


if __name__ == "__main__":
    main()
