"""Sequence layouts for ring attention: which global positions each shard of a sequence axis holds.

:func:`flashport.ring_attention` splits the sequence dim of query/key/value (and the segment ids)
evenly over the ``n`` shards of one mesh axis. How positions map to shards is the *layout*:

* ``"contiguous"``: shard ``r`` holds positions ``[r·S/n, (r+1)·S/n)``, i.e. the array as it is.
  With causal attention the work is unbalanced: shard 0's queries see one chunk of keys, shard
  ``n−1``'s see all ``n``, and every ring step waits for the busiest shard.
* ``"zigzag"``: the sequence is cut into ``2n`` chunks of ``S/(2n)`` and shard ``r`` holds chunks
  ``r`` and ``2n−1−r`` (an early and a late one), so every shard has the same causal work. The
  arrays must be *stored* in zigzag order: lay a batch out once with :func:`to_zigzag` (tokens,
  labels, segment ids, positions for RoPE...), run the model on that order (attention is the only
  op that looks across positions, and ring attention knows the true position of every element),
  and bring outputs back with :func:`from_zigzag`.

:func:`piece_starts` gives, per layout, the global start of each piece a shard holds; the ring uses
it to give every (query piece, key piece) pair its exact positional offset.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

LAYOUTS = ("contiguous", "zigzag")


def check_layout(seq_layout: str) -> str:
    """Validate a layout name; returns it."""
    if seq_layout not in LAYOUTS:
        raise ValueError(f"seq_layout must be one of {LAYOUTS}, got {seq_layout!r}")
    return seq_layout


def pieces(seq_layout: str) -> int:
    """How many contiguous pieces of the global sequence one shard holds (1 or 2)."""
    return {"contiguous": 1, "zigzag": 2}[check_layout(seq_layout)]


def piece_starts(seq_layout: str, n: int, length: int) -> np.ndarray:
    """Global start position of piece ``a`` on shard ``r``, as an int array ``[n, pieces]``.

    ``length`` is the global sequence length; every piece has ``length // (n · pieces)`` positions.
    """
    m = pieces(seq_layout)
    size = length // (n * m)
    r = np.arange(n)
    if m == 1:
        return (r * size)[:, None]
    return np.stack([r * size, (2 * n - 1 - r) * size], axis=1)


def zigzag_order(n: int) -> np.ndarray:
    """Chunk order of the zigzag layout: ``[0, 2n−1, 1, 2n−2, ...]`` (shard r: chunks r, 2n−1−r)."""
    r = np.arange(n)
    return np.stack([r, 2 * n - 1 - r], axis=1).reshape(-1)


def to_zigzag(x, n: int, axis: int = 1):
    """Reorder ``x`` along ``axis`` (the sequence) into the zigzag layout for ``n`` shards.

    The axis is cut into ``2n`` equal chunks and laid out as chunks ``0, 2n−1, 1, 2n−2, ...``, so
    that after sharding the axis ``n`` ways shard ``r`` holds chunks ``r`` and ``2n−1−r``. The
    default ``axis=1`` is the sequence of BSHD arrays and of ``[B, S]`` segment ids; pass ``axis=2``
    for BHSD. Works on numpy and JAX arrays (and under ``jit``).

    Raises:
      ValueError if the axis length is not a multiple of ``2n``.
    """
    return _reorder(x, n, axis, zigzag_order(n), "to_zigzag")


def from_zigzag(x, n: int, axis: int = 1):
    """Inverse of :func:`to_zigzag`: bring a zigzag-ordered axis back to natural order."""
    return _reorder(x, n, axis, np.argsort(zigzag_order(n)), "from_zigzag")


def _reorder(x, n, axis, order, name):
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"{name}: n (the number of shards) must be a positive int, got {n!r}")
    xp = np if isinstance(x, np.ndarray) else jnp
    axis = axis % x.ndim
    length = x.shape[axis]
    if length % (2 * n):
        raise ValueError(
            f"{name}: axis {axis} has length {length}, not a multiple of 2·n = {2 * n}; pad the "
            f"sequence to a multiple of {2 * n} (e.g. with a padding segment id) first"
        )
    chunks = x.reshape(*x.shape[:axis], 2 * n, length // (2 * n), *x.shape[axis + 1 :])
    chunks = xp.take(chunks, xp.asarray(order), axis=axis)
    return chunks.reshape(x.shape)
