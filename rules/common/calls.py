"""Building the new call: :func:`build_call` (formatted like the original, comments and evaluation order
kept), :func:`insert_in_source_order`, :func:`keep_comments` and the small node builders."""

from __future__ import annotations

import re
from collections.abc import Sequence

import libcst as cst

from flashport.rules.common.literals import is_pure, literal_number
from flashport.rules.site import Refuse, Rewrite, RuleContext


def _is_literal(node: cst.BaseExpression) -> bool:
    """Numbers, strings, ``None``/``True``/``False`` (with a unary sign): nothing to evaluate."""
    if isinstance(node, cst.Name):
        return node.value in ("None", "True", "False")
    return literal_number(node) is not None or isinstance(node, (cst.SimpleString, cst.ConcatenatedString))


def _source_positions(node: cst.CSTNode, positions: dict[int, int]) -> list[int]:
    """Indices (in the original call) of the source arguments whose value appears in ``node``."""
    found: list[int] = []

    class _Finder(cst.CSTVisitor):
        def on_visit(self, inner: cst.CSTNode) -> bool:
            if id(inner) in positions:
                found.append(positions[id(inner)])
                return False
            return True

    if id(node) in positions:
        return [positions[id(node)]]
    node.visit(_Finder())
    return found


def insert_in_source_order(
    call: cst.Call,
    positional: Sequence[cst.BaseExpression | cst.Arg],
    keywords: list,
    entry: tuple[str, cst.BaseExpression],
    name: str,
    ctx: RuleContext,
) -> list:
    """``keywords`` with ``entry`` (whose value is an argument of ``call``) inserted so that it is
    evaluated in the same order, relative to the other carried-over arguments, as in ``call``.

    The entry goes right after the last keyword holding an argument that preceded it in ``call``.
    When the rewrite reorders the other arguments around it (e.g. SDPA's ``is_causal`` written
    before a positional dropout), the order still holds for a side-effect-free expression
    (:func:`is_pure`); otherwise the site is refused.

    Raises:
      Refuse: for an impure expression that cannot keep its place.
    """
    value = entry[1]
    # A literal argument cannot observe a side effect, so its place does not constrain the entry.
    positions = {
        id(arg.value): i
        for i, arg in enumerate(call.args)
        if arg.value is value or not _is_literal(arg.value)
    }
    here = positions[id(value)]

    def spots(item: cst.BaseExpression | cst.Arg | tuple[str, cst.BaseExpression]) -> list[int]:
        node = item if isinstance(item, cst.CSTNode) else item[1]
        return _source_positions(node, positions)

    index = 0
    for i, item in enumerate(keywords):
        if any(p < here for p in spots(item)):
            index = i + 1
    before = [p for item in [*positional, *keywords[:index]] for p in spots(item)]
    after = [p for item in keywords[index:] for p in spots(item)]
    if not is_pure(value) and (any(p > here for p in before) or any(p < here for p in after)):
        raise Refuse(
            f"{name}={ctx.code(value)} may have side effects and would be evaluated out of its "
            f"original order here; bind it to a name first"
        )
    return [*keywords[:index], entry, *keywords[index:]]


_EMPTY = cst.Module(body=())


def comments(node: cst.CSTNode) -> list[str]:
    """The texts of every comment in ``node``'s subtree, in source order."""
    # Fast paths: visiting a subtree rebuilds it node by node (milliseconds per call), rendering
    # it is cheap, and almost no subtree holds a comment.
    if isinstance(node, cst.SimpleWhitespace) or "#" not in _EMPTY.code_for_node(node):
        return []
    found: list[str] = []

    class _Finder(cst.CSTVisitor):
        def visit_Comment(self, comment: cst.Comment) -> bool:
            found.append(comment.value)
            return False

    node.visit(_Finder())
    return found


def contains_comment(node: cst.CSTNode) -> bool:
    """True when ``node``'s subtree holds a comment."""
    return bool(comments(node))


def _without_comment(ws: cst.BaseParenthesizableWhitespace) -> cst.BaseParenthesizableWhitespace:
    """``ws`` with its comments removed (a layout template must not copy one arg's comment)."""
    if isinstance(ws, cst.ParenthesizedWhitespace):
        return ws.with_changes(first_line=cst.TrailingWhitespace(), empty_lines=())
    return ws


