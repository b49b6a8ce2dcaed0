"""Attention on CPU, side by side: flashport (JAX and torch adapter) vs jax.nn and torch SDPA.

Causal self-attention, B=1, H=8, D=64, float32, S = 2048, 4096, 8192, forward and forward+backward:

- ``flashport.attention`` (``backend="auto"``: on CPU the ``cpu_native`` backend, the C++
  FlashAttention-2 kernel behind ``jax.ffi``, jit),
- ``flashport.attention(backend="blockwise")`` (the pure-XLA blockwise backend, jit),
- ``flashport.torch.attention`` (auto on CPU torch tensors: torch SDPA when SDPA computes the call
  exactly, as it does here, else the JAX path),
- ``jax.nn.dot_product_attention(implementation="xla")`` (materialized O(S²) scores, jit),
- ``torch.nn.functional.scaled_dot_product_attention`` (torch picks its kernel: the CPU flash kernel).

Each (S, pass) runs in a fresh process that builds every implementation, warms it up, then times
them in alternating rounds (round r runs each implementation once, in an order rotated by r, so
load from other jobs on the host and one library's idle threads hit them alike) together with a square f32 matmul (XLA and torch; the faster is the
reference). Reported: median seconds, GFLOP/s, % of that matmul, and the throughput ratio to torch
SDPA (> 1 = faster than SDPA). FLOPs: causal forward 2·B·H·S²·D (QKᵀ and PV, half the square);
forward+backward 3.5x that (the backward's five S²·D matmuls, FlashAttention-2's convention).
The torch rows use BHSD tensors (SDPA's layout; the adapter is called with ``layout="BHSD"``).
Then the compiled scratch memory of flashport and jax.nn, forward and forward+backward, side by
side (flashport's linear in S, jax.nn's quadratic; flashport's is XLA's temp buffers plus the native
kernel's own workspace, which XLA cannot see inside the FFI call: ``cpu_native.backend.workspace_bytes``
computes it from the kernel's allocations), and a summary of the ratios against the goals:
flashport (JAX) / torch SDPA throughput >= 1.0x and flashport / jax.nn scratch <= 15% at S = 4096
and 8192.

Per call the worker also records the process CPU time and the CPU time of the busiest thread (Linux
``/proc/self/task/*/schedstat``). On a host shared with other jobs the wall clock measures the
load; the busiest thread's CPU time is a load-robust estimate (a lower bound) of the idle-host wall
time of a call whose threads run side by side, and CPU s / busiest s shows how many cores a call
keeps busy. Measured against idle-host wall times at S = 4096: torch SDPA forward 0.13 s vs 0.12 s
wall, the previous blockwise forward 0.17 s vs 0.17-0.18 s, but its forward+backward 0.78 s vs
1.03 s: busy-waiting pool threads count as busy, so it flatters a call that keeps one thread
waiting for another. Compare implementations on it, not with the wall-clock goal.

Only ratios measured side by side in one process mean anything on a shared host: the absolute
times move with the load (printed before and after).

    python benchmarks/attention_cpu.py            # full run (about 5 minutes on an idle 2-core host)
    python benchmarks/attention_cpu.py --quick    # CI-sized: S=1024, 2048, 3 rounds, no memory table
    python benchmarks/attention_cpu.py --single-thread --scratch-sizes  # work per call, one thread each
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

B, H, D = 1, 8, 64
IMPLS = ("flashport", "flashport blockwise (XLA)", "flashport.torch", "jax.nn", "torch sdpa")
# flashport's compiled scratch may be at most this fraction of jax.nn's (same S, same pass).
MEMORY_GOAL = 0.15
# The reference square matmul's size (the parent sets it for its workers; --quick uses 2048).
_MATMUL_N = int(os.environ.get("FLASHPORT_BENCH_MATMUL_N", "4096"))
# --single-thread: workers run XLA and torch on one thread each and time process CPU time, which
# a loaded host disturbs far less than wall time (it measures work, not use of the cores).
_SINGLE = os.environ.get("FLASHPORT_BENCH_SINGLE_THREAD") == "1"
if _SINGLE:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    )
_clock = time.process_time if _SINGLE else time.perf_counter


def _thread_cpu() -> dict[str, int]:
    """CPU nanoseconds per thread of this process (Linux ``schedstat``; empty elsewhere)."""
    out = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[tid] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return out


def _flops(seq: int, train: bool) -> float:
    forward = 2 * B * H * seq * seq * D
    return forward * (3.5 if train else 1.0)


def _jax_callables(seq: int, train: bool, with_xla: bool) -> dict:
    """Jitted JAX implementations, each a no-argument callable that blocks until done."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import flashport

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((B, seq, H, D)), jnp.float32) for _ in range(3))
    impls = {
        "flashport": lambda q, k, v: flashport.attention(q, k, v, causal=True),
        "flashport blockwise (XLA)": lambda q, k, v: flashport.attention(
            q, k, v, causal=True, backend="blockwise"
        ),
    }
    if with_xla:
        impls["jax.nn"] = lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="xla"
        )
    out = {}
    for name, attn in impls.items():
        if train:
            fn = jax.jit(jax.grad(lambda q, k, v, f=attn: jnp.sum(f(q, k, v)), argnums=(0, 1, 2)))
        else:
            fn = jax.jit(attn)
        out[name] = lambda fn=fn: jax.block_until_ready(fn(q, k, v))
    a = jnp.asarray(rng.standard_normal((_MATMUL_N, _MATMUL_N)), jnp.float32)
    mm = jax.jit(lambda a: a @ a)
    out["matmul xla"] = lambda: jax.block_until_ready(mm(a))
    return out


