"""A cycle ruler for Pallas TPU kernels without a TPU: the compiler's final VLIW schedule, counted.

libtpu compiles deviceless (``jax.experimental.topologies.get_topology_desc``, then
``.lower(lowering_platforms=("tpu",)).compile()``) and, with
``LIBTPU_INIT_ARGS="--xla_jf_dump_to=DIR --xla_jf_dump_llo_text=true"``, writes the final schedule of
every Mosaic kernel, one VLIW bundle per line (``…-<kernel>-…-final_bundles.txt``). A bundle issues in
one cycle, so a kernel's static cycles are the bundles of each region times how often it runs:

* **loops** are backward ``sbr.rel`` branches; their trip count is the constant of the
  ``/* loop exit test */`` compare (the outermost is the grid loop: grid steps + 2 pipeline steps);
* **guarded regions** are forward ``sbr.rel (%p)`` skips. How often one runs is read from what it
  holds and what its predicate depends on: a region holding MXU work and no guarded MXU region inside
  is a *tile body* and runs once per computed tile of its class (two bodies: the larger is the masked
  one for partial tiles, the smaller the mask-free one for full tiles; one body: every computed tile);
  a region whose predicate reads a scalar-prefetched table (not a spill slot) runs once per computed
  tile; one whose predicate compares a grid index with a constant runs once per row (first/last step
  of the streamed axis); anything else once per grid step. The tile counts come from the mask
  (:func:`tile_classes`), per kernel, with the block sizes the kernel uses.

What it omits: DMA waits (HBM bandwidth), pipeline stalls and bank conflicts. Absolute cycles are a
lower bound of run time; the ratio of two kernels' cycles is the ruler's output. Where libtpu's own
static estimate is exact (JAX's ``flash_attention`` without a mask) the two agree within 5%
(``tests/test_tpu_ruler.py``); with a causal mask libtpu counts the grid condition it cannot bound
as taken and reads above the ruler; for table-driven kernels (splash, flashport) it drops every
region behind a table value and is no ruler.

Rates: a chip's bf16 MXU rate in FLOP per cycle is derived the same way, from the schedule of a
512³ bf16 matmul per grid step (:func:`mxu_rate`); the MXU floor of a config is its model FLOPs over
that rate (forward ``4·B·Hq·pairs·D``, backward 2.5× that), the *ceiling* divides the floor by the
MXU fill at head dim D (``min(1, D / array width)``: 256 from v6e on, 128 before).

Long sequences (``--derive``): a kernel's regions run the same code at any S when its blocks are
the same, so a row at S = 8192 or 32768 may reuse the schedules compiled at a shorter S with the
same block shapes (:func:`base_seq_for`) and count them with the long row's tiles, rows and grid
(:func:`derived_cycles`; checked against a direct compile in ``tests/test_tpu_ruler.py``).

    python benchmarks/tpu_ruler.py --gens v6e --seqs 2048 8192 --dims 128 [--derive] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import os
import re
import sys
import tempfile
import time

DUMP_FLAGS = "--xla_jf_dump_to={dir} --xla_jf_dump_llo_text=true"
TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
MXU_WIDTH = {"v4": 128, "v5e": 128, "v5p": 128, "v6e": 256}
_DUMP: list[str] = []


def enable(directory: str | None = None) -> str:
    """Ask libtpu to dump final schedules into ``directory``; must run before libtpu initializes."""
    directory = directory or tempfile.mkdtemp(prefix="flashport_ruler_")
    flags = DUMP_FLAGS.format(dir=directory)
    os.environ["LIBTPU_INIT_ARGS"] = f"{os.environ.get('LIBTPU_INIT_ARGS', '')} {flags}".strip()
    _DUMP[:] = [directory]
    return directory


# ---------------------------------------------------------------------------------------------------
# Parsing one kernel's final bundles.

_BUNDLE = re.compile(r"^\s*0x[0-9a-f]+\s")
_REGION = re.compile(r"(Start|End|Start/End empty) region (\d+)")
_BRANCH = re.compile(r"sbr\.rel (?:\(!?(%p\w+)\) )?target = \$region(\d+)")
_SPILL_STORE = re.compile(r"sst \[smem:\[(#allocation\w+_spill)\]\] (%s\w+)")
_EXIT = re.compile(r"scmp[\w.]* %\w+, (\d+) /\* loop exit test \*/")
_OP = re.compile(r"(%\w+) = ([\w.]+)(.*)")
_MXU = re.compile(r"vmatmul|vmatres|\.mrf\.mxu")


@dataclasses.dataclass
class Span:
    """A loop (``trips`` set) or a guarded region (``pred`` set) over bundles ``[start, end)``."""

    start: int
    end: int
    trips: int = 0
    pred: str = ""
    children: list[Span] = dataclasses.field(default_factory=list)
    kind: str = ""  # filled by classification: loop, tile, wrapper, table, edge, step

    def contains(self, other: Span) -> bool:
        return self.start <= other.start and other.end <= self.end and self is not other


@dataclasses.dataclass
class Schedule:
    """One kernel's final schedule: bundle texts and the loop/guard tree."""

    bundles: list[str]
    root: Span
    defs: dict[str, tuple[str, str]]  # register -> (opcode, rest of the op text)
    spills: dict[str, list[str]]  # spill slot -> registers stored there

    def mxu(self, span: Span) -> bool:
        return any(_MXU.search(b) for b in self.bundles[span.start : span.end])


