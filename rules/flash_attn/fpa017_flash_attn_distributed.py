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

from flashport.rules.base import register
from flashport.rules.flash_attn.same_name import SameNameRule

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
class FlashAttnDistributed(SameNameRule):
    """Rewrite flash-attn's sequence-parallel collectives to flashport's torch.distributed drop-ins."""

    CODE = "FPA017"
    NAME = "flash-attn-distributed"
    SOURCES = tuple(f"flash_attn.utils.distributed.{name}" for name in FUNCTIONS)
    TRIGGERS = (b"flash_attn.utils.distributed",)
    TARGET = MODULE + ".all_gather"
    DROP_IN_MODULE = MODULE
    DROP_IN_KIND = "torch.distributed"
