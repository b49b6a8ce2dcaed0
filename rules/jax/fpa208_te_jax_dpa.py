"""FPA208 te-jax-dpa: TransformerEngine-JAX ``DotProductAttention`` -> flashport's Flax drop-in.

What it rewrites:
  constructions of ``transformer_engine.jax.flax.DotProductAttention`` (also
  ``...flax.transformer.DotProductAttention``), a ``flax.linen`` module configured when it is built
  and given its tensors when called, often in another function or wrapped (a
  ``functools.partial`` of its ``apply``, nnx's ``ToNNX``). The construction keeps its arguments and builds
  ``flashport.integrations.transformer_engine_flax.DotProductAttention`` instead: the same fields
  (TransformerEngine 2.18), the same ``__call__(query, key, value, sequence_descriptor=None,
  bias=None, *, deterministic=False, mask=None)`` and the same meaning, on ``flashport.attention``.
  Its call sites stay as written. ``transformer_engine.jax.attention.SequenceDescriptor`` (the class
and its ``from_seqlens`` / ``from_segment_ids_and_pos`` / ``from_seqlens_and_offsets`` factories)
becomes the drop-in module's ``SequenceDescriptor`` (TE 2.18's signatures), which the drop-in module
reads with TE's meaning, so the file no longer imports TransformerEngine for it.

Semantics mapping:
  ``attn_mask_type`` **defaults to 'causal'** (top-left) -> ``causal=True, align="top_left"``;
  ``'causal_bottom_right'`` -> ``align="bottom_right"``; ``'no_mask'`` -> ``causal=False``; the
  padding types add the ``mask`` given to ``__call__``, which is **True/non-zero = masked out** (the
  contract's ``mask`` is its negation). ``scale_factor=None`` = 1/sqrt(head_dim) -> ``scale``;
  ``window_size=(l, r)`` (inclusive, negative = unbounded) -> ``window``; layouts ``bshd_bshd_bshd``,
  ``bs3hd``, ``bshd_bs2hd`` (unpacked), ``transpose_batch_sequence`` (``sbhd``); ``num_gqa_groups``
  -> fewer kv heads; ``attn_bias_type`` post/pre-scale -> ``bias`` (pre-scale multiplied by the
  scale); ``attention_dropout`` (when not ``deterministic``) -> ``dropout_rate`` with a key from
  ``self.make_rng(dropout_rng_name)``. A descriptor from segment ids and positions (THD packing,
  MaxText's packed batches) masks by equal non-zero segment ids, causal and window by segment
  position (TE's definition in its fused-attention tests). Values known only at run time (MaxText's mask type, layout and
  window variables) are checked there: the drop-in raises ``NotImplementedError`` naming the
  argument for what it cannot run with TE's meaning.

What it refuses:
  a construction that does not state ``transpose_batch_sequence`` (TE defaulted it to True before
  2.10 and to False since, so its meaning depends on the installed release); ``**kwargs``/``*args``
  splats; literal THD (packed-sequence) layouts, ``softmax_type`` other than ``'vanilla'``,
  ``score_mod``/``score_mod_bprop``, unknown mask types, layouts or bias types, and unknown
  arguments (the drop-in has none of them either). The Praxis wrappers
  (``transformer_engine.jax.praxis``) are reported with the mapping a manual port needs. The class
  used as a value (a base class, ``functools.partial``) is reported: its constructions are out of
  sight. ``SequenceDescriptor`` is rewritten only where every TransformerEngine attention site of the
  file is: a descriptor built by the drop-in is no TE object, and TE's ``fused_attn`` or a refused
  construction would reject it (every rewrite of this rule in the file is then refused).

Example::

    attn = DotProductAttention(head_dim=64, num_attention_heads=8, attn_mask_type="no_mask",
                               transpose_batch_sequence=False)
    # becomes
    attn = flashport.integrations.transformer_engine_flax.DotProductAttention(head_dim=64,
                               num_attention_heads=8, attn_mask_type="no_mask", transpose_batch_sequence=False)
"""

from __future__ import annotations

import libcst as cst

from flashport.rules.apis import jax as jax_apis
from flashport.rules.base import Refuse, Report, Rewrite, Rule, register
from flashport.rules.common.binding import Signature
from flashport.rules.common.calls import dotted
from flashport.rules.common.literals import is_none, is_zero, literal_string