def parse(text: str) -> Schedule:
    """Bundles, region spans, loops, guards and scalar definitions of one ``final_bundles`` file."""
    bundles: list[str] = []
    for line in text.splitlines():
        if _BUNDLE.match(line):
            bundles.append(line)
        elif bundles:
            bundles[-1] += " " + line
    starts: dict[int, int] = {}
    for idx, b in enumerate(bundles):
        for what, num in _REGION.findall(b):
            if what != "End":
                starts.setdefault(int(num), idx)
    spans: list[Span] = []
    defs: dict[str, tuple[str, str]] = {}
    spills: dict[str, list[str]] = {}
    for idx, b in enumerate(bundles):
        body = b.split("{", 1)[-1]
        for op in body.split(";;"):
            op = op.strip().rstrip("}").strip()
            m = _OP.match(op)
            if m:
                defs[m.group(1)] = (m.group(2), m.group(3))
            store = _SPILL_STORE.search(op)
            if store:
                spills.setdefault(store.group(1), []).append(store.group(2))
        for pred, target in _BRANCH.findall(b):
            tgt = starts.get(int(target))
            if tgt is None:
                continue
            if tgt <= idx:
                trips = 0
                for prior in range(idx, tgt - 1, -1):
                    m = _EXIT.search(bundles[prior])
                    if m:
                        trips = int(m.group(1))
                        break
                spans.append(Span(tgt, idx + 1, trips=max(trips, 1)))
            elif pred:
                spans.append(Span(idx + 1, tgt, pred=pred))
    root = Span(0, len(bundles))
    for span in sorted(spans, key=lambda s: (s.start, -s.end)):
        parent = root
        while True:
            inner = [c for c in parent.children if c.contains(span)]
            if not inner:
                break
            parent = inner[-1]
        parent.children.append(span)
    return Schedule(bundles, root, defs, spills)


def _sources(sched: Schedule, reg: str, seen: set[str]) -> tuple[bool, set[int]]:
    """Whether ``reg`` depends on a table load, and the integer immediates its compares use."""
    if reg in seen:
        return False, set()
    seen.add(reg)
    op, rest = sched.defs.get(reg, ("", ""))
    table = False
    imms: set[int] = set()
    if op == "sld":
        slot = re.search(r"\[smem:\[(#allocation\w+)", rest)
        if slot and slot.group(1).endswith("_spill"):
            for stored in sched.spills.get(slot.group(1), []):
                t, i = _sources(sched, stored, seen)
                table, imms = table or t, imms | i
            return table, imms
        return True, imms
    if op.startswith("scmp"):
        imms |= {int(x) for x in re.findall(r", (\d+)\b", rest)[:1]}
    for operand in re.findall(r"%[sp]\w+", rest):
        t, i = _sources(sched, operand, seen)
        table, imms = table or t, imms | i
    return table, imms


def classify(sched: Schedule, span: Span, inside_grid: bool) -> None:
    """Set ``kind`` on ``span`` and its descendants (see the module docstring)."""
    for child in span.children:
        if child.trips:
            child.kind = "loop"
        elif sched.mxu(child):
            child.kind = "wrapper" if _has_mxu_guard(sched, child) else "tile"
        elif inside_grid:
            table, imms = _sources(sched, child.pred, set())
            child.kind = "table" if table else ("edge" if imms else "step")
        else:
            child.kind = "step"
        if child.kind != "tile":
            classify(sched, child, inside_grid or child.kind == "loop")
        else:
            _mark_nested(child)


def _has_mxu_guard(sched: Schedule, span: Span) -> bool:
    return any((not c.trips and sched.mxu(c)) or _has_mxu_guard(sched, c) for c in span.children)


def _mark_nested(span: Span) -> None:
    for c in span.children:
        c.kind = "loop" if c.trips else "inner"
        _mark_nested(c)


@dataclasses.dataclass(frozen=True)
class Counts:
    """How often a kernel's regions run: grid rows (first/last steps) and computed tiles per class."""

    rows: int
    full: int
    partial: int


@dataclasses.dataclass
class Breakdown:
    """One kernel on the ruler: cycles and the regions they come from."""

    cycles: int
    grid_trips: int
    tile_bundles: list[int]
    regions: list[tuple[str, int, int]]  # (kind, bundles, runs)


