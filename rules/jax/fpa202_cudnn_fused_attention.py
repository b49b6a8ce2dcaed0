"""FPA202 cudnn-fused-attention: ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`` -> ``flashport.attention``.

What it rewrites:
  JAX's private cuDNN entry point (used by MaxText), ``dot_product_attention(query, key, value,
  bias=None, mask=None, q_seqlen=None, kv_seqlen=None, q_offsets=None, kv_offsets=None,
  fp8_params=None, *, scale=1.0, mask_type=MaskType.NO_MASK, seed=42, dropout_rate=0.0,
  qkv_layout="BTNH", sliding_window_length=None, use_fp8=False, return_residual=False)``, with
  ``mask_type`` ``NO_MASK`` or ``CAUSAL``.

Semantics mapping:
  ``scale`` **defaults to 1.0** (not 1/sqrt(H); MaxText pre-scales the query) -> ``scale=1.0``
  written out; ``qkv_layout`` ``"BTNH"``/``"BSNH"`` -> ``layout="BSHD"``, ``"BNTH"``/``"BNSH"`` ->
  ``layout="BHSD"`` (the output keeps the query's layout in both); ``MaskType.CAUSAL`` ->
  ``causal=True, align="top_left"`` (jax.nn routes its top-left ``is_causal`` to this mask type);
  ``sliding_window_length=L`` (keys in ``(pos - L, pos]``) -> ``window=(L - 1, 0)``; ``bias``
  (additive, ``BNTS``) -> ``bias``; ``mask`` (bool, True = attend, turned into a large negative bias)
  -> ``mask``; GQA (fewer kv heads, contiguous groups) is the same. ``seed`` only matters with
  dropout and is dropped. Arguments are bound against ``jax-version`` (``sliding_window_length``
  0.4.33, ``fp8_params``/``use_fp8`` 0.4.38, ``q_offsets``/``kv_offsets`` 0.5.3,
  ``return_residual`` 0.6.0).

Drop-in:
  what the explicit call cannot state -- ``q_seqlen``/``kv_seqlen`` with a PADDING mask type,
  ``return_residual`` (lse in the layout's ``BTN``/``BNT`` order), ``dropout_rate`` with cuDNN's
  integer ``seed``, non-literal ``mask_type``/``qkv_layout``/``sliding_window_length``/``scale``,
  ``*args``/``**kwargs`` splats -- keeps its arguments and calls
  ``flashport.integrations.jax_cudnn_compat.dot_product_attention`` (the same signature and meaning,
  on ``flashport.attention``; its docstring). ``MaskType`` and its members become that module's enum
  of the same names and values, so the file no longer imports ``jax._src.cudnn``.

What it refuses:
  FP8 (``use_fp8``/``fp8_params``), packed segments (``q_offsets``/``kv_offsets``) and
  ``MaskType.ALIBI`` (the drop-in has none of them either); unknown arguments.

Known problems:
  cuDNN's causal alignment for Sq != Sk is presumed top-left (the cuDNN frontend's default; not
  verified in JAX). A fully masked row gives the mean of ``value`` in cuDNN (finite fill) and 0 in
  the contract.

Example::

    out = dot_product_attention(q, k, v, scale=1.0, mask_type=MaskType.CAUSAL, qkv_layout="BTNH")
    # becomes
    out = flashport.attention(q, k, v, scale=1.0, causal=True, align="top_left", layout="BSHD")
"""

from __future__ import annotations

import libcst as cst

from flashport.rules.base import Refuse, Rewrite, Rule, register
from flashport.rules.common.binding import Signature, no_dropout
from flashport.rules.common.calls import build_call, dotted, number, on_drop_in, string, tuple_of
from flashport.rules.common.literals import is_none, literal_number, literal_string
from flashport.rules.jax import shared as common

MASK_TYPES = ("NO_MASK", "PADDING", "CAUSAL", "PADDING_CAUSAL", "ALIBI")
LAYOUTS = {"BTNH": "BSHD", "BSNH": "BSHD", "BNTH": "BHSD", "BNSH": "BHSD"}


def cudnn_signature(version: tuple[int, ...]) -> Signature:
    """The cuDNN ``dot_product_attention`` signature at jax ``version``.

    Before 0.5.3 only the first seven parameters are accepted positionally (where ``fp8_params``
    sat in between was not verified, so later positionals are refused).
    """
    positional: tuple[str, ...] = ("query", "key", "value", "bias", "mask", "q_seqlen", "kv_seqlen")
    keyword_only: tuple[str, ...] = ("scale", "mask_type", "seed", "dropout_rate", "qkv_layout")
    if version >= (0, 5, 3):
        positional += ("q_offsets", "kv_offsets", "fp8_params")
    elif version >= (0, 4, 38):
        keyword_only += ("fp8_params",)
    if version >= (0, 4, 33):
        keyword_only += ("sliding_window_length",)
    if version >= (0, 4, 38):
        keyword_only += ("use_fp8",)
    if version >= (0, 6, 0):
        keyword_only += ("return_residual",)
    return Signature(positional, keyword_only)


PRIVATE = "jax._src.cudnn.fused_attention_stablehlo"
DROP_IN = "flashport.integrations.jax_cudnn_compat"
# refusals the drop-in cannot lift either (it raises NotImplementedError for them)
_NO_DROP_IN = ("FP8", "ALIBI", "q_offsets", "kv_offsets")

