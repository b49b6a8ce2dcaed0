"""FPA007 flash-attn-with-kvcache: ``flash_attn_with_kvcache`` -> a functional ``kvcache_attention`` or the drop-in.

What it rewrites:
  ``flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=..., softmax_scale=...,
  causal=..., window_size=..., softcap=..., return_softmax_lse=...)`` from ``flash_attn`` /
  ``flash_attn.flash_attn_interface`` into
  ``flashport.integrations.flash_attn_compat.kvcache_attention(...)``, in two cases:

  * no new ``k``/``v``: a pure read of the cache (nothing is mutated), always safe;
  * new ``k``/``v`` whose in-place cache update is **provably not relied on**: ``k_cache`` and
    ``v_cache`` are plain local names of the enclosing function (assigned there, not parameters,
    not ``global``/``nonlocal``), read nowhere else, and the call is not inside a loop. The
    functional call inserts the rows into a copy and attends over it, so the output is the same.

  Every other call -- new ``k``/``v`` whose in-place update may be relied on (caches that are
  attributes, parameters, aliases, updated in a loop), ``rotary_cos``/``rotary_sin``,
  ``cache_batch_idx``, ``cache_leftpad``, ``block_table``, a non-literal ``return_softmax_lse``, a
  ``*args``/``**kwargs`` splat --
  keeps its arguments and becomes a call of the drop-in
  ``flashport.integrations.flash_attn_compat.flash_attn_with_kvcache``, which has flash-attn's
  signature and full behaviour: it writes the new rows **in place** into the caches (rotated, at
  ``cache_seqlens``, through ``cache_batch_idx`` or the pages of ``block_table``) and attends like
  flash-attn (rotary positions, ``cache_leftpad``, per-sequence bottom-right causal/window).

Semantics mapping:
  layout ``[B, S, H, D]`` kept; keys ``j < cache_seqlens[b] (+ S_new)`` are valid; causal/window are
  bottom-right **per sequence** (offset ``L_b - S_q``), built as a boolean mask; ``softmax_scale`` ->
  ``scale``; ``window_size`` (-1 = unbounded) -> ``window`` (None); ``softcap`` 0.0 -> off;
  ``return_softmax_lse=True`` -> ``return_lse=True`` (the same ``(out, lse[B, H, Sq])``);
  ``num_splits`` / ``rotary_interleaved`` are dropped (kernel tuning / unused without rotary).
  Only ``q, k_cache, v_cache, k, v`` may be positional (the rest moved between 2.2 and 2.6).

What it refuses:
  ``alibi_slopes``, only one of ``k``/``v``, new ``k``/``v`` without ``cache_seqlens``, positional
  arguments after ``v`` (their positions changed between releases), unknown arguments.

Example::

    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True)
    # becomes
    out = flashport.integrations.flash_attn_compat.kvcache_attention(q, k_cache, v_cache, cache_seqlens=lens, scale=None, causal=True)
    out = flash_attn_with_kvcache(q, self.k_cache, self.v_cache, k, v, cache_seqlens=lens, causal=True)
    # becomes (the caches are updated in place, as before)
    out = flashport.integrations.flash_attn_compat.flash_attn_with_kvcache(q, self.k_cache, self.v_cache, k, v, cache_seqlens=lens, causal=True)
"""

from __future__ import annotations

from typing import ClassVar

import libcst as cst

from flashport.rules import _flash_attn as fa
from flashport.rules import _node_context
from flashport.rules.base import (
    Refuse,
    Rewrite,
    Rule,
    Signature,
    build_call,
    callee_name,
    dotted,
    is_none,
    literal_bool,
    register,
)

