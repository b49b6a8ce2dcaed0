"""A source API used as a value (not called): ported to flashport's drop-in of the same name, or
reported with a reason said for the actual context.

Calls are ported one by one because their arguments state the semantics; a value escapes that:
whatever calls it later (a dispatch table lookup, a ``functools.partial``, an attribute, a callback
parameter) is out of the rule's sight. Where flashport ships a drop-in that replicates the API
exactly (same signature, defaults and return convention: ``flashport.integrations.flash_attn_compat``,
``bert_padding``, ``xformers_compat``, ``flashport.torch``'s FlexAttention functions), the value is replaced by the drop-in's function of the same
name, so every later call runs on flashport whatever its arguments. The value stays (reported) where
its meaning could change: feature probes (``callable(f)``, ``inspect.signature(f)``, ``getattr(f,
...)``), ``isinstance``/``issubclass``, identity or equality comparisons, lookups by identity
(``target=``), monkeypatches (``F.x = wrap(F.x)``), ``__all__``, references inside an import guard
(``try: ... except ImportError`` with a fallback; a handler that only raises is no fallback), a
flash-attn version whose signature differs from the drop-in's, and APIs whose drop-in does not
replicate every use (FA3's ``flash_attn_func``/``flash_attn_varlen_func`` changed their return type
-- except for a value passed to ``@functools.wraps``, which only copies its name, docstring and
signature; FA3's ``flash_attn_with_kvcache`` did not and gets its drop-in --, FA4's drop-in
lacks mask mods and block sparsity, SDPA values are wrapped, patched or compared) or that have none.
An SDPA or FlexAttention value that is probed, compared or patched runs as is: it is torch's own
function, present on every host (:data:`TORCH_OWN`).
Local aliases whose calls can be resolved are ported call by call by the engine
(:mod:`flashport.rewriter.source.aliases`; a module-level SDPA alias whose every read is a ported call gets
the SDPA drop-in: :func:`call_drop_in`).
"""

from __future__ import annotations

import functools

import libcst as cst

from flashport.rules import apis
from flashport.rules.apis import flash_attn as apis_flash_attn
from flashport.rules.apis import torch as apis_torch
from flashport.rules.apis import xformers as apis_xformers
from flashport.rules.apis.model import pad
from flashport.rules.common.calls import dotted
from flashport.rules.site import Outcome, Report, Rewrite, RuleContext, runs_as_is

FA2 = apis_flash_attn.COMPAT
FA2_NAMES = (*apis_flash_attn.FA2_LEADING, "flash_attn_with_kvcache")
FA1_NAMES = tuple(apis_flash_attn.FA1_LEADING)
FA4 = apis_flash_attn.FA4
BERT_PADDING = apis_flash_attn.BERT_PADDING
PADDING_NAMES = tuple(d.name for api in apis_flash_attn.BERT_PADDING_APIS for d in api.drop_ins)
SDPA = apis_torch.SDPA_COMPAT
XFORMERS = apis_xformers.XFORMERS_COMPAT
FLEX = "flashport.torch"  # flex_attention / create_block_mask with torch's signatures
FA2_SIGNATURE = (2, 6)  # flash-attn's 2.x signatures are 2.8.3's (the drop-ins') from 2.6 on (kvcache: 2.6.1)
SEQUSED = (2, 7)  # unpad_input returns five values from 2.7 on (the drop-in's)
# Callees that inspect a function instead of calling it: the value must stay the one it probes.
PROBES = frozenset(
    (
        "callable",
        "getattr",
        "hasattr",
        "isinstance",
        "issubclass",
        "id",
        "type",
        "vars",
        "dir",
        "repr",
        "signature",
        "getfullargspec",
        "getsource",
        "getmodule",
        "getfile",
    )
)
# Of those, the ones that read only a function's parameters: the drop-in (same signature) answers alike.
SIGNATURE_PROBES = frozenset(("signature", "getfullargspec", "getargspec"))
_CONTAINERS = (cst.Element, cst.Tuple, cst.List, cst.Set, cst.Arg, cst.ComparisonTarget)
_IMPORT_ERRORS = ("ImportError", "ModuleNotFoundError", "Exception", "BaseException", "OSError")


