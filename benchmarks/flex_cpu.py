"""score_mod / mask_mod against the same built-in feature, and the tiles a document mask_mod skips.

Part 1, time (blockwise backend on CPU; B=1, H=8, D=64, float32): each feature written as a mod
is timed side by side with its built-in form, alternating in one process, forward and
forward+backward (medians). Pairs: softcap (``softcap=30`` vs ``30 * tanh(s / 30)``), causal
(``causal=True`` vs ``j <= i``), a causal sliding window (``window=(256, 0)`` vs a mask_mod), ALiBi
(``bias=`` [1, H, S, S] vs a score_mod closing over the slopes). Target: mod / built-in <= 1.1.

Part 2, tile skipping: a document mask_mod over packed documents of uneven lengths. The tiles the
blockwise backend computes are counted while it runs (a score_mod that reports each computed
entry's tile through ``jax.debug.callback``), next to the analytic count (the tiles some document
covers both rows and columns of) and the total. Then the Pallas TPU forward kernel (in the TPU
interpreter, with its visit counters): tiles computed through the mask-free body and through the
masked body, and tiles skipped, next to the block mask's FULL / PARTIAL / EMPTY counts of the dense
mask at the kernel's tiles.

    python benchmarks/flex_cpu.py                 # S = 2048
    python benchmarks/flex_cpu.py --sizes 1024 --repeats 3
    python benchmarks/flex_cpu.py --features causal window --no-counts
"""

from __future__ import annotations

import argparse
import statistics
import time

B, H, D = 1, 8, 64


def _pairs(seq: int):
    import jax.numpy as jnp
    import numpy as np

    slopes = jnp.asarray(2.0 ** -np.arange(1, H + 1), jnp.float32)
    pos = jnp.arange(seq)
    alibi = (slopes[:, None, None] * (pos[None, None, :] - pos[None, :, None]))[None]
    import flashport

    return {
        "softcap": ({"softcap": 30.0}, {"score_mod": lambda s, b, h, i, j: 30.0 * jnp.tanh(s / 30.0)}),
        "causal": (
            {"causal": True},
            {"block_mask": flashport.block_mask(lambda b, h, i, j: j <= i, None, None, seq, seq)},
        ),
        "window": (
            {"window": (256, 0)},
            {
                "block_mask": flashport.block_mask(
                    lambda b, h, i, j: (j <= i) & (j >= i - 256), None, None, seq, seq
                )
            },
        ),
        "alibi": (
            {"bias": alibi, "causal": True},
            {"score_mod": lambda s, b, h, i, j: s + slopes[h] * (j - i), "causal": True},
        ),
    }


def time_pairs(seq: int, repeats: int, features: list[str] | None = None) -> list[str]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import flashport

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((B, seq, H, D)), jnp.float32) for _ in range(3))
    rows = []
    for name, (builtin, mod) in _pairs(seq).items():
        if features and name not in features:
            continue
        fns = {}
        for label, kw in (("built-in", builtin), ("mod", mod)):

            def attn(q, k, v, kw=kw):
                return flashport.attention(q, k, v, backend="blockwise", **kw)

            fwd = jax.jit(attn)
            grad = jax.jit(jax.grad(lambda q, k, v, f=attn: jnp.sum(f(q, k, v)), argnums=(0, 1, 2)))
            fns[label] = (fwd, grad)
        medians = {}
        for kind, index in (("fwd", 0), ("fwd+bwd", 1)):
            samples = {label: [] for label in fns}
            for pair in fns.values():  # warm up (compile) both first
                jax.block_until_ready(pair[index](q, k, v))
            for _ in range(repeats):
                for label, pair in fns.items():
                    t = time.perf_counter()
                    jax.block_until_ready(pair[index](q, k, v))
                    samples[label].append(time.perf_counter() - t)
            medians[kind] = {label: statistics.median(s) for label, s in samples.items()}
        for kind, m in medians.items():
            rows.append(
                f"| {name} | {seq} | {kind} | {m['built-in'] * 1e3:.1f} | {m['mod'] * 1e3:.1f} | "
                f"{m['mod'] / m['built-in']:.2f} |"
            )
    return rows


