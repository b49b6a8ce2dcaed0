"""FPA017 flash-attn-distributed: ``flash_attn.utils.distributed`` collectives -> ``flashport.integrations.distributed``.

What it rewrites:
  calls and values of ``all_gather``, ``reduce_scatter``, ``all_reduce`` and their ``*_raw``
  variants from ``flash_attn.utils.distributed``: sequence-parallel collectives imported next to
  ring or context-parallel attention. They are plain ``torch.distributed``, but importing the module
  imports flash-attn's CUDA extension, so a ported file would still need the GPU library.

Semantics mapping:
  the same functions, arguments and results on ``torch.distributed``
  (``flashport/integrations/flash_attn/distributed.py``): gather/reduce-scatter/all-reduce along dim 0,
  ``(output, handle)`` from the raw variants (``async_op``), autograd for the others (a gather's
  gradient is a reduce-scatter and vice versa). The call keeps its arguments, their order and
  comments.

What it refuses:
  values that probe or compare the functions (reported with the reason).

Example::

    gathered = all_gather(x, process_group)
    # becomes
    gathered = flashport.integrations.distributed.all_gather(x, process_group)
"""

from __future__ import annotations

from flashport.rules.base import Rewrite, Rule, register
from flashport.rules.common import values
from flashport.rules.common.calls import dotted

MODULE = "flashport.integrations.distributed"
FUNCTIONS = (
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "all_gather_raw",
    "reduce_scatter_raw",
    "all_reduce_raw",
)


@register
class FlashAttnDistributed(Rule):
    """Rewrite flash-attn's sequence-parallel collectives to flashport's torch.distributed drop-ins."""

    CODE = "FPA017"
    NAME = "flash-attn-distributed"
    API = "flash_attn.utils.distributed.all_gather"
    FRAMEWORK = "torch"
    SOURCES = tuple(f"flash_attn.utils.distributed.{name}" for name in FUNCTIONS)
    TRIGGERS = (b"flash_attn.utils.distributed",)
    GPU_MODULES = ("flash_attn",)
    TARGET = MODULE + ".all_gather"

    def check_call(self, call, ctx):
        """The same call on the drop-in of the same name."""
        name = ctx.qualified_name.rsplit(".", 1)[-1]
        note = f"drop-in {name} (flash-attn's signature and result, torch.distributed)"
        return Rewrite(call.with_changes(func=dotted(f"{MODULE}.{name}")), imports=(MODULE,), notes=(note,))

    def check_reference(self, node, ctx):
        """A value is the drop-in of the same name unless it is probed or compared."""
        why = values.probe(ctx)
        if why is not None and not values.inspects_signature(ctx):
            return values.Report(f"{why}: not a call to port; kept")
        name = ctx.qualified_name.rsplit(".", 1)[-1]
        note = f"{values.describe(node, ctx)}: the value is now flashport's drop-in {MODULE}.{name} (same signature)"
        return Rewrite(dotted(f"{MODULE}.{name}"), imports=(MODULE,), notes=(note,))
