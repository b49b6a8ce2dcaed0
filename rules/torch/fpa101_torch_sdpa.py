"""FPA101 torch-sdpa: ``torch.nn.functional.scaled_dot_product_attention`` -> ``flashport.torch.attention``.

What it rewrites:
  ``F.scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
  is_causal=False, *, scale=None, enable_gqa=False)`` however ``torch.nn.functional`` is imported.

Semantics mapping:
  layout ``[B, H, S, D]`` (heads before sequence) -> ``layout="BHSD"``; ``is_causal`` is
  **top-left** (``tril(ones(L, S))``) -> ``causal=..., align="top_left"``; ``scale`` (None =
  1/sqrt(E)) -> ``scale``; ``attn_mask``: a bool mask (True = attend) becomes the contract's
  ``mask``, a float mask is additive and becomes ``bias`` -- the dtype is only known at run time, so
  the rewrite passes ``**flashport.sdpa_mask(attn_mask)`` which picks the keyword by dtype;
  ``enable_gqa``: the contract always accepts Hk dividing Hq with the same contiguous grouping
  (``repeat_interleave``), so the flag is dropped. ``dropout_p`` -> ``dropout_p`` verbatim (same
  meaning and default generator; evaluated once, in its source order among the carried arguments;
  a literal 0 is dropped, ``--inference`` drops a training-gated one). Fully masked rows give 0, as SDPA >= 2.5.
  Positional arguments are bound against SDPA's signature for ``torch-version``.

Runs as is:
  a backend probe (below) whose query is a tensor its function makes itself
  (``q = torch.zeros(...)``, ``torch.randn``...): it asks torch whether an SDPA kernel runs on this
  host, which a TPU host answers for itself, and ``flashport.torch.attention`` does not depend on
  the answer. Kept byte-identical, reported with the reason prefix "runs as is on a TPU host".

What it refuses:
  backend probes on model data: a call under a ``with sdpa_kernel(...)`` selector that sits in a ``try`` block or
  takes its backends from a variable (``with sdpa_kernel([backend]): F.scaled_dot_product_attention(q,
  q, q)`` asks whether that kernel runs; rewritten, it would always succeed). Not probes, so
  rewritten: under variable backends, a call whose value its function goes on with (returned, or
  assigned to a name it only returns or reshapes: ``with sdpa_kernel(kernel): out = sdpa(q, k, v)``
  then ``out.permute(...)``; a value inspected, ``out.isnan().any()``, or passed on stays a probe), and in a ``try`` whose body is only ``with sdpa_kernel(...): return <the call>`` (the
  handler's fallback runs only when that kernel fails; success is seen only as the attention
  returned, which flashport computes on every host);
  a dropout expression with side effects (a call) that the rewrite would evaluate out of its
  source order (bind it to a name first), unknown arguments; in a run whose files patch SDPA at
  run time, a call through a name bound to SDPA earlier (``from torch.nn.functional import
  scaled_dot_product_attention``, ``original = F.scaled_dot_product_attention``): whether it holds
  torch's SDPA or the patch depends on import order (the reason names the patch).

What runs as is:
  SDPA itself used as a value that is inspected, compared, wrapped and assigned back, looked up by
  identity (``target=``), listed in ``__all__`` or named in an import guard: torch's own function,
  present on every host, so the value keeps its meaning unchanged on a TPU host (reported as
  running as is).

Run-time patches:
  a run whose files replace ``torch.nn.functional.scaled_dot_product_attention`` (``F.scaled_dot_product_attention =
  cp_sdpa``, ``setattr(F, "scaled_dot_product_attention", ...)``, ``mock.patch(...)``, any alias of
  the module, or torch's own ``context_parallel``, which patches it while active) expects every
  ``F.scaled_dot_product_attention(...)`` call to reach the patch. The CLI finds these before it
  rewrites anything (``flashport.rewriter.engine.run_context``; every file of the run sees the patches of
  the others) and then sends every SDPA call made through the module attribute to
  ``flashport.integrations.sdpa_compat.scaled_dot_product_attention`` with its arguments verbatim
  (not to ``flashport.torch.attention``, which cannot forward to a patch): that drop-in calls the
  installed patch when there is one and runs flashport's SDPA otherwise, or when called from inside
  the patch (a thread-local re-entrancy guard). The rewrite's note names the patch's file:line. The
  patch statement itself is kept. A run without an SDPA patch is rewritten as before.

Drop-in:
  a call with a ``*args``/``**kwargs`` splat (its arguments are only known at run time) keeps its
  arguments and calls ``flashport.integrations.sdpa_compat.scaled_dot_product_attention``, SDPA's
  signature with the mapping above applied when it runs (SDPA's error for unequal head counts
  without ``enable_gqa`` kept); like every SDPA call, it runs a patch of
  ``F.scaled_dot_product_attention`` installed when it is called (Run-time patches, below).

Known problems:
  SDPA accepts any number of batch dims (``(N, ..., H, L, E)``); the contract needs rank 4.

Example::

    y = F.scaled_dot_product_attention(q, k, v, mask, is_causal=False)
    # becomes
    y = flashport.torch.attention(q, k, v, **flashport.sdpa_mask(mask), align="top_left", layout="BHSD")
    y = F.scaled_dot_product_attention(*args, **kwargs)
    # becomes
    y = flashport.integrations.sdpa_compat.scaled_dot_product_attention(*args, **kwargs)
"""