def count_tiles(seq: int, tile: int, lengths: list[int]) -> str:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import flashport
    from flashport.kernels.contract.registry import use

    docs_np = np.repeat(np.arange(len(lengths)), lengths)
    assert docs_np.size == seq
    docs = jnp.asarray(docs_np)
    seen: set[tuple[int, int]] = set()

    def score_mod(s, b, h, i, j):
        jax.debug.callback(lambda i, j: seen.add((int(i) // tile, int(j) // tile)), i, j)
        return s

    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((1, seq, 1, 16)), jnp.float32)
    flashport.attention(
        q,
        q,
        q,
        score_mod=score_mod,
        mask_mod=lambda b, h, i, j: docs[i] == docs[j],
        backend=use("blockwise", block_q=tile, block_k=tile),
    ).block_until_ready()
    analytic = set()
    start = 0
    for length in lengths:
        blocks = range(start // tile, (start + length - 1) // tile + 1)
        analytic |= {(a, c) for a in blocks for c in blocks}
        start += length
    n = -(-seq // tile)
    return (
        f"| {seq} | {tile} | {len(lengths)} | {len(seen)} | {len(analytic)} | {n * n} | "
        f"{'yes' if seen == analytic else 'NO'} |"
    )


def count_pallas_tiles(seq: int, lengths: list[int], block_q: int, block_k: int) -> str:
    import jax.numpy as jnp
    import numpy as np

    from flashport.kernels.backends.pallas_tpu import backend
    from flashport.kernels.contract.spec import make_spec
    from flashport.kernels.contract.validate import prepare_mods

    docs_np = np.repeat(np.arange(len(lengths)), lengths)
    docs = jnp.asarray(docs_np)
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((1, 1, seq, 32)), jnp.float32)
    mods = prepare_mods(q, q, None, lambda b, h, i, j: docs[i] == docs[j], None, "BHSD")
    spec = make_spec(
        q.shape, q.shape, scale=None, causal=False, window=None, align="bottom_right", softcap=None
    )
    options = dict(block_q=block_q, block_k=block_k)
    _, _, full, partial = backend.count_tiles_by_class(q, q, q, spec=spec, options=options, mods=mods)
    dense = docs_np[:, None] == docs_np[None, :]
    nq, nk = seq // block_q, seq // block_k
    tiles = dense.reshape(nq, block_q, nk, block_k)
    want_full = int(np.sum(tiles.all(axis=(1, 3))))
    want_partial = int(np.sum(tiles.any(axis=(1, 3)))) - want_full
    got_full, got_partial = int(np.sum(full)), int(np.sum(partial))
    skipped = nq * nk - got_full - got_partial
    equal = (got_full, got_partial) == (want_full, want_partial)
    return (
        f"| {seq} | {block_q}x{block_k} | {len(lengths)} | {got_full} / {want_full} | "
        f"{got_partial} / {want_partial} | {skipped} / {nq * nk - want_full - want_partial} | {nq * nk} | "
        f"{'yes' if equal else 'NO'} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--features", nargs="+", help="time only these (softcap causal window alibi)")
    parser.add_argument("--no-counts", action="store_true", help="only the timings")
    args = parser.parse_args()
    import jax

    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; B={B} H={H} D={D} float32, blockwise backend\n"
    )
    print("| feature | S | pass | built-in ms | mod ms | mod / built-in |")
    print("|---|---|---|---|---|---|")
    for seq in args.sizes:
        for row in time_pairs(seq, args.repeats, args.features):
            print(row, flush=True)
    if args.no_counts:
        return
    print("\nTile skipping, document mask_mod (tiles computed, counted while running):\n")
    print("| S | tile | documents | tiles computed | analytic | total | equal |")
    print("|---|---|---|---|---|---|---|")
    print(count_tiles(512, 32, [40, 72, 24, 120, 56, 88, 48, 64]))
    print(count_tiles(256, 64, [100, 60, 96]))
    print("\nPallas TPU forward kernel (TPU interpreter), same kind of mask_mod (kernel / analytic):\n")
    print("| S | tile | documents | mask-free body | masked body | skipped | total | equal |")
    print("|---|---|---|---|---|---|---|---|")
    print(count_pallas_tiles(1024, [128, 256, 100, 284, 256], 128, 128))


if __name__ == "__main__":
    main()