SEED_ONLY = (
    "cuDNN draws its dropout from the integer seed= (default 42) and flashport.attention needs a "
    "PRNG key (dropout_rng=) that this call does not have; port by hand with dropout_rate=/dropout_rng="
)


@register
class CudnnFusedAttention(Rule):
    """Rewrite JAX's private cuDNN ``dot_product_attention`` to ``flashport.attention``."""

    CODE = "FPA202"
    NAME = "cudnn-fused-attention"
    SOURCES = (
        "jax._src.cudnn.fused_attention_stablehlo.dot_product_attention",
        f"{PRIVATE}.MaskType",
        *(f"{PRIVATE}.MaskType.{member}" for member in MASK_TYPES),
    )
    TRIGGERS = (b"dot_product_attention", b"fused_attention_stablehlo")  # the module binds MaskType too
    GPU_MODULES = ("jax._src.cudnn",)
    TARGET = "flashport.attention"

    def check_call(self, call, ctx):
        """Map a NO_MASK/CAUSAL cuDNN call to the contract with scale, layout and align explicit;
        the rest (padding lengths, the lse residual, dropout from seed=, non-literal options,
        splats) keeps its arguments and calls the drop-in of the same signature."""
        if ctx.qualified_name != self.API:
            raise Refuse(f"{ctx.qualified_name.rsplit('.', 1)[-1]}(...) is not an attention call; kept")
        try:
            return self._explicit(call, ctx)
        except Refuse as refusal:
            if any(word in refusal.reason for word in _NO_DROP_IN):
                raise
            note = (
                f"drop-in {DROP_IN}.dot_product_attention (the cuDNN signature and meaning on "
                f"flashport.attention); the contract call could not state it: {refusal.reason.split(';')[0]}"
            )
            return on_drop_in(call, f"{DROP_IN}.dot_product_attention", note)

    def check_reference(self, node, ctx):
        """``MaskType`` and its members: the drop-in module's enum of the same names and values."""
        if ctx.qualified_name.startswith(f"{PRIVATE}.MaskType"):
            target = DROP_IN + ctx.qualified_name[len(PRIVATE) :]
            return Rewrite(
                dotted(target),
                imports=(DROP_IN,),
                notes=("jax's cuDNN MaskType -> the drop-in's enum (same names and values)",),
            )
        return super().check_reference(node, ctx)

    def _explicit(self, call, ctx):
        """The explicit mapping to ``flashport.attention``.

        Raises:
          Refuse: for what the contract call cannot state (the drop-in then takes the call).
        """
        bound = cudnn_signature(ctx.options.jax_version).bind(call, "cudnn dot_product_attention")
        value = {name: arg.value for name, arg in bound.items()}
        query, key, val = common.require(value, ("query", "key", "value"), "cudnn dot_product_attention")
        for name in ("q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets"):
            if not is_none(value.get(name)):
                raise Refuse(f"{name}: cuDNN padding/packed-segment lengths are not mapped to the contract")
        if not is_none(value.get("fp8_params")) or not common.literal_false(value.get("use_fp8")):
            raise Refuse("FP8 attention (use_fp8/fp8_params) has no portable equivalent")
        if not common.literal_false(value.get("return_residual")):
            raise Refuse("return_residual: cuDNN's logsumexp layout follows qkv_layout; not mapped")
        notes = no_dropout(value.get("dropout_rate"), "dropout_rate", ctx, SEED_ONLY)
        if "seed" in value:
            notes.append("dropped seed= (only used by dropout)")
        causal = self._causal(value.get("mask_type"), ctx)
        layout = self._layout(value.get("qkv_layout"))
        keywords: list = [
            ("scale", common.static_scale(value.get("scale"), cst.Float("1.0"), ctx, "scale")),
            ("causal", cst.Name("True" if causal else "False")),
        ]
        window = value.get("sliding_window_length")
        if not is_none(window):
            length = literal_number(window)
            if not isinstance(length, int) or length <= 0:
                raise Refuse(f"sliding_window_length={ctx.code(window)} is not a positive int literal")
            keywords.append(("window", tuple_of(number(length - 1), number(0))))
        for name in ("bias", "mask"):
            if not is_none(value.get(name)):
                keywords.append((name, value[name]))
        keywords += [("align", string("top_left")), ("layout", string(layout))]
        return Rewrite(build_call(self.TARGET, [query, key, val], keywords, call), notes=tuple(notes))

    @staticmethod
    def _causal(node, ctx) -> bool:
        if node is None:
            return False
        member = common.enum_member(node, "MaskType", MASK_TYPES)
        if member is None:
            raise Refuse(f"mask_type={ctx.code(node)} is not a literal MaskType member")
        if member in ("NO_MASK", "CAUSAL"):
            return member == "CAUSAL"
        if member == "ALIBI":
            raise Refuse("mask_type=MaskType.ALIBI has no portable equivalent")
        raise Refuse(
            f"mask_type=MaskType.{member}: padding masks (q_seqlen/kv_seqlen) are not mapped to the contract"
        )

    @staticmethod
    def _layout(node) -> str:
        if node is None:
            return "BSHD"
        literal = literal_string(node)
        if literal not in LAYOUTS:
            raise Refuse("qkv_layout is not one of the literals 'BTNH', 'BSNH', 'BNTH', 'BNSH'")
        return LAYOUTS[literal]
