"""FPA209 te-jax-fused-attn: TransformerEngine-JAX ``fused_attn`` -> flashport's drop-in (TE 2.0's form).

What it rewrites:
  calls of ``transformer_engine.jax.attention.fused_attn(qkv, bias, mask, seed, attn_bias_type,
  attn_mask_type, qkv_layout, scaling_factor, dropout_probability, is_training, ...)`` that pass
  ``mask=`` by keyword: that keyword exists up to TransformerEngine 2.0 (2.1 renamed the parameter
  ``sequence_descriptor``), so the call binds to 2.0's signature. The call keeps its arguments and
  calls ``flashport.integrations.transformer_engine_compat.fused_attn`` (TE 2.0's signature and
  meaning, on ``flashport.attention``; mask types, layouts and dropout known only at run time are
  read there, as in levanter). ``AttnBiasType``/``AttnMaskType``/``QKVLayout``/``CPStrategy`` and
  their members become that module's enums (TE's own where TE is installed), so the file no longer
  imports TransformerEngine for them.

Semantics mapping:
  ``scaling_factor`` (required; no default) -> ``scale``; ``AttnMaskType.CAUSAL_MASK`` ->
  ``causal=True, align="top_left"``; ``*_BOTTOM_RIGHT_MASK`` -> ``align="bottom_right"``;
  ``NO_MASK`` -> ``causal=False``; the padding types read ``mask`` (**True = masked out**; ignored
  otherwise); ``QKVLayout.BSHD_BSHD_BSHD`` -> ``layout="BSHD"`` (``BS3HD``/``BSHD_BS2HD`` unpacked);
  ``window_size=(l, r)`` -> ``window``; ``dropout_probability`` (when ``is_training``) ->
  ``dropout_rate`` with ``dropout_rng`` the PRNG key passed as ``seed`` (TE checks it is the uint32
  data of a key and seeds cuDNN's dropout generator with its first two words: the port draws a
  different random mask, at the same rate).

What it refuses:
  (reported with the manual mapping) calls that do not pass ``mask=`` by keyword (the release they
  bind to is unknown: 2.1 and later take a ``SequenceDescriptor`` third, and added parameters),
  splats, unknown arguments, literal THD layouts, the older
  ``transformer_engine.jax.fused_attn.fused_attn``. The reason names what an
  explicit call could not state: a mask type that is not a literal ``AttnMaskType`` member, and the
  dropout mapping when ``dropout_probability`` may be non-zero.

Example::

    out = fused_attn(qkv=(q, k, v), bias=None, mask=m, seed=key, attn_bias_type=AttnBiasType.NO_BIAS,
                     attn_mask_type=mask_type, qkv_layout=QKVLayout.BSHD_BSHD_BSHD,
                     scaling_factor=0.125, dropout_probability=p, is_training=training)
    # becomes
    out = flashport.integrations.transformer_engine_compat.fused_attn(qkv=(q, k, v), bias=None, mask=m,
                     seed=key, attn_bias_type=flashport.integrations.transformer_engine_compat.AttnBiasType.NO_BIAS,
                     attn_mask_type=mask_type, ...)
"""

from __future__ import annotations

import libcst as cst

from flashport.rules.apis import jax as jax_apis
from flashport.rules.base import Refuse, Report, Rewrite, Rule, register
from flashport.rules.common.binding import Signature
from flashport.rules.common.calls import dotted
from flashport.rules.common.literals import is_none, is_zero, literal_bool, literal_number
from flashport.rules.jax import shared as common

MASKS = {
    "NO_MASK": "causal=False",
    "PADDING_MASK": "segment ids",
    "CAUSAL_MASK": "causal=True, align='top_left'",
    "PADDING_CAUSAL_MASK": "causal=True, align='top_left' plus segment ids",
    "CAUSAL_BOTTOM_RIGHT_MASK": "causal=True, align='bottom_right'",
    "PADDING_CAUSAL_BOTTOM_RIGHT_MASK": "causal=True, align='bottom_right' plus segment ids",
}


API = "transformer_engine.jax.attention.fused_attn"
DROP_IN = jax_apis.TE_COMPAT
SIGNATURE = Signature.of(jax_apis.TE_FUSED_ATTN)
ENUMS = {  # TE's enums with the members the drop-in module's fallback enums have
    "AttnBiasType": jax_apis.TE_BIAS_TYPES,
    "AttnMaskType": tuple(MASKS),
    "QKVLayout": (*jax_apis.TE_LAYOUTS, *jax_apis.TE_THD_LAYOUTS),
    "CPStrategy": ("DEFAULT", "ALL_GATHER", "RING"),
}
THD = jax_apis.TE_THD_LAYOUTS


