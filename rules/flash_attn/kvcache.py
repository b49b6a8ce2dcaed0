"""What the ``flash_attn_with_kvcache`` rules share: FPA007 (flash-attn 2) and FPA012 (FlashAttention-3).

Both port a call to the functional ``flash_attn_compat.kvcache_attention`` where it applies (a pure
read of the cache, or new rows whose in-place update provably is not relied on:
:func:`cache_is_dead`), and every other call they can (live in-place updates, rotary, indirect or
paged caches, a return type known only at run time, splats) to their API's drop-in, which has the
original signature and full behaviour (``flash_attn_compat.flash_attn_with_kvcache`` /
``flash_attn3_compat.flash_attn_with_kvcache``). :class:`KVCacheRule` holds that logic; each rule
module sets the manifest and the per-API tables (what only the drop-in can do, what neither form can
do); the keywords are the API catalogue's (:mod:`flashport.rules.apis`).
"""

from __future__ import annotations

from typing import ClassVar

import libcst as cst

from flashport.rules import apis
from flashport.rules.base import Refuse, Rewrite, Rule
from flashport.rules.common import node_context
from flashport.rules.common.binding import Signature, required
from flashport.rules.common.calls import build_call, callee_name, on_drop_in
from flashport.rules.common.literals import is_none, literal_bool
from flashport.rules.flash_attn import arguments as fa

MODULE = "flashport.integrations.flash_attn_compat"  # the functional kvcache_attention lives here
POSITIONAL = ("q", "k_cache", "v_cache", "k", "v")


ALLOCATORS = frozenset(
    {
        "zeros",
        "zeros_like",
        "empty",
        "empty_like",
        "ones",
        "ones_like",
        "full",
        "full_like",
        "rand",
        "randn",
        "rand_like",
        "randn_like",
        "clone",
        "cat",
        "stack",
        "tensor",
    }
)


def _allocates(node: cst.BaseExpression) -> bool:
    """True for a call that returns a fresh tensor (``torch.zeros(...)``, ``x.clone()``, ...)."""
    if not isinstance(node, cst.Call):
        return False
    return callee_name(node) in ALLOCATORS


def cache_is_dead(call: cst.Call, names: list[str], ctx) -> str | None:
    """None when the in-place update of the caches ``names`` provably is not relied on, else why."""
    node = node_context.locate(call, ctx)
    if node is None:
        return "the call could not be located in its function"
    function = next((a for a in node_context.ancestors(node, ctx) if isinstance(a, cst.FunctionDef)), None)
    if function is None:
        return "the call is not inside a function"
    for up in node_context.ancestors(node, ctx):
        if up is function:
            break
        if isinstance(up, (cst.For, cst.While, cst.CompFor)):
            return "the call is inside a loop (the next iteration reads the updated cache)"
    params = {
        p.name.value
        for p in (*function.params.params, *function.params.posonly_params, *function.params.kwonly_params)
    }
    for star in (function.params.star_arg, function.params.star_kwarg):
        if isinstance(star, cst.Param):
            params.add(star.name.value)
    counts = {name: [0, 0] for name in names}  # [assignments, other uses]
    aliased: list[str] = []

    class _Uses(cst.CSTVisitor):
        def visit_Global(self, node):
            for item in node.names:
                if item.name.value in counts:
                    counts[item.name.value][1] += 99

        visit_Nonlocal = visit_Global

        def visit_Assign(self, node):
            for target in node.targets:
                if isinstance(target.target, cst.Name) and target.target.value in counts:
                    counts[target.target.value][0] += 1
                    if len(node.targets) > 1 or not _allocates(node.value):
                        aliased.append(target.target.value)

        def visit_Name(self, node):
            if node.value in counts:
                counts[node.value][1] += 1

    function.body.visit(_Uses())
    for name in names:
        if name in params:
            return f"{name} is a parameter: the caller may read the updated cache"
        assigned, uses = counts[name]
        if assigned == 0:
            return f"{name} is not assigned in this function"
        if name in aliased:
            return f"{name} is not assigned a fresh tensor (torch.zeros/empty/..., .clone()): it may alias a cache kept elsewhere"
        if uses - assigned != 1:  # each assignment target is also a Name; the call is the one read
            return f"{name} is used again after the in-place update"
    return None


