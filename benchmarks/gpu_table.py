"""The issue's CUDA table: flashport next to what a JAX user would pick instead, per contract feature.

Rows (bf16, B=2, H=16, D=128, S=8192 on the device; ``--smoke`` scales them down):

- causal; causal + sliding window 1024; causal GQA 32q/8kv; causal + softcap 30;
  causal + 4 packed documents (segment ids); chunked prefill Sq=S/4, Sk=S, bottom-right causal.

Columns: ``flashport auto`` (and the backend it picked), ``pallas_gpu`` (flashport's Triton kernel),
and the anchors ``jax.nn cudnn``, ``jax.nn xla`` (``jax.nn.dot_product_attention``; packed documents
and bottom-right causal through an explicit boolean mask, as a user would write them) and JAX's
Pallas GPU ``mha`` (``jax.experimental.pallas.ops.gpu.attention``; GQA by repeating K/V, as a user
would). An anchor that cannot express a row says why ("n/a: ...").

Per cell: median forward and forward+backward (d/dq, dk, dv of ``sum(out * dout)``) milliseconds,
and the compiled forward+backward scratch memory (``memory_analysis().temp_size_in_bytes``).

Goals (on the device): every row's ``flashport auto`` within 1.25x of the best anchor for that row,
forward and forward+backward; no row above 2x the plain causal row (same B, S, D); memory linear in
S (plain causal at S/2 and S: scratch ratio <= 2.5, where an O(S^2) path shows ~4).

With ``smoke=True`` the same code runs on CPU at tiny shapes: ``pallas_gpu`` becomes its interpreter
twin ``pallas_gpu_interpret``, ``mha`` runs with ``interpret=True``, and jax.nn's cuDNN path (which
needs CUDA) is skipped with a note; timings there say nothing about a GPU.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import flashport
from flashport.kernels.contract import api, registry

ANCHORS = ("jax.nn cudnn", "jax.nn xla", "pallas mha")
IMPLS = ("flashport auto", "pallas_gpu", *ANCHORS)
GOAL_ANCHOR_RATIO = 1.25
GOAL_CAUSAL_RATIO = 2.0
LINEAR_RATIO = 2.5
AGREE_TOL = 6e-2  # bf16 outputs of the same attention differ by a few 1e-3 (scores ~ N(0, 1))


@dataclasses.dataclass(frozen=True)
class Shape:
    """One scale of the table: the device's or the smoke test's."""

    batch: int
    heads: int
    head_dim: int
    seq: int
    window: int
    repeats: int
    smoke: bool

    @classmethod
    def make(cls, smoke: bool) -> Shape:
        if smoke:
            return cls(batch=1, heads=2, head_dim=16, seq=32, window=8, repeats=1, smoke=True)
        return cls(batch=2, heads=16, head_dim=128, seq=8192, window=1024, repeats=10, smoke=False)


@dataclasses.dataclass(frozen=True)
class Row:
    """One table row: the contract keywords plus the shape changes (query heads, Sq, documents)."""

    name: str
    causal: bool = True
    window: bool = False
    softcap: float | None = None
    gqa: bool = False
    documents: int = 0
    chunked: bool = False
    seq: int | None = None  # overrides Shape.seq (the memory rows)

    def dims(self, shape: Shape) -> tuple[int, int, int, int]:
        """(Hq, Hkv, Sq, Sk)."""
        seq = self.seq or shape.seq
        hq, hkv = (2 * shape.heads, shape.heads // 2) if self.gqa else (shape.heads, shape.heads)
        return hq, hkv, seq // 4 if self.chunked else seq, seq


def rows(shape: Shape) -> list[Row]:
    """The issue's six rows."""
    return [
        Row("causal"),
        Row(f"causal + window {shape.window}", window=True),
        Row(f"causal GQA {2 * shape.heads}q/{shape.heads // 2}kv", gqa=True),
        Row("causal + softcap 30", softcap=30.0),
        Row("causal + 4 documents", documents=4),
        Row("chunked prefill Sq=S/4 bottom-right", chunked=True),
    ]