def _own(span: Span) -> int:
    return span.end - span.start - sum(c.end - c.start for c in span.children)


def _static(span: Span) -> int:
    """Bundles of one pass through ``span`` with inner loops at their trip counts."""
    return _own(span) + sum(c.trips * _static(c) if c.trips else _static(c) for c in span.children)


def measure(sched: Schedule, counts: Counts, grid_trips: int | None = None) -> Breakdown:
    """The kernel's static cycles: every region's bundles times how often it runs. ``grid_trips``
    replaces the grid loop's trip count read from the schedule (see :func:`derived_cycles`)."""
    root = sched.root
    classify(sched, root, inside_grid=False)
    loops: list[Span] = []

    def find_loops(span: Span) -> None:
        for c in span.children:
            if c.kind == "loop":
                loops.append(c)
            if c.kind != "tile":
                find_loops(c)

    find_loops(root)
    grid = max(loops, key=lambda s: s.end - s.start) if loops else None
    tiles: list[Span] = []

    def collect(span: Span) -> None:
        for c in span.children:
            if c.kind == "tile":
                tiles.append(c)
            else:
                collect(c)

    collect(root)
    tiles.sort(key=_static)
    runs_of_tile: dict[int, int] = {}
    total_tiles = counts.full + counts.partial
    if len(tiles) == 1:
        runs_of_tile[id(tiles[0])] = total_tiles
    elif len(tiles) == 2:
        runs_of_tile[id(tiles[0])] = counts.full
        runs_of_tile[id(tiles[1])] = counts.partial
    else:
        for t in tiles:  # unknown structure: every body on every tile (an upper bound)
            runs_of_tile[id(t)] = total_tiles
    steps = grid.trips if grid is not None else 1
    if grid_trips is not None:
        if grid is None:
            raise ValueError("the schedule has no grid loop to rescale")
        steps = grid_trips
    regions: list[tuple[str, int, int]] = []

    def walk(span: Span, runs: int) -> int:
        cost = _own(span) * runs
        for c in span.children:
            if c.kind == "loop":
                r = runs * c.trips if c is not grid else steps
            elif c.kind == "tile":
                r = runs_of_tile[id(c)]
            elif c.kind == "table":
                r = min(runs, total_tiles)
            elif c.kind == "edge":
                r = min(runs, counts.rows)
            else:
                r = runs
            if c.kind in ("tile", "table", "edge"):
                regions.append((c.kind, _static(c), r))
            cost += walk(c, r)
        return cost

    cycles = walk(root, 1)
    return Breakdown(cycles, steps, [_static(t) for t in tiles], regions)


# ---------------------------------------------------------------------------------------------------
# Compiling and counting.


def one_chip(gen: str):
    """A one-device sharding on a TPU of generation ``gen`` (deviceless, from its topology)."""
    import jax
    import numpy as np
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(TOPOLOGIES[gen], "tpu").devices
    return jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(devices[:1]), ("x",)), jax.sharding.PartitionSpec()
    )


def compile_schedules(fn, *specs, compile_fn=None) -> dict[str, str]:
    """Compile ``jax.jit(fn)`` for TPU on ``specs``; ``{kernel name: final bundles text}`` of its
    Mosaic kernels (needs :func:`enable` first). ``compile_fn(fn, *specs)`` replaces the compile
    (e.g. one that also reads libtpu's static profile). JAX reuses the executable of a program it
    compiled before, so no schedule is dumped again: results are kept per lowered program and chip
    (the lowered text of one program is the same for every TPU generation)."""
    import jax

    chips = sorted({d.device_kind for s in specs if s.sharding is not None for d in s.sharding.device_set})
    key = (*chips, jax.jit(fn).trace(*specs).lower(lowering_platforms=("tpu",)).as_text())
    if key in _SCHEDULES:
        return _SCHEDULES[key]
    directory = _DUMP[0]
    for path in glob.glob(os.path.join(directory, "*")):
        os.remove(path)
    if compile_fn is None:
        jax.jit(fn).trace(*specs).lower(lowering_platforms=("tpu",)).compile()
    else:
        compile_fn(fn, *specs)
    out: dict[str, str] = {}
    for path in glob.glob(os.path.join(directory, "*-final_bundles.txt")):
        name = os.path.basename(path).split("-", 1)[1].rsplit("-", 2)[0]
        if "schedule-analysis" in path or name.startswith(("<", "TLP")):
            continue
        with open(path) as f:
            text = f.read()
        if "tpu_custom_call" in text or "vmatmul" in text:
            out[name] = text
    for path in glob.glob(os.path.join(directory, "*")):
        os.remove(path)
    _SCHEDULES[key] = out
    return out


_SCHEDULES: dict[tuple[str, ...], dict[str, str]] = {}