def _trailing(arg: cst.Arg) -> cst.BaseParenthesizableWhitespace:
    """The whitespace after ``arg`` (after its comma when it has one): where its comments sit."""
    return arg.comma.whitespace_after if isinstance(arg.comma, cst.Comma) else arg.whitespace_after_arg


# ----------------------------------------------------------------------------------- builders


_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def callee_name(call: cst.Call) -> str:
    """The last name of ``call``'s callee (``torch.zeros(...)`` -> ``"zeros"``); ``""`` for other callees."""
    func = call.func
    if isinstance(func, cst.Attribute):
        return func.attr.value
    return func.value if isinstance(func, cst.Name) else ""


def on_drop_in(call: cst.Call, target: str, *notes: str, module: str = "") -> Rewrite:
    """``call``, its arguments kept, on flashport's drop-in ``target`` (a dotted name) from ``module``,
    which the engine imports (default: ``target`` less its last component; a classmethod's
    ``module.Class.method`` names its module)."""
    module = module or target.rsplit(".", 1)[0]
    return Rewrite(call.with_changes(func=dotted(target)), imports=(module,), notes=notes)


def dotted(name: str) -> cst.BaseExpression:
    """``"flashport.torch.attention"`` as a Name/Attribute chain."""
    if not _DOTTED.match(name):
        raise ValueError(f"not a dotted name: {name!r}")
    parts = name.split(".")
    node: cst.BaseExpression = cst.Name(parts[0])
    for part in parts[1:]:
        node = cst.Attribute(value=node, attr=cst.Name(part))
    return node


def as_args(
    positional: Sequence[cst.BaseExpression | cst.Arg],
    keywords: Sequence[tuple[str, cst.BaseExpression] | cst.Arg],
) -> list[cst.Arg]:
    """``positional`` then ``keywords`` as ``cst.Arg`` nodes (ready-made ``cst.Arg`` items kept)."""
    args = [item if isinstance(item, cst.Arg) else cst.Arg(value=item) for item in positional]
    for item in keywords:
        if isinstance(item, cst.Arg):
            args.append(item)
            continue
        name, value = item
        equal = cst.AssignEqual(
            whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
        )
        args.append(cst.Arg(value=value, keyword=cst.Name(name), equal=equal))
    return args


def _order_inversions(spots: list[list[int]], like: cst.Call) -> list[tuple[int, int]]:
    """Pairs of source argument indices ``(earlier, later)`` of ``like`` that the new argument list
    (given as the source indices each new argument holds, in order) evaluates the other way round,
    where at least one of the two may have side effects (:func:`is_pure`)."""
    seen: list[int] = []
    found = []
    for held in spots:
        for here in held:
            for before in seen:
                if before > here and not (
                    is_pure(like.args[before].value) and is_pure(like.args[here].value)
                ):
                    found.append((here, before))
        seen.extend(held)
    return found


def _in_source_order(args: list[cst.Arg], like: cst.Call) -> list[cst.Arg]:
    """``args`` with every argument carried over from ``like`` evaluated in ``like``'s order.

    Keyword and ``**mapping`` arguments are free to move, so when the rewrite evaluates an argument with possible side
    effects out of its source order (``causal=f(), softmax_scale=g()`` mapped to ``scale=g(),
    causal=f()``), the keywords holding source arguments are sorted back into source order (the
    others keep their slots). Literals take no part (nothing to evaluate).

    Raises:
      Refuse: when the order still differs (a positional argument of the target holds a source
        argument that came after one with side effects).
    """
    if all(is_pure(arg.value) for arg in like.args):
        return args  # nothing can observe the order (the common case: names, attributes, literals)
    positions = {id(arg.value): i for i, arg in enumerate(like.args) if not _is_literal(arg.value)}
    spots = [_source_positions(arg.value, positions) for arg in args]
    if not _order_inversions(spots, like):
        return args
    movable = [i for i, arg in enumerate(args) if (arg.keyword is not None or arg.star == "**") and spots[i]]
    ordered = sorted(movable, key=lambda i: min(spots[i]))
    args, spots = list(args), list(spots)
    new_args, new_spots = list(args), list(spots)
    for slot, source in zip(movable, ordered, strict=True):
        new_args[slot], new_spots[slot] = args[source], spots[source]
    inversions = _order_inversions(new_spots, like)
    if inversions:
        moved = like.args[inversions[0][1]]
        name = moved.keyword.value if moved.keyword is not None else f"argument {inversions[0][1] + 1}"
        raise Refuse(
            f"{name}={_EMPTY.code_for_node(moved.value)} may have side effects and would be evaluated "
            "out of its original order here; bind it to a name first"
        )
    return new_args


