"""A causal/window ``AttentionSpec`` for tests of block tables and tile counts (no arrays needed)."""

from __future__ import annotations

from flashport.kernels.contract.spec import AttentionSpec


def band_spec(sq, sk, causal=False, left=None, right=None, align="bottom_right"):
    """The spec of a ``sq`` x ``sk`` call with only causal / window structure (scale 1, no softcap)."""
    return AttentionSpec(
        scale=1.0,
        causal=causal,
        window_left=left,
        window_right=right,
        offset=sk - sq if align == "bottom_right" else 0,
        softcap=None,
        seq_q=sq,
        seq_k=sk,
    )
