"""flash-attn's private kernel signatures per release, and which release a call was written for (FPA008).

The private entry points changed with flash-attn's releases: 2.0.2 added ``rng_state`` (and the
forward's 8th value), 2.3 added ``window_size``, 2.4
``alibi_slopes`` (and ``deterministic`` in the backward), 2.6 ``softcap`` before ``alibi_slopes``, and
2.7 split ``window_size`` into ``window_size_left`` / ``window_size_right`` and cut the forward's
return from 8 values to 4. A call's release range comes from the ``if``/``elif``/``else`` tests around
it that compare a flash-attn version (``if flash_attn_version >= version.parse("2.7.0"):``), else
from the configured ``--flash-attn-version``; the call must then bind to exactly one convention in
that range (its arguments and the number of names it is unpacked into decide), or it is refused as
ambiguous.
"""

from __future__ import annotations

import dataclasses
import re

import libcst as cst

from flashport.rules.apis import flash_attn as apis_flash_attn
from flashport.rules.apis.model import pad
from flashport.rules.base import Refuse, RuleContext, RuleOptions
from flashport.rules.common import node_context
from flashport.rules.common.binding import Signature
from flashport.rules.common.literals import is_none, literal_bool, literal_string


@dataclasses.dataclass(frozen=True)
class Convention:
    """The private kernels of flash-attn releases ``[start, end)``.

    Attributes:
      suffix: the drop-in's name suffix (``""`` for 2.7+, ``"_v2_6"``), None when flashport has none.
      tails: per function, the parameters after the tensors (and ``cu_seqlens``/``max_seqlen``);
        a function missing here is unknown for these releases (any call may fit).
      returns: how many values the forwards return.
    """

    start: tuple[int, ...]
    end: tuple[int, ...] | None
    suffix: str | None
    tails: dict[str, tuple[str, ...]]
    returns: int

    def signature(self, function: str) -> Signature | None:
        """The full parameter list of ``function`` in these releases (None when unknown)."""
        tail = self.tails.get(function)
        if tail is None:
            return None
        return Signature(apis_flash_attn.private_leading(function) + tail)


CONVENTIONS = tuple(Convention(*row) for row in apis_flash_attn.PRIVATE_RELEASES)
# parameters with a default (every other one is required in these releases)
OPTIONAL = apis_flash_attn.PRIVATE_OPTIONAL
OPTIONAL_VARLEN_FORWARD = apis_flash_attn.PRIVATE_OPTIONAL_VARLEN_FORWARD


padded = pad  # versions compare by release, whatever their length


def _version_literal(node: cst.BaseExpression) -> tuple[int, ...] | None:
    """``"2.6.0"``, ``version.parse("2.6.0")``, ``Version("2.6.0")`` as a padded tuple; else None."""
    if isinstance(node, cst.Call) and len(node.args) == 1:
        node = node.args[0].value
    text = literal_string(node)
    if text is None or not re.fullmatch(r"\d+(\.\d+)*", text):
        return None
    return padded(tuple(int(part) for part in text.split(".")))


_FLIP = {"GreaterThanEqual": "LessThanEqual", "GreaterThan": "LessThan"}
_FLIP.update({v: k for k, v in list(_FLIP.items())})
_NEGATE = {
    "GreaterThanEqual": "LessThan",
    "GreaterThan": "LessThanEqual",
    "LessThan": "GreaterThanEqual",
    "LessThanEqual": "GreaterThan",
}


def _bound(test: cst.BaseExpression, negated: bool) -> tuple[str, tuple[int, ...]] | None:
    """``("lo", X)`` / ``("hi", X)`` (release range ``[X, ...)`` / ``[..., X)``) that a branch's test
    puts on a flash-attn version (a name mentioning ``flash``); None for any other test."""
    if not (isinstance(test, cst.Comparison) and len(test.comparisons) == 1):
        return None
    left, target = test.left, test.comparisons[0]
    bound, kind = _version_literal(target.comparator), type(target.operator).__name__
    if bound is None and (bound := _version_literal(left)) is not None:
        left, kind = target.comparator, _FLIP.get(kind, kind)
    if bound is None or kind not in _NEGATE or "flash" not in cst.Module([]).code_for_node(left).lower():
        return None
    kind = _NEGATE[kind] if negated else kind
    after = (*bound[:-1], bound[-1] + 1)  # the next release after X
    if kind == "GreaterThanEqual":
        return "lo", bound
    if kind == "GreaterThan":
        return "lo", after
    return "hi", bound if kind == "LessThan" else after