MODULE = "flashport.integrations.flash_attn_compat"
POSITIONAL = ("q", "k_cache", "v_cache", "k", "v")
KEYWORDS = (
    "rotary_cos",
    "rotary_sin",
    "cache_seqlens",
    "cache_batch_idx",
    "cache_leftpad",
    "block_table",
    "softmax_scale",
    "causal",
    "window_size",
    "softcap",
    "rotary_interleaved",
    "alibi_slopes",
    "num_splits",
    "return_softmax_lse",
)
UNSUPPORTED = {
    "rotary_cos": "fused rotary embedding (rotary_cos/rotary_sin) is not part of the attention contract; apply rotary first",
    "rotary_sin": "fused rotary embedding (rotary_cos/rotary_sin) is not part of the attention contract; apply rotary first",
    "cache_batch_idx": "cache_batch_idx (indirect cache rows) has no portable equivalent",
    "cache_leftpad": "cache_leftpad (left-padded caches) has no portable equivalent",
    "block_table": "block_table (paged KV cache) has no portable equivalent",
    "alibi_slopes": "alibi_slopes: flash-attn's symmetric ALiBi bias has no portable equivalent here",
}
# What only the drop-in ``flash_attn_compat.flash_attn_with_kvcache`` (flash-attn's full behaviour,
# in-place update included) can port; the functional ``kvcache_attention`` cannot.
DROP_IN_ONLY = ("rotary_cos", "rotary_sin", "cache_batch_idx", "cache_leftpad", "block_table")


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
    node = _node_context.locate(call, ctx)
    if node is None:
        return "the call could not be located in its function"
    function = next((a for a in _node_context.ancestors(node, ctx) if isinstance(a, cst.FunctionDef)), None)
    if function is None:
        return "the call is not inside a function"
    for up in _node_context.ancestors(node, ctx):
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


NO_FA3_DROP_IN = (
    "flashport has no drop-in for FA3's flash_attn_with_kvcache (page_table, varlen decode and qv "
    "have no portable equivalent, and releases differ in what return_softmax_lse=True returns), so "
    "arguments known only at run time cannot be checked"
)


@register
class FlashAttnWithKVCache(Rule):
    """Rewrite ``flash_attn_with_kvcache`` to a functional call where the in-place update is not relied on."""

    CODE = "FPA007"
    NAME = "flash-attn-with-kvcache"
    API = "flash_attn.flash_attn_with_kvcache"
    FRAMEWORK = "torch"
    SOURCES = fa.sources("flash_attn_with_kvcache")
    TRIGGERS = (b"flash_attn",)
    GPU_MODULES: ClassVar[tuple[str, ...]] = ("flash_attn",)
    TARGET = MODULE + ".kvcache_attention"
    KEYWORDS: tuple[str, ...] = KEYWORDS
    UNSUPPORTED: dict[str, str] = UNSUPPORTED
    DROPPED: tuple[str, ...] = ("num_splits", "rotary_interleaved")
    DROP_IN: str | None = MODULE + ".flash_attn_with_kvcache"  # FA3 (FPA012, other signature) sets None

    def check_call(self, call, ctx):
        """Refuse what the contract cannot hold; rewrite reads, and updates nobody relies on, to the
        functional form; the rest (live in-place updates, rotary, paged, splats...) to the drop-in."""
        if self.DROP_IN:
            splat = fa.splat_drop_in(call, ctx)
            if splat is not None:
                return splat
        elif any(arg.star for arg in call.args):
            raise Refuse(f"*args/**kwargs splat: {NO_FA3_DROP_IN}")
        if sum(1 for a in call.args if a.keyword is None and not a.star) > len(POSITIONAL):
            raise Refuse(
                "arguments after v must be passed by keyword: their positions changed between releases"
            )
        bound = Signature(POSITIONAL, self.KEYWORDS).bind(call, self.API)
        q, k_cache, v_cache = fa.required(bound, POSITIONAL[:3], self.API)
        value = {name: arg.value for name, arg in bound.items()}
        if self.DROP_IN and is_none(value.get("alibi_slopes")):
            drop_in = [name for name in DROP_IN_ONLY if not is_none(value.get(name))]
            if drop_in:
                return self.drop_in(call, value, f"{drop_in[0]}= needs flash-attn's full behaviour")
        for name, reason in self.UNSUPPORTED.items():
            if not is_none(value.get(name)):
                raise Refuse(reason)
        self.check_extra(value, ctx)
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
        return Rewrite(call.with_changes(func=dotted(self.DROP_IN)), imports=(MODULE,), notes=(note,))

    def check_extra(self, value, ctx):
        """Hook for version-specific refusals (FA3 subclasses it)."""