def _layout(
    like: cst.Call,
) -> tuple[cst.BaseParenthesizableWhitespace | None, cst.BaseParenthesizableWhitespace]:
    """(whitespace between arguments when ``like`` has one argument per line, else None; whitespace
    before the closing paren), comments removed."""
    opening = like.whitespace_before_args
    between_ws = _without_comment(opening) if isinstance(opening, cst.ParenthesizedWhitespace) else None
    for original in like.args[:-1]:
        if (
            between_ws is None
            and isinstance(original.comma, cst.Comma)
            and isinstance(original.comma.whitespace_after, cst.ParenthesizedWhitespace)
        ):
            between_ws = _without_comment(original.comma.whitespace_after)
    closing: cst.BaseParenthesizableWhitespace = cst.SimpleWhitespace("")
    if between_ws is not None and like.args:
        closing = _without_comment(_trailing(like.args[-1]))
    return between_ws, closing


# The entry points that take the contract's keywords with their defaults (flashport.kernels.contract.keywords).
CONTRACT_TARGETS = ("flashport.attention", "flashport.torch.attention", "flashport.varlen_attention")


def _is_default(keyword: tuple[str, cst.BaseExpression] | cst.Arg) -> bool:
    """A ``(name, literal)`` keyword that spells the contract's default (``scale=None``,
    ``causal=False``); ``layout`` is always written, so that a call never depends on the default."""
    from flashport.kernels.contract.keywords import CONTRACT_KEYWORDS

    if isinstance(keyword, cst.Arg) or keyword[0] == "layout":
        return False
    name, value = keyword
    default = dict(CONTRACT_KEYWORDS).get(name, ...)
    spelled = "None" if default is None else "False" if default is False else None
    return spelled is not None and isinstance(value, cst.Name) and value.value == spelled


def build_call(
    target: str,
    positional: Sequence[cst.BaseExpression | cst.Arg],
    keywords: Sequence[tuple[str, cst.BaseExpression] | cst.Arg],
    like: cst.Call,
) -> cst.Call:
    """A call ``target(*positional, **keywords)`` formatted like ``like`` (one line or one arg per line).

    Comments are kept: an argument carried over from ``like`` keeps the comment after it; the
    engine re-attaches any other comment of ``like`` (:func:`keep_comments`). Arguments carried over
    from ``like`` are evaluated in their source order (:func:`_in_source_order`).

    ``positional`` and ``keywords`` items may be ready-made ``cst.Arg`` (e.g. a ``*x.unbind(2)``
    or ``**mapping`` argument). Keyword values are inserted as given; build string values with
    :func:`string`.

    Raises:
      Refuse: when an argument with possible side effects cannot keep its evaluation order.
    """
    if target in CONTRACT_TARGETS:
        keywords = [k for k in keywords if not _is_default(k)]
    args = _in_source_order(as_args(positional, keywords), like)
    between_ws, closing = _layout(like)
    multiline = between_ws is not None
    # An argument carried over keeps the comments that followed it (its comma's whitespace).
    commented = {id(a.value): _trailing(a) for a in like.args if comments(_trailing(a))}
    formatted = []
    for i, arg in enumerate(args):
        kept = commented.pop(id(arg.value), None)
        comma: cst.Comma | cst.MaybeSentinel
        if i < len(args) - 1:
            between = between_ws if between_ws is not None else cst.SimpleWhitespace(" ")
            comma = cst.Comma(whitespace_after=kept or between)
        elif kept is not None or (multiline and isinstance(closing, cst.ParenthesizedWhitespace)):
            comma = cst.Comma(whitespace_after=kept or closing)  # never a `,)` on the last line
        else:
            comma = cst.MaybeSentinel.DEFAULT
        # one with_changes per argument (each is a dataclasses.replace with validation)
        formatted.append(arg.with_changes(whitespace_after_arg=cst.SimpleWhitespace(""), comma=comma))
    return like.with_changes(
        func=dotted(target), args=formatted, whitespace_before_args=like.whitespace_before_args
    )


