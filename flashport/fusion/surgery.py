"""Edit jaxprs directly instead of retracing them: inline nested calls, splice traced snippets.

A :class:`Builder` copies the equations of one closed jaxpr into a new one while the caller decides,
equation by equation, to keep it, drop it, replace it by an edited equation, or inline another closed
jaxpr in its place (with fresh variables, its constants hoisted into the new jaxpr's constants and
its outputs standing in for the replaced equation's outputs). Nothing is re-bound, so the cost is
proportional to the number of equations touched, not to a retrace of the whole body.
"""

from __future__ import annotations

import numpy as np
from jax._src.interpreters import partial_eval as pe
from jax.extend import core as jcore

from flashport.fusion.graph import is_literal


class Builder:
    """Accumulates the equations of a rewritten version of ``closed`` (same inputs and outputs)."""

    def __init__(self, closed):
        self.src = closed.jaxpr
        self.constvars = list(closed.jaxpr.constvars)
        self.consts = list(closed.consts)
        self.eqns: list = []
        self.subst: dict = {}  # original var -> the atom that now holds its value

    def atom(self, v):
        """The atom holding the value of the source jaxpr's ``v`` in the new jaxpr."""
        return v if is_literal(v) else self.subst.get(v, v)

    def keep(self, eqn):
        """Append ``eqn`` (its inputs renamed where earlier edits replaced them)."""
        invars = [self.atom(v) for v in eqn.invars]
        if all(a is v for a, v in zip(invars, eqn.invars, strict=False)):
            self.eqns.append(eqn)
            return
        self.alias(eqn.outvars, self._append(eqn.replace(invars=invars)))

    def _append(self, eqn) -> list:
        """Append ``eqn`` as jax's tracer would stage it; return the atoms holding its outputs.

        Like ``DynamicJaxprTrace``, a primitive with a constant-folding rule applied to literals
        becomes literals, and a forwarding rule (a same-type ``convert_element_type``, a no-op
        ``broadcast_in_dim``) forwards its input, so inlined bodies look as if they were retraced.
        """
        fold = pe.const_fold_rules.get(eqn.primitive)
        if fold is not None and any(is_literal(v) for v in eqn.invars):
            vals = fold(
                [v.val if is_literal(v) else None for v in eqn.invars],
                eqn.params,
                [v.aval for v in eqn.outvars],
            )
            if vals is not None and all(x is not None and np.shape(x) == () for x in vals):
                return [jcore.Literal(x, v.aval) for x, v in zip(vals, eqn.outvars, strict=False)]
        forward = pe.forwarding_rules.get(eqn.primitive)
        if forward is None or eqn.effects:
            self.eqns.append(eqn)
            return list(eqn.outvars)
        in_fwd, new = forward(eqn)
        if new is not None:
            self.eqns.append(new)
        return [v if i is None else eqn.invars[i] for v, i in zip(eqn.outvars, in_fwd, strict=False)]

    def inline(self, closed, in_atoms, *, source=None, traceback=None, expand=None) -> list:
        """Append ``closed``'s equations with fresh variables, reading ``in_atoms``; return its outputs.

        ``source`` (the replaced equation's SourceInfo) prefixes the inlined equations' name stacks;
        ``traceback``, when given, replaces their tracebacks (a snippet traced for this site should
        point at the user's code). ``expand(eqn)`` may return a nested ClosedJaxpr to inline
        recursively instead of keeping ``eqn``.
        """
        jaxpr = closed.jaxpr
        env = dict(zip(jaxpr.invars, in_atoms, strict=False))
        for v, val in zip(jaxpr.constvars, closed.consts, strict=False):
            env[v] = self.add_const(v.aval, val)

        def read(v):
            return v if is_literal(v) else env[v]

        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            info = _nested_source(source, eqn.source_info, traceback)
            body = expand(eqn) if expand is not None else None
            if body is not None:
                outs = self.inline(body, ins, source=info, expand=expand)
                env.update(
                    (v, o)
                    for v, o in zip(eqn.outvars, outs, strict=False)
                    if not isinstance(v, jcore.DropVar)
                )
                continue
            fresh = [
                jcore.DropVar(v.aval) if isinstance(v, jcore.DropVar) else jcore.Var(v.aval)
                for v in eqn.outvars
            ]
            outs = self._append(eqn.replace(invars=ins, outvars=fresh, source_info=info))
            env.update(zip(eqn.outvars, outs, strict=False))
        return [read(v) for v in jaxpr.outvars]

    def alias(self, outvars, atoms):
        """Later reads of ``outvars`` (the source jaxpr's) read ``atoms`` instead."""
        for v, a in zip(outvars, atoms, strict=False):
            if not isinstance(v, jcore.DropVar):
                self.subst[v] = a

    def add_const(self, aval, val):
        """A new constvar of the built jaxpr holding ``val``."""
        var = jcore.Var(aval)
        self.constvars.append(var)
        self.consts.append(val)
        return var

    def build(self):
        """The new ClosedJaxpr (constants that nothing reads any more are dropped)."""
        outvars = [self.atom(v) for v in self.src.outvars]
        used = {v for e in self.eqns for v in e.invars if not is_literal(v)}
        used.update(v for v in outvars if not is_literal(v))
        pairs = [(v, c) for v, c in zip(self.constvars, self.consts, strict=False) if v in used]
        jaxpr = self.src.replace(constvars=[v for v, _ in pairs], eqns=self.eqns, outvars=outvars)
        return jcore.ClosedJaxpr(jaxpr, [c for _, c in pairs])


def _nested_source(outer, inner, traceback=None):
    if outer is None:
        return inner
    return inner.replace(
        traceback=inner.traceback if traceback is None else traceback,
        name_stack=outer.name_stack + inner.name_stack,
    )