def _matmul_bundles(gen: str, tile: int, depth: int) -> int:
    """Bundles from the first to the last MXU op of a Pallas kernel computing one bf16
    [tile, depth] x [depth, tile] product per grid step."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    steps = 4

    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

    call = pl.pallas_call(
        kernel,
        grid=(steps,),
        in_specs=[
            pl.BlockSpec((tile, depth), lambda i: (i, 0)),
            pl.BlockSpec((depth, tile), lambda i: (0, 0)),
        ],
        out_specs=pl.BlockSpec((tile, tile), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((steps * tile, tile), jnp.float32),
        name="ruler_matmul",
    )
    sh = one_chip(gen)
    x = jax.ShapeDtypeStruct((steps * tile, depth), jnp.bfloat16, sharding=sh)
    y = jax.ShapeDtypeStruct((depth, tile), jnp.bfloat16, sharding=sh)
    (text,) = compile_schedules(call, x, y).values()
    mxu = [i for i, b in enumerate(parse(text).bundles) if _MXU.search(b)]
    return mxu[-1] - mxu[0] + 1


@functools.cache
def mxu_rate(gen: str) -> float:
    """bf16 FLOP per cycle of ``gen``'s MXUs in steady state: the extra bundles of a 512x1536x512
    matmul over a 512x512x512 one (fill and drain cancel)."""
    tile, small, large = 512, 512, 1536
    extra = _matmul_bundles(gen, tile, large) - _matmul_bundles(gen, tile, small)
    return 2 * tile * tile * (large - small) / extra


@dataclasses.dataclass(frozen=True)
class Config:
    """One ruler row's attention problem (B = 1)."""

    gen: str
    seq: int
    dim: int
    mask: str  # full, causal, window, gqa, segments
    backward: bool
    heads: int = 8
    window: int = 1024
    segments: int = 4

    @property
    def kv_heads(self) -> int:
        return 2 if self.mask == "gqa" else self.heads

    @property
    def causal(self) -> bool:
        return self.mask in ("causal", "window")

    @property
    def name(self) -> str:
        return f"{self.gen} S={self.seq} D={self.dim} {self.mask} {'bwd' if self.backward else 'fwd'}"


def _seg_of(cfg: Config, pos: int) -> int:
    return pos * cfg.segments // cfg.seq


def tile_classes(cfg: Config, bq: int, bk: int, *, skip_segments: bool, full_segments: bool):
    """``(full, partial)`` tiles of one head's [S, S] score matrix with [bq, bk] tiles (the empty
    ones are skipped). ``skip_segments``: the kernel skips tiles whose segment ids cannot match;
    ``full_segments``: it runs the mask-free body on tiles inside one segment (else segment ids make
    every tile partial)."""
    full = partial = 0
    segs = cfg.mask == "segments"
    for q0 in range(0, cfg.seq, bq):
        q1 = min(q0 + bq, cfg.seq) - 1
        for k0 in range(0, cfg.seq, bk):
            k1 = min(k0 + bk, cfg.seq) - 1
            lo, hi = k0 - q1, k1 - q0  # range of k - q over the tile
            if (cfg.causal and lo > 0) or (cfg.mask == "window" and hi < -cfg.window):
                continue
            pos_full = not (cfg.causal and hi > 0) and not (cfg.mask == "window" and lo < -cfg.window)
            if segs:
                qa, qb, ka, kb = (_seg_of(cfg, x) for x in (q0, q1, k0, k1))
                if skip_segments and (qb < ka or kb < qa):
                    continue
                pos_full = pos_full and full_segments and qa == qb == ka == kb
            if pos_full:
                full += 1
            else:
                partial += 1
    return full, partial


def visible_pairs(cfg: Config) -> int:
    """Visible (query, key) pairs of one head."""
    import numpy as np

    q = np.arange(cfg.seq)
    lo = np.zeros_like(q)
    hi = q + 1 if cfg.causal else np.full_like(q, cfg.seq)
    if cfg.mask == "window":
        lo = np.maximum(q - cfg.window, 0)
    if cfg.mask == "segments":
        seg = q * cfg.segments // cfg.seq  # as _seg_of
        starts = np.searchsorted(seg, np.arange(cfg.segments + 1))
        lo = np.maximum(lo, starts[seg])
        hi = np.minimum(hi, starts[seg + 1])
    return int(np.sum(hi - lo))


def floor_cycles(cfg: Config) -> float:
    """MXU floor: model FLOPs (4·Hq·pairs·D; x2.5 for the backward) over the chip's rate."""
    flops = 4.0 * cfg.heads * visible_pairs(cfg) * cfg.dim * (2.5 if cfg.backward else 1.0)
    return flops / mxu_rate(cfg.gen)


def ceiling_cycles(cfg: Config) -> float:
    """The D-dependent MXU ceiling: the floor over the array's fill at head dim D."""
    return floor_cycles(cfg) / min(1.0, cfg.dim / MXU_WIDTH[cfg.gen])


