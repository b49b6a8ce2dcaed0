"""FlashAttention-3's private kernels (FPA008): which FA3 build a call was written for, and its drop-in.

FA3's ``_flash_attn_forward`` / ``_flash_attn_backward`` changed their parameter lists between
builds (``rules/apis/flash_attn.py`` ``FA3_PRIVATE_BUILDS``): parameters were inserted in the middle
(``qv``, ``seqlens_rotary``), removed (``sink_token_length``), split (``window_size`` into
``window_size_left``/``_right``) and renamed (``out`` to ``out_``, the backward's ``causal`` to
``is_causal``), and the backward's result changed from ``(dq, dk, dv, softmax_d)`` to ``softmax_d``.
A call goes to the drop-in of the latest build whose signature it fits when every build it fits
binds its arguments to the same parameters and, where the result is used, returns the same
values; a ``**kwargs`` splat (bound at run time) and a value go to the latest build's drop-in.
"""

from __future__ import annotations

import libcst as cst

from flashport.rules.apis import flash_attn as apis_flash_attn
from flashport.rules.apis.model import REQUIRED
from flashport.rules.base import Refuse, Rewrite
from flashport.rules.common import values
from flashport.rules.common.calls import dotted, on_drop_in
from flashport.rules.common.literals import is_none, literal_bool
from flashport.rules.flash_attn.fa3_fa4 import FA3_COMPAT
from flashport.rules.flash_attn.private_kernels import _unpacked

SOURCES = tuple(name for api in apis_flash_attn.FA3_PRIVATE_APIS for name in api.names)
_TENSORS = frozenset(("q", "k", "v", "dout", "softmax_lse"))  # tensors every build requires
_BACKWARD_TENSORS = _TENSORS | {"out"}  # the forward's out/out_ is an optional output buffer
_WINDOW = "window_size"
_FORWARD_RETURNS = 4
# probes that ask about the object itself: every use of the name becomes the same drop-in, so they
# describe the function the file then calls (a plain Python function with that build's signature)
_ASKS_THE_OBJECT = ("inspected with inspect.", "inspected with isinstance(", "inspected with callable(")


def _date(build: tuple[int, ...]) -> str:
    return "-".join(f"{part:02d}" for part in build)


def _function(ctx) -> str:
    return ctx.qualified_name.rsplit(".", 1)[-1]


def _bind(call: cst.Call, parameters, tensors: frozenset[str]) -> dict[int, str]:
    """Argument index -> parameter name of ``call`` under one build's ``parameters``.

    Raises:
      Refuse: when the call does not fit (too many positionals, unknown or repeated names, a
        required parameter missing, a literal of the wrong kind: a pair where no window goes, a
        number, bool or None where a window pair or a required tensor goes).
    """
    names = [p.name for p in parameters]
    bound: dict[int, str] = {}
    position = 0
    for index, arg in enumerate(call.args):
        if arg.star:
            continue
        if arg.keyword is None:
            if position >= len(names):
                raise Refuse(f"more than {len(names)} positional arguments")
            name = names[position]
            position += 1
        else:
            name = arg.keyword.value
            if name not in names:
                raise Refuse(f"no parameter {name!r}")
        if name in bound.values():
            raise Refuse(f"{name!r} given twice")
        _check_literal(name, arg.value, tensors)
        bound[index] = name
    given = set(bound.values())
    missing = [p.name for p in parameters if p.default is REQUIRED and p.name not in given]
    if missing and not any(arg.star == "**" for arg in call.args):
        raise Refuse(f"{missing[0]!r} missing")
    return bound


def _check_literal(name: str, value: cst.BaseExpression, tensors: frozenset[str]) -> None:
    pair = isinstance(value, (cst.Tuple, cst.List))
    scalar = is_none(value) or literal_bool(value) is not None or isinstance(value, (cst.Integer, cst.Float))
    if name == _WINDOW and scalar:
        raise Refuse("a number, bool or None where its window_size pair goes")
    if name != _WINDOW and pair:
        raise Refuse(f"a tuple where its {name} goes")
    if name in tensors and scalar:
        raise Refuse(f"a literal where its tensor {name} goes")


