"""Block sizes of the Pallas TPU attention kernels: the dataclass, per-generation defaults, options.

The heuristic (the reasoning is in ``kernels/README.md``):

* The forward streams K/V blocks past a resident Q block, so its arithmetic intensity is about
  ``block_q`` FLOP per HBM byte (bf16). ``block_q`` is therefore the smallest power of two at or
  above the chip's ridge point (peak FLOP/s ÷ HBM bytes/s): v4 224, v5e 240, v5p ~180, v6e 560.
* ``block_k`` sets the per-step work (grid steps cost ~0.35 µs each) and the size of the f32 score
  tile; ``block_q * block_k`` is kept at 512K elements (2 MiB f32 per [bq, bk] temporary), which with
  the 3-4 live temporaries of a step stays inside the default 16 MiB scoped VMEM of every generation.
* The dK/dV kernel streams Q/dO past resident K/V, so its ``block_k_dkv`` plays the role of the
  forward's ``block_q``; the dQ kernel mirrors the forward. Backward steps keep ~5 [bq, bk] f32
  temporaries, so their tiles are half the forward's.
* v6e (and newer) has 256×256 MXUs: every block is a multiple of 256 there.

All blocks are clipped to the (padded) sequence lengths at call time, so short sequences never pay
for a large default.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

# Sublane granularity of query blocks: 32 rows keep f32 (8), bf16/f16 (16) and the int8 mask (32)
# tiles whole. Key blocks are lane dimensions of the score tile: multiples of 128.
Q_ALIGN = 32
# A query shorter than Q_ALIGN (decode: Sq = 1..31) is one block of the whole query rounded up to 8
# rows (one f32 sublane tile) instead of 32: the block spans the whole padded array, which Mosaic
# accepts for any dtype, and a decode step computes 8 padded rows per head rather than 32.
SHORT_Q_ALIGN = 8
K_ALIGN = 128
LANES = 128


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the forward, dK/dV and dQ kernels (rows of Q × rows of K/V per grid step).

    Attributes:
      block_q / block_k: forward kernel.
      block_q_dkv / block_k_dkv: dK/dV kernel (K/V resident, Q and dO streamed).
      block_q_dq / block_k_dq: dQ kernel (Q and dO resident, K/V streamed).
    """

    block_q: int
    block_k: int
    block_q_dkv: int
    block_k_dkv: int
    block_q_dq: int
    block_k_dq: int

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid block and how to fix it."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            align = Q_ALIGN if f.name.startswith("block_q") else K_ALIGN
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % align:
                raise ValueError(
                    f"pallas_tpu option {f.name}={value!r} is invalid: it must be a positive multiple of "
                    f"{align} ({'query rows are sublanes' if align == Q_ALIGN else 'key blocks are lanes'}); "
                    f"e.g. registry.use('pallas_tpu', {f.name}={max(align, 512)})"
                )


# Per generation. See the module docstring; README.md has the numbers behind each choice.
GENERATION_DEFAULTS = {
    # 16 MiB VMEM per core, 128x128 MXU, ridge ~224 FLOP/B.
    "v4": BlockSizes(
        block_q=512, block_k=512, block_q_dkv=256, block_k_dkv=512, block_q_dq=512, block_k_dq=256
    ),
    # 128 MiB VMEM, 4x 128x128 MXU, ridge ~240.
    # Backward 512x1024 / 1024x512 (not 512x512): 7% fewer cycles on the schedule ruler at S=2048.
    "v5e": BlockSizes(
        block_q=512, block_k=1024, block_q_dkv=512, block_k_dkv=1024, block_q_dq=1024, block_k_dq=512
    ),
    # 64 MiB VMEM per core (megacore), ridge ~166-187.
    "v5p": BlockSizes(
        block_q=512, block_k=1024, block_q_dkv=512, block_k_dkv=512, block_q_dq=512, block_k_dq=512
    ),
    # 128 MiB VMEM, 2x 256x256 MXU, ridge ~560.
    "v6e": BlockSizes(
        block_q=1024, block_k=512, block_q_dkv=512, block_k_dkv=1024, block_q_dq=1024, block_k_dq=512
    ),
}
# Newer or unknown chips (TPU7x: 256x256 MXU, 64 MiB VMEM/core, ridge ~312) use the v6e table. It is
# also the default when nothing names a chip (exporting for TPU from a CPU host, no abstract mesh):
# its blocks fit the 16 MiB default scoped VMEM of every generation (see the module docstring).
FALLBACK_GENERATION = "v6e"