def inputs(row: Row, shape: Shape) -> tuple[tuple[jax.Array, ...], dict]:
    """``(q, k, v, dout)`` in BSHD bf16 and the row's extra arrays (segment ids, anchor masks)."""
    hq, hkv, sq, sk = row.dims(shape)
    rng = np.random.default_rng(0)
    b, d = shape.batch, shape.head_dim
    arrays = [
        rng.standard_normal(s) for s in ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, hq, d))
    ]
    extra = {}
    if row.documents:
        ids = (np.arange(sk) * row.documents // sk).astype(np.int32)
        extra["seg"] = jnp.asarray(np.broadcast_to(ids, (b, sk)))
    return tuple(jnp.asarray(x, jnp.bfloat16) for x in arrays), extra


def contract(row: Row, shape: Shape) -> dict:
    """The flashport.attention keywords of ``row`` (window (W, 0) with causal: a sliding window)."""
    kw: dict = dict(causal=row.causal, softcap=row.softcap)
    if row.window:
        kw["window"] = (shape.window, 0)
    return kw


def flashport_fn(row: Row, shape: Shape, backend) -> Callable:
    kw = contract(row, shape)

    def run(q, k, v, extra):
        segs = dict(q_segment_ids=extra["seg"], kv_segment_ids=extra["seg"]) if "seg" in extra else {}
        return flashport.attention(q, k, v, backend=backend, **kw, **segs)

    return run


def _anchor_mask(row: Row, sq: int, sk: int, extra: dict):
    """The boolean mask jax.nn needs for packed documents or bottom-right causal (else None)."""
    mask = None
    if row.documents:
        seg = extra["seg"]
        mask = seg[:, None, :, None] == seg[:, None, None, :]
    if row.chunked:
        i, j = jnp.arange(sq)[:, None], jnp.arange(sk)[None, :]
        causal = (j <= i + (sk - sq))[None, None]
        mask = causal if mask is None else mask & causal
    return mask


def jax_nn_fn(row: Row, shape: Shape, implementation: str) -> Callable | str:
    """jax.nn.dot_product_attention as a user would call it for ``row``, or why it cannot."""
    if row.softcap is not None:
        return "n/a: jax.nn has no softcap"
    if implementation == "cudnn" and shape.smoke:
        return "skipped: needs CUDA (cuDNN)"
    window = (shape.window, 0) if row.window else None
    _, _, sq, sk = row.dims(shape)

    def run(q, k, v, extra):
        mask = _anchor_mask(row, sq, sk, extra)
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            mask=mask,
            is_causal=row.causal and not row.chunked,
            local_window_size=window,
            implementation=implementation,
        )

    return run


