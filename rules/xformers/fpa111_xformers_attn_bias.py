"""FPA111 xformers-attn-bias: xformers ``attn_bias`` constructors -> flashport's mirror classes.

What it rewrites:
  calls that build a bias: ``LowerTriangularMask()``, ``LowerTriangularMaskWithTensorBias(b)``,
  ``LowerTriangularFromBottomRightMask()``, ``LowerTriangularFromBottomRightLocalAttentionMask(w)``,
  ``LocalAttentionFromBottomRightMask(l, r)``, ``BlockDiagonalMask.from_seqlens(q, kv)`` /
  ``.from_tensor_list(ts)`` and the same for ``BlockDiagonalCausalMask`` and
  ``BlockDiagonalCausalFromBottomRightMask``, from ``xformers.ops``, ``xformers.ops.fmha`` or
  ``xformers.ops.fmha.attn_bias``. Only the callee changes (to
  ``flashport.integrations.xformers_compat.<same name>``); the arguments and any chained
  ``.make_causal()`` / ``.make_local_attention(w)`` / ``.add_bias(t)`` / ``.split(out)`` stay.

Semantics mapping:
  the mirror classes record the same meaning (top-left vs bottom-right causal, window, block
  lengths) and ``memory_efficient_attention`` (FPA110) turns them into contract keywords; see
  ``flashport/integrations/xformers_compat.py``. Block lengths may be dynamic Python ints (they
  become segment ids at run time).

What it refuses:
  padded/paged/gappy block masks (``BlockDiagonalPaddedKeysMask``,
  ``BlockDiagonalCausalWithOffsetPaddedKeysMask``, ``BlockDiagonalGappyKeysMask``,
  ``Paged...``, ``BlockDiagonalCausalWithOffsetGappyKeysMask``) and ``from_tensor_lists_qkv``:
  their layouts (padding inside blocks, page tables) are not representable. Every constructor of
  a file (decided once the file's other sites are final) where some use of
  ``memory_efficient_attention*`` is not rewritten by FPA110 -- refused, suppressed with
  ``# flashport: ignore[FPA110]``, left out by ``--ignore FPA110``, declined in ``--interactive``
  review, or used as a value that stays xformers' (a probe such as ``callable(...)``; a value
  rewritten to the drop-in takes flashport's classes) -- or where a bias class reference stays
  xformers' (listed in ``__all__``, inside an import guard): a bias built here could reach code that
  still runs xformers and needs xformers' own classes.

Types travel with values:
  a bias class named anywhere else -- ``isinstance(b, BlockDiagonalMask)``, an annotation
  ``bias: Optional[AttentionBias]``, a value -- becomes the mirror class of the same name
  (``AttentionMask`` -> ``AttentionBias``), so constructors, type checks and annotations move
  together. The mirror classes' ``isinstance`` also holds for a real xformers bias of that class
  (built by code left on xformers), which ``memory_efficient_attention`` accepts too. Calling a class
  itself (``BlockDiagonalMask(q_seqinfo, k_seqinfo)``) is refused: the mirror has other fields.

Example::

    bias = fmha.BlockDiagonalMask.from_seqlens([3, 5]).make_causal()
    # becomes
    bias = flashport.integrations.xformers_compat.BlockDiagonalMask.from_seqlens([3, 5]).make_causal()
"""

from __future__ import annotations

from collections import Counter

from flashport.rules.base import Refuse, Rewrite, Rule, RuleContext, register
from flashport.rules.common import values
from flashport.rules.common.calls import dotted, on_drop_in
from flashport.rules.xformers.names import ATTENTION_PREFIX, UNSUPPORTED

MODULE = "flashport.integrations.xformers_compat"
PREFIXES = ("xformers.ops.", "xformers.ops.fmha.", "xformers.ops.fmha.attn_bias.")
PLAIN = (
    "LowerTriangularMask",
    "LowerTriangularMaskWithTensorBias",
    "LowerTriangularFromBottomRightMask",
    "LowerTriangularFromBottomRightLocalAttentionMask",
    "LocalAttentionFromBottomRightMask",
)
BLOCKS = ("BlockDiagonalMask", "BlockDiagonalCausalMask", "BlockDiagonalCausalFromBottomRightMask")
CONSTRUCTORS = ("from_seqlens", "from_tensor_list")
# the mirror classes a type check or annotation may name (AttentionMask is xformers.ops' alias)
TYPES = (
    "AttentionBias",
    "AttentionMask",
    *BLOCKS,
    "BlockDiagonalCausalLocalAttentionMask",
    "BlockDiagonalCausalLocalAttentionFromBottomRightMask",
)
# where a class reference stays xformers': the module's re-exports, and an import guard's fallback
_KEPT_CONTEXTS = ("__all__", "import guard", "monkeypatch")

