"""What the flash-attn 2.x dense and varlen rules share: FPA001-FPA003 (``flash_attn_func`` and its
packed forms) and FPA004-FPA006 (``flash_attn_varlen_func`` and its packed forms).

The three rules of each form differ only in their leading tensors and how those become the
contract's q, k, v; :class:`DenseRule` and :class:`VarlenRule` hold the binding, the drop-in
choices and the argument mapping, and each rule module sets its manifest, ``LEADING`` and
``positional``.
"""

from __future__ import annotations

from typing import ClassVar

import libcst as cst

from flashport.rules.base import Rewrite, Rule
from flashport.rules.common.binding import tensors as required_tensors
from flashport.rules.common.calls import build_call, string
from flashport.rules.flash_attn import arguments as fa


class DenseRule(Rule):
    """A flash-attn 2.x dense function to ``flashport.torch.attention`` (``layout="BSHD"``): bound
    against the configured version's signature; a splat, ALiBi, ``return_attn_probs`` without
    dropout and a dropout that cannot keep its evaluation order go to the drop-in of the same name.

    Class attributes:
      LEADING: the tensor parameters before ``dropout_p`` (``("q", "k", "v")``, ``("qkv",)``...).
    """

    FRAMEWORK = "torch"
    TRIGGERS = (b"flash_attn",)
    GPU_MODULES = ("flash_attn",)
    TARGET = "flashport.torch.attention"
    LEADING: ClassVar[tuple[str, ...]] = ()

    def positional(self, tensors: list[cst.BaseExpression]) -> list:
        """The contract call's positional arguments (q, k, v) from the ``LEADING`` tensors."""
        return list(tensors)

    def check_call(self, call, ctx):
        """Bind, send what only the drop-in keeps there, and map the rest to the contract."""
        splat = fa.splat_drop_in(call, ctx)
        if splat is not None:
            return splat
        leading = len(self.LEADING)
        bound = fa.signature(self.LEADING, ctx.options.flash_attn_version).bind(call, self.API)
        tensors = required_tensors(bound, self.LEADING, self.API)
        drop_in = fa.alibi_drop_in(call, bound, ctx, leading)
        drop_in = drop_in or fa.probs_drop_in(call, bound, ctx, leading)
        if drop_in is not None:
            return drop_in
        keywords, notes = fa.map_arguments(bound, ctx, self.API)
        positional = self.positional(tensors)
        carried = fa.dropout_or_drop_in(call, positional, keywords, bound, ctx, leading)
        if isinstance(carried, Rewrite):
            return carried
        keywords, more = carried
        node = build_call(self.TARGET, positional, keywords + [("layout", string("BSHD"))], call)
        notes += more
        return Rewrite(node, notes=tuple(notes))


class VarlenRule(Rule):
    """A flash-attn 2.x (or 1.x ``unpadded``) varlen function to ``flashport.varlen_attention``
    (``layout="THD"``): bound against the signature of the name and version; a splat, dropout,
    ALiBi, ``block_table`` and ``return_attn_probs`` without dropout go to the drop-in of the same
    name; the ``max_seqlen`` arguments are dropped.

    Class attributes:
      LEADING: the parameters before ``dropout_p`` (tensors, ``cu_seqlens``, ``max_seqlen``).
      REQUIRED: how many of them the rewrite reads (the tensors and ``cu_seqlens``).
      DROPPED_NOTE: the note naming the dropped ``max_seqlen`` arguments.
    """

    FRAMEWORK = "torch"
    TRIGGERS = (b"flash_attn",)
    GPU_MODULES = ("flash_attn",)
    TARGET = "flashport.varlen_attention"
    LEADING: ClassVar[tuple[str, ...]] = ()
    REQUIRED: ClassVar[int] = 0
    DROPPED_NOTE: ClassVar[str] = "dropped max_seqlen_q/max_seqlen_k (kernel launch sizes only)"

    def split(
        self, values: list[cst.BaseExpression], ctx
    ) -> tuple[list, cst.BaseExpression, cst.BaseExpression]:
        """(positional q, k, v; ``cu_seqlens_q``; ``cu_seqlens_k``) from the ``REQUIRED`` values.

        Raises:
          Refuse: for what the rewrite cannot state.
        """
        *tensors, cu_q, cu_k = values
        return tensors, cu_q, cu_k

    def check_call(self, call, ctx):
        """Bind, send what only the drop-in keeps there, and map the rest to the varlen contract."""
        splat = fa.splat_drop_in(call, ctx)
        if splat is not None:
            return splat
        sig, version = fa.varlen_signature(self.LEADING, ctx.qualified_name, ctx.options.flash_attn_version)
        bound = sig.bind(call, self.API)
        values = required_tensors(bound, self.LEADING[: self.REQUIRED], self.API)
        drop_in = fa.varlen_drop_in(call, bound, ctx, len(self.LEADING))
        drop_in = drop_in or fa.probs_drop_in(call, bound, ctx, len(self.LEADING))
        if drop_in is not None:
            return drop_in
        positional, cu_q, cu_k = self.split(list(values), ctx)
        keywords, notes = fa.map_arguments(bound, ctx, self.API, version, dropout=False)
        keywords = [("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)] + keywords
        notes.append(self.DROPPED_NOTE)
        node = build_call(self.TARGET, positional, keywords + [("layout", string("THD"))], call)
        return Rewrite(node, notes=tuple(notes))
