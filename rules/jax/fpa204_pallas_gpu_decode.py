"""FPA204 pallas-gpu-decode: Pallas GPU ``decode_attention.mqa``/``gqa`` -> ``flashport.attention``.

What it rewrites:
  ``jax.experimental.pallas.ops.gpu.decode_attention.mqa(q, k, v, start_idx=None,
  kv_seq_len=None, sm_scale=None, block_h=16, block_k=256, k_splits=16, num_warps=None,
  num_stages=2, grid=None, interpret=False, debug=False, return_residuals=False,
  normalize_output=True)`` and ``gqa(...)`` with the same parameters: one query token per sequence.

Semantics mapping:
  ``mqa``: ``q [B, H, D]``, ``k``/``v [B, S, D]`` (one shared kv head) ->
  ``flashport.attention(q[:, None], k[:, :, None], v[:, :, None], ..., layout="BSHD")[:, 0]``.
  ``gqa``: ``q [B, Hq, D]``, ``k``/``v [B, S, Hkv, D]`` (query head h uses kv head h // (Hq/Hkv),
  the contract's contiguous grouping) -> ``flashport.attention(q[:, None], k, v, ...)[:, 0]``.
  ``sm_scale=None`` means 1/sqrt(D) here (**unlike** ``mha``'s 1.0) -> ``scale=None``. No causal mask
  (one query sees every key); ``align="bottom_right"`` is written for completeness. Kernel tuning
  arguments are dropped with a note.

What it refuses:
  ``start_idx``/``kv_seq_len`` (per-sequence valid key ranges are not mapped); ``return_residuals``;
  ``normalize_output=False``; positional arguments after ``v`` (only ``q, k, v`` are bound
  positionally because the parameter list was only checked at jax 0.10.2); a scale computed with
  array ops; splats; unknown arguments.

Example::

    out = decode_attention.gqa(q, k_cache, v_cache, sm_scale=0.125)
    # becomes
    out = flashport.attention(q[:, None], k_cache, v_cache, scale=0.125, align="bottom_right", layout="BSHD")[:, 0]
"""

from __future__ import annotations

import libcst as cst

from flashport.rules.base import Refuse, Rewrite, Rule, register
from flashport.rules.common.binding import Signature
from flashport.rules.common.calls import build_call, string
from flashport.rules.common.literals import is_none
from flashport.rules.jax import shared as common

MODULE = "jax.experimental.pallas.ops.gpu.decode_attention"
TUNING = ("block_h", "block_k", "k_splits", "num_warps", "num_stages", "grid", "interpret", "debug")
SIGNATURE = Signature(
    ("q", "k", "v"),
    ("start_idx", "kv_seq_len", "sm_scale") + TUNING + ("return_residuals", "normalize_output"),
)


@register
class PallasGpuDecode(Rule):
    """Rewrite the Pallas GPU decode kernels ``mqa``/``gqa`` to ``flashport.attention``."""

    CODE = "FPA204"
    NAME = "pallas-gpu-decode"
    API = f"{MODULE}.mqa / .gqa"
    SOURCES = (f"{MODULE}.mqa", f"{MODULE}.gqa")
    GPU_MODULES = (MODULE,)
    TARGET = "flashport.attention"

    def check_call(self, call, ctx):
        """Add the length-1 query axis (and the kv head axis for ``mqa``), call the contract, drop the axis."""
        function = ctx.qualified_name.rsplit(".", 1)[-1]
        bound = SIGNATURE.bind(call, f"decode_attention.{function}")
        value = {name: arg.value for name, arg in bound.items()}
        q, k, v = common.require(value, ("q", "k", "v"), f"decode_attention.{function}")
        for name in ("start_idx", "kv_seq_len"):
            if not is_none(value.get(name)):
                raise Refuse(
                    f"{name}: per-sequence valid key ranges of the decode kernel are not mapped to the contract"
                )
        if not common.literal_false(value.get("return_residuals")):
            raise Refuse("return_residuals: the decode kernel's (l, m) residuals have no contract equivalent")
        normalize = value.get("normalize_output")
        if normalize is not None and not (isinstance(normalize, cst.Name) and normalize.value == "True"):
            raise Refuse(
                "normalize_output may be False (unnormalized output); the contract always normalizes"
            )
        if function == "mqa":
            k, v = common.subscript(k, ":", ":", "None"), common.subscript(v, ":", ":", "None")
        keywords = [
            ("scale", common.static_scale(value.get("sm_scale"), cst.Name("None"), ctx, "sm_scale")),
            ("causal", cst.Name("False")),
            ("align", string("bottom_right")),
            ("layout", string("BSHD")),
        ]
        inner = build_call(self.TARGET, [common.subscript(q, ":", "None"), k, v], keywords, call)
        dropped = [name for name in TUNING if name in value]
        notes = (f"dropped Pallas GPU tuning arguments: {', '.join(dropped)}",) if dropped else ()
        return Rewrite(common.subscript(inner, ":", "0"), notes=notes)
