"""Analyze a closed jaxpr (recursively through nested jaxprs) and evaluate it with sites replaced.

Analysis normalizes each jaxpr (small nested calls such as ``jnp.where``'s ``_where``, ``tril`` or a
jitted softmax are inlined so a pattern can cross them), finds matches and near-misses, and recurses
into ``jit``, ``custom_jvp_call``, ``custom_vjp_call``, ``remat``/``checkpoint``, ``scan``, ``cond`` and
``while`` bodies. :func:`rewrite` builds the rewritten jaxpr by editing equations (no retrace of the
program); :func:`run` evaluates a plan by re-binding every primitive and rebuilds nested calls through
the public APIs (``jax.jit``, ``jax.checkpoint``, ``lax.scan``/``switch``/``while_loop``) — the
rewrite uses it only for a nested body that needs constants its container cannot hold.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax._src import source_info_util
from jax.extend import core as jcore

from flashport.fusion.emit import emit
from flashport.fusion.graph import Graph, is_literal
from flashport.fusion.patterns import Miss, find_matches
from flashport.fusion.surgery import Builder

# Nested calls with any of these inside are kept as calls (analyzed recursively), not inlined.
HEAVY = frozenset(
    {
        "dot_general",
        "scan",
        "while",
        "cond",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "remat2",
        "checkpoint",
        "shard_map",
        "rng_bit_generator",
        "random_bits",
    }
)
CALLS = ("jit", "pjit", "closed_call", "core_call")
CUSTOM_JVP = ("custom_jvp_call", "custom_jvp_call_jaxpr")
CUSTOM_VJP = ("custom_vjp_call", "custom_vjp_call_jaxpr")
REMAT = ("remat2", "checkpoint")


@dataclasses.dataclass
class Plan:
    """The analysis of one jaxpr: its normalized form, matches, near-misses and changed children."""

    closed: jcore.ClosedJaxpr
    path: str
    matches: dict
    misses: list
    children: dict  # id(eqn) -> list[Plan | None] (one per sub-jaxpr; None = unchanged)
    all_children: dict = dataclasses.field(default_factory=dict)  # id(eqn) -> list[Plan]
    _fns: dict = dataclasses.field(default_factory=dict)

    @property
    def changed(self) -> bool:
        """Whether evaluating this plan differs from evaluating the original jaxpr."""
        return bool(self.matches) or bool(self.children)


def analyze(closed, path="", memo=None, dropout=None) -> Plan:
    """Normalize, match and recurse into ``closed`` (a ClosedJaxpr). Shared bodies share plans.

    ``dropout`` is passed to :func:`~.patterns.find_matches` (``"contract"`` fuses attention-weight
    dropout).
    """
    memo = {} if memo is None else memo
    key = id(closed.jaxpr)
    if key in memo:
        return memo[key]
    norm = normalize(closed)
    g = Graph(norm.jaxpr, norm.consts)
    matches, misses = find_matches(g, dropout)
    plan = Plan(
        closed=norm, path=path, matches={id(m.anchor): m for m in matches}, misses=misses, children={}
    )
    memo[key] = plan
    for eqn in norm.jaxpr.eqns:
        subs = _sub_jaxprs(eqn)
        if not subs:
            continue
        label = _label(eqn)
        child = [analyze(s, f"{path}/{label}" if path else label, memo, dropout) for s in subs]
        plan.all_children[id(eqn)] = child
        if any(c.changed for c in child):
            plan.children[id(eqn)] = [c if c.changed else None for c in child]
    return plan


def checked_rewrite(plan: Plan, backend):
    """:func:`rewrite`, never raising: a site whose replacement cannot be built is demoted to a near-miss.

    Returns the rewritten ClosedJaxpr, or None when nothing is left to rewrite or the rewrite of the
    whole program failed (then every site is demoted and the program runs exactly as written).
    """
    if not plan.changed:
        return None
    try:
        return rewrite(plan, backend)
    except Exception as err:  # noqa: BLE001 -- find the site(s) at fault, keep the others
        whole = err
    for p, m in list(all_sites(plan)):
        if isinstance(m, Miss):
            continue
        try:
            _site_jaxpr(m, _site_key(m, backend)[1], backend)
        except Exception as err:  # noqa: BLE001
            demote(p, m, err)
    if not any(p.matches for p, _ in all_sites(plan)):
        return None
    try:
        return rewrite(plan, backend)
    except Exception:  # noqa: BLE001 -- not one site: leave the whole program as written
        for p, m in list(all_sites(plan)):
            if not isinstance(m, Miss):
                demote(p, m, whole)
        return None


def demote(plan: Plan, match, err: Exception) -> None:
    """Turn ``match`` into a near-miss naming the internal error ``err``; its site stays as written."""
    plan.matches.pop(id(match.anchor), None)
    plan._fns.clear()
    info = {
        "location": match.info.get("location", "?"),
        "scores_shape": match.info.get("scores_shape", ()),
        "dtype": match.dtype,
    }
    reason = f"internal error while rewriting (site left unchanged): {type(err).__name__}: {err}"
    plan.misses.append(Miss(eqn=match.anchor, reason=reason, info=info))


def all_sites(plan: Plan, seen=None):
    """Every match and near-miss in ``plan`` and all nested jaxprs (each shared body once)."""
    seen = set() if seen is None else seen
    if id(plan) in seen:
        return
    seen.add(id(plan))
    yield from ((plan, m) for m in plan.matches.values())
    yield from ((plan, m) for m in plan.misses)
    for subs in plan.all_children.values():
        for sub in subs:
            yield from all_sites(sub, seen)


def _label(eqn):
    name = eqn.primitive.name
    if name in CALLS:
        return f"jit[{eqn.params.get('name', '?')}]"
    if name in CUSTOM_JVP + CUSTOM_VJP:
        dbg = getattr(eqn.params["call_jaxpr"].jaxpr, "debug_info", None)
        return f"{name}[{getattr(dbg, 'func_name', '?')}]"
    return name


def _sub_jaxprs(eqn):
    name, p = eqn.primitive.name, eqn.params
    if name in CALLS:
        return [p["jaxpr"]]
    if name in CUSTOM_JVP + CUSTOM_VJP:
        return [p["call_jaxpr"]]
    if name in REMAT:
        return [jcore.ClosedJaxpr(p["jaxpr"], ())]
    if name == "scan":
        return [p["jaxpr"]]
    if name == "cond":
        return list(p["branches"])
    if name == "while":
        return [p["body_jaxpr"]]
    return []


# ------------------------------------------------------------------------------- normalization


def _is_light(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in HEAVY or eqn.effects:
            return False
        for sub in _sub_jaxprs(eqn):
            if not _is_light(sub.jaxpr):
                return False
    return True


def _inlinable(eqn) -> bool:
    name = eqn.primitive.name
    if name in CALLS:
        return _is_light(eqn.params["jaxpr"].jaxpr)
    if name in CUSTOM_JVP:  # only a softmax-like body: the pattern crosses it (jax_softmax_custom_jvp)
        body = eqn.params["call_jaxpr"].jaxpr
        prims = {e.primitive.name for e in body.eqns}
        return _is_light(body) and "exp" in prims and "reduce_max" in prims
    return False


def normalize(closed):
    """Return ``closed`` with light nested calls inlined (the same object when there are none).

    The calls' equations are spliced in directly (fresh variables, name stacks nested under the
    call's), not retraced.
    """
    if not any(_inlinable(e) for e in closed.jaxpr.eqns):
        return closed
    b = Builder(closed)
    for eqn in closed.jaxpr.eqns:
        body = _inline_body(eqn)
        if body is None:
            b.keep(eqn)
        else:
            outs = b.inline(
                body, [b.atom(v) for v in eqn.invars], source=eqn.source_info, expand=_inline_body
            )
            b.alias(eqn.outvars, outs)
    return b.build()


def _inline_body(eqn):
    if not _inlinable(eqn):
        return None
    return eqn.params["jaxpr" if eqn.primitive.name in CALLS else "call_jaxpr"]


# ------------------------------------------------------------------------------- evaluation


def rewrite(plan: Plan, backend, memo=None):
    """Return ``plan.closed`` with matched sites replaced by flashport.attention, as a ClosedJaxpr.

    Built by editing the jaxpr, not by retracing it: each site's replacement is traced once per
    distinct site signature (:func:`_site_jaxpr`) and spliced in, dead equations (the scores and
    softmax) are dropped, and nested calls whose bodies changed get the rewritten bodies as params.
    Only a nested body that would need constants its container cannot hold (not ``jit``) falls back
    to retracing that one call. ``memo`` caches rewritten bodies (shared bodies are rewritten once)
    and site snippets.
    """
    memo = {} if memo is None else memo
    if id(plan) in memo:
        return memo[id(plan)]
    b = Builder(plan.closed)
    live = _live(plan)
    for i, eqn in enumerate(plan.closed.jaxpr.eqns):
        if i not in live:
            continue
        if id(eqn) in plan.matches:
            outs = _splice_site(b, plan.matches[id(eqn)], eqn, backend, memo)
        elif id(eqn) in plan.children:
            new = _rebuilt(plan, eqn, backend, memo)
            if new is not None:
                b.keep(new)
                continue
            outs = _splice_retraced(b, plan, eqn, backend)
        else:
            b.keep(eqn)
            continue
        b.alias(eqn.outvars, outs)
    memo[id(plan)] = out = b.build()
    return out


def _splice_site(b, match, eqn, backend, memo):
    key, inputs = _site_key(match, backend)
    snippet = memo.get(key)
    if snippet is None:
        snippet = memo[key] = _site_jaxpr(match, inputs, backend)
    return b.inline(
        snippet, [b.atom(v) for v in inputs], source=eqn.source_info, traceback=eqn.source_info.traceback
    )


def _site_key(match, backend):
    """A hashable signature of what :func:`emit` builds for ``match``, and its distinct inputs."""
    inputs = list(dict.fromkeys(match.inputs))
    slots = tuple(inputs.index(v) for v in match.inputs)
    avals = tuple((tuple(v.aval.shape), str(v.aval.dtype), bool(v.aval.weak_type)) for v in inputs)
    terms = tuple((t.dmap, t.mult, t.keep_when_true) for t in (*match.biases, *match.masks))
    static = (
        match.q_order,
        match.k_order,
        match.v_order,
        match.sizes,
        match.out_perm,
        match.canon_dims,
        match.groups,
        match.scale,
        match.softcap,
        len(match.biases),
        terms,
        match.causal,
        match.window,
        match.align,
        match.empty,
        match.dtype,
        str(match.out_dtype),
        None if match.dropout is None else match.dropout.rate,
    )
    return ("site", backend, avals, slots, _freeze(static)), inputs


def _freeze(x):
    if isinstance(x, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v) for v in x)
    return x


def _site_jaxpr(match, inputs, backend):
    """Trace :func:`emit` for ``match`` alone, on the avals of its distinct ``inputs``."""
    specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type) for v in inputs]

    def snippet(*vals):
        env = dict(zip(inputs, vals, strict=False))
        return [emit(match, env.__getitem__, backend)]

    return jax.make_jaxpr(snippet)(*specs)


def _rebuilt(plan, eqn, backend, memo):
    """``eqn`` with its changed bodies rewritten in place, or None when a body needs constants."""
    name, params = eqn.primitive.name, dict(eqn.params)
    subs = [None if c is None else rewrite(c, backend, memo) for c in plan.children[id(eqn)]]
    if name not in CALLS and any(s is not None and s.consts for s in subs):
        return None
    if name in CALLS:
        params["jaxpr"] = subs[0]
    elif name in CUSTOM_JVP + CUSTOM_VJP:
        params["call_jaxpr"] = subs[0]
    elif name in REMAT:
        params["jaxpr"] = subs[0].jaxpr
    elif name == "scan":
        params["jaxpr"] = subs[0]
    elif name == "cond":
        params["branches"] = tuple(
            br if s is None else s for s, br in zip(subs, params["branches"], strict=False)
        )
    elif name == "while":
        params["body_jaxpr"] = subs[0]
    else:
        raise AssertionError(name)
    return eqn.replace(params=params)


def _splice_retraced(b, plan, eqn, backend):
    specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type) for v in eqn.invars]

    def one_call(*vals):
        with _ctx(eqn):
            return _run_nested(plan, eqn, list(vals), backend)

    snippet = jax.make_jaxpr(one_call)(*specs)
    return b.inline(snippet, [b.atom(v) for v in eqn.invars], source=eqn.source_info)


def run(plan: Plan, args, backend):
    """Evaluate ``plan.closed`` on ``args`` with matched sites replaced by flashport.attention."""
    jaxpr = plan.closed.jaxpr
    env: dict[jcore.Var, object] = {}
    read = functools.partial(_read, env)
    _write_all(env, jaxpr.constvars, plan.closed.consts)
    _write_all(env, jaxpr.invars, args)
    live = _live(plan)
    for i, eqn in enumerate(jaxpr.eqns):
        if i not in live:
            continue
        with _ctx(eqn):
            if id(eqn) in plan.matches:
                outs = [emit(plan.matches[id(eqn)], read, backend)]
            elif id(eqn) in plan.children:
                outs = _run_nested(plan, eqn, [read(v) for v in eqn.invars], backend)
            else:
                outs = _bind(eqn, [read(v) for v in eqn.invars])
        _write_all(env, eqn.outvars, outs)
    return [read(v) for v in jaxpr.outvars]


def _live(plan: Plan):
    if "live" in plan._fns:
        return plan._fns["live"]
    jaxpr = plan.closed.jaxpr
    need = {v for v in jaxpr.outvars if not is_literal(v)}
    live = set()
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        if not eqn.effects and not any(o in need for o in eqn.outvars):
            continue
        live.add(i)
        ins = plan.matches[id(eqn)].inputs if id(eqn) in plan.matches else eqn.invars
        need.update(v for v in ins if not is_literal(v))
    plan._fns["live"] = live
    return live


def _run_nested(plan, eqn, invals, backend):
    name, p = eqn.primitive.name, eqn.params
    subs = plan.children[id(eqn)]
    if name in CALLS:
        return list(_jitted(subs[0], p.get("name", "fused"), backend)(*invals))
    if name in REMAT:
        fn = functools.partial(_run_flat, subs[0], backend)
        return list(jax.checkpoint(fn, prevent_cse=p["prevent_cse"], policy=p["policy"])(*invals))
    if name in CUSTOM_JVP + CUSTOM_VJP:
        new = _retraced(subs[0], backend)
        return _bind_params(eqn, invals, call_jaxpr=new)
    if name == "scan":
        nc, ncarry = p["num_consts"], p["num_carry"]
        consts, carry, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]

        def body(c, x):
            outs = run(subs[0], [*consts, *c, *x], backend)
            return tuple(outs[:ncarry]), tuple(outs[ncarry:])

        c, ys = jax.lax.scan(
            body, tuple(carry), tuple(xs), length=p["length"], reverse=p["reverse"], unroll=p["unroll"]
        )
        return [*c, *ys]
    if name == "cond":
        fns = [
            functools.partial(_run_flat, s, backend) if s is not None else functools.partial(_eval_closed, br)
            for s, br in zip(subs, p["branches"], strict=False)
        ]
        return list(jax.lax.switch(invals[0], fns, *invals[1:]))
    if name == "while":
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, init = invals[:nc], invals[nc : nc + nb], invals[nc + nb :]
        cond = p["cond_jaxpr"]
        out = jax.lax.while_loop(
            lambda c: _eval_closed(cond, *cconsts, *c)[0],
            lambda c: tuple(run(subs[0], [*bconsts, *c], backend)),
            tuple(init),
        )
        return list(out)
    raise AssertionError(name)


def _run_flat(plan, backend, *args):
    return run(plan, list(args), backend)


def _eval_closed(closed, *args):
    return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)


def _jitted(plan, name, backend):
    key = ("jit", backend)
    if key not in plan._fns:

        def fn(*args):
            return run(plan, list(args), backend)

        fn.__name__ = fn.__qualname__ = name
        plan._fns[key] = jax.jit(fn)
    return plan._fns[key]


def _retraced(plan, backend):
    avals = [
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
        for v in plan.closed.jaxpr.invars
    ]
    return jax.make_jaxpr(functools.partial(_run_flat, plan, backend))(*avals)


# ------------------------------------------------------------------------------- helpers


def _ctx(eqn):
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    return source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack)


def _bind(eqn, invals):
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return out if eqn.primitive.multiple_results else [out]


def _bind_params(eqn, invals, **changes):
    params = dict(eqn.params, **changes)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
    return out if eqn.primitive.multiple_results else [out]


def _read(env, v):
    return v.val if is_literal(v) else env[v]


def _write_all(env, vars_, vals):
    for v, x in zip(vars_, vals, strict=False):
        if not isinstance(v, jcore.DropVar):
            env[v] = x