# The device_kind JAX reports for each generation; the Mosaic lowering is told this chip when the
# computation itself names none.
GENERATION_DEVICE_KINDS = {"v4": "TPU v4", "v5e": "TPU v5 lite", "v5p": "TPU v5", "v6e": "TPU v6 lite"}

_DEVICE_KINDS = {
    "TPU v4": "v4",
    "TPU v4 lite": "v4",
    "TPU v5e": "v5e",
    "TPU v5 lite": "v5e",
    "TPU v5": "v5p",
    "TPU v5p": "v5p",
    "TPU v6e": "v6e",
    "TPU v6 lite": "v6e",
}

OPTION_NAMES = ("generation", "read_bshd", *(f.name for f in dataclasses.fields(BlockSizes)))


def generation_of(device_kind: str | None) -> str:
    """Map a JAX ``device_kind`` (``"TPU v5 lite"``) to a key of :data:`GENERATION_DEFAULTS`."""
    return _DEVICE_KINDS.get(device_kind or "", FALLBACK_GENERATION)


def current_device_kind(*arrays) -> str | None:
    """The TPU kind being lowered for, or ``None`` when nothing names one (export from a CPU host).

    In order: the abstract mesh's device (set by the user), the device of the mesh the ``arrays``
    are laid out on (under ``jit`` their abstract values carry the mesh of the compile target, e.g.
    ``get_topology_desc`` devices when compiling ahead of time), the default TPU device. Never raises.
    """
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    if abstract is not None:
        return abstract.device_kind
    for x in arrays:
        mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
        device = getattr(mesh, "abstract_device", None)
        if device is not None and device.platform == "tpu":
            return device.device_kind
    try:
        return jax.devices("tpu")[0].device_kind
    except RuntimeError:
        return None


def resolve_blocks(options: dict[str, Any], backend: str, *arrays) -> tuple[str, BlockSizes]:
    """Validate backend options and return ``(generation, BlockSizes)`` with user overrides applied.

    Options: ``generation`` (one of :data:`GENERATION_DEFAULTS`; default: the chip
    :func:`current_device_kind` finds for ``arrays``), ``read_bshd``
    (read by the backend, not here) and any field of :class:`BlockSizes`. ``block_q``/``block_k`` also set the backward blocks unless those are given.
    """
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise ValueError(
            f"backend {backend!r} does not take option(s) {unknown}; valid options: {', '.join(OPTION_NAMES)}"
        )
    generation = options.get("generation")
    if generation is None:
        generation = generation_of(current_device_kind(*arrays))
    elif generation not in GENERATION_DEFAULTS:
        raise ValueError(
            f"backend {backend!r} option generation={generation!r} is unknown; use one of "
            f"{', '.join(map(repr, GENERATION_DEFAULTS))}"
        )
    base = GENERATION_DEFAULTS[generation]
    overrides = {k: v for k, v in options.items() if k not in ("generation", "read_bshd")}
    # A user who sets only the forward blocks means "use these tiles"; mirror them into the backward.
    for fwd, bwd in (("block_q", ("block_q_dkv", "block_q_dq")), ("block_k", ("block_k_dkv", "block_k_dq"))):
        if fwd in overrides:
            for name in bwd:
                overrides.setdefault(name, overrides[fwd])
    blocks = dataclasses.replace(base, **overrides)
    blocks.validate()
    return generation, blocks


# Blocks a sliding window narrows no further: below 512 the per-step scalar/DMA work outweighs what
# the masked area saves (measured on the schedule ruler, benchmarks/tpu_ruler.py).
WINDOW_MIN_BLOCK = 512


# Per generation, the kernels whose default tiles become square under a causal mask over a short
# query (:func:`fit_band`); measured on the schedule ruler (``benchmarks/tpu_ruler.py``, S=2048,
# D=128): v6e dQ 1024x512 -> 512x512 12% fewer cycles (but 2.5% more at S=8192, four times the
# blocks), v5e forward 512x1024 -> 512x512 10% fewer, v5e backward 9% fewer; v6e forward
# 1024x512 -> 512x512 6% more.
CAUSAL_SQUARE_KERNELS = {"v5e": ("fwd", "dkv", "dq"), "v6e": ("dq",)}


def fit_band(
    generation: str, kind: str, bq: int, bk: int, *, causal: bool, left: int | None, seq: int
) -> tuple[int, int]:
    """Default blocks of kernel ``kind`` for a causal or sliding-window band: every kernel's tiles are
    narrowed to a window (:func:`fit_window`); under a causal mask, the kernels of
    :data:`CAUSAL_SQUARE_KERNELS` get square tiles when the sequence (``seq``, the longer of query and
    key) spans at most two of their longer blocks. There the oblong tiles on the diagonal compute a
    large share of masked scores; with more blocks the diagonal's share shrinks and the oblong tile's
    lower per-step cost wins."""
    if causal and kind in CAUSAL_SQUARE_KERNELS.get(generation, ()) and seq <= 2 * max(bq, bk):
        bq = bk = min(bq, bk)
    return fit_window(bq, bk, left)