def _segment_ids(cfg: Config):
    import jax.numpy as jnp

    return jnp.asarray([[_seg_of(cfg, p) for p in range(cfg.seq)]], jnp.int32)


def _program(fn, cfg: Config, layout: str):
    """``fn(q, k, v)`` or the gradient of its sum; the arguments' ShapeDtypeStructs."""
    import jax
    import jax.numpy as jnp

    sh = one_chip(cfg.gen)
    if layout == "BSHD":
        qs, ks = (1, cfg.seq, cfg.heads, cfg.dim), (1, cfg.seq, cfg.kv_heads, cfg.dim)
    else:
        qs, ks = (1, cfg.heads, cfg.seq, cfg.dim), (1, cfg.kv_heads, cfg.seq, cfg.dim)
    specs = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sh) for s in (qs, ks, ks)]
    if not cfg.backward:
        return fn, specs
    return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)), specs


def _kwargs(cfg: Config) -> dict:
    kw: dict = {"causal": cfg.causal}
    if cfg.mask == "window":
        kw["window"] = (cfg.window, 0)
    if cfg.mask == "segments":
        ids = _segment_ids(cfg)
        kw["q_segment_ids"] = ids
        kw["kv_segment_ids"] = ids
    return kw


def _mask_mod_kwargs(cfg: Config) -> dict:
    """The mask of ``cfg`` (causal or sliding window) written as a FlexAttention-style mask_mod."""
    if cfg.mask == "causal":
        return {"mask_mod": lambda b, h, i, j: j <= i}
    if cfg.mask == "window":
        return {"mask_mod": lambda b, h, i, j: (j <= i) & (i - j <= cfg.window)}
    raise ValueError(f"no mask_mod form for the {cfg.mask} rows")


def flashport_kernels(cfg: Config, layout: str, as_mod: bool = False, **options):
    """(program, specs, {kernel name prefix: Counts}) of flashport's ``pallas_tpu`` backend.
    ``as_mod``: the mask goes in as a ``mask_mod`` (its block mask gives the same tile classes),
    not as the built-in ``causal`` / ``window`` arguments."""
    import flashport
    from flashport.kernels.contract import registry

    backend = registry.use("pallas_tpu", generation=cfg.gen, **options)
    kw = _mask_mod_kwargs(cfg) if as_mod else _kwargs(cfg)
    fn = lambda q, k, v: flashport.attention(q, k, v, layout=layout, backend=backend, **kw)  # noqa: E731
    prog, specs = _program(fn, cfg, layout)
    counts = {}
    shape = dataclasses.replace(cfg, mask="full") if as_mod else cfg  # what the wrapper's blocks see
    for kind in ("dkv", "dq") if cfg.backward else ("fwd",):
        g, token_major = flashport_geometry(shape, layout, kind, **options)
        full, partial = tile_classes(cfg, g.bq, g.bk, skip_segments=True, full_segments=True)
        # Grid extent along the heads: heads-major steps hold g.head_block kv heads.
        groups = 1 if token_major else cfg.kv_heads // g.head_block
        if kind == "dkv":  # heads-major without a head block: one query head per step (grid axis G)
            units = cfg.heads if not token_major and g.head_block == 1 else groups
            rows = g.nk * groups
        else:
            units, rows = groups, g.nq * groups
        counts[f"flashport_flash_{kind}"] = Counts(rows=rows, full=full * units, partial=partial * units)
    return prog, specs, counts


def flashport_geometry(cfg: Config, layout: str, kind: str, **options):
    """``(Geometry, token_major)`` flashport's wrapper picks for kernel ``kind`` of ``cfg``."""
    import jax
    import jax.numpy as jnp

    from flashport.kernels.backends.pallas_tpu import backend as pb
    from flashport.kernels.backends.pallas_tpu.blocks import resolve_blocks
    from flashport.kernels.contract.spec import AttentionSpec

    spec = AttentionSpec(
        scale=cfg.dim**-0.5,
        causal=cfg.causal,
        window_left=cfg.window if cfg.mask == "window" else None,
        window_right=0 if cfg.mask == "window" else None,
        offset=0,
        softcap=None,
        seq_q=cfg.seq,
        seq_k=cfg.seq,
        layout=layout,
    )
    read_bshd = options.pop("read_bshd", None)
    generation, blocks = resolve_blocks({"generation": cfg.gen, **options}, "pallas_tpu")
    conf = pb.Config(spec, blocks, False, generation, read_bshd)
    q = jax.ShapeDtypeStruct((1, cfg.heads, cfg.seq, cfg.dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, cfg.kv_heads, cfg.seq, cfg.dim), jnp.bfloat16)
    kinds = ("dkv", "dq") if kind != "fwd" else ("fwd",)
    token_major = layout == "BSHD" and conf.operands(q, k, k, kinds).token_major
    return conf.geometry(kind, q, k, k, token_major=token_major), token_major