def mha_fn(row: Row, shape: Shape) -> Callable | str:
    """JAX's Pallas GPU ``mha`` (causal is top-left with one segment-id array: Sq must equal Sk)."""
    if row.window or row.softcap is not None or row.chunked:
        return "n/a: mha has no window, softcap or bottom-right causal"
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    small = shape.smoke
    blocks = (
        pallas_attention.BlockSizes(16, 16, 16, 16, 16, 16)
        if small
        else pallas_attention.BlockSizes.get_default()
    )
    hq, hkv, _, _ = row.dims(shape)

    def run(q, k, v, extra):
        if hq != hkv:  # the user's GQA: repeat K/V per query head
            k, v = (jnp.repeat(x, hq // hkv, axis=2) for x in (k, v))
        return pallas_attention.mha(
            q,
            k,
            v,
            extra.get("seg"),
            sm_scale=1.0 / float(np.sqrt(shape.head_dim)),
            causal=row.causal,
            block_sizes=blocks,
            interpret=small,
        )

    return run


def implementations(row: Row, shape: Shape) -> dict[str, Callable | str]:
    """Every column's callable ``f(q, k, v, extra) -> out`` for ``row`` (a string: why not)."""
    pallas = registry.use("pallas_gpu_interpret") if shape.smoke else "pallas_gpu"
    return {
        "flashport auto": flashport_fn(row, shape, "auto"),
        "pallas_gpu": flashport_fn(row, shape, pallas),
        "jax.nn cudnn": jax_nn_fn(row, shape, "cudnn"),
        "jax.nn xla": jax_nn_fn(row, shape, "xla"),
        "pallas mha": mha_fn(row, shape),
    }


def auto_pick(row: Row, shape: Shape) -> str:
    """The backend ``auto`` runs for ``row`` on this machine's platform (and on CUDA, when smoke)."""
    (q, k, v, _), extra = inputs(row, shape)
    segs = dict(q_segment_ids=extra["seg"], kv_segment_ids=extra["seg"]) if "seg" in extra else {}
    _, call = api.prepare(q, k, v, **contract(row, shape), **segs)
    platform = "cuda" if jax.default_backend() == "gpu" else jax.default_backend()
    picked = registry.choose(platform, call)[0]
    if platform != "cuda":
        picked += f" (cuda: {registry.choose('cuda', call)[0]})"
    return picked


@dataclasses.dataclass
class Cell:
    """One measurement: median ms forward and forward+backward, scratch bytes, the largest
    difference of its forward output from flashport auto's, or why there is none."""

    fwd_ms: float | None = None
    train_ms: float | None = None
    scratch: int | None = None
    diff: float | None = None
    note: str = ""
    out: jax.Array | None = None  # the forward output, kept until the row's diffs are taken


def _median_ms(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(attn: Callable, row: Row, shape: Shape, timed: bool = True) -> Cell:
    """Time ``attn`` forward and forward+backward and read its compiled forward+backward scratch
    memory (``timed=False``: the memory only)."""
    (q, k, v, dout), extra = inputs(row, shape)

    def loss(q, k, v, extra):
        return jnp.sum(attn(q, k, v, extra).astype(jnp.float32) * dout.astype(jnp.float32))

    train = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v, extra).compile()
    memory = train.memory_analysis()
    cell = Cell(scratch=None if memory is None else int(memory.temp_size_in_bytes))
    if timed:
        fwd = jax.jit(attn)
        cell.out = fwd(q, k, v, extra)
        cell.fwd_ms = _median_ms(fwd, (q, k, v, extra), shape.repeats)
        cell.train_ms = _median_ms(train, (q, k, v, extra), shape.repeats)
    return cell


def measure_row(row: Row, shape: Shape, timed: bool = True) -> dict[str, Cell]:
    """Every column of ``row``; an anchor that fails records its error as a note. Each cell's
    ``diff`` is its largest absolute difference from flashport auto's output (same semantics)."""
    cells = {}
    for name, attn in implementations(row, shape).items():
        if isinstance(attn, str):
            cells[name] = Cell(note=attn)
            continue
        try:
            cells[name] = measure(attn, row, shape, timed)
        except Exception as err:  # noqa: BLE001 - an anchor's refusal is a table entry, not a crash
            cells[name] = Cell(note=f"error: {type(err).__name__}: {str(err).splitlines()[0][:90]}")
    auto = cells["flashport auto"].out
    for cell in cells.values():
        if auto is not None and cell.out is not None:
            diff = jnp.max(jnp.abs(cell.out.astype(jnp.float32) - auto.astype(jnp.float32)))
            cell.diff = float(diff)
        cell.out = None
    return cells


# ----------------------------------------------------------------------------------- report


def _best_anchor(cells: dict[str, Cell], attr: str) -> tuple[str, float] | None:
    timed = [(getattr(c, attr), name) for name, c in cells.items() if name in ANCHORS and getattr(c, attr)]
    return None if not timed else min(timed)[::-1]


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _mib(x: int | None) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


def format_row(row: Row, cells: dict[str, Cell], pick: str) -> list[str]:
    """The row's lines: one per column, ratios to the row's best anchor."""
    lines = [f"{row.name}  (auto picked {pick})"]
    best = {attr: _best_anchor(cells, attr) for attr in ("fwd_ms", "train_ms")}
    for name, cell in cells.items():
        ratios = []
        for attr in ("fwd_ms", "train_ms"):
            got, ref = getattr(cell, attr), best[attr]
            ratios.append("-" if got is None or ref is None else f"{got / ref[1]:.2f}x")
        diff = (
            "-" if cell.diff is None else f"{cell.diff:.1e}" + ("" if cell.diff <= AGREE_TOL else " MISMATCH")
        )
        lines.append(
            f"  {name:15s} {_ms(cell.fwd_ms):>9} {_ms(cell.train_ms):>11} {_mib(cell.scratch):>12} "
            f"{ratios[0]:>8} {ratios[1]:>8} {diff:>10}  {cell.note}"
        )
    return lines


HEADER = (
    f"  {'column':15s} {'fwd ms':>9} {'fwd+bwd ms':>11} {'scratch MiB':>12} {'fwd/best':>8} "
    f"{'f+b/best':>8} {'|out-auto|':>10}"
)


def row_goals(name: str, cells: dict[str, Cell], causal: dict[str, Cell]) -> tuple[bool, str]:
    """The row's goals for ``flashport auto``: within 1.25x of the best anchor and at most 2x the
    plain causal row, forward and forward+backward."""
    auto = cells["flashport auto"]
    if auto.fwd_ms is None or auto.train_ms is None:
        return False, f"{name}: flashport auto did not run ({auto.note})"
    parts, ok = [], True
    for attr, label in (("fwd_ms", "fwd"), ("train_ms", "fwd+bwd")):
        best = _best_anchor(cells, attr)
        if best is not None:
            ratio = getattr(auto, attr) / best[1]
            ok &= ratio <= GOAL_ANCHOR_RATIO
            parts.append(f"{label} {ratio:.2f}x {best[0]}")
        base = getattr(causal["flashport auto"], attr)
        if base:
            ratio = getattr(auto, attr) / base
            ok &= ratio <= GOAL_CAUSAL_RATIO
            parts.append(f"{label} {ratio:.2f}x causal")
    return ok, f"{name}: {'PASS' if ok else 'FAIL'} ({', '.join(parts)})"


def memory_lines(shape: Shape, large: dict[str, Cell]) -> tuple[bool, list[str]]:
    """Plain causal scratch at S/2 (measured here) and S (``large``, the table's causal row) for every
    column; flashport auto's must grow linearly."""
    half = shape.seq // 2
    small = measure_row(Row("causal", seq=half), shape, timed=False)
    lines = [
        f"compiled fwd+bwd scratch, plain causal, S={half} -> S={shape.seq} (linear: <= {LINEAR_RATIO}x)"
    ]
    ok = True
    for name in IMPLS:
        a, b = small[name].scratch, large[name].scratch
        if a is None or b is None:
            lines.append(f"  {name:15s} -  {small[name].note or large[name].note}")
            ok &= name != "flashport auto"
            continue
        ratio = b / max(a, 1)
        linear = ratio <= LINEAR_RATIO
        if name == "flashport auto":
            ok &= linear
        verdict = "linear" if linear else "superlinear"
        lines.append(f"  {name:15s} {_mib(a):>9} -> {_mib(b):>9} MiB  {ratio:.2f}x {verdict}")
    return ok, lines


def run_table(shape: Shape, emit: Callable[[str], None], only: tuple[str, ...] = ()) -> tuple[bool, bool]:
    """Measure every row (those whose name contains one of ``only``, when given, plus the plain causal
    row every goal refers to) and column, print the table and the goals.

    Returns ``(goals_met, agree)``: ``agree`` is False when a column's output differs from flashport
    auto's by more than :data:`AGREE_TOL` (a wrong anchor or a wrong kernel) or auto did not run.
    """
    emit(f"bf16 B={shape.batch} H={shape.heads} D={shape.head_dim} S={shape.seq}, medians of {shape.repeats}")
    emit(HEADER)
    results = {}
    for n, row in enumerate(rows(shape)):
        if n and only and not any(word in row.name for word in only):
            continue
        results[row.name] = measure_row(row, shape)
        for line in format_row(row, results[row.name], auto_pick(row, shape)):
            emit(line)
    causal = results[rows(shape)[0].name]
    agree = all(
        cells["flashport auto"].fwd_ms is not None
        and all(c.diff is None or c.diff <= AGREE_TOL for c in cells.values())
        for cells in results.values()
    )
    ok = True
    emit(f"goals: auto within {GOAL_ANCHOR_RATIO}x of the best anchor, at most {GOAL_CAUSAL_RATIO}x causal")
    for name, cells in results.items():
        good, text = row_goals(name, cells, causal)
        ok &= good
        emit("  " + text)
    good, lines = memory_lines(shape, causal)
    for line in lines:
        emit(line)
    ok &= good
    emit(
        f"GOALS {'MET' if ok else 'NOT MET'}; columns {'agree' if agree else 'DISAGREE'} with flashport auto"
    )
    return ok, agree