def _result_used(ctx) -> bool:
    up = ctx.ancestors[0] if ctx.ancestors else None
    return not isinstance(up, cst.Expr)


def port_call(call: cst.Call, ctx) -> Rewrite:
    """The call on the drop-in of the FA3 build it was written for.

    Raises:
      Refuse: a ``*args`` splat, a call that fits no build (or only FA3's 2024 dense builds, which
        have no drop-in), builds that bind its arguments differently or return different values
        where the result is used, a forward's result unpacked into other than its 4 values.
    """
    function = _function(ctx)
    builds = apis_flash_attn.FA3_PRIVATE_BUILDS[function]
    if any(arg.star == "*" for arg in call.args):
        raise Refuse(
            f"*args splat into FlashAttention-3's {function}: its positions changed between FA3 builds "
            "(qv and seqlens_rotary were inserted), so which build it fills is unknown"
        )
    unpacked = _unpacked(ctx)
    if function.endswith("forward") and unpacked is not None:
        names, starred = unpacked
        if (names - 1 > _FORWARD_RETURNS) if starred else names != _FORWARD_RETURNS:
            raise Refuse(f"{function}'s result is unpacked into {names} names, not the 4 FA3's builds return")
    splat = any(arg.star == "**" for arg in call.args)
    fits, reasons = [], []
    for build, text in builds[-1:] if splat else builds:
        try:
            tensors = _BACKWARD_TENSORS if function.endswith("backward") else _TENSORS
            fits.append((build, _bind(call, apis_flash_attn.fa3_private_params(text), tensors)))
        except Refuse as refusal:
            reasons.append(f"{_date(build)}: {refusal.reason}")
    if not fits:
        raise Refuse(
            f"FlashAttention-3's {function} call fits no FA3 build's signature from 2025-01-07 on "
            f"(FA3's 2024 dense-only builds have no drop-in): {'; '.join(reasons[-2:])}"
        )
    if len({tuple(sorted(bound.items())) for _, bound in fits}) > 1:
        raise Refuse(
            f"FlashAttention-3's {function} call fits builds "
            f"{', '.join(_date(b) for b, _ in fits)}, which read its arguments as different parameters: ambiguous"
        )
    if function.endswith("backward") and _result_used(ctx):
        grads = {b < apis_flash_attn.FA3_PRIVATE_GRADS_RETURNED for b, _ in fits}
        if len(grads) > 1:
            raise Refuse(
                f"{function}'s result is used, and the FA3 builds the call fits return (dq, dk, dv, "
                "softmax_d) before 2025-07-24 and softmax_d after: ambiguous"
            )
    build = fits[-1][0]
    target = apis_flash_attn.fa3_private_drop_in(function, build)
    span = f"{_date(fits[0][0])}" + (f" to {_date(build)}" if len(fits) > 1 else "")
    note = (
        f"drop-in {target}: the call fits the signature of FA3's builds of {span} "
        "(each reads its arguments alike), with their return convention and in-place gradients"
        + ("; the **kwargs splat is bound at run time by the latest build's signature" if splat else "")
    )
    return on_drop_in(call, f"{FA3_COMPAT}.{target}", note)


def port_value(node: cst.BaseExpression, ctx) -> Rewrite:
    """A value (passed on, stored, inspected with ``inspect.*``, ``isinstance`` or ``callable``) on the
    latest build's drop-in, a plain function with that build's signature, so inspection-driven
    callers bind to it.

    Raises:
      Refuse: a value compared, re-exported, monkeypatched or inside an import guard.
    """
    why = values.probe(ctx)
    if why is not None and not why.startswith(_ASKS_THE_OBJECT):
        raise Refuse(f"used as a value: {why}")
    function = _function(ctx)
    target = apis_flash_attn.fa3_private_drop_in(
        function, apis_flash_attn.FA3_PRIVATE_BUILDS[function][-1][0]
    )
    note = (
        f"{values.describe(node, ctx)}: the value is now the drop-in {target}, a plain function with the "
        "signature and return convention of FA3's latest build (callers written for an older build's "
        "parameter names get a TypeError)"
    )
    return Rewrite(dotted(f"{FA3_COMPAT}.{target}"), imports=(FA3_COMPAT,), notes=(note,))