class KVCacheRule(Rule):
    """``flash_attn_with_kvcache`` to the functional ``kvcache_attention`` where the in-place update
    is not relied on, else to the API's drop-in (subclasses set the tables below; not registered).
    ``KEYWORDS``, the parameters after :data:`POSITIONAL`, are those of the catalogue's latest
    signature of the first of ``SOURCES``."""

    TARGET = MODULE + ".kvcache_attention"
    KEYWORDS: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        """``KEYWORDS`` of the subclass's API from the catalogue."""
        super().__init_subclass__(**kwargs)
        if cls.SOURCES:
            *_, (_, parameters) = apis.api(cls.SOURCES[0]).signatures
            cls.KEYWORDS = tuple(p.name for p in parameters if p.name not in POSITIONAL)

    # Arguments only the drop-in implements (the functional form cannot); UNSUPPORTED gives the
    # functional form's refusal reasons, and those of its names outside DROP_IN_ONLY are what
    # neither form implements.
    DROP_IN_ONLY: ClassVar[tuple[str, ...]] = ()
    UNSUPPORTED: ClassVar[dict[str, str]] = {}
    DROPPED: ClassVar[tuple[str, ...]] = ()
    DROP_IN_MODULE: ClassVar[str] = MODULE
    DROP_IN: ClassVar[str | None] = None
    # Why return_softmax_lse=True needs the drop-in (the functional form returns the contract's
    # (out, lse), lse -inf for a row that sees no key), or None when the functional form matches.
    LSE_DROP_IN: ClassVar[str | None] = None

    def splat(self, call: cst.Call, ctx) -> Rewrite | None:
        """The call on the drop-in when it has a ``*args``/``**kwargs`` splat, else None."""
        return None

    def check_extra(self, value, ctx):
        """Hook for refusals of values neither form implements (FPA012: ``attention_chunk``)."""

    def check_call(self, call, ctx):
        """Refuse what neither form can hold; rewrite reads, and updates nobody relies on, to the
        functional form; the rest (live in-place updates, rotary, paged, splats...) to the drop-in."""
        splat = self.splat(call, ctx)
        if splat is not None:
            return splat
        if sum(1 for a in call.args if a.keyword is None and not a.star) > len(POSITIONAL):
            raise Refuse(
                "arguments after v must be passed by keyword: their positions changed between releases"
            )
        bound = Signature(POSITIONAL, self.KEYWORDS).bind(call, self.API)
        q, k_cache, v_cache = required(bound, POSITIONAL[:3], self.API)
        value = {name: arg.value for name, arg in bound.items()}
        self.check_extra(value, ctx)
        refused = [n for n in self.UNSUPPORTED if n not in self.DROP_IN_ONLY and not is_none(value.get(n))]
        if self.DROP_IN and not refused:
            drop_in = [name for name in self.DROP_IN_ONLY if not is_none(value.get(name))]
            if drop_in:
                return self.drop_in(call, value, f"{drop_in[0]}= needs flash-attn's full behaviour")
        for name, reason in self.UNSUPPORTED.items():
            if not is_none(value.get(name)):
                raise Refuse(reason)
        notes = [f"dropped {name}= (kernel tuning / rotary only)" for name in self.DROPPED if name in value]
        new_rows = self.new_rows(call, value, ctx)
        if isinstance(new_rows, Rewrite):
            return new_rows
        if new_rows:
            notes.append(
                "functional: the in-place cache update is not relied on (caches are local and not read again)"
            )
        lse = value.get("return_softmax_lse")
        if lse is not None and literal_bool(lse) is None and self.DROP_IN:
            return self.drop_in(
                call, value, f"return_softmax_lse={ctx.code(lse)} decides the return type at run time"
            )
        if lse is not None and literal_bool(lse) is None:
            raise Refuse(f"return_softmax_lse={ctx.code(lse)} is not a literal: the return type is unknown")
        if literal_bool(lse) and self.LSE_DROP_IN and self.DROP_IN:
            return self.drop_in(call, value, self.LSE_DROP_IN)
        keywords, more = self.keywords(bound, value, ctx)
        node = build_call(self.TARGET, [q, k_cache, v_cache, *new_rows], keywords, call)
        return Rewrite(node, imports=(MODULE,), notes=tuple(notes + more))

    def new_rows(self, call, value, ctx) -> list | Rewrite:
        """The new ``[k, v]`` for the functional form (``[]`` for a pure read), or the drop-in call
        when the in-place cache update may be relied on.

        Raises:
          Refuse: for only one of k/v, new rows without ``cache_seqlens``, or (without a drop-in) a
            live in-place update.
        """
        new_k, new_v = value.get("k"), value.get("v")
        if is_none(new_k) and is_none(new_v):
            return []
        if is_none(new_k) or is_none(new_v):
            raise Refuse("only one of k/v is given")
        if is_none(value.get("cache_seqlens")):
            raise Refuse(
                "new k/v without cache_seqlens: where flash-attn writes them is not expressible here"
            )
        k_cache, v_cache = value["k_cache"], value["v_cache"]
        why: str | None
        if not all(isinstance(c, cst.Name) for c in (k_cache, v_cache)):
            why = f"k_cache/v_cache are not local names ({ctx.code(k_cache)}, {ctx.code(v_cache)})"
        else:
            why = cache_is_dead(call, [k_cache.value, v_cache.value], ctx)
        if why and self.DROP_IN:
            return self.drop_in(call, value, f"the in-place cache update may be relied on ({why})")
        if why:
            raise Refuse(
                f"flash_attn_with_kvcache updates k_cache/v_cache in place and the update may be relied on: {why}"
            )
        return [new_k, new_v]

    def keywords(self, bound, value, ctx) -> tuple[list, list[str]]:
        """(keywords, notes) of the functional call: ``cache_seqlens``, the flash-attn mapping without
        ``align`` (kvcache alignment is per sequence, bottom-right) and ``return_lse``."""
        fa_bound = {n: bound[n] for n in ("softmax_scale", "causal", "window_size", "softcap") if n in bound}
        keywords, notes = fa.map_arguments(fa_bound, ctx, self.API)
        keywords = [kw for kw in keywords if kw[0] != "align"]
        if not is_none(value.get("cache_seqlens")):
            keywords.insert(0, ("cache_seqlens", value["cache_seqlens"]))
        if literal_bool(value.get("return_softmax_lse")):
            keywords.append(("return_lse", cst.Name("True")))
        return keywords, notes

    def drop_in(self, call, value, why):
        """The call itself, on flashport's drop-in ``flash_attn_with_kvcache`` (same signature and
        behaviour, in-place cache update included): arguments, order and comments unchanged.

        Raises:
          Refuse: for what the drop-in cannot do (new k/v without cache_seqlens, only one of k/v).
        """
        if is_none(value.get("k")) != is_none(value.get("v")):
            raise Refuse("only one of k/v is given")
        if not is_none(value.get("k")) and is_none(value.get("cache_seqlens")):
            raise Refuse(
                "new k/v without cache_seqlens: where flash-attn writes them is not expressible here"
            )
        if self.DROP_IN is None:
            raise Refuse(f"{self.API} has no drop-in replacement: {why}")
        note = f"drop-in flash_attn_with_kvcache (updates the caches in place like flash-attn): {why}"
        return on_drop_in(call, self.DROP_IN, note)
