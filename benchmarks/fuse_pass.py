"""The jaxpr fusion pass: (a) its overhead, (b) what it buys on CPU.

(a) Pass overhead: trace + match + rewrite (``fuse_attention``'s first-call work, without running)
    of a 12-layer Flax transformer, against ``jax.jit(model).lower(...).compile()`` of the same
    model. Target: at most 10%.
(b) A small GPT-style Flax model (causal, flax ``make_causal_mask``) at S=4096 on CPU, unmodified vs
    ``fuse_attention``: median forward time and peak memory, each variant in its own process (peak
    RSS above the process's baseline after setup, and XLA's compiled temp+argument+output bytes).
    Targets: fused at least 2x faster and at most 25% of the memory.

    python benchmarks/fuse_pass.py                       # both parts
    python benchmarks/fuse_pass.py --seq 2048 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def _model(layers: int, width: int, heads: int, vocab: int):
    import flax.linen as nn
    import jax.numpy as jnp

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, mask):
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=heads, qkv_features=width)(h, h, mask=mask)
            h = nn.LayerNorm()(x)
            return x + nn.Dense(width)(nn.gelu(nn.Dense(4 * width)(h)))

    class GPT(nn.Module):
        @nn.compact
        def __call__(self, ids):
            x = nn.Embed(vocab, width)(ids)
            mask = nn.make_causal_mask(ids)
            for _ in range(layers):
                x = Block()(x, mask)
            return nn.Dense(vocab)(nn.LayerNorm()(x)).astype(jnp.float32)

    return GPT()


def overhead(repeats: int) -> dict:
    """Part (a): seconds for the pass vs for jit lower+compile, 12 layers, S=256."""
    import jax
    import jax.numpy as jnp

    from flashport.rewriter.jaxpr import fuse as fuse_mod
    from flashport.rewriter.jaxpr.interpreter import analyze, run

    model = _model(layers=12, width=256, heads=8, vocab=512)
    ids = jnp.zeros((2, 256), jnp.int32)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), ids)
    fn = model.apply
    phases = {"trace": [], "match": [], "rewrite": [], "pass": [], "compile": []}
    for _ in range(repeats):
        flat, treedef, dyn, _ = fuse_mod._split((params, ids), {})
        t0 = time.perf_counter()
        closed, _ = fuse_mod._trace(fn, flat, treedef, dyn)
        t1 = time.perf_counter()
        plan = analyze(closed)  # normalize + match, recursively
        t2 = time.perf_counter()
        avals = [fuse_mod._spec(flat[i]) for i in dyn]
        jax.make_jaxpr(lambda *a: run(plan, list(a), "auto"))(*avals)
        t3 = time.perf_counter()
        assert len(plan.matches) == 12
        phases["trace"].append(t1 - t0)
        phases["match"].append(t2 - t1)
        phases["rewrite"].append(t3 - t2)
        phases["pass"].append(t3 - t0)
        start = time.perf_counter()
        jax.jit(lambda p, i: fn(p, i)).lower(params, ids).compile()  # a fresh function: no cache
        phases["compile"].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in phases.items()}
    return {"pass_s": med["pass"], "compile_s": med["compile"], "ratio": med["pass"] / med["compile"],
            "trace_s": med["trace"], "match_s": med["match"], "rewrite_s": med["rewrite"], "sites": 12}


def _worker(variant: str, seq: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    import flashport

    model = _model(layers=2, width=256, heads=4, vocab=256)
    ids = jax.random.randint(jax.random.PRNGKey(1), (1, seq), 0, 256)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), ids[:, :8])
    fn = model.apply if variant == "unmodified" else flashport.fuse_attention(model.apply)
    jitted = jax.jit(fn)
    jax.block_until_ready(params)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mem = jitted.lower(params, ids).compile().memory_analysis()
    xla_bytes = mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
    out = jax.block_until_ready(jitted(params, ids))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(jitted(params, ids))
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"median_s": statistics.median(times), "times": times, "peak_rss_delta": peak - base,
            "xla_bytes": xla_bytes, "checksum": float(jnp.sum(out[0, -8:]))}


def _run(variant: str, seq: int, repeats: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", variant, str(seq), str(repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    """Run both parts and print a table (``--json`` for machine-readable output)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", nargs=3, metavar=("VARIANT", "SEQ", "REPEATS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        variant, seq, repeats = args.worker
        print(json.dumps(_worker(variant, int(seq), int(repeats))))
        return 0
    result = {}
    if not args.skip_overhead:
        result["overhead"] = overhead(max(1, min(args.repeats, 3)))
        o = result["overhead"]
        print(f"(a) 12-layer transformer: pass {o['pass_s']*1e3:.0f} ms vs jit lower+compile "
              f"{o['compile_s']*1e3:.0f} ms -> {o['ratio']:.1%} (target <= 10%)\n"
              f"    pass = trace {o['trace_s']*1e3:.0f} ms + normalize/match {o['match_s']*1e3:.0f} ms "
              f"+ rewrite {o['rewrite_s']*1e3:.0f} ms; {o['sites']} sites")
    base = _run("unmodified", args.seq, args.repeats)
    fused = _run("fused", args.seq, args.repeats)
    result.update(unmodified=base, fused=fused)
    speed = base["median_s"] / fused["median_s"]
    rss = fused["peak_rss_delta"] / max(base["peak_rss_delta"], 1)
    xla = fused["xla_bytes"] / base["xla_bytes"]
    print(f"(b) GPT-style Flax model, 2 layers, S={args.seq}, CPU, forward (median of {args.repeats}):")
    print(f"    {'variant':<11} {'median s':>9} {'peak RSS MiB':>13} {'XLA MiB':>9}")
    for name, r in (("unmodified", base), ("fused", fused)):
        print(f"    {name:<11} {r['median_s']:>9.3f} {r['peak_rss_delta']/2**20:>13.0f} {r['xla_bytes']/2**20:>9.0f}")
    print(f"    speedup {speed:.2f}x (target >= 2x); peak RSS {rss:.1%}, XLA bytes {xla:.1%} of unmodified "
          f"(target <= 25%); checksum diff {abs(base['checksum'] - fused['checksum']):.2e}")
    result["summary"] = {"speedup": speed, "rss_ratio": rss, "xla_ratio": xla}
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