_SUPPORTED = PLAIN + tuple(f"{b}.{c}" for b in BLOCKS for c in CONSTRUCTORS)
_REFUSED = (
    tuple(f"{u}.{c}" for u in UNSUPPORTED for c in CONSTRUCTORS)
    + UNSUPPORTED
    + tuple(f"{b}.from_tensor_lists_qkv" for b in BLOCKS)
)


# The class attributes are the rule's manifest (rules/base.py Rule): every rule lists the same fields,
# so rules of one family read alike by design; the mapping they share lives in their helper module.
@register
class XformersAttnBias(Rule):
    """Point xformers ``attn_bias`` constructors at flashport's mirror classes."""

    CODE = "FPA111"
    NAME = "xformers-attn-bias"
    API = "xformers.ops.fmha.attn_bias"
    SOURCES = tuple(p + n for n in _SUPPORTED + _REFUSED + TYPES for p in PREFIXES)
    TRIGGERS = (b"xformers",)
    TARGET = MODULE + ".<class>"

    def check_call(self, call, ctx):
        """Swap the callee for the mirror class; refuse padded/paged/gappy layouts."""
        name = next(
            ctx.qualified_name[len(p) :]
            for p in sorted(PREFIXES, key=len, reverse=True)
            if ctx.qualified_name.startswith(p)
        )
        if name in TYPES:
            raise Refuse(
                f"{name}(...) built from its fields: the mirror class has other fields; build it with "
                "from_seqlens / from_tensor_list"
            )
        if name not in _SUPPORTED:
            raise Refuse(f"{name}: padded, paged or gappy block layouts have no flashport equivalent")
        return on_drop_in(call, f"{MODULE}.{name}", module=MODULE)

    def check_reference(self, node, ctx):
        """A bias class named in a type check, an annotation or as a value moves with the
        constructors: flashport's mirror class of the same name (whose ``isinstance`` also accepts
        a real xformers bias of that class, built by code left on xformers)."""
        name = ctx.qualified_name.rsplit(".", 1)[-1]
        if name not in PLAIN + TYPES:
            return super().check_reference(node, ctx)
        why = values.probe(ctx)
        if why is not None and any(kept in why for kept in _KEPT_CONTEXTS):
            raise Refuse(f"{why}: xformers' class kept")
        target = "AttentionBias" if name == "AttentionMask" else name
        note = f"the bias class {name} is flashport's mirror class (constructors, type checks and annotations move together)"
        return Rewrite(dotted(f"{MODULE}.{target}"), imports=(MODULE,), notes=(note,))

    def settle(self, sites, ctx):
        """Keep every constructor when some consumer of a bias in the file stays xformers."""
        if not any(s.rule == self.CODE and s.status == "rewrite" for s in sites):
            return None  # nothing to veto: skip the walk over the file
        rewritten = Counter(  # a value use rewritten to the drop-in takes flashport's classes too
            s.line
            for s in sites
            if s.rule == "FPA110" and s.status == "rewrite" and s.kind in ("call", "reference")
        )
        for line, count in sorted(_attention_uses(ctx).items()):
            if count > rewritten[line]:
                return (
                    f"memory_efficient_attention on line {line} stays xformers "
                    f"({_why(sites, line)}); its biases must stay xformers' classes"
                )
        for site in sites:
            if site.rule == self.CODE and site.kind == "reference" and site.status != "rewrite":
                return (
                    f"{site.api.rsplit('.', 1)[-1]} on line {site.line} is used as a value and stays xformers' "
                    "class; the biases of this file must stay xformers' classes too"
                )
        return None


def _why(sites, line: int) -> str:
    reasons = [s.reason for s in sites if s.rule == "FPA110" and s.line == line and s.status != "rewrite"]
    return (
        reasons[0] if reasons else "not rewritten: FPA110 is not selected, or the function is used as a value"
    )


def _attention_uses(ctx: RuleContext) -> Counter:
    """Lines of every mention of ``memory_efficient_attention*`` (or an alias imported for it)
    outside import statements: calls, values, ``getattr`` strings. Over-counting only keeps
    constructors, which is the safe direction."""
    names = {
        b.asname
        for b in ctx.imports()
        if b.is_from and b.asname and b.alias.name.startswith(ATTENTION_PREFIX)
    }
    return ctx.mentions(lambda text: text.startswith(ATTENTION_PREFIX) or text in names)
