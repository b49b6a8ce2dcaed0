"""The one padding helper of the tiled backends: extend arrays at the end of an axis to whole blocks.

The blockwise backend and the Pallas kernels (GPU and TPU) pad sequences to a multiple of their
block sizes; padded positions are hidden by the position test of
:func:`flashport.kernels.contract.spec.positional_visible`, so the padding value only matters where a
kernel reads it unmasked (e.g. ``-inf`` for a padded lse).
"""

from __future__ import annotations

import jax.numpy as jnp


class PaddedLengths:
    """The sequence lengths of a tiling padded to whole blocks, for a class with block sizes ``bq`` /
    ``bk`` and block counts ``nq`` / ``nk`` (the Pallas geometries)."""

    bq: int
    bk: int

    @property
    def nq(self) -> int:
        """Number of query blocks."""
        raise NotImplementedError

    @property
    def nk(self) -> int:
        """Number of key blocks."""
        raise NotImplementedError

    @property
    def sqp(self) -> int:
        """Padded query length."""
        return self.nq * self.bq

    @property
    def skp(self) -> int:
        """Padded key length."""
        return self.nk * self.bk


def pad_to(x, axis: int, size: int, value=0):
    """Pad ``x`` at the end of ``axis`` to length ``size`` with ``value``; ``None`` passes through.

    Raises:
      ValueError when ``x`` is already longer than ``size`` along ``axis``.
    """
    if x is None or x.shape[axis] == size:
        return x
    if x.shape[axis] > size:
        raise ValueError(f"pad_to: axis {axis} has length {x.shape[axis]}, longer than size={size}")
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def pad_broadcastable(x, sizes: dict[int, int], value=0):
    """Pad a bias/mask-like ``x`` along each ``axis: size`` of ``sizes`` where it is not broadcast.

    Axes of length 1 are broadcast dims and stay 1; ``None`` passes through.
    """
    if x is None:
        return None
    for axis, size in sizes.items():
        if x.shape[axis] > 1:
            x = pad_to(x, axis, size, value)
    return x
