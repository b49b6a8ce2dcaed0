"""Reading literal arguments: numbers, ``None``, booleans, strings, and whether an expression is free
of side effects (:func:`is_pure`)."""

from __future__ import annotations

import libcst as cst

# ----------------------------------------------------------------------------------- literal helpers


def literal_number(node: cst.BaseExpression | None) -> float | int | None:
    """The value of an int/float literal (with an optional unary minus), else None."""
    if node is None:
        return None
    sign = 1
    while isinstance(node, cst.UnaryOperation) and isinstance(node.operator, (cst.Minus, cst.Plus)):
        if isinstance(node.operator, cst.Minus):
            sign = -sign
        node = node.expression
    if isinstance(node, cst.Integer):
        return sign * int(node.evaluated_value)
    if isinstance(node, cst.Float):
        return sign * float(node.evaluated_value)
    return None


def is_none(node: cst.BaseExpression | None) -> bool:
    """True for an absent argument or the literal ``None``."""
    return node is None or (isinstance(node, cst.Name) and node.value == "None")


def literal_bool(node: cst.BaseExpression | None) -> bool | None:
    """True/False for the literals ``True``/``False``, else None."""
    if isinstance(node, cst.Name) and node.value in ("True", "False"):
        return node.value == "True"
    return None


def is_zero(node: cst.BaseExpression | None) -> bool:
    """True for a literal numeric zero."""
    value = literal_number(node)
    return value is not None and value == 0


def literal_string(node: cst.BaseExpression | None) -> str | None:
    """The value of a plain string literal, else None."""
    if isinstance(node, cst.SimpleString):
        value = node.evaluated_value
        return value if isinstance(value, str) else None
    return None


def training_gated_zero(node: cst.BaseExpression) -> bool:
    """True for ``x if <cond> else 0`` or ``0 if <cond> else x`` (dropout gated by a condition)."""
    return isinstance(node, cst.IfExp) and (is_zero(node.orelse) or is_zero(node.body))


_PURE_LEAVES = (cst.Name, cst.Integer, cst.Float, cst.Imaginary, cst.SimpleString, cst.ConcatenatedString)


def is_pure(node: cst.BaseExpression) -> bool:
    """True for expressions whose evaluation order does not matter: names, attribute chains,
    literals, subscripts, and operators / comparisons / conditionals over those (no calls, no
    ``await``/``yield``/``:=``). Properties and operator overloads are presumed side-effect free."""
    if isinstance(node, _PURE_LEAVES):
        return True
    if isinstance(node, cst.Attribute):
        return is_pure(node.value)
    if isinstance(node, cst.UnaryOperation):
        return is_pure(node.expression)
    if isinstance(node, (cst.BinaryOperation, cst.BooleanOperation)):
        return is_pure(node.left) and is_pure(node.right)
    if isinstance(node, cst.Comparison):
        return is_pure(node.left) and all(is_pure(t.comparator) for t in node.comparisons)
    if isinstance(node, cst.IfExp):
        return is_pure(node.test) and is_pure(node.body) and is_pure(node.orelse)
    if isinstance(node, cst.Subscript):
        return is_pure(node.value) and all(
            isinstance(e.slice, cst.Index) and is_pure(e.slice.value) for e in node.slice
        )
    if isinstance(node, cst.Tuple):
        return all(type(e) is cst.Element and is_pure(e.value) for e in node.elements)
    return False
