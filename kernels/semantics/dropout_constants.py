"""The framework-free part of the contract's dropout: the hash constants, the keep threshold and
the rate check, shared by :mod:`flashport.kernels.semantics.dropout` (JAX) and ``flashport.torch._dropout``
(which must not import jax). The keep-mask definition itself is documented in
:mod:`flashport.kernels.semantics.dropout`.
"""

from __future__ import annotations

import math
import numbers

FMIX_M1 = 0x85EBCA6B
FMIX_M2 = 0xC2B2AE35
BATCH_MUL = 0x9E3779B9
HEAD_MUL = 0x7F4A7C15
ROW_MUL = 0x9E3779B9
KEY_MUL = 0x27D4EB2F
MASK32 = 0xFFFFFFFF


def threshold(rate: float) -> int:
    """The uint32 cut: an entry is kept when its hash bits are ``>= threshold(rate)``."""
    return min(math.floor(rate * 2.0**32), MASK32)


def check_rate(name: str, rate, *, type_hint: str, value_hint: str = "") -> float:
    """Validate a dropout rate argument ``name``: a real number in [0, 1). Returns it as a float.

    ``type_hint`` ends the TypeError for a non-number (an array, a tensor...) with what to pass
    instead; ``value_hint`` is appended to the ValueError for an out-of-range rate.
    """
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real):
        raise TypeError(f"{name} must be a Python float in [0, 1), got {type(rate).__name__}; {type_hint}")
    rate = float(rate)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {rate}; pass 0.0 to disable dropout{value_hint}")
    return rate