FLAX_MODULES = ("transformer_engine.jax.flax", "transformer_engine.jax.flax.transformer")
PRAXIS_MODULES = ("transformer_engine.jax.praxis", "transformer_engine.jax.praxis.transformer")
DESCRIPTOR = "transformer_engine.jax.attention.SequenceDescriptor"
DESCRIPTOR_FACTORIES = ("from_seqlens", "from_seqlens_and_offsets", "from_segment_ids_and_pos")
DROP_IN = jax_apis.TE_FLAX
DESCRIPTOR_DROP_IN = jax_apis.TE_COMPAT
SIGNATURE = Signature.of(jax_apis.TE_DOT_PRODUCT_ATTENTION)
MASK_MAPPING = {
    "no_mask": "causal=False",
    "causal": "causal=True, align='top_left'",
    "causal_bottom_right": "causal=True, align='bottom_right'",
    "bottom_right_causal": "causal=True, align='bottom_right'",
    "padding": "the mask (True = masked out)",
    "padding_causal": "causal=True, align='top_left' plus the mask (True = masked out)",
    "causal_padding": "causal=True, align='top_left' plus the mask (True = masked out)",
    "padding_causal_bottom_right": "causal=True, align='bottom_right' plus the mask (True = masked out)",
    "causal_padding_bottom_right": "causal=True, align='bottom_right' plus the mask (True = masked out)",
    "bottom_right_causal_padding": "causal=True, align='bottom_right' plus the mask (True = masked out)",
    "bottom_right_padding_causal": "causal=True, align='bottom_right' plus the mask (True = masked out)",
}
LAYOUTS, THD_LAYOUTS, BIAS_TYPES = jax_apis.TE_LAYOUTS, jax_apis.TE_THD_LAYOUTS, jax_apis.TE_BIAS_TYPES


def mask_type_note(node, default: str, ctx) -> str:
    """How a TE ``attn_mask_type`` value maps to the contract (one clause)."""
    if node is None:
        return f"attn_mask_type={default!r} (default) -> {MASK_MAPPING[default]}"
    literal = literal_string(node)
    if literal is not None and literal in MASK_MAPPING:
        return f"attn_mask_type={literal!r} -> {MASK_MAPPING[literal]}"
    return f"attn_mask_type={ctx.code(node)} (not a literal: checked by the drop-in when called)"