def family(api: str) -> str | None:
    """Which flashport drop-in module replicates ``api`` (a qualified source name), if any."""
    if api.startswith("flash_attn.cute"):
        return FA4
    if api.startswith(("flash_attn_interface", "flash_attn_3", "hopper")):
        return None  # FA3's return type changed on 2025-07-11; nothing says which one the code expects
    if api.startswith("flash_attn.bert_padding."):
        return BERT_PADDING
    if api == "torch.nn.functional.scaled_dot_product_attention":
        return SDPA
    if api.startswith("torch.nn.attention.flex_attention."):
        return FLEX
    if api.startswith("xformers.ops."):
        return XFORMERS
    if api.startswith("flash_attn.") and "triton" not in api:
        return FA2
    return None


PROVIDES = {
    FA2: FA2_NAMES + FA1_NAMES,
    FA4: ("flash_attn_func", "flash_attn_varlen_func"),
    BERT_PADDING: PADDING_NAMES,
    SDPA: ("scaled_dot_product_attention",),
    XFORMERS: ("memory_efficient_attention",),
    FLEX: ("flex_attention", "create_block_mask"),
}


TORCH_OWN = (SDPA, FLEX)  # drop-in families whose source API is torch's own: it runs on every host


def kept_torch_value(why: str, api: str) -> str:
    """The as-is reason of a torch attention function kept as a value (probed, compared, patched,
    named in an import guard, bound beside a fallback): torch's own function, so the same object on
    a TPU host."""
    return f"{why}: torch's own {api.rsplit('.', 1)[-1]}, present on every host"


_INEXACT = {  # drop-ins that serve explicit calls but do not replicate every call a value may get
    FA4: (
        "the FA4 drop-in lacks mask/score mods, block sparsity, sinks and qv, and FA4's parameters "
        "moved between releases; the callers of a value are out of sight"
    ),
    SDPA: (
        "SDPA values are mostly wrapped, patched or looked up by identity, which the drop-in would "
        "change (SDPA itself runs on every host)"
    ),
}
_EXACT_FOR_CALLS = (SDPA,)  # of those, drop-ins that do replicate every call (not identity or patching)


def call_drop_in(api: str, alias: str) -> Rewrite | None:
    """The drop-in for a module-level alias ``alias = <api>`` whose every read in its file is a call
    that was ported, when flashport's drop-in replicates every *call* of ``api`` (SDPA's, at every
    rank) though values of ``api`` stay (:data:`_INEXACT`): the alias is then only reached by the
    modules that import it, and they call it. None otherwise."""
    module, name = family(api), api.rsplit(".", 1)[-1]
    if module not in _EXACT_FOR_CALLS or name not in PROVIDES[module]:
        return None
    note = (
        f"module-level alias {alias}: every read of it in this file is a ported call; modules that "
        f"import it now call flashport's drop-in {module}.{name} (same signature and semantics)"
    )
    return Rewrite(dotted(f"{module}.{name}"), imports=(module,), notes=(note,))


FA3 = apis_flash_attn.FA3
_FA3_NAMES = ("flash_attn_func", "flash_attn_varlen_func")
# FA3 drop-ins that replicate every use of a value: the cache call returns out unless
# return_softmax_lse=True before and after 2025-07-11 (only flash_attn_func/varlen changed theirs).
_FA3_EXACT = ("flash_attn_with_kvcache",)


@functools.cache
def first_release(module: str, name: str) -> tuple[int, ...]:
    """The earliest release whose signature drop-in ``module.name`` replicates (the API catalogue)."""
    return min(
        (
            pad(r)
            for api in apis.catalogue()
            for d in api.drop_ins
            if (d.module, d.name) == (module, name)
            for r in d.releases
        ),
    )