def splash_kernels(cfg: Config):
    """(program, specs, {kernel name prefix: Counts}) of JAX's splash attention (512 blocks)."""
    import flashport

    kw = _kwargs(cfg)
    fn = lambda q, k, v: flashport.attention(q, k, v, layout="BHSD", backend="splash", **kw)  # noqa: E731
    prog, specs = _program(fn, cfg, "BHSD")
    block = max(b for b in (512, 256, 128) if cfg.seq % b == 0)
    full, partial = tile_classes(cfg, block, block, skip_segments=False, full_segments=False)
    rows = cfg.heads * (cfg.seq // block)
    c = Counts(rows=rows, full=full * cfg.heads, partial=partial * cfg.heads)
    kinds = ("dkv", "dq") if cfg.backward else ("fwd",)
    return prog, specs, {f"splash_mha_{kind}": c for kind in kinds}


def jax_flash_kernels(cfg: Config, block: int = 512):
    """(program, specs, counts) of JAX's ``flash_attention`` (forward; MHA; full or causal)."""
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    blocks = fa.BlockSizes(*(block,) * 3, 1, *(block,) * 7)
    fn = lambda q, k, v: fa.flash_attention(  # noqa: E731
        q, k, v, causal=cfg.causal, sm_scale=cfg.dim**-0.5, block_sizes=blocks
    )
    prog, specs = _program(fn, cfg, "BHSD")
    full, partial = tile_classes(cfg, block, block, skip_segments=False, full_segments=False)
    rows = cfg.heads * (cfg.seq // block)
    return prog, specs, {"flash": Counts(rows=rows, full=full * cfg.heads, partial=partial * cfg.heads)}


def ruler_cycles(prog, specs, counts: dict[str, Counts], compile_fn=None) -> tuple[int, dict[str, Breakdown]]:
    """Compile ``prog`` and measure its Mosaic kernels named in ``counts`` (by name prefix);
    ``(total cycles, {kernel: Breakdown})``. ``compile_fn``: see :func:`compile_schedules`."""
    schedules = compile_schedules(prog, *specs, compile_fn=compile_fn)
    out: dict[str, Breakdown] = {}
    for name, text in sorted(schedules.items()):
        match = [c for prefix, c in counts.items() if name.startswith(prefix)]
        if match:  # other kernels (the forward a gradient recomputes) are not in this row
            out[name] = measure(parse(text), match[0])
    missing = [p for p in counts if not any(n.startswith(p) for n in out)]
    if missing:
        raise ValueError(f"kernels {missing} not found among {sorted(schedules)}")
    return sum(b.cycles for b in out.values()), out


# The grid loop of a final schedule runs the grid's steps plus two pipeline steps (prologue, epilogue).
PIPELINE_TRIPS = 2


def kernel_grids(prog, specs) -> dict[str, set[tuple[tuple[int, ...], str]]]:
    """``{pallas_call name: {(grid, block shapes)}}`` of the Pallas kernels of ``prog`` at ``specs``,
    read from its jaxpr: traced, not compiled (seconds, where a compile takes minutes)."""
    import jax

    found: dict[str, set[tuple[tuple[int, ...], str]]] = {}

    def walk(jaxpr) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                gm = eqn.params["grid_mapping"]
                blocks = repr([tuple(map(str, bm.block_shape)) for bm in gm.block_mappings])
                name = str(eqn.params["name"])
                found.setdefault(name, set()).add((tuple(gm.grid), blocks))
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(prog)(*specs).jaxpr)
    return found


def _grid_of(grids: dict, prefix: str) -> tuple[tuple[int, ...], str]:
    (entry,) = {g for name, gs in grids.items() if name.startswith(prefix) for g in gs}
    return entry


def derived_cycles(build, cfg: Config, base_seq: int) -> tuple[int, dict[str, Breakdown]]:
    """:func:`ruler_cycles` of ``build(cfg)`` (``build``: :func:`splash_kernels` or a
    :func:`flashport_kernels` partial) from the schedules compiled at sequence length ``base_seq``.

    A tile body, a first/last-step region and a grid step run the same code at any S when the kernel's
    blocks are the same: only how often they run depends on S. So the schedules compiled at
    ``base_seq`` are counted with ``cfg``'s runs: tiles per class and rows from ``build(cfg)``'s
    counts (as a direct row), grid trips from the kernel's grid at ``cfg.seq`` (traced, not compiled)
    plus the pipeline's two. Raises ``ValueError`` when a kernel's block shapes differ between the
    two lengths (e.g. the causal square tiles of short sequences, :func:`fit_band`) or when the grid
    loop of a base schedule does not run the base grid's steps + 2."""
    import math

    prog, specs, counts = build(cfg)
    bprog, bspecs, _ = build(dataclasses.replace(cfg, seq=base_seq))
    target, base = kernel_grids(prog, specs), kernel_grids(bprog, bspecs)
    for prefix in counts:
        if _grid_of(target, prefix)[1] != _grid_of(base, prefix)[1]:
            raise ValueError(f"{prefix}: blocks at S={cfg.seq} differ from those at S={base_seq}")
    schedules = compile_schedules(bprog, *bspecs)
    out: dict[str, Breakdown] = {}
    for name, text in sorted(schedules.items()):
        match = [p for p in counts if name.startswith(p)]
        if not match:
            continue
        at_base = measure(parse(text), counts[match[0]])
        if at_base.grid_trips != math.prod(_grid_of(base, match[0])[0]) + PIPELINE_TRIPS:
            raise ValueError(f"{name}: grid loop of {at_base.grid_trips} trips is not the base grid's + 2")
        trips = math.prod(_grid_of(target, match[0])[0]) + PIPELINE_TRIPS
        out[name] = measure(parse(text), counts[match[0]], grid_trips=trips)
    missing = [p for p in counts if not any(n.startswith(p) for n in out)]
    if missing:
        raise ValueError(f"kernels {missing} not found among {sorted(schedules)}")
    return sum(b.cycles for b in out.values()), out


def base_seq_for(build, cfg: Config, candidates=(2048, 4096)) -> int | None:
    """The shortest of ``candidates`` below ``cfg.seq`` at which ``build``'s kernels have ``cfg``'s
    block shapes (a schedule :func:`derived_cycles` may rescale), or ``None``."""
    prog, specs, counts = build(cfg)
    target = kernel_grids(prog, specs)
    for seq in candidates:
        if seq >= cfg.seq:
            break
        bprog, bspecs, _ = build(dataclasses.replace(cfg, seq=seq))
        base = kernel_grids(bprog, bspecs)
        if all(_grid_of(target, p)[1] == _grid_of(base, p)[1] for p in counts):
            return seq
    return None


def configs(gens, seqs, dims, masks, directions) -> list[Config]:
    """Every ruler row."""
    return [
        Config(gen, s, d, m, bwd == "bwd")
        for gen in gens
        for d in dims
        for s in seqs
        for m in masks
        for bwd in directions
    ]


def _compile_profiled(llo, estimate: dict, fn, *specs) -> None:
    """Compile with ``llo_profile`` and keep libtpu's static estimate in ``estimate``."""
    estimate.update(llo.compile_profiled(fn, *specs)[1])


def validation(gen: str = "v6e") -> dict:
    """Measurements the tests check (run in its own process: the dump flags must precede libtpu).

    ``jax_flash``: ruler cycles and libtpu's static estimate of JAX's ``flash_attention`` (gated by
    grid arithmetic, so the estimate is valid), full and causal; ``grid``: flashport's forward at S and
    2S (cycles and computed tiles); ``rows``: ruler cycles, MXU floor and ceiling of splash and
    flashport (BHSD, BSHD) forward and backward on small configs; ``derived``: splash and flashport
    (BHSD) causal forward at S=8192 compiled directly and derived from S=2048 (:func:`derived_cycles`).
    """
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "llo_profile", os.path.join(os.path.dirname(__file__), "llo_profile.py")
    )
    llo = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(llo)
    llo.enable()
    enable()
    out: dict = {"rate": mxu_rate(gen), "jax_flash": {}, "grid": {}, "rows": []}
    for mask in ("full", "causal"):
        cfg = Config(gen, 2048, 128, mask, False)
        prog, specs, counts = jax_flash_kernels(cfg)
        estimate: dict[str, int] = {}
        compile_fn = functools.partial(_compile_profiled, llo, estimate)
        ruler, _ = ruler_cycles(prog, specs, counts, compile_fn=compile_fn)
        out["jax_flash"][mask] = {"ruler": ruler, "libtpu": llo.kernel_cycles(estimate)}
    for seq in (2048, 4096):
        cfg = Config(gen, seq, 128, "full", False)
        prog, specs, counts = flashport_kernels(cfg, "BHSD")
        cycles, _ = ruler_cycles(prog, specs, counts)
        (c,) = counts.values()
        out["grid"][seq] = {"cycles": cycles, "tiles": c.full + c.partial}
    for mask, bwd in (("full", False), ("causal", False), ("full", True)):
        cfg = Config(gen, 2048, 128, mask, bwd)
        row = {"config": cfg.name, "floor": floor_cycles(cfg), "ceiling": ceiling_cycles(cfg)}
        row["splash"] = ruler_cycles(*splash_kernels(cfg))[0]
        for layout in ("BHSD", "BSHD"):
            row[layout] = ruler_cycles(*flashport_kernels(cfg, layout))[0]
        out["rows"].append(row)
    cfg = Config(gen, 8192, 128, "causal", False)
    out["derived"] = {
        name: {"direct": ruler_cycles(*build(cfg))[0], "derived": derived_cycles(build, cfg, 2048)[0]}
        for name, build in (
            ("splash", splash_kernels),
            ("BHSD", functools.partial(flashport_kernels, layout="BHSD")),
        )
    }
    return out


