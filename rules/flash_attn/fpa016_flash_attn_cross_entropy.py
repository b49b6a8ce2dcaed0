"""FPA016 flash-attn-cross-entropy: ``flash_attn.ops.triton.cross_entropy.cross_entropy_loss`` -> ``flashport.integrations.cross_entropy``.

What it rewrites:
  calls and values of flash-attn's fused (Triton) cross entropy, imported next to the attention
  call in model code (log-probabilities of RL trainers, LM losses). Importing
  ``flash_attn.ops.triton.cross_entropy`` needs flash-attn and Triton, so a file whose attention is
  ported would still need the GPU library for it.

Semantics mapping:
  the same function, arguments and result in plain torch (``flashport/integrations/flash_attn/cross_entropy.py``):
  ``(losses, z_losses)`` ``[N]`` fp32 with label smoothing, ``logit_scale``, the z-loss
  ``lse_square_scale``, ``ignore_index`` rows zeroed, ``precomputed_lse`` (used only without scale
  and smoothing, as flash-attn does), the same gradient, ``inplace_backward`` writing it into the
  logits. The call keeps its arguments, their order and comments.

What it refuses:
  ``process_group=`` other than ``None`` (the vocabulary split across ranks is not replicated; a
  value of the function called with one raises ``NotImplementedError``); a third positional
  argument (``precomputed_lse`` was inserted third, so older code's positional
  ``label_smoothing`` would bind differently); splats; values that probe or compare the function.

Example::

    losses, _ = cross_entropy_loss(logits, labels, inplace_backward=True)
    # becomes
    losses, _ = flashport.integrations.cross_entropy.cross_entropy_loss(logits, labels, inplace_backward=True)
"""

from __future__ import annotations

from flashport.rules.base import Refuse, Rewrite, Rule, register
from flashport.rules.common import values
from flashport.rules.common.binding import Signature
from flashport.rules.common.calls import dotted, on_drop_in
from flashport.rules.common.literals import is_none

MODULE = "flashport.integrations.cross_entropy"
SIGNATURE = Signature(
    (
        "logits",
        "labels",
        "precomputed_lse",
        "label_smoothing",
        "logit_scale",
        "lse_square_scale",
        "ignore_index",
        "inplace_backward",
        "process_group",
    )
)


@register
class FlashAttnCrossEntropy(Rule):
    """Rewrite flash-attn's fused cross entropy to flashport's plain-torch drop-in."""

    CODE = "FPA016"
    NAME = "flash-attn-cross-entropy"
    SOURCES = ("flash_attn.ops.triton.cross_entropy.cross_entropy_loss",)
    TARGET = MODULE + ".cross_entropy_loss"

    def check_call(self, call, ctx):
        """The same call on the drop-in, unless it splits the vocabulary or binds by release."""
        bound = SIGNATURE.bind(call, self.API)
        if any(arg.keyword is None for arg in call.args[2:]):
            raise Refuse(
                "a third positional argument: precomputed_lse was inserted third, so which "
                "parameter it fills depends on the flash-attn release; pass it by keyword"
            )
        group = bound.get("process_group")
        if group is not None and not is_none(group.value):
            raise Refuse(
                f"process_group={ctx.code(group.value)}: the vocabulary split across ranks is not "
                "replicated by flashport's cross_entropy_loss"
            )
        note = "drop-in cross_entropy_loss (flash-attn's signature, (losses, z_losses) and gradient, plain torch)"
        return on_drop_in(call, self.TARGET, note)

    def check_reference(self, node, ctx):
        """A value is the drop-in unless it is probed or compared (a process group then raises
        NotImplementedError at run time)."""
        why = values.probe(ctx)
        if why is not None and not values.inspects_signature(ctx):
            return values.Report(f"{why}: not a call to port; kept")
        note = (
            f"{values.describe(node, ctx)}: the value is now flashport's drop-in {self.TARGET} (same "
            "signature; a process_group raises NotImplementedError)"
        )
        return Rewrite(dotted(self.TARGET), imports=(MODULE,), notes=(note,))