def _torch_callables(seq: int, train: bool) -> dict:
    """torch SDPA and flashport.torch.attention on the same BHSD tensors, plus torch's matmul."""
    import torch
    import torch.nn.functional as F

    import flashport.torch as ft

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, seq, D, generator=gen, requires_grad=train) for _ in range(3))
    impls = {
        "flashport.torch": lambda: ft.attention(q, k, v, causal=True, layout="BHSD"),
        "torch sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    out = {}
    for name, attn in impls.items():
        if train:

            def step(attn=attn):
                for x in (q, k, v):
                    x.grad = None
                attn().sum().backward()

            out[name] = step
        else:
            out[name] = lambda attn=attn: attn()
    a = torch.randn(_MATMUL_N, _MATMUL_N, generator=gen)
    out["matmul torch"] = lambda: a @ a
    return out


def _worker(seq: int, rounds: int, train: bool, with_xla: bool) -> dict:
    """Time every implementation in alternating rounds; return per-implementation medians (s)."""
    if _SINGLE:
        import torch

        torch.set_num_threads(1)
    fns = {**_jax_callables(seq, train, with_xla), **_torch_callables(seq, train)}
    for fn in fns.values():  # compile and warm up
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    busiest: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):  # rotate the order: no implementation always follows the same one
        for name in names[r % len(names) :] + names[: r % len(names)]:
            threads, cpu_start, start = _thread_cpu(), time.process_time(), _clock()
            fns[name]()
            times[name].append(_clock() - start)
            cpu[name].append(time.process_time() - cpu_start)
            after = _thread_cpu()
            busiest[name].append(max((after[t] - threads.get(t, 0) for t in after), default=0) / 1e9)
    medians = {name: statistics.median(t) for name, t in times.items()}
    matmul = max(2 * _MATMUL_N**3 / medians.pop(f"matmul {lib}") for lib in ("xla", "torch"))
    return {
        "medians": medians,
        "spread": {n: [min(t), max(t)] for n, t in times.items()},
        "cpu": {n: statistics.median(t) for n, t in cpu.items()},
        "busiest": {n: statistics.median(t) for n, t in busiest.items()},
        "matmul": matmul,
    }