def release_range(ctx: RuleContext) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """``[lo, hi)``: the flash-attn releases the site runs under, from the version tests of the
    branches around it, else the configured version alone."""
    lo: tuple[int, ...] = (0, 0, 0)
    hi: tuple[int, ...] | None = None
    seen = False
    child = ctx.node
    for up in ctx.ancestors:
        if isinstance(up, cst.If) and child is not up.test:
            found = _bound(up.test, negated=child is not up.body)
            if found is not None:
                seen = True
                if found[0] == "lo":
                    lo = max(lo, found[1])
                else:
                    hi = found[1] if hi is None else min(hi, found[1])
        child = up
    if not seen:
        version = padded(ctx.options.flash_attn_version)
        return version, (*version[:-1], version[-1] + 1)
    return lo, hi


def _unpacked(ctx: RuleContext) -> tuple[int, bool] | None:
    """How many names the call's result is unpacked into, and whether one of them is starred
    (``out, *_ = ...`` takes any number of values from one on); None when it is not unpacked."""
    up = ctx.ancestors[0] if ctx.ancestors else None
    if isinstance(up, cst.Assign) and up.value is ctx.node:
        for target in up.targets:
            if isinstance(target.target, (cst.Tuple, cst.List)):
                elements = target.target.elements
                return len(elements), any(isinstance(e, cst.StarredElement) for e in elements)
    return None


def _unpack_fits(unpacked: tuple[int, bool] | None, returns: int) -> bool:
    if unpacked is None:
        return True
    names, starred = unpacked
    return returns >= names - 1 if starred else names == returns


def value_convention(function: str, ctx: RuleContext) -> Convention:
    """The one convention of the site's release range that has ``function`` (for a value: its
    callers are out of sight, so the range alone must decide).

    Raises:
      Refuse: when the range spans conventions with different signatures, or the one has no drop-in.
    """
    lo, hi = release_range(ctx)
    found = [
        c
        for c in CONVENTIONS
        if not ((c.end is not None and c.end <= lo) or (hi is not None and hi <= c.start))
        and function in c.tails
    ]
    span = f"flash-attn {_text(lo)} to {_text(hi) if hi else 'latest'}"
    if len({c.signature(function) for c in found}) != 1 or len({c.returns for c in found}) != 1:
        raise Refuse(f"{function}'s signature differs between the releases of {span}: ambiguous for a value")
    if found[0].suffix is None:
        raise Refuse(f"{function} of flash-attn 2.3 ({span}): flashport has no drop-in with its signature")
    return found[0]


def _fits(convention: Convention, call: cst.Call, function: str, ctx: RuleContext) -> dict[str, cst.Arg]:
    """The call bound to ``convention``'s signature (empty with a splat or an unknown signature).

    Raises:
      Refuse: when it does not fit (arguments, required ones missing, unpacked names).
    """
    unpacked = _unpacked(ctx)
    if function.endswith("_forward") and not _unpack_fits(unpacked, convention.returns):
        assert unpacked is not None
        raise Refuse(
            f"{function}'s result is unpacked into {unpacked[0]}{' or more' if unpacked[1] else ''} names, "
            f"not the {convention.returns} it returns"
        )
    signature = convention.signature(function)
    if signature is None:
        return {}
    if any(arg.star for arg in call.args):
        # a **dict splat whose keys are known: a key this release lacks would raise TypeError there
        lacking = sorted(node_context.splat_keys(call, ctx) - set(signature.names))
        if lacking:
            raise Refuse(f"{function}'s **kwargs splat passes {lacking[0]!r}, which this release lacks")
        return {}
    bound = signature.bind(call, function)
    window = bound["window_size"].value if "window_size" in bound else None
    if window is not None and (
        is_none(window) or literal_bool(window) is not None or isinstance(window, (cst.Integer, cst.Float))
    ):  # flash-attn 2.3-2.6 read window_size[0]: this is another release's rng_state / return_softmax
        raise Refuse(f"{function} call with a window_size that is no pair (flash-attn 2.3-2.6 index it)")
    varlen_defaults = function == "_flash_attn_varlen_forward" and convention.start >= (2, 6, 0)  # 2.6.3 on
    optional = OPTIONAL | (OPTIONAL_VARLEN_FORWARD if varlen_defaults else set())
    missing = [name for name in signature.names if name not in bound and name not in optional]
    if missing:
        raise Refuse(f"{function} call without {missing[0]!r}")
    return bound