from __future__ import annotations

import libcst as cst

from flashport.rules.apis import torch as apis_torch
from flashport.rules.base import Patch, Refuse, Rewrite, Rule, RuleContext, register, runs_as_is
from flashport.rules.common import node_context
from flashport.rules.common.binding import Signature, carry_dropout
from flashport.rules.common.calls import build_call, dotted, insert_in_source_order, on_drop_in, string
from flashport.rules.common.literals import is_none, literal_bool

DROP_IN = "flashport.integrations.sdpa_compat"


def sdpa_signature(version: tuple[int, ...]) -> Signature:
    """SDPA's signature at torch ``version`` (scale from 2.1, enable_gqa from 2.5: the API catalogue)."""
    api = apis_torch.SDPA_API
    return Signature.of(api.signature_at(version) or api.signatures[0][1])


@register
class TorchSDPA(Rule):
    """Rewrite ``torch.nn.functional.scaled_dot_product_attention`` to ``flashport.torch.attention``."""

    CODE = "FPA101"
    NAME = "torch-sdpa"
    SOURCES = ("torch.nn.functional.scaled_dot_product_attention",)
    TARGET = "flashport.torch.attention"

    def check_call(self, call, ctx):
        """Bind against SDPA's signature; map mask polarity, top-left causal and BHSD. A splat call
        goes to the drop-in, which binds its arguments at run time. A backend probe is refused."""
        probe = node_context.backend_probe(ctx)
        if probe is not None and node_context.synthetic_query(
            call, node_context.enclosing_function(ctx.node, ctx) if ctx.node is not None else None
        ):
            return runs_as_is(
                f"SDPA backend probe on tensors it makes itself ({probe}): it asks torch whether that "
                "kernel runs on this host, which a TPU host answers for itself; flashport calls do not "
                "depend on the answer"
            )
        if probe is not None:
            raise Refuse(
                f"backend probe: {probe}, so it tests whether that SDPA kernel runs here; "
                "rewritten, the probe would always succeed (port the code that uses its answer by hand)"
            )
        patch = ctx.options.patch_of(self.API)
        if patch is not None:
            return _patch_aware(call, patch, ctx)
        if any(arg.star for arg in call.args):
            return on_drop_in(
                call,
                f"{DROP_IN}.scaled_dot_product_attention",
                "drop-in scaled_dot_product_attention (SDPA's signature): a *args/**kwargs splat is bound at run time",
            )
        bound = sdpa_signature(ctx.options.torch_version).bind(call, self.API)
        for name in ("query", "key", "value"):
            if name not in bound:
                raise Refuse(f"{self.API} call without {name!r}")
        value = {name: arg.value for name, arg in bound.items()}
        dropout, notes = carry_dropout(value.get("dropout_p"), "dropout_p", "dropout_p", ctx)
        if (chosen := node_context.selected_output(ctx)) is not None:
            notes.append(chosen)
        gqa = value.get("enable_gqa")
        if gqa is not None and literal_bool(gqa) is not False:
            notes.append(
                "dropped enable_gqa= (flashport always groups KV heads contiguously, like repeat_interleave)"
            )
        scale = value.get("scale")
        keywords: list[tuple[str, cst.BaseExpression]] = [
            ("scale", cst.Name("None") if is_none(scale) else scale),
            ("causal", value.get("is_causal", cst.Name("False"))),
        ]
        mask = value.get("attn_mask")
        if not is_none(mask):
            splat = cst.Call(func=dotted("flashport.sdpa_mask"), args=[cst.Arg(value=mask)])
            keywords.append(cst.Arg(value=splat, star="**"))
        keywords += [("align", string("top_left")), ("layout", string("BHSD"))]
        positional = [value["query"], value["key"], value["value"]]
        for entry in dropout:
            keywords = insert_in_source_order(call, positional, keywords, entry, "dropout_p", ctx)
        return Rewrite(build_call(self.TARGET, positional, keywords, call), notes=tuple(notes))


def _patch_aware(call: cst.Call, patch: Patch, ctx: RuleContext) -> Rewrite:
    """The run replaces SDPA at run time (``patch``): a call through the module attribute goes to the
    patch-aware drop-in with its arguments verbatim (the drop-in runs whatever is installed when it
    is called, as the attribute lookup did); a call through a name bound earlier is kept."""
    more = [p.where() for p in ctx.options.patches if p.api == patch.api and p is not patch]
    also = f"; also {', '.join(more[:3])}{' ...' if len(more) > 3 else ''}" if more else ""
    where = (
        f"{patch.where()} replaces torch.nn.functional.scaled_dot_product_attention at run time "
        f"({patch.how}{also})"
    )
    if not (isinstance(call.func, cst.Attribute) and call.func.attr.value == "scaled_dot_product_attention"):
        raise Refuse(
            f"calls {ctx.code(call.func)}, bound to SDPA when that binding ran, and {where}: whether "
            f"{ctx.code(call.func)} holds torch's SDPA or the patch depends on the order the program runs "
            "in; call F.scaled_dot_product_attention(...) through the module to have it ported"
        )
    return on_drop_in(
        call,
        f"{DROP_IN}.scaled_dot_product_attention",
        f"patch-aware drop-in, arguments verbatim: {where}; the drop-in runs that patch when it is "
        "installed, flashport's SDPA otherwise",
    )