def _scratch_worker(seq: int) -> dict:
    """Compiled scratch memory (bytes) at ``seq`` of flashport's and jax.nn's forward and
    forward+backward, keyed ``"<impl> <pass>"`` (compiled, not run: jax.nn's O(S²) scores need no
    memory to be measured)."""
    import jax
    import jax.numpy as jnp

    import flashport

    args = [jax.ShapeDtypeStruct((B, seq, H, D), jnp.float32)] * 3
    impls = {
        "flashport": lambda q, k, v: flashport.attention(q, k, v, causal=True),
        "jax.nn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"),
    }
    out = {}
    for name, attn in impls.items():
        train = jax.grad(lambda q, k, v, f=attn: jnp.sum(f(q, k, v)), argnums=(0, 1, 2))
        for kind, fn in (("forward", attn), ("fwd+bwd", train)):
            compiled = jax.jit(fn).lower(*args).compile()
            out[f"{name} {kind}"] = compiled.memory_analysis().temp_size_in_bytes
    # The native kernel's own allocations, which XLA's statistics do not see: its forward's
    # workspace, or (fwd+bwd) the larger of the forward's and the backward's (they run one after
    # the other), added to XLA's temp buffers (which hold the residuals out and lse).
    from flashport.kernels.backends.cpu_native import backend as native

    shapes = ((B, H, seq, D), (B, H, seq, D), D)
    fwd = native.workspace_bytes(*shapes, backward=False)
    out["flashport forward"] += fwd
    out["flashport fwd+bwd"] += max(fwd, native.workspace_bytes(*shapes, backward=True))
    return out


