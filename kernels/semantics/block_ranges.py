"""The one builder of block ranges: which key blocks a query block can see, and the reverse.

Every tiled implementation asks the same questions of the causal/window structure of an
:class:`~flashport.kernels.contract.spec.AttentionSpec` (``spec``): which key positions can queries
``[q_lo, q_hi)`` see (:func:`key_range`), which key blocks must query block ``i`` visit
(:func:`key_blocks`), which of those need no position mask (:func:`full_key_blocks`), and the same
from the key side for the dK/dV passes (:func:`query_range`, :func:`query_blocks`,
:func:`full_query_blocks`). The answers follow from :func:`flashport.kernels.semantics.visibility.band_visible`:
query ``i`` sees key ``j`` when ``i + offset - left <= j <= i + offset + right`` (causal caps
``right`` at 0), and both lengths bound the positions.

The functions take an :class:`Ops` (``min``/``max``/``where``/``div`` of an array namespace), so
the same code computes static Python tables (:data:`PYTHON`, the default; the blockwise backend,
the Pallas TPU geometry, ring attention) and traced scalars inside a kernel (the Pallas GPU loop
bounds pass JAX's). This module imports no framework.

Ranges are half-open and may be empty (``lo >= hi``). A block range is clipped to the blocks that
exist; a query block's range never includes a key block none of its queries sees, and a block in
its *full* range is one whose every key every query of the block sees, with no padding on either
side (a ragged last query block has none, the ragged last key block is never full).
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple


class Ops(NamedTuple):
    """Elementwise integer operations of one array namespace (Python ints, numpy, jax.numpy...).

    ``div`` is the integer quotient of non-negative numbers (every call here clamps first).
    """

    minimum: Any
    maximum: Any
    where: Any
    div: Any


def _select(cond, a, b):
    return a if cond else b


# Plain Python ints: static tables computed at trace time.
PYTHON = Ops(min, max, _select, operator.floordiv)


def reach(spec) -> tuple[int | None, int | None]:
    """``(left, right)`` reach of the positional mask, ``None`` where unbounded; causal caps right at 0."""
    right = spec.window_right
    if spec.causal:
        right = 0 if right is None else min(right, 0)
    return spec.window_left, right


def key_range(spec, q_lo, q_hi, ops: Ops = PYTHON):
    """Half-open range of key positions that queries ``[q_lo, q_hi)`` may see, within ``[0, seq_k)``.

    Only causal/window structure counts (masks, bias and segment ids may hide more).
    """
    left, right = reach(spec)
    lo, hi = 0, spec.seq_k
    if right is not None:
        hi = ops.minimum(hi, q_hi + (spec.offset + right))
    if left is not None:
        lo = ops.maximum(lo, q_lo + (spec.offset - left))
    return lo, hi


def query_range(spec, k_lo, k_hi, ops: Ops = PYTHON):
    """Half-open range of query positions that may see keys ``[k_lo, k_hi)``, within ``[0, seq_q)``."""
    left, right = reach(spec)
    lo, hi = 0, spec.seq_q
    if right is not None:  # j <= i + offset + right  <=>  i >= j - offset - right
        lo = ops.maximum(lo, k_lo - (spec.offset + right))
    if left is not None:  # j >= i + offset - left  <=>  i <= j - offset + left
        hi = ops.minimum(hi, k_hi + (left - spec.offset))
    return lo, hi


def _blocks(lo, hi, block: int, count: int, ops: Ops):
    """Position range ``[lo, hi)`` -> the range of ``block``-sized blocks (of ``count``) it touches."""
    lo_b = ops.minimum(ops.div(ops.maximum(lo, 0), block), count)
    hi_b = ops.where(hi > lo, ops.minimum(_cdiv(ops.maximum(hi, 0), block, ops), count), lo_b)
    return lo_b, ops.maximum(hi_b, lo_b)


def _cdiv(x, n: int, ops: Ops):
    return ops.div(x + (n - 1), n)


def key_blocks(spec, i, bq: int, bk: int, ops: Ops = PYTHON):
    """Half-open range of key blocks (size ``bk``) that query block ``i`` (size ``bq``) must visit."""
    first = i * bq
    lo, hi = key_range(spec, first, ops.minimum(first + bq, spec.seq_q), ops)
    return _blocks(lo, hi, bk, -(-spec.seq_k // bk), ops)


def query_blocks(spec, j, bq: int, bk: int, ops: Ops = PYTHON):
    """Half-open range of query blocks (size ``bq``) that may see key block ``j`` (size ``bk``)."""
    first = j * bk
    lo, hi = query_range(spec, first, ops.minimum(first + bk, spec.seq_k), ops)
    return _blocks(lo, hi, bq, -(-spec.seq_q // bq), ops)


def full_key_blocks(spec, i, bq: int, bk: int, ops: Ops = PYTHON):
    """Half-open range of key blocks whose every key every query of block ``i`` sees (no position
    mask needed); empty when block ``i`` holds padded rows, never the ragged last key block."""
    left, right = reach(spec)
    first = i * bq
    last = first + bq - 1
    whole = spec.seq_k // bk  # key blocks without padding
    lo = 0 if left is None else ops.maximum(last + (spec.offset - left), 0)
    hi = whole
    if right is not None:
        hi = ops.minimum(ops.div(ops.maximum(first + (spec.offset + right + 1), 0), bk), whole)
    lo_b = _cdiv(lo, bk, ops)
    return lo_b, ops.where(last < spec.seq_q, ops.maximum(hi, lo_b), lo_b)


def full_query_blocks(spec, j, bq: int, bk: int, ops: Ops = PYTHON):
    """Half-open range of query blocks whose every query sees every key of block ``j`` (no position
    mask needed); only blocks without padding on both sides."""
    left, right = reach(spec)
    first = j * bk
    last = first + bk - 1
    whole = spec.seq_q // bq
    # i sees `last`  <=>  i >= last - offset - right;  i sees `first`  <=>  i <= first - offset + left
    lo = 0 if right is None else ops.maximum(last - (spec.offset + right), 0)
    hi = whole
    if left is not None:
        hi = ops.minimum(ops.div(ops.maximum(first + (left - spec.offset + 1), 0), bq), whole)
    lo_b = _cdiv(lo, bq, ops)
    return lo_b, ops.where(last < spec.seq_k, ops.maximum(hi, lo_b), lo_b)


class BlockTables(NamedTuple):
    """Static per-block ranges of one tiling (tuples of Python ints, one entry per block).

    ``row_lo/row_hi[i]``: the key blocks query block i visits; ``full_lo/full_hi[i]``: those of them
    that need no position mask; ``col_lo/col_hi[j]``: the query blocks that may see key block j.
    """

    row_lo: tuple[int, ...]
    row_hi: tuple[int, ...]
    full_lo: tuple[int, ...]
    full_hi: tuple[int, ...]
    col_lo: tuple[int, ...]
    col_hi: tuple[int, ...]


def block_tables(spec, bq: int, bk: int) -> BlockTables:
    """The static :class:`BlockTables` of ``spec`` tiled by [bq, bk] blocks."""
    nq, nk = -(-spec.seq_q // bq), -(-spec.seq_k // bk)
    rows = [key_blocks(spec, i, bq, bk) for i in range(nq)]
    full = [full_key_blocks(spec, i, bq, bk) for i in range(nq)]
    cols = [query_blocks(spec, j, bq, bk) for j in range(nk)]

    def column(pairs, n):
        return tuple(int(p[n]) for p in pairs)

    return BlockTables(
        column(rows, 0), column(rows, 1), column(full, 0), column(full, 1), column(cols, 0), column(cols, 1)
    )
