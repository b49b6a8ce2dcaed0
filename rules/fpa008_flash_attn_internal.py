"""FPA008 flash-attn-triton-and-internals: flash-attn entry points that are reported, never rewritten.

What it reports:
  * the Triton implementation ``flash_attn.flash_attn_triton.flash_attn_func(q, k, v, bias=None,
    causal=False, softmax_scale=None)`` and its ``flash_attn_kvpacked_func`` /
    ``flash_attn_qkvpacked_func``: same names as the CUDA functions (FPA001-003) but another
    signature -- the 4th positional argument is an additive ``bias``, not ``dropout_p`` -- so
    rewriting them as the CUDA function would change the meaning;
  * private kernel entry points of ``flash_attn.flash_attn_interface``: ``_flash_attn_forward`` /
    ``_flash_attn_backward``, ``_flash_attn_varlen_forward`` / ``_flash_attn_varlen_backward`` and
    their ``_wrapped_*`` variants (custom autograd functions, ring/context-parallel attention). They
    return ``(out, softmax_lse, S_dmask, rng_state)`` or write gradients into caller-provided
    buffers: no call-for-call equivalent.

Semantics mapping:
  none (scan-only). Port by hand: the Triton function is ``flashport.torch.attention(q, k, v,
  bias=bias, causal=causal, scale=softmax_scale)`` once its causal alignment is checked; a custom
  autograd function around the private forward usually becomes ``flashport.torch.attention(...,
  return_lse=True)`` with autograd doing the backward.

What it refuses:
  every call and value use, with the reason above.

Example::

    from flash_attn.flash_attn_triton import flash_attn_func
    out = flash_attn_func(q, k, v, bias, True)   # reported: 4th argument is a bias
"""

from __future__ import annotations

from flashport.rules.base import Refusal, Rule, register

TRITON = tuple(
    f"flash_attn.flash_attn_triton.{name}"
    for name in ("flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func")
)
PRIVATE = tuple(
    f"flash_attn.flash_attn_interface.{prefix}flash_attn{kind}_{step}"
    for prefix in ("_", "_wrapped_")
    for kind in ("", "_varlen")
    for step in ("forward", "backward")
)


@register
class FlashAttnTritonAndInternals(Rule):
    """Report flash-attn's Triton functions and private kernel entry points with the reason."""

    CODE = "FPA008"
    NAME = "flash-attn-triton-and-internals"
    API = "flash_attn.flash_attn_triton.flash_attn_func"
    FRAMEWORK = "torch"
    SOURCES = TRITON + PRIVATE
    TRIGGERS = (b"flash_attn",)
    TARGET = "flashport.torch.attention (manual)"
    REWRITES = False

    def check_call(self, call, ctx):
        """Refuse with the reason that applies to this entry point."""
        return Refusal(_reason(ctx.qualified_name))

    def check_reference(self, node, ctx):
        """Value uses are reported with the same reason."""
        return Refusal(f"used as a value: {_reason(ctx.qualified_name)}")


def _reason(name: str) -> str:
    short = name.rsplit(".", 1)[-1]
    if name in TRITON:
        return (
            f"flash_attn_triton.{short} is the Triton implementation: its 4th positional argument is an "
            "additive bias (not dropout_p), so it is not the CUDA function; port it by hand to "
            "flashport.torch.attention(q, k, v, bias=..., causal=..., scale=...)"
        )
    return (
        f"{short} is a private flash-attn kernel entry point (returns out, softmax_lse, S_dmask, rng_state "
        "or writes gradients into given buffers); port the surrounding autograd code by hand to "
        "flashport.torch.attention(..., return_lse=True)"
    )
