"""What the flash-attn 2.x dense and varlen rules share: FPA001-FPA003 (``flash_attn_func`` and its
packed forms) and FPA004-FPA006 (``flash_attn_varlen_func`` and its packed forms).

The three rules of each form differ only in their leading tensors and how those become the
contract's q, k, v; :class:`DenseRule` and :class:`VarlenRule` hold the binding, the drop-in
choices and the argument mapping. Each rule module names its ``FUNCTION``; the import paths and
the leading parameters come from the API catalogue (:mod:`flashport.rules.apis.flash_attn`).
"""

from __future__ import annotations

from typing import ClassVar

import libcst as cst

from flashport.rules.apis import flash_attn as apis_flash_attn
from flashport.rules.base import Rewrite, Rule
from flashport.rules.common.binding import required
from flashport.rules.common.calls import build_call, string
from flashport.rules.flash_attn import arguments as fa


class _FA2Function(Rule):
    """A flash-attn 2.x public function named by ``FUNCTION``, whose import paths (with its 1.x name,
    if any) and ``LEADING`` parameters (before ``dropout_p``) are the API catalogue's."""

    FUNCTION: ClassVar[str] = ""
    LEADING: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        """Take ``SOURCES`` and ``LEADING`` of the subclass's ``FUNCTION`` from the catalogue."""
        super().__init_subclass__(**kwargs)
        if cls.FUNCTION:
            cls.SOURCES = fa.sources_with_fa1(cls.FUNCTION)
            cls.LEADING = apis_flash_attn.FA2_LEADING[cls.FUNCTION]


class DenseRule(_FA2Function):
    """A flash-attn 2.x dense function to ``flashport.torch.attention`` (``layout="BSHD"``): bound
    against the configured version's signature; a splat, ALiBi, ``return_attn_probs`` without
    dropout and a dropout that cannot keep its evaluation order go to the drop-in of the same name.

    ``LEADING`` are the tensor parameters before ``dropout_p`` (``("q", "k", "v")``, ``("qkv",)``...).
    """

    TRIGGERS = (b"flash_attn",)
    TARGET = "flashport.torch.attention"

    def positional(self, tensors: list[cst.BaseExpression]) -> list:
        """The contract call's positional arguments (q, k, v) from the ``LEADING`` tensors: a packed
        ``qkv``/``kv`` is split once (``*kv.unbind(2)``)."""
        return fa.split_packed(self.LEADING, tensors, 2)

    def check_call(self, call, ctx):
        """Bind, send what only the drop-in keeps there, and map the rest to the contract."""
        splat = fa.splat_drop_in(call, ctx)
        if splat is not None:
            return splat
        leading = len(self.LEADING)
        bound = fa.signature(self.LEADING, ctx.options.flash_attn_version).bind(call, self.API)
        tensors = required(bound, self.LEADING, self.API)
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


class VarlenRule(_FA2Function):
    """A flash-attn 2.x (or 1.x ``unpadded``) varlen function to ``flashport.varlen_attention``
    (``layout="THD"``): bound against the signature of the name and version; a splat, dropout,
    ALiBi, ``block_table`` and ``return_attn_probs`` without dropout go to the drop-in of the same
    name; the ``max_seqlen`` arguments are dropped.

    ``LEADING`` are the parameters before ``dropout_p`` (tensors, ``cu_seqlens``, ``max_seqlen``).

    Class attributes:
      REQUIRED: how many of them the rewrite reads (the tensors and ``cu_seqlens``: all but the
        trailing ``max_seqlen`` ones).
      DROPPED_NOTE: the note naming the dropped ``max_seqlen`` arguments.
    """

    TRIGGERS = (b"flash_attn",)
    TARGET = "flashport.varlen_attention"
    REQUIRED: ClassVar[int] = 0
    DROPPED_NOTE: ClassVar[str] = "dropped max_seqlen_q/max_seqlen_k (kernel launch sizes only)"

    def split(
        self, values: list[cst.BaseExpression], ctx
    ) -> tuple[list, cst.BaseExpression, cst.BaseExpression]:
        """(positional q, k, v; ``cu_seqlens_q``; ``cu_seqlens_k``) from the ``REQUIRED`` values: a
        packed ``kv`` is split once (``*kv.unbind(1)``).

        Raises:
          Refuse: for what the rewrite cannot state.
        """
        *tensors, cu_q, cu_k = values
        return fa.split_packed(self.LEADING, tensors, 1), cu_q, cu_k

    def __init_subclass__(cls, **kwargs):
        """``REQUIRED``: the leading parameters up to the ``max_seqlen`` ones."""
        super().__init_subclass__(**kwargs)
        cls.REQUIRED = len([name for name in cls.LEADING if not name.startswith("max_seqlen")])

    def check_call(self, call, ctx):
        """Bind, send what only the drop-in keeps there, and map the rest to the varlen contract."""
        splat = fa.splat_drop_in(call, ctx)
        if splat is not None:
            return splat
        sig, version = fa.varlen_signature(self.LEADING, ctx.qualified_name, ctx.options.flash_attn_version)
        bound = sig.bind(call, self.API)
        values = required(bound, self.LEADING[: self.REQUIRED], self.API)
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