def _child(args: list[str], env: dict | None = None) -> dict:
    cmd = [sys.executable, __file__, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _table(title: str, seqs, train: bool, rounds: int, xla_max: int, matmul_n: int, ratios: dict):
    """One rich table (a fresh worker process per S); ``ratios[(pass, S)]`` gets flashport's ratio."""
    from rich.table import Table

    table = Table(title=title)
    cols = ("S", "implementation", "median s", "min-max s", "GFLOP/s", "% matmul", "vs torch SDPA")
    for col in (*cols, "CPU s", "busiest thread s", "busiest vs SDPA"):
        table.add_column(col, justify="right" if col != "implementation" else "left")
    env = dict(os.environ, FLASHPORT_BENCH_MATMUL_N=str(matmul_n))
    for seq in seqs:
        r = _child(["--worker", str(seq), str(rounds), str(int(train)), str(int(seq <= xla_max))], env)
        sdpa = r["medians"]["torch sdpa"]
        med, cpu = r["medians"], r["cpu"]
        ratios[("fwd+bwd" if train else "forward", seq)] = {
            "wall": sdpa / med["flashport"],
            "cpu": cpu["torch sdpa"] / cpu["flashport"],
            "blockwise wall": sdpa / med["flashport blockwise (XLA)"],
            "blockwise cpu": cpu["torch sdpa"] / cpu["flashport blockwise (XLA)"],
        }
        busy_sdpa = r["busiest"]["torch sdpa"]
        for name in IMPLS:
            if name not in r["medians"]:
                table.add_row(str(seq), name, "skipped", "", "", "", f"(O(S²) scores; --xla-max {xla_max})")
                continue
            t = r["medians"][name]
            lo, hi = r["spread"][name]
            gflops = _flops(seq, train) / t / 1e9
            table.add_row(
                str(seq),
                name,
                f"{t:.3f}",
                f"{lo:.3f}-{hi:.3f}",
                f"{gflops:.1f}",
                f"{gflops / (r['matmul'] / 1e9):.0%}",
                f"{sdpa / t:.2f}x",
                f"{r['cpu'][name]:.3f}",
                f"{r['busiest'][name]:.3f}",
                f"{busy_sdpa / r['busiest'][name]:.2f}x" if r["busiest"][name] else "",
            )
        table.add_row(
            "", f"square f32 matmul {matmul_n}² (best of XLA, torch)", "", "", f"{r['matmul'] / 1e9:.1f}"
        )
        table.add_section()
    return table


def main() -> None:
    """Run the side-by-side benchmark and print the tables."""
    from rich.console import Console
    from rich.table import Table

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="CI-sized: S=1024 2048, 3 rounds, matmul 2048²")
    parser.add_argument("--sizes", type=int, nargs="+", default=None)
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 5; quick 3)")
    parser.add_argument("--xla-max", type=int, default=4096, help="largest S for jax.nn forward")
    parser.add_argument("--xla-max-train", type=int, default=2048, help="largest S for jax.nn fwd+bwd")
    parser.add_argument("--scratch-sizes", type=int, nargs="*", default=None)
    parser.add_argument(
        "--single-thread",
        action="store_true",
        help="one thread each, process CPU time (work efficiency; robust to a loaded host)",
    )
    args = parser.parse_args()
    sizes = args.sizes or ([1024, 2048] if args.quick else [2048, 4096, 8192])
    rounds = args.rounds or (3 if args.quick else 5)
    matmul_n = 2048 if args.quick else 4096
    scratch = (
        args.scratch_sizes if args.scratch_sizes is not None else ([] if args.quick else [4096, 8192, 16384])
    )
    if args.single_thread:
        os.environ["FLASHPORT_BENCH_SINGLE_THREAD"] = "1"
    console = Console(width=160)
    console.print(f"{os.cpu_count()} CPU cores; load average before the run: {os.getloadavg()[0]:.1f}")
    clock = (
        "one thread, process CPU s" if args.single_thread else f"all threads ({os.cpu_count()} cores), wall s"
    )
    shape = f"causal, B={B} H={H} D={D} f32, {rounds} alternating rounds, {clock}"
    ratios: dict = {}
    console.print(_table(f"forward, {shape}", sizes, False, rounds, args.xla_max, matmul_n, ratios))
    console.print(
        _table(f"forward+backward, {shape}", sizes, True, rounds, args.xla_max_train, matmul_n, ratios)
    )
    memory: dict = {}
    if scratch:
        mem = Table(title="compiled scratch memory: flashport linear in S, jax.nn quadratic (side by side)")
        cols = ("S", "pass", "flashport MB", "flashport / S (KB)", "jax.nn MB", "flashport / jax.nn")
        for col in cols:
            mem.add_column(col, justify="right")
        for seq in scratch:
            r = _child(["--scratch", str(seq)])
            for kind in ("forward", "fwd+bwd"):
                ours, xla = r[f"flashport {kind}"], r[f"jax.nn {kind}"]
                memory[(kind, seq)] = ours / xla
                mem.add_row(
                    str(seq),
                    kind,
                    f"{ours / 1e6:.1f}",
                    f"{ours / seq / 1e3:.1f}",
                    f"{xla / 1e6:.1f}",
                    f"{ours / xla:.1%}",
                )
            mem.add_section()
        console.print(mem)
    console.print(f"load average after the run: {os.getloadavg()[0]:.1f}")
    console.print(
        "flashport (JAX, auto) throughput / torch SDPA's, wall (CPU time) (goal: >= 1.00x at S = 4096 and 8192);"
        " the blockwise (XLA) backend's for comparison:"
    )
    for (kind, seq), ratio in sorted(ratios.items()):
        goal = (
            ""
            if seq < 4096
            else ("  goal met" if min(ratio["wall"], ratio["cpu"]) >= 1.0 else "  goal NOT met")
        )
        console.print(
            f"  {kind:8s} S={seq:5d}: {ratio['wall']:.2f}x ({ratio['cpu']:.2f}x){goal}"
            f"   blockwise {ratio['blockwise wall']:.2f}x ({ratio['blockwise cpu']:.2f}x)"
        )
    if memory:
        console.print(
            f"flashport compiled scratch / jax.nn's (goal: <= {MEMORY_GOAL:.0%} at S = 4096 and 8192):"
        )
        for (kind, seq), ratio in sorted(memory.items()):
            goal = (
                ""
                if seq not in (4096, 8192)
                else ("  goal met" if ratio <= MEMORY_GOAL else "  goal NOT met")
            )
            console.print(f"  {kind:8s} S={seq:5d}: {ratio:.1%}{goal}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        seq, rounds, train, with_xla = map(int, sys.argv[2:6])
        print(json.dumps(_worker(seq, rounds, bool(train), bool(with_xla))))
    elif len(sys.argv) > 1 and sys.argv[1] == "--scratch":
        print(json.dumps(_scratch_worker(int(sys.argv[2]))))
    else:
        main()
