"""BlockSpecs of the Pallas TPU attention kernels: one builder per grid order.

The forward and dQ kernels share the grouped grid ``(B, Hkv, nq, steps_k)`` (:class:`GroupMajor`,
:func:`grouped_specs`): a step serves the G query heads of a kv head, so K/V are fetched once per
group. The dK/dV kernel has the key-major grid ``(B, Hkv, nk, G, steps_q)`` (:func:`key_major_specs`).
Both return the input specs in the kernels' operand order ``q, k, v, [do, lse, di,] bias, mask, q_seg,
kv_seg`` with ``None`` for an absent operand, so the kernel bodies take every ref by name (an absent
one arrives as ``None``). :class:`Operands` maps the same grids onto heads-major (BHSD) or
token-major (the caller's BSHD, every head per step) arrays. :class:`QueryMajor` is the previous
per-query-head grid ``(B, Hq, nq, steps_k)``, kept as the counting harness's "before".

Index maps receive the grid indices and the call's :class:`~flashport.kernels.backends.pallas_tpu.tiling.Tables`.
Step j along the streamed axis visits block ``Step(...).block``; skipped steps repeat a fetched block,
so they cost no DMA. K/V use the kv head ``h // G``, so GQA/MQA never repeats K/V.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flashport.kernels.backends.pallas_tpu.blocks import LANES
from flashport.kernels.backends.pallas_tpu.tiling import Geometry, Step

_SQ = pl.Squeezed()


@dataclasses.dataclass(frozen=True)
class Operands:
    """The layout a kernel reads Q/K/V (and writes its outputs) in, and how a head's rows are read.

    Heads-major (``token_major=False``): BHSD [B, H, S, D] arrays, blocks of one head (or of the G
    heads of a group) ``[.., rows, D]``. Token-major: the caller's BSHD [B, S, H, D] arrays, read
    without a transpose. Mosaic needs a block's last two dims to be whole (8, 128) tiles or the array's
    own, and XLA tiles a BSHD array over (H, D), so a token-major block holds every head of its rows:
    ``[rows, H, D]`` (a reshape to [B, S, H*D] would be a relayout copy on TPU). ``kv_group`` is G, the
    query heads per kv head.
    """

    token_major: bool
    kv_group: int = 1
    # Token-major blocks are read (``strided``) and written (``strided_stores``) with sublane-strided
    # accesses of reshaped (bf16: uint32) views of the block; False copies head by head (the TPU
    # interpreter has no reshaped refs; the plain interpreter cannot store through one).
    strided: bool = True
    strided_stores: bool = True

    def for_interpret(self, interpret) -> Operands:
        """This layout as ``pallas_call(interpret=interpret)`` can run it: the TPU interpreter
        (``InterpretParams``) has no reshaped refs, the plain one (``True``) cannot store through one."""
        if not interpret:
            return self
        return dataclasses.replace(self, strided=interpret is True, strided_stores=False)

    def heads(self, x) -> int:
        """The head count of an operand in this layout."""
        return x.shape[2 if self.token_major else 1]

    @staticmethod
    def batch(x) -> int:
        """The batch size of an operand."""
        return x.shape[0]

    def shape(self, b: int, h: int, s: int, d: int) -> tuple[int, int, int, int]:
        """The shape of a [b, h, s, d] (BHSD) array in this layout."""
        return (b, s, h, d) if self.token_major else (b, h, s, d)

    def spec(self, heads: int, rows: int, width: int, index_map, *, squeeze: bool = False):
        """BlockSpec of ``heads`` heads x ``rows`` rows x ``width`` lanes.

        ``index_map`` returns heads-major block indices ``(b, head_block, row_block, 0)``; ``squeeze``
        drops the head dim of a one-head heads-major block (the kernel then reads ``ref[...]``).
        """
        if self.token_major:
            return pl.BlockSpec((_SQ, rows, heads, width), lambda *a: _token_major(index_map(*a)))
        return pl.BlockSpec((_SQ, _SQ if squeeze else heads, rows, width), index_map)

    def q_rows(self, ref, gi):
        """Query-side rows [rows, D] of head ``gi`` (a traced index) of the step's heads.

        ``ref`` is a heads-major block, or a token-major block's heads-major VMEM copy (:meth:`stage`).
        """
        return ref[gi]

    def kv_rows(self, ref, gi):
        """K/V rows [rows, D] for query head ``gi`` of the step's heads (its kv head ``gi // G``).

        ``ref`` is a heads-major one-head block [rows, D], a heads-major block of several kv heads
        [heads, rows, D] (the forward's head blocks) or a token-major block's VMEM copy (:meth:`stage`).
        """
        return ref[gi // self.kv_group] if len(ref.shape) == 3 else ref[...]

    def stage(self, ref, scratch) -> None:
        """Copy a token-major block ``ref`` [rows, H, D] into heads-major VMEM ``scratch`` [H, rows, D].

        Mosaic reads one head's rows of a 16-bit block only at a static head index, so the tile
        bodies loop over heads (``fori_loop``: one compiled body, as heads-major) on this copy. The
        copy is one sublane-strided load per head of the block viewed as [rows * H, D] (f32), or per
        pair of heads of its 32-bit view (bf16: a word holds heads 2p and 2p + 1 of a row; a bf16 in
        the high half of a word is that value as an f32); other blocks (and ``strided=False``) copy
        ``ref[:, h, :]``.
        """
        rows, heads, width = ref.shape
        view = self._view(ref)
        if view == "words":
            flat = ref.reshape(rows * heads, width)
            for h in range(heads):
                scratch[h] = flat[pl.ds(h, rows, stride=heads), :]
        elif view == "pairs":
            words = ref.reshape(rows * heads, width).bitcast(jnp.uint32)
            for p in range(heads // 2):
                pair = words[pl.ds(p, rows, stride=heads // 2), :]
                scratch[2 * p], scratch[2 * p + 1] = unpack_pair(pair, ref.dtype)
        else:
            for h in range(heads):
                scratch[h] = ref[:, h, :]

    def _view(self, ref) -> str | None:
        """How :meth:`stage`/:meth:`write_rows` copy block ``ref``: ``"words"`` (32-bit: strided rows
        of [rows * H, D]), ``"pairs"`` (bf16, even H: strided uint32 words of two heads) or ``None``
        (head by head). Mosaic strides only over rows one vreg wide (``D = 128``) on every chip:
        v5e and v5p reject a strided load of wider rows."""
        if not self.strided or ref.shape[-1] != LANES:
            return None
        if jnp.dtype(ref.dtype).itemsize == 4:
            return "words"
        return "pairs" if ref.dtype == jnp.bfloat16 and ref.shape[1] % 2 == 0 else None

    def write_rows(self, ref, scratch) -> None:
        """Write f32 ``scratch`` [H, rows, D] into output block ``ref`` in the operands' layout
        (token-major: the inverse of :meth:`stage`, one sublane-strided store per head or bf16 pair)."""
        if not self.token_major:
            ref[...] = scratch[...].astype(ref.dtype).reshape(ref.shape)
            return
        rows, heads, width = ref.shape
        view = self._view(ref) if self.strided_stores else None
        if view == "words":
            flat = ref.reshape(rows * heads, width)
            for h in range(heads):
                flat[pl.ds(h, rows, stride=heads), :] = scratch[h].astype(ref.dtype)
        elif view == "pairs":
            words = ref.reshape(rows * heads, width).bitcast(jnp.uint32)
            for p in range(heads // 2):
                words[pl.ds(p, rows, stride=heads // 2), :] = pack_pair(scratch[2 * p], scratch[2 * p + 1])
        else:
            for h in range(heads):
                ref[:, h, :] = scratch[h].astype(ref.dtype)

    def stage_when(self, cond, pairs) -> None:
        """Under ``cond``, :meth:`stage` each ``(block ref, scratch)`` pair."""

        @pl.when(cond)
        def _stage():
            for ref, scratch in pairs:
                self.stage(ref, scratch)

    def stage_shapes(self, heads: int, rows: int, widths_dtypes) -> list:
        """VMEM scratch of :meth:`stage`: one ``[heads, rows, width]`` buffer per ``(width, dtype)``
        (none when heads-major)."""
        if not self.token_major:
            return []
        return [pltpu.VMEM((heads, rows, width), dtype) for width, dtype in widths_dtypes]


def unpack_pair(words, dtype=jnp.bfloat16):
    """uint32 ``words`` of a bf16 block's 32-bit view -> its ``(even, odd)`` rows: a word holds the even
    row in its low half, the odd row in its high half (:func:`pltpu.bitcast`'s packing), and a bf16's
    bits in the high half of a word with a zero low half are that value as an f32."""
    even = pltpu.bitcast(words << 16, jnp.float32).astype(dtype)
    odd = pltpu.bitcast(words & jnp.uint32(0xFFFF0000), jnp.float32).astype(dtype)
    return even, odd


def pack_pair(even, odd):
    """The inverse of :func:`unpack_pair`: f32 rows rounded to bf16, packed two to a uint32 word."""
    bits = [pltpu.bitcast(x.astype(jnp.bfloat16).astype(jnp.float32), jnp.uint32) for x in (even, odd)]
    return bits[1] | (bits[0] >> 16)


def _token_major(index):
    b, h, r, _ = index
    return b, r, h, 0


def lse_rows_spec(g: Geometry, heads: int | None, q_map):
    """BlockSpec of the compact lse (or di) rows f32 [B, Hq, nq, 1, bq]: ``heads`` lane-dense rows of bq
    (``None``: one head, squeezed; the kernel reads a [1, bq] row).

    ``q_map`` returns the query-side heads-major indices ``(b, head_block, q_block, 0)``.
    """

    def index_map(*args):
        b, h, i, _ = q_map(*args)
        return b, h, i, 0, 0

    return pl.BlockSpec((_SQ, _SQ if heads is None else heads, _SQ, 1, g.bq), index_map)


class QueryMajor:
    """Index maps of the previous per-query-head grid ``(B, Hq, nq, steps_k)`` of the forward and dQ
    kernels: the counting harness's "before" (K/V fetched once per query head)."""

    def __init__(self, g: Geometry, group: int):
        self.g, self.group = g, group

    def step(self, bi, h, i, j, tables):
        """The visit schedule entry of grid point (bi, h, i, j)."""
        return Step(tables, bi, i, j, self.g.nq, self.g.nk, by_rows=True)

    def q(self, bi, h, i, j, tables):
        """Query-side blocks (q, out, lse, dO, di, dQ): query block i."""
        return bi, h, i, 0

    def kv(self, bi, h, i, j, tables):
        """K/V blocks: the scheduled key block of the shared kv head."""
        return bi, h // self.group, self.step(bi, h, i, j, tables).block, 0

    def bias(self, bi, h, i, j, tables):
        """(b, h, q block, k block) indices of bias/mask tiles (see :func:`bias_spec`)."""
        return bi, h, i, self.step(bi, h, i, j, tables).block


class KeyMajor:
    """Index maps of the key-major grid ``(B, Hkv, nk, G, steps_q)`` (dK/dV kernel): one query head
    per step. With a head block (``Geometry.head_block`` > 1) the grid is ``(B, Hkv / hb, nk, 1,
    steps_q)``: a step serves the ``hb`` kv heads of block ``hk`` and all their ``hb * G`` query heads
    (one query-side block), as a token-major step serves every head."""

    def __init__(self, g: Geometry, group: int):
        self.g, self.group = g, group

    def step(self, bi, hk, j, gi, i, tables):
        """The visit schedule entry of grid point (bi, hk, j, gi, i): the query block to visit."""
        return Step(tables, bi, j, i, self.g.nk, self.g.nq, by_rows=False)

    def _q_head(self, hk, gi):
        """Query-side head (block) index: head ``hk * G + gi``, or head block ``hk``."""
        return hk if self.g.head_block > 1 else hk * self.group + gi

    def q(self, bi, hk, j, gi, i, tables):
        """Query-side blocks of the step's query heads: the scheduled query block."""
        return bi, self._q_head(hk, gi), self.step(bi, hk, j, gi, i, tables).block, 0

    def kv(self, bi, hk, j, gi, i, tables):
        """K/V (and dK/dV) blocks: the resident key block j."""
        return bi, hk, j, 0

    def bias(self, bi, hk, j, gi, i, tables):
        """(b, h, q block, k block) indices of bias/mask tiles."""
        return bi, self._q_head(hk, gi), self.step(bi, hk, j, gi, i, tables).block, j


def key_major_heads(g: Geometry, ops: Operands, hq: int, hkv: int) -> tuple[int, int]:
    """``(query heads, kv heads)`` of one dK/dV step (see :class:`KeyMajor`)."""
    if ops.token_major:
        return hq, hkv
    if g.head_block > 1:
        return g.head_block * (hq // hkv), g.head_block
    return 1, 1


def key_major_specs(g: Geometry, ops: Operands, q, k, v, bias, mask, segmented: bool):
    """Input specs of the dK/dV kernel: ``q, k, v, do, lse, di, bias, mask, q_seg, kv_seg``.

    Heads-major: one query head per step (grid ``(B, Hkv, nk, G, steps_q)``) or, with a head block,
    the ``hb * G`` query heads of ``hb`` kv heads (grid ``(B, Hkv / hb, nk, 1, steps_q)``); token-major:
    every head per step (grid ``(B, 1, nk, 1, steps_q)``).
    """
    hq, hkv = ops.heads(q), ops.heads(k)
    maps = KeyMajor(g, hq // hkv)
    heads, kv_heads = key_major_heads(g, ops, hq, hkv)
    dp, dvp = q.shape[-1], v.shape[-1]
    specs = [
        ops.spec(heads, g.bq, dp, maps.q),
        ops.spec(kv_heads, g.bk, dp, maps.kv, squeeze=kv_heads == 1),
        ops.spec(kv_heads, g.bk, dvp, maps.kv, squeeze=kv_heads == 1),
        ops.spec(heads, g.bq, dvp, maps.q),
        lse_rows_spec(g, heads, maps.q),
        lse_rows_spec(g, heads, maps.q),
        None if bias is None else grouped_bias_spec(g, bias.shape, heads, maps.bias),
        None if mask is None else grouped_bias_spec(g, mask.shape, heads, maps.bias),
        # Key-major tiles: query ids along lanes [B, 1, Sqp], key ids along rows [B, Skp, 1].
        pl.BlockSpec(
            (_SQ, 1, g.bq), lambda bi, hk, j, gi, i, t: (bi, 0, maps.step(bi, hk, j, gi, i, t).block)
        )
        if segmented
        else None,
        pl.BlockSpec((_SQ, g.bk, 1), lambda bi, hk, j, gi, i, t: (bi, j, 0)) if segmented else None,
    ]
    return maps, specs


class GroupMajor:
    """Index maps of the forward's grouped grid ``(B, Hkv / head_block, nq, steps_k)``: one block of
    kv heads per step (one kv head unless ``Geometry.head_block`` says more).

    The G query heads of a GQA group share the step: their query rows form one ``[G, bq, D]`` block
    (query head ``hk * G + gi`` at index gi), so each K/V block is fetched once per group instead of
    once per query head. With a head block of ``hb`` kv heads, index ``hk`` counts blocks: query
    heads ``hk * hb * G + gi``, kv heads ``hk * hb + gi // G``.
    """

    def __init__(self, g: Geometry, group: int):
        self.g, self.group = g, group

    def step(self, bi, hk, i, j, tables):
        """The visit schedule entry of grid point (bi, hk, i, j)."""
        return Step(tables, bi, i, j, self.g.nq, self.g.nk, by_rows=True)

    def q(self, bi, hk, i, j, tables):
        """Query-side blocks (q, out, lse) of the whole group: query block i of heads ``hk*G ..``."""
        return bi, hk, i, 0

    def kv(self, bi, hk, i, j, tables):
        """K/V blocks: the scheduled key block of kv head ``hk``."""
        return bi, hk, self.step(bi, hk, i, j, tables).block, 0

    def bias(self, bi, hk, i, j, tables):
        """(b, head-group, q block, k block) indices of bias/mask tiles (see :func:`grouped_bias_spec`)."""
        return bi, hk, i, self.step(bi, hk, i, j, tables).block


def grouped_bias_spec(g: Geometry, shape, group: int, index_of):
    """BlockSpec of a rank-4 bias/mask holding the ``group`` heads of one grid step in one block.

    ``index_of`` returns ``(b, head_block, q_block, k_block)``. A broadcast head dim stays squeezed
    (one tile serves every head); other size-1 dims stay at block 0.
    """
    bb, hb, sqb, skb = shape
    block = (_SQ, group if hb > 1 else _SQ, g.bq if sqb > 1 else 1, g.bk if skb > 1 else 1)

    def index_map(*args):
        b, hk, qi, kj = index_of(*args)
        return (b if bb > 1 else 0, hk if hb > 1 else 0, qi if sqb > 1 else 0, kj if skb > 1 else 0)

    return pl.BlockSpec(block, index_map)


def grouped_specs(g: Geometry, ops: Operands, q, k, v, bias, mask, segmented: bool, *, grads=False):
    """Input specs of the grouped forward (``q, k, v, bias, mask, q_seg, kv_seg``) or, with
    ``grads``, of the grouped dQ kernel (``do, lse, di`` after ``v``); ``None`` where absent.

    Heads-major: one step serves the GQA groups of ``g.head_block`` kv heads (the grid's head axis
    counts head blocks); token-major: one step serves every head (grid extent 1 along the kv heads).
    Either way each K/V block is fetched once per group, not per query head.
    """
    hq, hkv = ops.heads(q), ops.heads(k)
    maps = GroupMajor(g, hq // hkv)
    kv_heads = hkv if ops.token_major else g.head_block
    step_heads = kv_heads * (hq // hkv)
    dp, dvp = q.shape[-1], v.shape[-1]
    specs = [
        ops.spec(step_heads, g.bq, dp, maps.q),
        ops.spec(kv_heads, g.bk, dp, maps.kv, squeeze=kv_heads == 1),
        ops.spec(kv_heads, g.bk, dvp, maps.kv, squeeze=kv_heads == 1),
    ]
    if grads:
        specs += [
            ops.spec(step_heads, g.bq, dvp, maps.q),
            lse_rows_spec(g, step_heads, maps.q),
            lse_rows_spec(g, step_heads, maps.q),
        ]
    specs += [
        None if bias is None else grouped_bias_spec(g, bias.shape, step_heads, maps.bias),
        None if mask is None else grouped_bias_spec(g, mask.shape, step_heads, maps.bias),
        pl.BlockSpec((_SQ, g.bq, 1), lambda bi, h, i, j, t: (bi, i, 0)) if segmented else None,
        pl.BlockSpec((_SQ, 1, g.bk), lambda bi, h, i, j, t: (bi, 0, maps.step(bi, h, i, j, t).block))
        if segmented
        else None,
    ]
    return maps, specs