def fit_window(bq: int, bk: int, left: int | None) -> tuple[int, int]:
    """``(bq, bk)`` halved, the larger first (ties: ``bq``), until a sliding window reaching ``left``
    keys back holds whole [bq, bk] tiles (``bq + bk - 2 <= left``), not below
    :data:`WINDOW_MIN_BLOCK`. Tiles straddling the band's edges run the masked body; with blocks wider
    than the band every visited tile does (a 1024-key window under 1024x512 tiles)."""
    if left is None:
        return bq, bk
    while bq + bk - 2 > left and max(bq, bk) > WINDOW_MIN_BLOCK:
        if bq >= bk:
            bq = max(WINDOW_MIN_BLOCK, round_to_align(bq // 2))
        else:
            bk = max(WINDOW_MIN_BLOCK, bk // 2 // K_ALIGN * K_ALIGN)
    return bq, bk


# What the grouped forward's blocks may occupy in VMEM: the 16 MiB default scoped VMEM less a margin
# for Mosaic's own temporaries.
FORWARD_VMEM_BUDGET = 12 * 2**20

# Steps holding the blocks of several kv heads (token-major: every head of their rows; the heads-major
# forward's head blocks, :func:`fit_head_block`) fit a larger budget on chips with the VMEM for it:
# (budget the blocks fit, ``vmem_limit_bytes`` the kernels request). Physical VMEM per core: 128 MiB
# on v5e/v6e, 64 MiB on v5p; v4 keeps the 16 MiB default scoped VMEM.
MULTI_HEAD_VMEM = {
    "v4": (FORWARD_VMEM_BUDGET, None),
    "v5e": (48 * 2**20, 64 * 2**20),
    "v5p": (24 * 2**20, 32 * 2**20),
    "v6e": (48 * 2**20, 64 * 2**20),
}


def forward_vmem_bytes(
    bq: int,
    bk: int,
    group: int,
    dp: int,
    dvp: int,
    itemsize: int,
    kv_heads: int = 1,
    staged: bool = False,
    tile_bytes: int = 0,
) -> int:
    """VMEM of one grouped forward step: double-buffered q/out blocks and compact lse rows of the
    step's ``group`` heads, the K/V blocks of its ``kv_heads``, the heads' m/l (lane-replicated) and
    accumulator scratch, ~4 live f32 [bq, bk] temporaries (the heads run one after another) and,
    ``staged`` (token-major), the heads-major copies of the Q and K/V blocks, and ``tile_bytes`` per
    score element for the bias/mask blocks (:func:`tile_operand_bytes`)."""
    copies = 1 if staged else 0
    per_row = group * ((2 + copies) * dp * itemsize + 2 * dvp * itemsize + 2 * 4 + 2 * LANES * 4 + dvp * 4)
    return (
        bq * per_row + (2 + copies) * bk * (dp + dvp) * itemsize * kv_heads + (4 * 4 + tile_bytes) * bq * bk
    )


def tile_operand_bytes(kind: str, heads: int, bias, mask) -> int:
    """VMEM bytes per [bq, bk] score element that a step of kernel ``kind`` holds for its bias and
    mask blocks (double-buffered; per head of the step's ``heads`` unless broadcast over heads) and,
    in the dQ kernel, its bias-gradient output block (f32). Blocks broadcast along a sequence dim are
    a row or a column, not a tile, and count as nothing here."""
    total = 0
    for x, grad in ((bias, kind == "dq"), (mask, False)):
        if x is None or x.shape[2] == 1 or x.shape[3] == 1:
            continue
        per_head = heads if x.shape[1] > 1 else 1
        total += 2 * per_head * jnp.dtype(x.dtype).itemsize
        if grad:
            total += 2 * heads * 4
    return total


def fit_forward_block_q(
    block_q: int,
    bk: int,
    group: int,
    dp: int,
    dvp: int,
    itemsize: int,
    *,
    kv_heads: int = 1,
    budget: int = FORWARD_VMEM_BUDGET,
    staged: bool = False,
    tile_bytes: int = 0,
) -> int:
    """``block_q`` halved (not below ``Q_ALIGN``) until the grouped forward fits
    ``budget`` (:data:`FORWARD_VMEM_BUDGET`): the G query heads of a group share each step, so their blocks
    multiply the per-row VMEM by G. The tile still carries ``G * block_q`` query rows per K/V fetch.
    Without GQA (G = 1) the block is the per-generation default or the user's, unchanged. The
    token-major forward passes every head of a step (``group`` = Hq, ``kv_heads`` = Hkv, ``staged``)."""
    if group == 1 and not tile_bytes:
        return block_q
    bq = block_q
    while (
        bq > Q_ALIGN
        and forward_vmem_bytes(bq, bk, group, dp, dvp, itemsize, kv_heads, staged, tile_bytes) > budget
    ):
        bq = max(Q_ALIGN, round_to_align(bq // 2))
    return bq


def fit_head_block(kv_heads: int, step_bytes) -> int:
    """Kv heads per step of the heads-major forward and dQ kernels: the largest divisor ``hb`` of
    ``kv_heads`` whose step fits, ``step_bytes(hb)`` giving the step's VMEM bytes and its budget
    (:func:`forward_vmem_bytes` / :func:`backward_vmem_bytes` of ``hb * G`` query heads and ``hb``
    kv heads). A grid step costs a fixed scalar and DMA set-up (~200 bundles on the schedule ruler)
    whatever it holds: one step per head block instead of per kv head pays it once per ``hb``."""
    best = 1
    for hb in range(2, kv_heads + 1):
        if kv_heads % hb == 0:
            need, budget = step_bytes(hb)
            if need <= budget:
                best = hb
    return best


def round_to_align(rows: int) -> int:
    """``rows`` rounded down to a multiple of ``Q_ALIGN`` (at least ``Q_ALIGN``)."""
    return max(Q_ALIGN, rows // Q_ALIGN * Q_ALIGN)


def backward_vmem_bytes(
    kind: str,
    bq: int,
    bk: int,
    heads: int,
    kv_heads: int,
    dp: int,
    dvp: int,
    itemsize: int,
    staged: bool = False,
    tile_bytes: int = 0,
) -> int:
    """VMEM of one backward step serving ``heads`` query heads and ``kv_heads`` kv heads.

    ``kind`` ``"dq"`` (Q, dO resident; K/V streamed) or ``"dkv"`` (K/V resident; Q, dO streamed): the
    double-buffered blocks of both sides, the compact lse/di rows, the kernel's output block and f32
    accumulator, ~5 live f32 [bq, bk] temporaries and, ``staged`` (token-major), the heads-major
    copies of both sides' blocks.
    """
    buffers = 3 if staged else 2
    q_side = buffers * bq * heads * (dp + dvp) * itemsize + 2 * 2 * heads * bq * 4
    kv_side = buffers * bk * kv_heads * (dp + dvp) * itemsize
    if kind == "dq":
        own = 2 * bq * heads * dp * itemsize + bq * heads * dp * 4
    else:
        own = 2 * bk * kv_heads * (dp + dvp) * itemsize + bk * kv_heads * (dp + dvp) * 4
    return q_side + kv_side + own + (5 * 4 + tile_bytes) * bq * bk


def fit_backward_blocks(
    kind: str,
    bq: int,
    bk: int,
    heads: int,
    kv_heads: int,
    dp: int,
    dvp: int,
    itemsize: int,
    budget: int = FORWARD_VMEM_BUDGET,
    staged: bool = False,
    tile_bytes: int = 0,
) -> tuple[int, int]:
    """``(bq, bk)`` of a backward kernel halved until :func:`backward_vmem_bytes` fits
    ``budget`` (:data:`FORWARD_VMEM_BUDGET`), the side holding more VMEM rows first. One head per step
    (heads-major dK/dV, dQ without GQA) keeps the blocks unchanged, as the forward does;
    ``staged``: token-major steps (see :func:`backward_vmem_bytes`)."""
    if heads == 1 and kv_heads == 1 and not tile_bytes:
        return bq, bk

    def fits(rows, cols):
        need = backward_vmem_bytes(kind, rows, cols, heads, kv_heads, dp, dvp, itemsize, staged, tile_bytes)
        return need <= budget

    while not fits(bq, bk):
        # Halve the side holding more rows of VMEM (ties: the key side), keeping the tiles square-ish.
        can_q, can_k = bq > Q_ALIGN, bk > K_ALIGN
        if can_k and (bk * kv_heads >= bq * heads or not can_q):
            bk = max(K_ALIGN, bk // 2 // K_ALIGN * K_ALIGN)
        elif can_q:
            bq = max(Q_ALIGN, round_to_align(bq // 2))
        else:
            break
    return bq, bk
