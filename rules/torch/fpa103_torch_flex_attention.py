"""FPA103 torch-flex-attention: torch's FlexAttention (``flex_attention``, ``create_block_mask``) -> ``flashport.torch``.

What it rewrites:
  ``torch.nn.attention.flex_attention.flex_attention(query, key, value, score_mod=None,
  block_mask=None, scale=None, enable_gqa=False, return_lse=False, kernel_options=None, *,
  return_aux=None)`` and ``create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cuda",
  BLOCK_SIZE=128, _compile=False)`` calls, however the module is imported, into
  ``flashport.torch.flex_attention`` / ``flashport.torch.create_block_mask`` with the arguments
  verbatim; the functions used as values (``attn = torch.compile(flex_attention)``, a dispatch
  table entry, a callback) become the same drop-ins, so ``torch.compile(flex_attention)`` wrappers
  keep working (flashport's function compiles torch's FlexAttention itself where that pays off).

Semantics mapping:
  the drop-ins have torch's signatures and run torch's own FlexAttention on CPU and CUDA tensors;
  on torch_xla / torchax tensors (TPU) they run ``flashport.attention`` with the ``score_mod`` and the
  block mask's ``mask_mod`` traced into JAX (arithmetic, comparisons, ``torch.where``, ``clamp``,
  casts, ``tanh``/``exp``/``abs``..., indexing closed-over tensors; ``docs/flex.md``), a mod using
  anything else is refused there at run time with the name of what it used. ``create_block_mask``
  builds on the CPU when the requested device has no FlexAttention (``device="cuda"`` on a TPU host).

What it refuses:
  calls with ``*args``/``**kwargs`` splats or arguments FlexAttention does not have (the drop-in
  would bind them differently); values that are inspected, compared or patched (see FPA101's
  value rules) are reported and kept.

Example::

    out = flex_attention(q, k, v, score_mod=alibi, block_mask=create_block_mask(causal, None, None, S, S))
    # becomes
    out = flashport.torch.flex_attention(q, k, v, score_mod=alibi, block_mask=flashport.torch.create_block_mask(causal, None, None, S, S))
"""

from __future__ import annotations

from flashport.rules.base import Refuse, Rule, register
from flashport.rules.common.binding import Signature
from flashport.rules.common.calls import on_drop_in

MODULE = "torch.nn.attention.flex_attention"
TARGET_MODULE = "flashport.torch"
SIGNATURES = {
    "flex_attention": Signature(
        (
            "query",
            "key",
            "value",
            "score_mod",
            "block_mask",
            "scale",
            "enable_gqa",
            "return_lse",
            "kernel_options",
        ),
        ("return_aux",),
    ),
    "create_block_mask": Signature(
        ("mask_mod", "B", "H", "Q_LEN", "KV_LEN", "device", "BLOCK_SIZE", "_compile")
    ),
}


@register
class TorchFlexAttention(Rule):
    """Point FlexAttention's ``flex_attention`` / ``create_block_mask`` at ``flashport.torch``'s drop-ins."""

    CODE = "FPA103"
    NAME = "torch-flex-attention"
    SOURCES = tuple(f"{MODULE}.{name}" for name in SIGNATURES)
    TRIGGERS = (b"flex_attention",)
    TARGET = "flashport.torch.flex_attention"

    def check_call(self, call, ctx):
        """Check the arguments against FlexAttention's signature; call the drop-in with them verbatim."""
        name = ctx.qualified_name.rsplit(".", 1)[-1]
        bound = SIGNATURES[name].bind(call, ctx.qualified_name)
        first = SIGNATURES[name].positional[0]
        if first not in bound:
            raise Refuse(f"{ctx.qualified_name} call without {first!r}")
        return on_drop_in(
            call,
            f"{TARGET_MODULE}.{name}",
            f"flashport.torch.{name}: torch's signature; torch's FlexAttention on CPU/CUDA, JAX on TPU",
        )