def keep_comments(original: cst.Call, new: cst.BaseExpression) -> cst.BaseExpression | None:
    """``new`` with every comment of ``original`` that it lacks added before its closing paren
    (one comment per line); None when ``new`` is not a call, so there is no place to put them."""
    missing = list(comments(original))
    for text in comments(new):
        if text in missing:
            missing.remove(text)
    if not missing:
        return new
    if not isinstance(new, cst.Call):
        return None
    # Indent the comments like the arguments (a multi-line call's continuation lines), else like the block.
    template = next(
        (
            a.comma.whitespace_after
            for a in new.args[:-1]
            if isinstance(a.comma, cst.Comma)
            and isinstance(a.comma.whitespace_after, cst.ParenthesizedWhitespace)
        ),
        None,
    )
    indent = template.indent if template is not None else True
    space = template.last_line if template is not None else cst.SimpleWhitespace("")
    lines = [cst.EmptyLine(indent=indent, whitespace=space, comment=cst.Comment(text)) for text in missing]
    if not new.args:
        ws = new.whitespace_before_args
        return new.with_changes(whitespace_before_args=_append_lines(ws, lines))
    last = new.args[-1]
    if isinstance(last.comma, cst.Comma):
        last = last.with_changes(
            comma=last.comma.with_changes(whitespace_after=_append_lines(last.comma.whitespace_after, lines))
        )
    else:
        last = last.with_changes(whitespace_after_arg=_append_lines(last.whitespace_after_arg, lines))
    return new.with_changes(args=[*new.args[:-1], last])


def _append_lines(
    ws: cst.BaseParenthesizableWhitespace, lines: list[cst.EmptyLine]
) -> cst.ParenthesizedWhitespace:
    """``ws`` followed by the comment ``lines``; the closing paren then starts its own line."""
    if isinstance(ws, cst.ParenthesizedWhitespace):
        return ws.with_changes(empty_lines=[*ws.empty_lines, *lines])
    return cst.ParenthesizedWhitespace(
        first_line=cst.TrailingWhitespace(),
        empty_lines=lines,
        indent=True,
        last_line=cst.SimpleWhitespace(""),
    )


def string(value: str) -> cst.SimpleString:
    """A double-quoted string literal."""
    return cst.SimpleString('"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"')


def tuple_of(*items: cst.BaseExpression) -> cst.Tuple:
    """``(a, b)`` as a parenthesized tuple."""
    elements = []
    for i, item in enumerate(items):
        comma = (
            cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
            if i < len(items) - 1
            else cst.MaybeSentinel.DEFAULT
        )
        elements.append(cst.Element(value=item, comma=comma))
    return cst.Tuple(elements=elements)


def parenthesized(node: cst.BaseExpression) -> cst.BaseExpression:
    """``node`` in parentheses unless it is a name, attribute, call or subscript or has them already:
    an operand that keeps its meaning wherever a template puts it (``(a if c else b)[0]``,
    ``for w in (x if c else y)``, ``(q := x).unbind(0)``)."""
    if isinstance(node, (cst.Name, cst.Attribute, cst.Call, cst.Subscript)) or node.lpar:
        return node
    return node.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])


def number(value: int | float) -> cst.BaseExpression:
    """An int or float literal (negative values get a unary minus)."""
    node: cst.BaseExpression = (
        cst.Integer(str(abs(value))) if isinstance(value, int) else cst.Float(repr(abs(value)))
    )
    return cst.UnaryOperation(operator=cst.Minus(), expression=node) if value < 0 else node