def convention_for(
    call: cst.Call, function: str, ctx: RuleContext
) -> tuple[Convention, dict[str, cst.Arg], str | None]:
    """The one convention of the site's release range that the call fits, with its bound arguments
    and, when the range came from the default ``--flash-attn-version`` alone (a version the user
    names is kept) and the call fits none of it but
    exactly one other release's (its arguments or unpacked names would raise under the configured
    version, so the code was written for that release), a note saying so.

    Raises:
      Refuse: when none fits, more than one does (ambiguous), or the one that fits has no drop-in.
    """
    lo, hi = release_range(ctx)
    fits, reasons = _fitting(call, function, ctx, lo, hi)
    single = hi is not None and hi == (*lo[:-1], lo[-1] + 1)
    span = (
        f"flash-attn {_text(lo)}" if single else f"flash-attn {_text(lo)} to {_text(hi) if hi else 'latest'}"
    )
    inferred = None
    default = RuleOptions.__dataclass_fields__["flash_attn_version"].default
    elsewhere = ""
    if not fits and single and not _has_version_test(ctx) and ctx.options.flash_attn_version == default:
        anywhere, _ = _fitting(call, function, ctx, (0, 0, 0), None, known_only=True)
        if len(anywhere) > 1:
            ranges = " and ".join(
                f"{_text(c.start)} to {_text(c.end) if c.end else 'latest'}" for c, _ in anywhere
            )
            elsewhere = (
                f"; it fits the private signatures of flash-attn {ranges}, which read its arguments "
                "differently: set --flash-attn-version to the release it was written for"
            )
        if len(anywhere) == 1 and anywhere[0][0].suffix is not None:
            fits = anywhere
            convention = anywhere[0][0]
            inferred = (
                f"fits only the private signature of flash-attn {_text(convention.start)} to "
                f"{_text(convention.end) if convention.end else 'latest'} (under the configured {span} "
                f"it would raise: {reasons[-1] if reasons else 'no known signature'}): ported to that "
                "release's drop-in"
            )
    if not fits:
        raise Refuse(f"{reasons[-1] if reasons else 'no known signature'} ({span}){elsewhere}")
    if len(fits) > 1:
        raise Refuse(
            f"{function} fits the private signatures of several flash-attn releases in {span} "
            "(their arguments or return values differ): ambiguous"
        )
    convention, bound = fits[0]
    if convention.suffix is None:
        raise Refuse(f"{function} of flash-attn 2.3 ({span}): flashport has no drop-in with its signature")
    return convention, bound, inferred


def _fitting(call, function, ctx, lo, hi, known_only=False) -> tuple[list, list[str]]:
    """The conventions of releases ``[lo, hi)`` the call fits (with its bound arguments), and why
    the others do not; ``known_only``: only those whose signature of ``function`` is known."""
    fits, reasons = [], []
    for convention in CONVENTIONS:
        if (convention.end is not None and convention.end <= lo) or (
            hi is not None and hi <= convention.start
        ):
            continue
        if known_only and function not in convention.tails:
            continue
        try:
            fits.append((convention, _fits(convention, call, function, ctx)))
        except Refuse as refusal:
            reasons.append(refusal.reason)
    return fits, reasons


def _has_version_test(ctx: RuleContext) -> bool:
    """Whether an ``if`` around the site tests a flash-attn version (then its range is the code's)."""
    child = ctx.node
    for up in ctx.ancestors:
        if isinstance(up, cst.If) and child is not up.test and _bound(up.test, negated=False) is not None:
            return True
        child = up
    return False


def _text(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))
