"""The contract's keywords, defined once, and the decorator that gives them to every entry point.

``flashport.attention``, ``prepare``, ``attention_backward``, ``ring_attention``,
``flashport.torch.attention`` and both ``varlen_attention`` functions take the same masking and
layout keywords with the same defaults. Each declares only its own arguments plus ``**contract``;
:func:`takes_contract_keywords` adds :data:`CONTRACT_KEYWORDS` to its signature (what ``help()``,
``inspect.signature`` and documentation tools show), rejects unknown keywords as Python would, and
calls the function with every contract keyword present (defaults filled in). Adding or changing a
keyword of the contract is one edit here. This module imports no framework.
"""

from __future__ import annotations

import functools
import inspect

# (name, default) of the keywords every entry point takes, in the order signatures show them.
CONTRACT_KEYWORDS: tuple[tuple[str, object], ...] = (
    ("scale", None),
    ("causal", False),
    ("window", None),
    ("align", "bottom_right"),
    ("softcap", None),
    ("bias", None),
    ("mask", None),
    ("q_segment_ids", None),
    ("kv_segment_ids", None),
    ("layout", "BSHD"),
)

TENSOR_KEYWORDS = ("bias", "mask", "q_segment_ids", "kv_segment_ids")  # arrays, not static options
SPEC_KEYWORDS = ("scale", "causal", "window", "align", "softcap")  # what make_spec normalizes
VARLEN_KEYWORDS = (*SPEC_KEYWORDS, "layout")  # the packed-sequence entry points take these


def pick(contract: dict, names) -> dict:
    """The entries ``names`` of a ``contract`` keyword dict (e.g. :data:`SPEC_KEYWORDS` for ``make_spec``)."""
    return {n: contract[n] for n in names}


def takes_contract_keywords(names=None, **defaults):
    """Decorator for ``fn(*args, **contract)``: ``fn`` gets the contract keywords ``names`` (default:
    all of :data:`CONTRACT_KEYWORDS`) as keyword-only parameters, with ``defaults`` overriding theirs.

    The wrapped function's signature lists them after ``fn``'s required keyword-only parameters;
    a call binds against that signature (so a misspelt keyword raises ``TypeError`` naming it) and
    passes every listed keyword to ``fn``.
    """
    chosen = [(n, defaults.get(n, d)) for n, d in CONTRACT_KEYWORDS if names is None or n in names]
    unknown = set(defaults) - {n for n, _ in chosen}
    if unknown:
        raise ValueError(f"takes_contract_keywords: defaults for keywords it does not add: {sorted(unknown)}")

    def decorate(fn):
        own = [p for p in inspect.signature(fn).parameters.values() if p.kind != p.VAR_KEYWORD]
        first = [p for p in own if p.kind != p.KEYWORD_ONLY or p.default is p.empty]
        rest = [p for p in own if p.kind == p.KEYWORD_ONLY and p.default is not p.empty]
        added = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d) for n, d in chosen]
        signature = inspect.Signature([*first, *added, *rest])

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return fn(*bound.args, **bound.kwargs)

        wrapper.__signature__ = signature
        return wrapper

    return decorate