@register
class TransformerEngineDotProductAttention(Rule):
    """Build flashport's Flax drop-in where TransformerEngine-JAX's ``DotProductAttention`` is built."""

    CODE = "FPA208"
    NAME = "te-jax-dpa"
    SOURCES = (
        *(f"{module}.DotProductAttention" for module in FLAX_MODULES + PRAXIS_MODULES),
        DESCRIPTOR,
        *(f"{DESCRIPTOR}.{factory}" for factory in DESCRIPTOR_FACTORIES),
    )
    TRIGGERS = (b"DotProductAttention", b"SequenceDescriptor")
    GPU_MODULES = ("transformer_engine",)
    TARGET = DROP_IN + ".DotProductAttention"

    def check_call(self, call, ctx):
        """The same construction on the drop-in, when every literal argument is one it runs with
        TE's meaning and ``transpose_batch_sequence`` is stated; a ``SequenceDescriptor`` built by the
        drop-in module's class of the same signatures."""
        if ctx.qualified_name.startswith(DESCRIPTOR):
            return self._descriptor(call, ctx)
        if ctx.qualified_name.rsplit(".", 1)[0] in PRAXIS_MODULES:
            return Report(
                "TransformerEngine's Praxis DotProductAttention layer has no drop-in; port by hand to "
                "flashport.attention (its mask is True = masked out)"
            )
        bound = SIGNATURE.bind(call, "TransformerEngine DotProductAttention")
        value = {name: arg.value for name, arg in bound.items()}
        if "transpose_batch_sequence" not in value:
            raise Refuse(
                "transpose_batch_sequence is not stated: TransformerEngine defaults it to True (inputs "
                "[s, b, h, d]) before 2.10 and to False ([b, s, h, d]) since, so the meaning depends on the "
                "installed release; state it"
            )
        self._check_literals(value)
        notes = [
            f"drop-in {DROP_IN}.DotProductAttention (TE's fields, call and meaning on flashport.attention)",
            mask_type_note(value.get("attn_mask_type"), "causal", ctx),
        ]
        dropout = value.get("attention_dropout")
        if dropout is not None and not is_zero(dropout):
            notes.append(
                f"attention_dropout={ctx.code(dropout)}: dropout with a key from the "
                f"{ctx.code(value['dropout_rng_name']) if 'dropout_rng_name' in value else repr('dropout')} "
                "rng when not deterministic (a different random mask than cuDNN's)"
            )
        return Rewrite(
            call.with_changes(func=dotted(f"{DROP_IN}.DotProductAttention")),
            imports=(DROP_IN,),
            notes=tuple(notes),
        )

    def check_reference(self, node, ctx):
        """``SequenceDescriptor`` and its factories as values: the drop-in module's of the same name."""
        if ctx.qualified_name.startswith(DESCRIPTOR):
            return self._descriptor(node, ctx)
        return super().check_reference(node, ctx)

    @staticmethod
    def _descriptor(node, ctx) -> Rewrite:
        """``node`` (a ``SequenceDescriptor`` call or value) on the drop-in module's class."""
        target = f"{DESCRIPTOR_DROP_IN}.SequenceDescriptor" + ctx.qualified_name[len(DESCRIPTOR) :]
        note = f"TE's SequenceDescriptor -> {target} (TE 2.18's signature and meaning)"
        if isinstance(node, cst.Call):
            return Rewrite(
                node.with_changes(func=dotted(target)), imports=(DESCRIPTOR_DROP_IN,), notes=(note,)
            )
        return Rewrite(dotted(target), imports=(DESCRIPTOR_DROP_IN,), notes=(note,))

    def settle(self, sites, ctx):
        """Keep the drop-in's ``SequenceDescriptor`` only where no TransformerEngine attention site of
        the file stays TE's (it would be handed a descriptor that is no TE object)."""
        if not any(s.rule == self.CODE and s.api.startswith(DESCRIPTOR) for s in sites):
            return None
        for site in sites:
            if site.api.startswith("transformer_engine.") and site.status != "rewrite":
                return (
                    f"{site.api.rsplit('.', 1)[-1]} on line {site.line} stays TransformerEngine's; the "
                    "SequenceDescriptor objects of this file must stay TE's too"
                )
        return None

    @staticmethod
    def _check_literals(value) -> None:
        """Refuse literal settings the drop-in raises for (non-literals are checked when called)."""
        mask_type = literal_string(value.get("attn_mask_type"))
        if mask_type is not None and mask_type not in MASK_MAPPING:
            raise Refuse(f"attn_mask_type={mask_type!r} is not one of TransformerEngine's mask types")
        layout = literal_string(value.get("qkv_layout"))
        if layout is not None and layout.upper() in THD_LAYOUTS:
            raise Refuse(
                f"qkv_layout={layout!r}: THD sequence packing (segment ids and positions in a "
                "SequenceDescriptor) has no drop-in"
            )
        if layout is not None and layout.upper() not in LAYOUTS:
            raise Refuse(f"qkv_layout={layout!r} is not one of TransformerEngine's layouts")
        bias = value.get("attn_bias_type")
        bias_type = literal_string(bias)
        if not is_none(bias) and bias_type is not None and bias_type.upper() not in BIAS_TYPES:
            raise Refuse(f"attn_bias_type={bias_type!r} is not one of TransformerEngine's bias types")
        softmax = literal_string(value.get("softmax_type"))
        if softmax is not None and softmax != "vanilla":
            raise Refuse(
                f"softmax_type={softmax!r} (attention sinks) has no counterpart in flashport.attention"
            )
        for name in ("score_mod", "score_mod_bprop"):
            if not is_none(value.get(name)):
                raise Refuse(f"{name}= (a cuDNN frontend score callback) has no drop-in")
        transpose = value["transpose_batch_sequence"]
        if is_none(transpose):
            raise Refuse(
                "transpose_batch_sequence=None: TransformerEngine reads it as False only since 2.10 "
                "(True before); state True or False"
            )
