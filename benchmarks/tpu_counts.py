"""Counted work of the Pallas TPU forward kernel, before and after tile classification and GQA folding.

Runs the forward in the TPU interpreter on CPU (no TPU needed) and prints, per case:

* head tiles computed per class (fully visible / partial) and the model's (brute-force visibility);
* mask operations per tile body, read from the lowered kernel's jaxpr, and mask ops evaluated
  (ops per body x tiles through it): before = the kernel with classification off (``classify=False``:
  every visited tile runs the masked body, as before), after = the kernel as shipped;
* K/V block fetches over the grid (index map evaluated in grid order; a fetch per block change):
  before = the previous per-query-head grid, after = the grouped grid; model = before / G;
* padded multiply-accumulates (decode): before = the old 32-row query block per head;
* dQ K/V block fetches: the dQ kernel's grid, before = per query head, after = per kv head (grouped);
* lse bytes the forward writes for a BSHD call at S = 4096, H = 8, D = 128 bf16 (traced): inference
  without lse, with ``return_lse``, and the forward of a gradient, against the previous lane-replicated
  f32 [B, H, S, 128].

    python benchmarks/tpu_counts.py
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.table import Table

from flashport.kernels.backends.pallas_tpu import counting
from flashport.kernels.backends.pallas_tpu.blocks import Q_ALIGN
from flashport.kernels.backends.pallas_tpu.tiling import round_up
from flashport.kernels.contract.spec import AttentionSpec

D = 128


def spec_of(sq, sk, causal=False, left=None):
    """Bottom-right aligned spec with scale 1."""
    return AttentionSpec(
        scale=1.0,
        causal=causal,
        window_left=left,
        window_right=None,
        offset=sk - sq,
        softcap=None,
        seq_q=sq,
        seq_k=sk,
    )


def model_tiles(spec, bq, bk, seg=None):
    """(full, partial) tiles per head from the contract's visibility over real positions."""
    i = np.arange(spec.seq_q)[:, None] + spec.offset
    j = np.arange(spec.seq_k)[None, :]
    keep = np.ones((spec.seq_q, spec.seq_k), bool)
    if spec.causal:
        keep &= j <= i
    if spec.window_left is not None:
        keep &= j >= i - spec.window_left
    if seg is not None:
        keep &= seg[0][:, None] == seg[0][None, :]
    full = partial = 0
    for a in range(-(-spec.seq_q // bq)):
        for c in range(-(-spec.seq_k // bk)):
            t = keep[a * bq : (a + 1) * bq, c * bk : (c + 1) * bk]
            full += bool(t.all() and (c + 1) * bk <= spec.seq_k)
            partial += bool(t.any() and not (t.all() and (c + 1) * bk <= spec.seq_k))
    return full, partial


CASES = [
    # name, sq, sk, hq, hkv, spec kwargs, options, segment ids
    ("causal S=1024 GQA 8/2", 1024, 1024, 8, 2, dict(causal=True), dict(block_q=128, block_k=128), None),
    (
        "window 256 S=1024 GQA 8/2",
        1024,
        1024,
        8,
        2,
        dict(causal=True, left=256),
        dict(block_q=128, block_k=128),
        None,
    ),
    ("4 segments S=1024 MHA 4/4", 1024, 1024, 4, 4, {}, dict(block_q=128, block_k=128), "docs"),
    ("decode Sq=1 Sk=4096 MQA 8/1", 1, 4096, 8, 1, dict(causal=True), dict(block_k=512), None),
    ("decode Sq=1 Sk=4096 MHA 8/8", 1, 4096, 8, 8, dict(causal=True), dict(block_k=512), None),
]


def run_case(name, sq, sk, hq, hkv, kw, opts, segs):
    """Counts of one case: a dict of the table's columns."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, hq, sq, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, hkv, sk, D)), jnp.float32)
    spec = spec_of(sq, sk, **kw)
    seg = None
    arrays = {}
    if segs:
        seg = np.sort(np.repeat(np.arange(4), sq // 4)[None], axis=1).astype(np.int32)
        arrays = dict(q_seg=jnp.asarray(seg), kv_seg=jnp.asarray(seg))
    g = counting.forward_geometry(spec, q, k, k, opts)
    counts = counting.tile_counts(q, k, k, spec=spec, options=opts, **arrays)
    kernel = counting.forward_kernel_jaxpr(q, k, k, spec=spec, options=opts, **arrays)
    ops = counting.mask_ops_per_tile(kernel, g.bq, g.bk)
    old = counting.tile_counts(q, k, k, spec=spec, options=opts, classify=False, **arrays)
    old_kernel = counting.forward_kernel_jaxpr(q, k, k, spec=spec, options=opts, classify=False, **arrays)
    old_ops = counting.mask_ops_per_tile(old_kernel, g.bq, g.bk)
    m_full, m_partial = model_tiles(spec, g.bq, g.bk, seg)
    segs_j = (arrays.get("q_seg"), arrays.get("kv_seg"))
    after = counting.kv_block_fetches(g, 1, hq, hkv, *segs_j)
    before = counting.kv_block_fetches(g, 1, hq, hkv, *segs_j, grouped=False)
    g_dq = counting.dq_geometry(spec, q, k, k, opts)
    dq_after = counting.kv_block_fetches(g_dq, 1, hq, hkv, *segs_j)
    dq_before = counting.kv_block_fetches(g_dq, 1, hq, hkv, *segs_j, grouped=False)
    macs = counting.padded_macs(kernel, counts)
    tiles = counts.full + counts.partial
    old_rows = round_up(sq, Q_ALIGN) if sq < Q_ALIGN else g.bq
    return dict(
        case=name,
        tiles=f"{counts.full} / {counts.partial}",
        model=f"{hq * m_full} / {hq * m_partial}",
        ops=f"{ops['full']} / {ops['partial']}",
        evaluated=f"{old.partial * old_ops['partial'] + old.full * old_ops['full']:,} -> "
        f"{counts.partial * ops['partial'] + counts.full * ops['full']:,}",
        kv=f"{before} -> {after} ({before / after:.0f}x; model {hq // hkv}x)",
        macs=f"{tiles * old_rows * g.bk * 2 * D / 1e6:.1f}M -> {macs / 1e6:.1f}M",
        dq=f"{dq_before} -> {dq_after} ({dq_before / dq_after:.0f}x; model {hq // hkv}x)",
    )


def lse_table():
    """The lse bytes the forward writes for the issue's BSHD call, traced (no run)."""
    b, s, h = 1, 4096, 8
    q = jnp.zeros((b, s, h, D), jnp.bfloat16)
    opts = dict(generation="v6e")
    before = b * h * s * 128 * 4
    table = Table(title="forward lse bytes written, BSHD S=4096 H=8 D=128 bf16 (v6e blocks)")
    for col in ("call", "before (lane-replicated f32)", "after", "model"):
        table.add_column(col)
    for name, grad, ret, model in (
        ("inference", False, False, 0),
        ("return_lse", False, True, b * h * s * 4),
        ("gradient", True, False, b * h * s * 4),
    ):
        got = counting.lse_bytes_written(q, q, q, grad=grad, causal=True, return_lse=ret, options=opts)
        table.add_row(name, f"{before:,}", f"{got:,}", f"{model:,}")
    return table


def main():
    """Print the table (about a minute on 2 CPU cores: the interpreter runs every grid step)."""
    table = Table(title="pallas_tpu forward: counted work (TPU interpreter, f32, D=128)")
    cols = [
        ("case", "case"),
        ("tiles full / partial", "tiles"),
        ("model", "model"),
        ("mask ops/tile full / partial", "ops"),
        ("mask ops evaluated before -> after", "evaluated"),
        ("K/V block fetches before -> after", "kv"),
        ("padded MACs before -> after", "macs"),
        ("dQ K/V fetches before -> after", "dq"),
    ]
    for title, _ in cols:
        table.add_column(title)
    for case in CASES:
        row = run_case(*case)
        table.add_row(*(row[key] for _, key in cols))
    console = Console(width=220)
    console.print(table)
    console.print(lse_table())


if __name__ == "__main__":
    main()
