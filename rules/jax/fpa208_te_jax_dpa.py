"""FPA208 te-jax-dpa: TransformerEngine-JAX ``DotProductAttention`` (scan + refusal with the mapping).

What it rewrites:
  nothing: ``transformer_engine.jax.flax.DotProductAttention`` (also ``...flax.transformer`` and the
  ``transformer_engine.jax.praxis`` wrappers) is a Flax module. Its configuration is given when
  the module is constructed and its tensors when the instance is called, often in another
  function, so no single call site can be rewritten. Each construction is reported with the
  ``flashport.attention`` keywords a manual port needs.

Semantics mapping (for the manual port):
  ``attn_mask_type`` **defaults to 'causal'** (top-left) -> ``causal=True, align="top_left"``;
  ``'causal_bottom_right'`` -> ``align="bottom_right"``; ``'no_mask'`` -> ``causal=False``;
  ``padding*`` types -> segment ids. The ``mask`` passed to ``__call__`` is **True = masked out**
  (the opposite of the contract's ``mask``: pass ``mask=~mask``). ``scale_factor=None`` =
  1/sqrt(head_dim) -> ``scale``; ``window_size=(l, r)`` (inclusive, negative = unbounded) ->
  ``window``; layout ``bshd`` -> ``layout="BSHD"`` (``sbhd`` with ``transpose_batch_sequence``;
  packed ``bs3hd``/``bshd_bs2hd``/``thd_*`` layouts need unpacking); ``num_gqa_groups`` -> fewer kv
  heads.

What it refuses:
  every construction, with a reason naming its mask type and the blocking features
  (``attention_dropout``, packed layouts, ALiBi/bias types). Dropout maps to the contract's
  ``dropout_rate=attention_dropout, dropout_rng=self.make_rng("dropout")`` (``deterministic`` at
  call time -> ``dropout_rate=0.0``), which the manual port writes where the tensors are.

Example::

    attn = DotProductAttention(head_dim=64, num_attention_heads=8)
    # reported: "... attn_mask_type='causal' (default, top-left) -> causal=True, align='top_left' ..."
"""

from __future__ import annotations

from flashport.rules.base import Report, Rule, register
from flashport.rules.common.literals import is_none, is_zero, literal_string
from flashport.rules.jax import shared as common

MODULES = (
    "transformer_engine.jax.flax",
    "transformer_engine.jax.flax.transformer",
    "transformer_engine.jax.praxis",
    "transformer_engine.jax.praxis.transformer",
)
MASK_MAPPING = {
    "no_mask": "causal=False",
    "causal": "causal=True, align='top_left'",
    "causal_bottom_right": "causal=True, align='bottom_right'",
    "padding": "segment ids for padding",
    "padding_causal": "causal=True, align='top_left' plus segment ids",
    "causal_padding": "causal=True, align='top_left' plus segment ids",
    "padding_causal_bottom_right": "causal=True, align='bottom_right' plus segment ids",
}


def mask_type_note(node, default: str, ctx) -> str:
    """How a TE ``attn_mask_type`` value maps to the contract (one clause)."""
    if node is None:
        return f"attn_mask_type={default!r} (default) -> {MASK_MAPPING[default]}"
    literal = literal_string(node)
    if literal is not None and literal.lower() in MASK_MAPPING:
        return f"attn_mask_type={literal!r} -> {MASK_MAPPING[literal.lower()]}"
    return f"attn_mask_type={ctx.code(node)} (not a literal)"


@register
class TransformerEngineDotProductAttention(Rule):
    """Report TransformerEngine-JAX ``DotProductAttention`` modules with the mapping a manual port needs."""

    CODE = "FPA208"
    NAME = "te-jax-dpa"
    SOURCES = tuple(f"{module}.DotProductAttention" for module in MODULES)
    TARGET = "flashport.attention (manual)"
    REWRITES = False

    def check_call(self, call, ctx):
        """Report the construction; name the mask type mapping and what blocks a port."""
        if any(arg.star for arg in call.args):
            return Report(
                "TransformerEngine DotProductAttention (Flax module) built from a splat: configuration unknown; port by hand to flashport.attention (mask True = masked out)"
            )
        value = {arg.keyword.value: arg.value for arg in call.args if arg.keyword is not None}
        blockers = []
        dropout = value.get("attention_dropout")
        if dropout is not None and not is_zero(dropout):
            blockers.append(
                f"attention_dropout={ctx.code(dropout)} (drawn from the module's 'dropout' rng at call time: "
                "port with dropout_rate=, dropout_rng=self.make_rng('dropout'))"
            )
        layout = literal_string(value.get("qkv_layout"))
        if layout is not None and layout.lower() != "bshd_bshd_bshd":
            blockers.append(f"qkv_layout={layout!r} (packed: unpack q/k/v first)")
        bias = value.get("attn_bias_type")
        if not is_none(bias) and literal_string(bias) not in (None, "no_bias"):
            blockers.append(f"attn_bias_type={ctx.code(bias)}")
        transpose = value.get("transpose_batch_sequence")
        if transpose is not None and not common.literal_false(transpose):
            blockers.append("transpose_batch_sequence (sbhd layout)")
        parts = [
            "TransformerEngine DotProductAttention is a Flax module (config at construction, tensors at call): not rewritten",
            mask_type_note(value.get("attn_mask_type"), "causal", ctx),
            "its __call__ mask is True = masked out (pass mask=~mask)",
        ]
        if blockers:
            parts.append("also blocking: " + ", ".join(blockers))
        return Report("; ".join(parts))
