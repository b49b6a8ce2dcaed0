"""Reading matmuls out of HLO text: which ``dot`` ops a staged computation holds, with their shapes.

The residual-reusing backward is checked through these: the forward's output product P·V is the
only matmul of attention whose result has both a query-length axis and the value head_dim axis
(dq has Sq x D, dv has Sk x Dv, the scores Sq x Sk), so with Sq, Sk, D and Dv all distinct a
backward HLO holding such a dot is recomputing the forward.
"""

from __future__ import annotations

import re

# `%dot.12 = f32[2,2,2,40,24]{4,3,2,1,0} dot(...)` (HLO text; layouts optional).
_DOT = re.compile(r"=\s*[a-z0-9]+\[([0-9,]*)\](?:\{[^}]*\})?\s+dot\(")


def dot_shapes(hlo_text: str) -> list[tuple[int, ...]]:
    """The result shapes of every ``dot`` op in ``hlo_text`` (every computation, in text order)."""
    return [tuple(int(d) for d in m.group(1).split(",") if d) for m in _DOT.finditer(hlo_text)]


def output_products(hlo_text: str, seq_q: int, v_head_dim: int) -> list[tuple[int, ...]]:
    """The dots whose result has both a ``seq_q`` axis and a ``v_head_dim`` axis: P·V products."""
    return [s for s in dot_shapes(hlo_text) if seq_q in s and v_head_dim in s]
