"""Binding a call's arguments to a source API's parameters and checking them: :class:`Signature`,
:func:`required`, and the dropout checks every target shares."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING

import libcst as cst

from flashport.rules.common.literals import is_zero, training_gated_zero
from flashport.rules.site import Refuse, RuleContext

if TYPE_CHECKING:
    from flashport.rules.apis.model import Param

# ----------------------------------------------------------------------------------- signatures


@dataclasses.dataclass(frozen=True)
class Signature:
    """A source API's parameter list for one version.

    Attributes:
      positional: names that may be passed positionally, in order.
      keyword_only: names that must be passed by keyword.
    """

    positional: tuple[str, ...]
    keyword_only: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """Every parameter name."""
        return self.positional + self.keyword_only

    @classmethod
    def of(cls, parameters: Sequence[Param]) -> Signature:
        """The signature of a source API's catalogued ``parameters`` (:mod:`flashport.rules.apis`)."""
        return cls(
            tuple(p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD),
            tuple(p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY),
        )

    def bind(self, call: cst.Call, api: str) -> dict[str, cst.Arg]:
        """Map every argument of ``call`` to its parameter name.

        Raises:
          Refuse: on ``*args``/``**kwargs`` splats, too many positionals, unknown or repeated names.
        """
        bound: dict[str, cst.Arg] = {}
        index = 0
        for arg in call.args:
            if arg.star == "**":
                raise Refuse("**kwargs splat: its keys are unknown statically")
            if arg.star == "*":
                raise Refuse("*args splat: which parameters it fills is unknown statically")
            if arg.keyword is None:
                if index >= len(self.positional):
                    raise Refuse(f"{api} takes at most {len(self.positional)} positional arguments here")
                name = self.positional[index]
                index += 1
            else:
                name = arg.keyword.value
                if name not in self.names:
                    raise Refuse(f"unknown argument {name!r} for {api} at this version")
            if name in bound:
                raise Refuse(f"argument {name!r} given twice")
            bound[name] = arg
        return bound


def required(bound: dict[str, cst.Arg], names: tuple[str, ...], api: str) -> list[cst.BaseExpression]:
    """The values of required arguments, or Refuse naming the missing one."""
    out = []
    for name in names:
        if name not in bound:
            raise Refuse(f"{api} call without {name!r}")
        out.append(bound[name].value)
    return out


_LITERALS = (
    cst.Integer,
    cst.Float,
    cst.Imaginary,
    cst.SimpleString,
    cst.ConcatenatedString,
    cst.FormattedString,
)


def tensors(bound: dict[str, cst.Arg], names: tuple[str, ...], api: str) -> list[cst.BaseExpression]:
    """The values of required tensor arguments (:func:`required`), none of them a literal.

    Raises:
      Refuse: for a missing one, or a literal number, string, ``None``/``True``/``False`` where a
        tensor goes: the call was written for another signature under that name (flash-attn 1.x's
        ``flash_attn_func(qkv, cu_seqlens, dropout_p, max_s)``), so binding it to this one would
        change its meaning.
    """
    values = required(bound, names, api)
    for name, value in zip(names, values, strict=True):
        if isinstance(value, _LITERALS) or (
            isinstance(value, cst.Name) and value.value in ("None", "True", "False")
        ):
            text = cst.Module([]).code_for_node(value)
            raise Refuse(
                f"{name}={text} is a literal, not a tensor: the call does not fit {api}'s signature "
                "(it was written for another release's or another function's under that name)"
            )
    return values


def no_dropout(
    node: cst.BaseExpression | None,
    name: str,
    ctx: RuleContext,
    why: str = "flashport.attention has no dropout",
) -> list[str]:
    """Check a dropout argument is zero, for targets that cannot take dropout; returns notes
    (``--inference`` drops a training-gated one).

    Raises:
      Refuse: for dropout that may be non-zero; ``why`` says why the target cannot carry it.
    """
    if node is None or is_zero(node):
        return []
    if training_gated_zero(node) and ctx.options.inference:
        return [f"dropped {name}={ctx.code(node)} (--inference: treated as 0)"]
    if training_gated_zero(node):
        raise Refuse(f"{name}={ctx.code(node)} is non-zero in training; {why} (--inference drops it)")
    raise Refuse(f"{name}={ctx.code(node)} may be non-zero; {why}")


def carry_dropout(
    node: cst.BaseExpression | None, name: str, target: str, ctx: RuleContext
) -> tuple[list[tuple[str, cst.BaseExpression]], list[str]]:
    """Carry a dropout argument over verbatim as the target's ``target`` keyword.

    Returns ``(keywords, notes)``: no keyword for an absent or literal-zero dropout (the contract's
    default is 0), none either for a training-gated one under ``--inference`` (dropped, with a note),
    else ``[(target, node)]`` -- the expression itself, evaluated once by the new call. Place the
    keyword with :func:`insert_in_source_order`.
    """
    if node is None or is_zero(node):
        return [], []
    if training_gated_zero(node) and ctx.options.inference:
        return [], [f"dropped {name}={ctx.code(node)} (--inference: treated as 0)"]
    return [(target, node)], []