@register
class TransformerEngineFusedAttn(Rule):
    """Report TransformerEngine-JAX ``fused_attn`` calls with why they are not rewritten."""

    CODE = "FPA209"
    NAME = "te-jax-fused-attn"
    SOURCES = (
        API,
        "transformer_engine.jax.fused_attn.fused_attn",
        *(f"transformer_engine.jax.attention.{enum}" for enum in ENUMS),
        *(f"transformer_engine.jax.attention.{enum}.{m}" for enum, members in ENUMS.items() for m in members),
    )
    TRIGGERS = (b"fused_attn", *(enum.encode() for enum in ENUMS))
    GPU_MODULES = ("transformer_engine",)
    TARGET = DROP_IN + ".fused_attn"

    def check_call(self, call, ctx):
        """The same call on the drop-in when ``mask=`` binds it to TE 2.0; else a report with what
        blocks a rewrite here and the manual mapping."""
        if ctx.qualified_name == API:
            try:
                return self._drop_in(call, ctx)
            except Refuse as refusal:
                blocker = refusal.reason
        else:
            blocker = "the pre-2.0 module transformer_engine.jax.fused_attn has no drop-in"
        return self._report(call, ctx, blocker)

    def check_reference(self, node, ctx):
        """TE's enums and their members: the drop-in module's (TE's own where TE is installed)."""
        prefix = "transformer_engine.jax.attention."
        if ctx.qualified_name.startswith(prefix) and ctx.qualified_name[len(prefix) :].split(".")[0] in ENUMS:
            target = DROP_IN + "." + ctx.qualified_name[len(prefix) :]
            note = (
                f"TE's {ctx.qualified_name[len(prefix) :]} -> {target} (TE's own enum where TE is installed)"
            )
            # an argument of a TE call moves with it: a refused call stays byte for byte as it was
            calls = []
            call = ctx.enclosing(node, cst.Call)
            while call is not None:
                if ctx.qualified_names(call.func) & {API, self.SOURCES[1]}:
                    calls.append(call)
                call = ctx.enclosing(call, cst.Call)
            if calls:
                otherwise = "an argument of a TransformerEngine fused_attn call that is not rewritten"
                return Rewrite(
                    dotted(target),
                    imports=(DROP_IN,),
                    notes=(note,),
                    requires=tuple(calls),
                    otherwise=otherwise,
                )
            return Rewrite(dotted(target), imports=(DROP_IN,), notes=(note,))
        return super().check_reference(node, ctx)

    def _drop_in(self, call, ctx) -> Rewrite:
        """``call`` on the drop-in.

        Raises:
          Refuse: when the call does not bind to TE 2.0 by a ``mask=`` keyword, or asks for THD.
        """
        bound = SIGNATURE.bind(call, "TE 2.0 fused_attn")
        if "mask" not in bound or bound["mask"].keyword is None:
            raise Refuse("mask= is not passed by keyword, so the release the call binds to is unknown")
        layout = common.enum_member(
            bound["qkv_layout"].value if "qkv_layout" in bound else None, "QKVLayout", THD
        )
        if layout:
            raise Refuse(f"QKVLayout.{layout} (THD sequence packing) has no drop-in")
        notes = [f"drop-in {DROP_IN}.fused_attn (TE 2.0's signature and meaning on flashport.attention)"]
        mask = common.enum_member(
            bound["attn_mask_type"].value if "attn_mask_type" in bound else None, "AttnMaskType", tuple(MASKS)
        )
        if mask:
            notes.append(f"AttnMaskType.{mask} -> {MASKS[mask]}")
        dropout = bound.get("dropout_probability")
        if dropout is not None and not is_zero(dropout.value):
            notes.append(
                f"dropout_probability={ctx.code(dropout.value)} (when is_training) with a key from seed=: a "
                "different random mask than cuDNN's, at the same rate"
            )
        return Rewrite(
            call.with_changes(func=dotted(f"{DROP_IN}.fused_attn")), imports=(DROP_IN,), notes=tuple(notes)
        )

    def _report(self, call, ctx, blocker: str) -> Report:
        """The refusal: ``blocker``, what an explicit call could not state, and the manual mapping."""
        value = {arg.keyword.value: arg.value for arg in call.args if arg.keyword is not None}
        positional = [arg.value for arg in call.args if arg.keyword is None and not arg.star]

        def argument(name: str, index: int):
            return value.get(name, positional[index] if len(positional) > index else None)

        found = [
            common.enum_member(node, "AttnMaskType", tuple(MASKS))
            for node in list(value.values()) + positional
        ]
        mask = next((m for m in found if m), None)
        parts = [f"TE fused_attn not rewritten: {blocker} (its parameters changed between releases)"]
        mask_type = argument("attn_mask_type", 5)
        if mask:
            parts.append(f"AttnMaskType.{mask} -> {MASKS[mask]}")
        elif mask_type is not None and not is_none(mask_type) and not isinstance(mask_type, cst.Attribute):
            parts.append(
                f"attn_mask_type={ctx.code(mask_type)} is not a literal AttnMaskType member (decided at run "
                "time), so no explicit flashport.attention call states it"
            )
        else:
            parts.append("mask type not a literal AttnMaskType member")
        dropout, training = argument("dropout_probability", 8), argument("is_training", 9)
        if dropout is not None and not is_zero(dropout) and literal_bool(training) is not False:
            seed = argument("seed", 3)
            gate = f" if {ctx.code(training)} else 0.0" if literal_bool(training) is None else ""
            key = ctx.code(seed) if seed is not None else "<key>"
            verb = "is" if literal_number(dropout) is not None else "may be"
            parts.append(
                f"dropout_probability={ctx.code(dropout)} {verb} non-zero: port with "
                f"dropout_rate={ctx.code(dropout)}{gate}, dropout_rng={key} (seed= is a PRNG key's uint32 "
                "data seeding cuDNN's dropout; the mask drawn differs, the rate does not)"
            )
        parts.append("port by hand: flashport.attention(q, k, v, scale=scaling_factor, ...)")
        return Report("; ".join(parts))
