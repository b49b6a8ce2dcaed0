"""FPA203 pallas-gpu-mha: Pallas GPU (Triton) ``attention.mha`` -> ``flashport.attention``.

What it rewrites:
  ``mha(q, k, v, segment_ids, sm_scale=1.0, causal=False, block_sizes=..., backward_pass_impl=...,
  num_warps=None, num_stages=2, grid=None, interpret=False, debug=False, return_residuals=False)``
  from ``jax.experimental.pallas.ops.gpu.attention`` (jax >= 0.4.29) and from the older module path
  ``jax.experimental.pallas.ops.attention`` (jax <= 0.4.28, still imported by praxis). Before jax
  0.5.3 the tuning parameters were ``block_q, block_k`` instead of ``block_sizes``; arguments are
  bound against ``jax-version``.

Semantics mapping:
  layout ``[B, T, N, H]`` -> ``layout="BSHD"``; ``sm_scale`` **defaults to 1.0** -> ``scale=1.0``
  written out; ``causal`` is ``span_q >= span_k`` (top-left) -> ``causal=..., align="top_left"``;
  ``segment_ids`` ``[B, S]`` is shared by queries and keys -> ``q_segment_ids=segment_ids,
  kv_segment_ids=segment_ids``. Pallas ``mha`` has no GQA (equal head counts), which the contract
  handles identically. Kernel tuning (``block_sizes``/``block_q``/``block_k``, ``num_warps``,
  ``num_stages``, ``grid``, ``backward_pass_impl``, ``interpret``, ``debug``) is dropped with a note.

What it refuses:
  ``return_residuals`` (the kernel's residual is a **base-2** log-sum-exp, ``m + log2(l)`` of
  log2(e)-scaled logits, while the contract's lse is natural-log); a ``segment_ids`` expression
  that is not a plain name/attribute (it would be evaluated twice); a scale computed with array
  ops; splats; unknown arguments; a call without ``segment_ids`` (it is a required argument).

Example::

    out = attention.mha(q, k, v, None, causal=True, sm_scale=0.125)
    # becomes
    out = flashport.attention(q, k, v, scale=0.125, causal=True, align="top_left", layout="BSHD")
"""

from __future__ import annotations

import libcst as cst

from flashport.rules.base import Refuse, Rewrite, Rule, register
from flashport.rules.common.binding import Signature
from flashport.rules.common.calls import build_call, string
from flashport.rules.common.literals import is_none
from flashport.rules.jax import shared as common

MODULES = ("jax.experimental.pallas.ops.gpu.attention", "jax.experimental.pallas.ops.attention")
TUNING = (
    "block_sizes",
    "block_q",
    "block_k",
    "backward_pass_impl",
    "num_warps",
    "num_stages",
    "grid",
    "interpret",
    "debug",
)


def mha_signature(version: tuple[int, ...]) -> Signature:
    """Pallas GPU ``mha``'s signature at jax ``version`` (every parameter positional-or-keyword)."""
    blocks = ("block_q", "block_k") if version < (0, 5, 3) else ("block_sizes",)
    names = (
        ("q", "k", "v", "segment_ids", "sm_scale", "causal")
        + blocks
        + ("backward_pass_impl", "num_warps", "num_stages", "grid", "interpret", "debug")
    )
    if version >= (0, 6, 2):
        names += ("return_residuals",)
    return Signature(names)


@register
class PallasGpuMha(Rule):
    """Rewrite the Pallas GPU flash-attention kernel ``mha`` to ``flashport.attention``."""

    CODE = "FPA203"
    NAME = "pallas-gpu-mha"
    SOURCES = tuple(f"{module}.mha" for module in MODULES)
    GPU_MODULES = MODULES
    TARGET = "flashport.attention"

    def check_call(self, call, ctx):
        """Map ``mha`` to the contract: explicit ``scale`` (default 1.0), top-left causal, shared segment ids."""
        bound = mha_signature(ctx.options.jax_version).bind(call, "pallas mha")
        value = {name: arg.value for name, arg in bound.items()}
        q, k, v, segment_ids = common.require(value, ("q", "k", "v", "segment_ids"), "pallas mha")
        if not common.literal_false(value.get("return_residuals")):
            raise Refuse(
                "return_residuals: Pallas mha's residual is a base-2 log-sum-exp; the contract's lse is natural-log"
            )
        keywords: list = [
            ("scale", common.static_scale(value.get("sm_scale"), cst.Float("1.0"), ctx, "sm_scale")),
            ("causal", value.get("causal", cst.Name("False"))),
        ]
        if not is_none(segment_ids):
            if not common.simple(segment_ids):
                raise Refuse(
                    "segment_ids is an expression that would be evaluated twice (q and kv ids); bind it to a name first"
                )
            keywords += [("q_segment_ids", segment_ids), ("kv_segment_ids", segment_ids)]
        keywords += [("align", string("top_left")), ("layout", string("BSHD"))]
        dropped = [name for name in TUNING if name in value]
        notes = (f"dropped Pallas GPU tuning arguments: {', '.join(dropped)}",) if dropped else ()
        return Rewrite(build_call(self.TARGET, [q, k, v], keywords, call), notes=notes)