def drop_in(api: str, ctx: RuleContext, metadata_only: bool = False) -> tuple[str, str] | str:
    """``(module, function)`` of the drop-in that replicates ``api`` at the configured versions,
    or why there is none. ``metadata_only``: the value is only read for its name, docstring and
    signature (``functools.wraps``), so FA3's return-type change does not matter."""
    module, name = family(api), api.rsplit(".", 1)[-1]
    if (
        metadata_only
        and api.startswith(("flash_attn_interface", "flash_attn_3", "hopper"))
        and name in _FA3_NAMES
    ):
        return FA3, name
    if api.startswith(("flash_attn_interface", "flash_attn_3", "hopper")) and name in _FA3_EXACT:
        return FA3, name
    if api.startswith(("flash_attn_interface", "flash_attn_3", "hopper")) and name not in _FA3_NAMES:
        return f"flashport has no drop-in for FA3's {name}"
    if api.startswith(("flash_attn_interface", "flash_attn_3", "hopper")):
        return (
            "FlashAttention-3 changed its return type on 2025-07-11 (out vs (out, lse)) and the "
            "callers of a value are out of sight"
        )
    if module is None or name not in PROVIDES[module]:
        return "flashport has no drop-in with its exact signature"
    if module in _INEXACT:
        return _INEXACT[module]
    version = ctx.options.flash_attn_version
    shown = ".".join(map(str, version))
    if module == FA2 and name in FA2_NAMES and pad(version) < first_release(FA2, name):
        return (
            f"the drop-in follows flash-attn 2.8's signature and --flash-attn-version is {shown} "
            "(parameters moved in 2.3-2.6; causal is top-left before 2.1)"
        )
    if module == BERT_PADDING and name == "unpad_input" and version < SEQUSED:
        return f"the drop-in returns flash-attn 2.7's five values and --flash-attn-version is {shown}"
    return module, name


def _callee(node: cst.BaseExpression) -> str:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return f"{_callee(node.value)}.{node.attr.value}"
    return "..."


