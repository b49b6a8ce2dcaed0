"""The jaxpr fusion pass: (a) its overhead, (b) what it buys on CPU, (c) whole-program speed by length.

(a) Pass overhead on a 12-layer Flax transformer (S=256, 12 attention sites), against
    ``jax.jit(f).lower(...).compile()`` of the same model, reported two ways, measured side by side
    in one run (medians of ``--overhead-repeats`` rounds, wall and CPU seconds). Target: at most 10%.

    (1) The issue's literal metric: (trace + match + rewrite) / jit(f) lower+compile, where trace is
        ``make_jaxpr`` of the user's function, match is normalize + match and rewrite builds the
        rewritten jaxpr. It MISSES the target and cannot meet it: the trace alone is ~25-35% of
        jit(f) lower+compile, and jit pays that same trace (the pass's own match + rewrite is ~3%).
    (2) The end-to-end extra a user pays: [jit(fuse_attention(f)).lower().compile() -
        jit(f).lower().compile()] / jit(f).lower().compile(), the median over paired rounds. Inside
        jit the user's function is still traced once; the extra is match + rewrite + evaluating the
        rewritten jaxpr into jit's trace (~40 ms CPU together) plus any difference in XLA compile
        time of the fused program (often shorter: the fused program has fewer ops). It MEETS the
        target: 1-8% in most runs on a shared 2-core machine (one loaded run read 17% wall / 12%
        CPU); the difference of two ~1 s timings is noisy, so compare the CPU column and rerun.

(b) A small GPT-style Flax model (causal, flax ``make_causal_mask``) at S=4096 on CPU, unmodified vs
    ``fuse_attention``: median forward time and peak memory, each variant in its own process (peak
    RSS above the process's baseline after setup, and XLA's compiled temp+argument+output bytes).
    Targets: fused at least 2x faster and at most 25% of the memory.

    With ``--model bert``, (b) runs a padded batch through a BERT-style Flax encoder instead
    (bidirectional, B=2 with the second sequence 25% padding, the key-padding mask given as
    ``mask[:, None, None, :]`` to flax attention; the fused call gets it as kv segment ids).

(c) The whole compiled forward program, unmodified vs fused, at S = 1024 ... 8192 (``--seqs``), both
    variants in one process and timed in alternation, the speedup being the median of the per-round
    ratios (wall, and CPU seconds in brackets). (b) times each variant in its own process, one after
    the other, so a change of load on a shared host between the two reads as a speedup or slowdown
    of the program (the likely source of the 0.74x (b) once reported for the BERT encoder at
    S=4096: nothing in the fused program accounts for it, see below). (c) also says
    where the time goes: the same model with its attention replaced by ``v`` ("rest") and one
    attention site alone, flax's ``dot_product_attention`` and ``fuse_attention`` of it. The fused
    program costs its parts (rest + sites x one fused site, in CPU seconds): its compiled HLO holds the
    kernel's loops, O(S*D) layout transposes of q/k/v/out and no S*S buffer, mask, convert or
    rematerialization. Target: >= 1.0x at every length.

    python benchmarks/fuse_pass.py                       # all parts
    python benchmarks/fuse_pass.py --skip-model          # (a) only
    python benchmarks/fuse_pass.py --seq 2048 --repeats 3
    python benchmarks/fuse_pass.py --skip-overhead --model bert --seq 1024
    python benchmarks/fuse_pass.py --skip-overhead --skip-model --model bert   # (c) only
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def _model(layers: int, width: int, heads: int, vocab: int, attention_fn=None):
    import flax.linen as nn
    import jax.numpy as jnp

    attention_fn = attention_fn or nn.dot_product_attention

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, mask):
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(
                num_heads=heads, qkv_features=width, attention_fn=attention_fn
            )(h, h, mask=mask)
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


def _bert(layers: int, width: int, heads: int, vocab: int, attention_fn=None):
    """A BERT-style encoder: post-LayerNorm blocks, bidirectional attention with a key-padding mask."""
    import flax.linen as nn
    import jax.numpy as jnp

    attention_fn = attention_fn or nn.dot_product_attention

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, mask):
            x = nn.LayerNorm()(
                x
                + nn.MultiHeadDotProductAttention(
                    num_heads=heads, qkv_features=width, attention_fn=attention_fn
                )(x, x, mask=mask)
            )
            return nn.LayerNorm()(x + nn.Dense(width)(nn.gelu(nn.Dense(4 * width)(x))))

    class Bert(nn.Module):
        @nn.compact
        def __call__(self, ids, attention_mask):
            x = nn.Embed(vocab, width)(ids)
            mask = attention_mask.astype(bool)[:, None, None, :]  # [B, 1, 1, S] key padding
            for _ in range(layers):
                x = Block()(x, mask)
            return nn.Dense(vocab)(x).astype(jnp.float32)

    return Bert()


def overhead(repeats: int) -> dict:
    """Part (a): the pass's cost against ``jax.jit(f).lower(...).compile()``, 12 layers, S=256.

    Each repeat measures, in alternating order, wall and CPU seconds of:

    * the pass's phases on a fresh trace: ``trace`` (``make_jaxpr`` of the user's function, which
      ``jax.jit`` also pays), ``match`` (normalize + match, recursively) and ``rewrite`` (the
      rewritten jaxpr, built by equation surgery);
    * ``plain``: ``jax.jit(f).lower(...).compile()`` of a fresh function (no jit cache hit);
    * ``fused``: ``jax.jit(fuse_attention(f)).lower(...).compile()`` of a fresh fused function (its
      trace cache empty, so the whole pass runs inside jit's trace).

    Two ratios of the medians are reported (see the module docstring):
    ``pass_ratio`` = (trace + match + rewrite) / plain, and
    ``e2e_ratio`` = (fused - plain) / plain.
    """
    import jax
    import jax.numpy as jnp

    import flashport
    from flashport.fusion import fuse as fuse_mod
    from flashport.fusion.interpreter import analyze, rewrite

    model = _model(layers=12, width=256, heads=8, vocab=512)
    ids = jnp.zeros((2, 256), jnp.int32)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), ids)
    fn = model.apply

    def timed(f):
        w0, c0 = time.perf_counter(), time.process_time()
        out = f()
        return out, time.perf_counter() - w0, time.process_time() - c0

    def the_pass():
        flat, treedef, dyn, _ = fuse_mod._split((params, ids), {})
        closed, tw, tc = timed(lambda: fuse_mod._trace(fn, flat, treedef, dyn)[0])
        plan, mw, mc = timed(lambda: analyze(closed))
        new, rw, rc = timed(lambda: rewrite(plan, "auto"))
        assert _count_sites(new.jaxpr) == 12
        return {"trace": (tw, tc), "match": (mw, mc), "rewrite": (rw, rc)}

    def jit_phases(f, name):
        traced, tw, tc = timed(lambda: jax.jit(f).trace(params, ids))
        _, cw, cc = timed(lambda: traced.lower().compile())
        return {name: (tw + cw, tc + cc), f"{name}_trace": (tw, tc), f"{name}_lower_compile": (cw, cc)}

    def plain():  # a fresh function each time: no jit cache hit
        return jit_phases(lambda p, i: fn(p, i), "plain")

    def fused():  # a fresh fused function: its trace cache is empty, the whole pass runs
        return jit_phases(flashport.fuse_attention(lambda p, i: fn(p, i)), "fused")

    samples: dict = {}
    for r in range(repeats + 1):  # the first round warms caches shared by both sides; dropped
        got = {}
        for step in (the_pass, plain, fused) if r % 2 else (fused, plain, the_pass):
            got.update(step())
        if r:
            for k, v in got.items():
                samples.setdefault(k, []).append(v)
    wall = {k: statistics.median(w for w, _ in v) for k, v in samples.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in samples.items()}
    pass_s = wall["trace"] + wall["match"] + wall["rewrite"]

    def paired(i):  # median over rounds of (fused - plain) / plain: cancels drift between rounds
        return statistics.median(
            (f[i] - p[i]) / p[i] for f, p in zip(samples["fused"], samples["plain"], strict=True)
        )

    return {
        "repeats": repeats,
        "sites": 12,
        "wall_s": wall,
        "cpu_s": cpu,
        "pass_s": pass_s,
        "pass_ratio": pass_s / wall["plain"],
        "own_ratio": (wall["match"] + wall["rewrite"]) / wall["plain"],
        "e2e_ratio": paired(0),
        "e2e_ratio_cpu": paired(1),
    }


def _count_sites(jaxpr) -> int:
    import jax

    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("jit", "pjit") and eqn.params.get("name") == "flashport_attention":
            n += 1
        else:
            n += sum(_count_sites(sub) for sub in jax.extend.core.jaxprs_in_params(eqn.params))
    return n


def _setup(model_name: str, seq: int, attention_fn=None):
    """``(model, params, args)`` of part (b)'s model at sequence length ``seq``."""
    import jax
    import jax.numpy as jnp

    if model_name == "bert":
        model = _bert(layers=2, width=256, heads=4, vocab=256, attention_fn=attention_fn)
        ids = jax.random.randint(jax.random.PRNGKey(1), (2, seq), 0, 256)
        lengths = jnp.array([seq, seq - seq // 4])
        attention_mask = (jnp.arange(seq)[None, :] < lengths[:, None]).astype(jnp.int32)
        args = (ids, attention_mask)
        params = jax.jit(model.init)(jax.random.PRNGKey(0), ids[:, :8], attention_mask[:, :8])
    else:
        model = _model(layers=2, width=256, heads=4, vocab=256, attention_fn=attention_fn)
        ids = jax.random.randint(jax.random.PRNGKey(1), (1, seq), 0, 256)
        args = (ids,)
        params = jax.jit(model.init)(jax.random.PRNGKey(0), ids[:, :8])
    return model, params, args


def _worker(variant: str, seq: int, repeats: int, model_name: str = "gpt") -> dict:
    import jax
    import jax.numpy as jnp

    import flashport

    model, params, args = _setup(model_name, seq)
    fn = model.apply if variant == "unmodified" else flashport.fuse_attention(model.apply)
    jitted = jax.jit(fn)
    jax.block_until_ready(params)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    compiled = jitted.lower(params, *args).compile()
    mem = compiled.memory_analysis()
    xla_bytes = mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
    sites = _count_sites(jax.make_jaxpr(fn)(params, *args).jaxpr)
    out = jax.block_until_ready(jitted(params, *args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(jitted(params, *args))
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "median_s": statistics.median(times),
        "times": times,
        "peak_rss_delta": peak - base,
        "xla_bytes": xla_bytes,
        "sites": sites,
        "checksum": float(jnp.sum(out[:, -8:])),
    }


def _sweep_worker(seq: int, repeats: int, model_name: str) -> dict:
    """Part (c) at one length: the whole compiled programs, unmodified and fused, timed in alternation
    (so a change of load on the host hits both), and where their time goes: the same model with
    its attention replaced by ``v`` (everything but attention) and one attention site alone, flax's
    ``dot_product_attention`` and the pass applied to it."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    import flashport

    model, params, args = _setup(model_name, seq)
    rest_model = _setup(model_name, 8, attention_fn=lambda q, k, v, **kw: v)[0]
    b = args[0].shape[0]
    q = jax.random.normal(jax.random.PRNGKey(2), (b, seq, 4, 64))
    if model_name == "bert":
        mask = args[1].astype(bool)[:, None, None, :]
    else:
        mask = nn.make_causal_mask(args[0])

    def one_site(q, k, v):
        return nn.dot_product_attention(q, k, v, mask=mask)

    programs = {
        "unmodified": (jax.jit(model.apply), (params, *args)),
        "fused": (jax.jit(flashport.fuse_attention(model.apply)), (params, *args)),
        "rest": (jax.jit(rest_model.apply), (params, *args)),
        "site_unmodified": (jax.jit(one_site), (q, q, q)),
        "site_fused": (jax.jit(flashport.fuse_attention(one_site)), (q, q, q)),
    }
    result: dict = {
        "seq": seq,
        "sites": _count_sites(jax.make_jaxpr(flashport.fuse_attention(model.apply))(params, *args).jaxpr),
    }
    outs = {}
    for name in ("unmodified", "fused"):
        fn, a = programs[name]
        mem = fn.lower(*a).compile().memory_analysis()
        result[f"{name}_xla_bytes"] = (
            mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
        )
        outs[name] = jax.block_until_ready(fn(*a))
    result["checksum_diff"] = float(jnp.max(jnp.abs(outs["unmodified"] - outs["fused"])))
    for fn, a in programs.values():  # compile and warm up
        jax.block_until_ready(fn(*a))
    times: dict = {name: [] for name in programs}
    for _ in range(repeats):
        for name, (fn, a) in programs.items():
            w0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn(*a))
            times[name].append((time.perf_counter() - w0, time.process_time() - c0))
    result["wall_s"] = {k: statistics.median(w for w, _ in v) for k, v in times.items()}
    result["cpu_s"] = {k: statistics.median(c for _, c in v) for k, v in times.items()}
    result["speedup"] = statistics.median(
        u[0] / f[0] for u, f in zip(times["unmodified"], times["fused"], strict=True)
    )
    result["speedup_cpu"] = statistics.median(
        u[1] / f[1] for u, f in zip(times["unmodified"], times["fused"], strict=True)
    )
    return result


def sweep(seqs: list[int], repeats: int, model_name: str) -> list[dict]:
    """Part (c): one worker process per length (see :func:`_sweep_worker`)."""
    rows = []
    for seq in seqs:
        cmd = [sys.executable, __file__, "--sweep-worker", str(seq), str(repeats), model_name]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"sweep worker S={seq} failed:\n{proc.stderr[-3000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return rows


def _print_sweep(rows: list[dict], repeats: int, model_name: str) -> None:
    what = "BERT-style encoder, padded B=2" if model_name == "bert" else "GPT-style causal model, B=1"
    print(
        f"(c) whole compiled program, forward, {what}, 2 layers, CPU; medians of {repeats} rounds, "
        f"variants timed in alternation; wall s [CPU s]"
    )
    print(
        "| S | unmodified | fused | speedup (paired median) [CPU] | rest (no attention) | "
        "one site: flax | one site: fused | XLA MiB unmodified / fused | max abs diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        w, c = r["wall_s"], r["cpu_s"]

        def cell(k, w=w, c=c):
            return f"{w[k]:.3f} [{c[k]:.3f}]"

        print(
            f"| {r['seq']} | {cell('unmodified')} | {cell('fused')} | {r['speedup']:.2f}x [{r['speedup_cpu']:.2f}x] | "
            f"{cell('rest')} | {cell('site_unmodified')} | {cell('site_fused')} | "
            f"{r['unmodified_xla_bytes'] / 2**20:.0f} / {r['fused_xla_bytes'] / 2**20:.0f} | {r['checksum_diff']:.1e} |"
        )
    worst = min(r["speedup"] for r in rows)
    print(f"    lowest whole-program speedup {worst:.2f}x (target >= 1.0x at every length)")


def _run(variant: str, seq: int, repeats: int, model: str = "gpt") -> dict:
    cmd = [sys.executable, __file__, "--worker", variant, str(seq), str(repeats), model]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _verdict(ratio: float) -> str:
    return "meets" if ratio <= 0.10 else "MISSES"


def main(argv=None) -> int:
    """Run both parts and print a table (``--json`` for machine-readable output)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--overhead-repeats", type=int, default=9)
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--model",
        choices=("gpt", "bert"),
        default="gpt",
        help="(b): causal GPT-style model (default) or padded-batch BERT-style encoder",
    )
    ap.add_argument(
        "--seqs",
        default="1024,2048,4096,8192",
        help="(c): comma-separated sequence lengths of the whole-program sweep",
    )
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument(
        "--worker", nargs=4, metavar=("VARIANT", "SEQ", "REPEATS", "MODEL"), help=argparse.SUPPRESS
    )
    ap.add_argument("--sweep-worker", nargs=3, metavar=("SEQ", "REPEATS", "MODEL"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        variant, seq, repeats, model = args.worker
        print(json.dumps(_worker(variant, int(seq), int(repeats), model)))
        return 0
    if args.sweep_worker:
        seq, repeats, model = args.sweep_worker
        print(json.dumps(_sweep_worker(int(seq), int(repeats), model)))
        return 0
    result = {}
    if not args.skip_overhead:
        result["overhead"] = o = overhead(args.overhead_repeats)
        w, c = o["wall_s"], o["cpu_s"]

        def ms(key):
            return f"{w[key] * 1e3:.0f} ms [{c[key] * 1e3:.0f}]"

        print(
            f"(a) 12-layer Flax transformer, S=256, {o['sites']} sites; medians of {o['repeats']} "
            f"(wall, CPU ms in brackets)\n"
            f"    jit(f).lower().compile()                  {ms('plain')} = trace {ms('plain_trace')} "
            f"+ lower/compile {ms('plain_lower_compile')}\n"
            f"    jit(fuse_attention(f)).lower().compile()  {ms('fused')} = trace {ms('fused_trace')} "
            f"+ lower/compile {ms('fused_lower_compile')}\n"
            f"    pass alone: trace {ms('trace')} + normalize/match {ms('match')} + rewrite {ms('rewrite')}\n"
            f"    (1) issue metric, (trace+match+rewrite) / jit(f) lower+compile: {o['pass_ratio']:.1%} "
            f"-> {_verdict(o['pass_ratio'])} the <= 10% target\n"
            f"        (the pass's own work, match+rewrite without the trace jit also pays: {o['own_ratio']:.1%})\n"
            f"    (2) end-to-end extra, (jit(fuse_attention(f)) - jit(f)) / jit(f), lower+compile, median of "
            f"paired rounds: {o['e2e_ratio']:.1%} [CPU {o['e2e_ratio_cpu']:.1%}] -> {_verdict(o['e2e_ratio'])} "
            f"the <= 10% target"
        )
    if not args.skip_sweep:
        result["sweep"] = rows = sweep([int(x) for x in args.seqs.split(",")], args.repeats, args.model)
        _print_sweep(rows, args.repeats, args.model)
    if args.skip_model:
        if args.json:
            print(json.dumps(result))
        return 0
    base = _run("unmodified", args.seq, args.repeats, args.model)
    fused = _run("fused", args.seq, args.repeats, args.model)
    result.update(unmodified=base, fused=fused)
    speed = base["median_s"] / fused["median_s"]
    rss = fused["peak_rss_delta"] / max(base["peak_rss_delta"], 1)
    xla = fused["xla_bytes"] / base["xla_bytes"]
    what = (
        "BERT-style Flax encoder, padded batch B=2 (25% padding)"
        if args.model == "bert"
        else "GPT-style Flax model"
    )
    print(
        f"(b) {what}, 2 layers, S={args.seq}, CPU, forward (median of {args.repeats}), "
        f"{fused['sites']} fused sites:"
    )
    print(f"    {'variant':<11} {'median s':>9} {'peak RSS MiB':>13} {'XLA MiB':>9}")
    for name, r in (("unmodified", base), ("fused", fused)):
        print(
            f"    {name:<11} {r['median_s']:>9.3f} {r['peak_rss_delta'] / 2**20:>13.0f} {r['xla_bytes'] / 2**20:>9.0f}"
        )
    print(
        f"    speedup {speed:.2f}x (target >= 2x); peak RSS {rss:.1%}, XLA bytes {xla:.1%} of unmodified "
        f"(target <= 25%); checksum diff {abs(base['checksum'] - fused['checksum']):.2e}"
    )
    result["summary"] = {"speedup": speed, "rss_ratio": rss, "xla_ratio": xla}
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