def main(argv=None) -> None:
    """Print the table: flashport (BHSD and BSHD) vs splash per config, % of the MXU floor/ceiling."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gens", nargs="+", default=["v5e", "v6e"], choices=sorted(TOPOLOGIES))
    parser.add_argument("--seqs", nargs="+", type=int, default=[2048, 8192, 32768])
    parser.add_argument("--dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--masks", nargs="+", default=["full", "causal", "window", "gqa", "segments"])
    parser.add_argument("--directions", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    parser.add_argument("--out", help="also append the rows to this file")
    parser.add_argument(
        "--derive",
        action="store_true",
        help="rows at S > 2048 from the schedules of a shorter S with the same blocks (derived_cycles)",
    )
    parser.add_argument("--validate", action="store_true", help="print validation() as JSON and exit")
    parser.add_argument(
        "--mods", action="store_true", help="compare each causal/window mask with the same mask as a mask_mod"
    )
    args = parser.parse_args(argv)
    if args.validate:
        import json

        print(json.dumps(validation(args.gens[-1])))
        return
    enable()
    import jax

    if args.mods:
        _mods_table(configs(args.gens, args.seqs, args.dims, args.masks, args.directions), args.out)
        return

    header = (
        f"{'config':<36} {'splash':>11} {'fp BHSD':>11} {'fp BSHD':>11} {'BHSD/spl':>8} {'BSHD/spl':>8}"
        f" {'%floor spl':>10} {'%floor fp':>9} {'%ceil fp':>8}  tile bundles (fp BHSD)"
    )
    print(f"# jax {jax.__version__}; cycles = bundles x runs (deviceless libtpu compile)")
    print(header)
    out = open(args.out, "a") if args.out else None
    for cfg in configs(args.gens, args.seqs, args.dims, args.masks, args.directions):
        t0 = time.time()
        bases: list[str] = []
        (spl, _), (bhsd, parts), (bshd, _) = (
            _row_cycles(build, cfg, args.derive, bases)
            for build in (
                splash_kernels,
                functools.partial(flashport_kernels, layout="BHSD"),
                functools.partial(flashport_kernels, layout="BSHD"),
            )
        )
        best = min(bhsd, bshd)
        tiles = " ".join(f"{k.split('.')[0][16:]}:{v.tile_bundles}" for k, v in parts.items())
        row = (
            f"{cfg.name:<36} {spl:>11,} {bhsd:>11,} {bshd:>11,} {bhsd / spl:>8.2f} {bshd / spl:>8.2f}"
            f" {100 * floor_cycles(cfg) / spl:>9.1f}% {100 * floor_cycles(cfg) / best:>8.1f}%"
            f" {100 * ceiling_cycles(cfg) / best:>7.1f}%  {tiles}  ({time.time() - t0:.0f}s)"
        )
        if any(bases):
            row += f"  derived: splash/BHSD/BSHD from S={'/'.join(b or 'direct' for b in bases)}"
        print(row, flush=True)
        if out:
            out.write(row + "\n")
            out.flush()
    if out:
        out.close()
    sys.stdout.flush()


def _row_cycles(build, cfg: Config, derive: bool, bases: list[str]) -> tuple[int, dict[str, Breakdown]]:
    """One column of a row: :func:`derived_cycles` from a shorter S when ``derive`` and one has the
    same blocks, else a direct compile; appends the base S used ("" when direct) to ``bases``."""
    base = base_seq_for(build, cfg) if derive else None
    bases.append(str(base or ""))
    if base is None:
        return ruler_cycles(*build(cfg))
    return derived_cycles(build, cfg, base)


def _mods_table(rows: list[Config], out_path: str | None) -> None:
    """flashport's Pallas TPU kernels with a built-in mask vs the same mask as a mask_mod (BHSD)."""
    header = f"{'config':<36} {'built-in':>11} {'mask_mod':>11} {'mod/built-in':>12}"
    print(header)
    lines = [header]
    for cfg in rows:
        if cfg.mask not in ("causal", "window"):
            continue
        t0 = time.time()
        builtin, _ = ruler_cycles(*flashport_kernels(cfg, "BHSD"))
        mod, _ = ruler_cycles(*flashport_kernels(cfg, "BHSD", as_mod=True))
        row = f"{cfg.name:<36} {builtin:>11,} {mod:>11,} {mod / builtin:>12.2f}  ({time.time() - t0:.0f}s)"
        print(row, flush=True)
        lines.append(row)
    if out_path:
        with open(out_path, "a") as out:
            out.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