def probe(ctx: RuleContext) -> str | None:
    """Why the value's context inspects or compares it instead of calling it (None when it does not)."""
    user = next((up for up in ctx.ancestors if not isinstance(up, _CONTAINERS)), None)
    first = ctx.ancestors[0] if ctx.ancestors else None
    if isinstance(first, cst.Arg) and first.keyword is not None and first.keyword.value == "target":
        return "passed as target= (a lookup by identity, as torch.fx's find_nodes does)"
    if isinstance(user, cst.Comparison):
        return "compared (identity, equality or membership): the comparison must see the same object"
    if isinstance(user, cst.Call):
        callee = _callee(user.func)
        if callee.rsplit(".", 1)[-1] in PROBES or callee.startswith("inspect."):
            return f"inspected with {callee}(...) (a feature probe)"
    for up in ctx.ancestors:
        if isinstance(up, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            break
        if isinstance(up, cst.Assign) and any(
            isinstance(t.target, cst.Name) and t.target.value == "__all__" for t in up.targets
        ):
            return "listed in __all__ (a re-export)"
        if isinstance(up, cst.Assign) and ctx.node is not None:
            here = ctx.code(ctx.node)
            if any(ctx.code(t.target) == here for t in up.targets):
                return f"wrapped and assigned back to {here} (a monkeypatch of the library function)"
        if isinstance(up, cst.Try) and any(
            _catches_import_error(h) and not _only_raises(h) for h in up.handlers
        ):
            return "inside an import guard (try/except ImportError), which decides between flash-attn and a fallback"
    return None


def inspects_signature(ctx: RuleContext) -> bool:
    """The value is the argument of ``inspect.signature`` / ``getfullargspec`` (only its parameters
    are read), outside an import guard (where the probe may decide between the library and a
    fallback)."""
    user = next((up for up in ctx.ancestors if not isinstance(up, _CONTAINERS)), None)
    if not (isinstance(user, cst.Call) and _callee(user.func).rsplit(".", 1)[-1] in SIGNATURE_PROBES):
        return False
    for up in ctx.ancestors:
        if isinstance(up, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            break
        if isinstance(up, cst.Try) and any(
            _catches_import_error(h) and not _only_raises(h) for h in up.handlers
        ):
            return False
    return True


def _only_raises(handler: cst.ExceptHandler) -> bool:
    """The handler's body is nothing but ``raise`` statements: no fallback, the library is required
    (``except ImportError as e: raise RuntimeError("install flash-attn") from e``). The import
    clean-up reads the same shape from the ``ast`` (``flashport.rewriter.imports.dead_imports._required``)."""
    body = handler.body.body if isinstance(handler.body, cst.IndentedBlock) else [handler.body]
    return all(
        isinstance(stmt, cst.SimpleStatementLine) and all(isinstance(s, cst.Raise) for s in stmt.body)
        for stmt in body
    )


def _catches_import_error(handler: cst.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    names = (
        [e.value for e in handler.type.elements] if isinstance(handler.type, cst.Tuple) else [handler.type]
    )
    return any(_callee(name).rsplit(".", 1)[-1] in _IMPORT_ERRORS for name in names)


def answer(node: cst.BaseExpression, ctx: RuleContext) -> Outcome:
    """The outcome for a source API used as a value: a rewrite to its drop-in (the note says how the
    value is used), or a report saying why it stays."""
    found = drop_in(ctx.qualified_name, ctx, metadata_only=copied_by_wraps(ctx))
    why = probe(ctx)
    if why is not None and isinstance(found, tuple) and inspects_signature(ctx):
        module, name = found
        note = (
            f"{why}: the drop-in {module}.{name} has the same parameters and defaults, so the probe "
            "answers alike and the file no longer needs the GPU library for it"
        )
        return Rewrite(dotted(f"{module}.{name}"), imports=(module,), notes=(note,))
    if why is not None and family(ctx.qualified_name) in TORCH_OWN:
        return runs_as_is(kept_torch_value(why, ctx.qualified_name))
    if why is not None:
        return Report(f"{why}: not a call to port; kept")
    if isinstance(found, str):
        return Report(f"{describe(node, ctx)}; not rewritten: {found}")
    module, name = found
    note = f"{describe(node, ctx)}: the value is now flashport's drop-in {module}.{name} (same signature)"
    return Rewrite(dotted(f"{module}.{name}"), imports=(module,), notes=(note,))


def copied_by_wraps(ctx: RuleContext) -> bool:
    """True when the value is the only argument of a ``@functools.wraps(<value>)`` decorator: wraps
    never calls it, it copies its name, docstring, module and ``__wrapped__`` (the signature
    ``inspect.signature`` shows) onto the decorated wrapper."""
    path = list(ctx.ancestors)
    if len(path) < 3 or not isinstance(path[0], cst.Arg) or path[0].keyword is not None or path[0].star:
        return False
    call, decorator = path[1], path[2]
    return (
        isinstance(call, cst.Call)
        and len(call.args) == 1
        and _callee(call.func) in ("functools.wraps", "wraps")
        and isinstance(decorator, cst.Decorator)
    )


def describe(node: cst.BaseExpression, ctx: RuleContext) -> str:
    """A few words on how ``node`` (a source API as a value) is used."""
    path = list(ctx.ancestors)
    up = path[0] if path else None
    if copied_by_wraps(ctx):
        return (
            "copied by @functools.wraps(...) (its name, docstring and signature only; wraps never calls it)"
        )
    if isinstance(up, cst.DictElement):
        return "entry of a dispatch table"
    if isinstance(up, cst.Element):
        return "element of a list/tuple/set"
    if isinstance(up, cst.Arg) and len(path) > 1 and isinstance(path[1], cst.Call):
        callee = _callee(path[1].func)
        if callee.rsplit(".", 1)[-1] == "partial":
            return f"bound with {callee}(...)"
        if callee.rsplit(".", 1)[-1] in SIGNATURE_PROBES:
            return f"its parameters read by {callee}(...)"
        return f"passed to {callee}(...) as a callback"
    if isinstance(up, cst.Assign):
        targets = [t.target for t in up.targets]
        return f"stored in {', '.join(_callee(t) for t in targets)}"
    if isinstance(up, cst.Return):
        return "returned as a value"
    return "used as a value"
