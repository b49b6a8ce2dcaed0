"""FPA008 flash-attn-triton-and-internals: flash-attn's private kernels -> flashport's drop-ins; Triton reported.

What it rewrites:
  the private kernel entry points of ``flash_attn.flash_attn_interface`` (ring / context-parallel
  attention and custom autograd functions call them): ``_flash_attn_forward`` /
  ``_flash_attn_backward``, ``_flash_attn_varlen_forward`` / ``_flash_attn_varlen_backward`` and
  their ``_wrapped_*`` variants become flashport's drop-in for the flash-attn release the call was
  written for, in ``flashport.integrations.flash_attn_compat`` (``flash_attn_private``): the call,
  its arguments, their order and comments unchanged. The release range comes from the ``if`` /
  ``elif`` / ``else`` tests around the call that compare a flash-attn version (``if
  flash_attn_version >= version.parse("2.7.0"):``), else from ``--flash-attn-version`` (default
  2.8.3); the call must fit exactly one release's signature in that range (its arguments, and the
  number of names a forward's result is unpacked into): 2.7+ -> the drop-in of the same name;
  2.6 / 2.4-2.5 (``window_size=(l, r)``, 8 return values) -> ``_flash_attn_forward_v2_6`` / ``_v2_4``,
  ``_flash_attn_backward_v2_6`` / ``_v2_4`` and the varlen ones alike; 2.0.2-2.2 (no window, softcap
  or ALiBi; a ``None`` bound to 2.3-2.6's ``window_size`` is such a release's ``rng_state``) ->
  ``_v2_0``. ``*args``/``**kwargs`` splats are bound at
  run time (``rules/flash_attn/private_kernels.py``).

  FlashAttention-3's private ``_flash_attn_forward`` / ``_flash_attn_backward`` (``flash_attn_interface``,
  ``flash_attn_3.flash_attn_interface``, ``hopper.flash_attn_interface``, before 2025 ``flashattn_hopper``)
  go to the drop-in of the FA3 build whose signature the call fits, in
  ``flashport.integrations.flash_attn3_compat`` (the latest build's under the same name, an older
  build's with its date: ``_flash_attn_forward_v2025_03_15``): every build it fits must read its
  arguments as the same parameters (their positions moved as ``qv`` and ``seqlens_rotary`` were
  inserted) and, where the result is used, return the same values; a ``**kwargs`` splat and a
  value (stored, passed on, inspected with ``inspect.*`` / ``isinstance``) go to the latest build's
  (``rules/flash_attn/fa3_private.py``).

Semantics mapping:
  the drop-ins keep flash-attn's conventions: the 2.7+ forwards return ``(out, softmax_lse,
  S_dmask, rng_state)``, the older ones ``(out, q, k, v, out_padded, softmax_lse, S_dmask,
  rng_state)`` (lse [B, H, Sq] / varlen [H, total_q], +inf for a row that sees no key; ``S_dmask``
  None; ``rng_state`` the dropout seed); the backwards write dq, dk, dv **into the given buffers**
  from the ``out`` and ``softmax_lse`` they are given (not a recomputed forward, so merged ring /
  two-branch results get flash-attn's gradients) and return ``softmax_d`` (2.7+) or ``(dq, dk, dv,
  softmax_d)``. Causal/window bottom-right (per sequence for varlen), softcap, GQA, ALiBi (dense),
  dropout regenerated from ``rng_state`` in the backward.

What it refuses:
  * a call that fits no release's signature in its range, or several with different conventions
    (ambiguous), flash-attn 2.3 (no drop-in), ``return_softmax=True``,
    varlen ``alibi_slopes``/``block_table``/``leftpad_k``/``seqused_k`` given by an expression (a
    forwarded name is checked at run time: the drop-in raises when it is not None), value uses in a range whose
    releases differ, and values that are compared, listed in ``__all__`` or inside an import guard;
  * the Triton implementation ``flash_attn.flash_attn_triton.flash_attn_func(q, k, v, bias=None,
    causal=False, softmax_scale=None)`` and its ``flash_attn_kvpacked_func`` /
    ``flash_attn_qkvpacked_func``: same names as the CUDA functions (FPA001-003) but another
    signature -- the 4th positional argument is an additive ``bias``, not ``dropout_p`` -- so
    rewriting them as the CUDA function would change the meaning. Port by hand to
    ``flashport.torch.attention(q, k, v, bias=bias, causal=causal, scale=softmax_scale, layout="BSHD")`` once its
    causal alignment is checked;
  * FlashAttention-3's private kernels called with a ``*args`` splat, fitting no build from
    2025-01-07 on (FA3's 2024 dense-only builds, a 7-value forward, have no drop-in), or fitting
    builds that read its arguments differently or return different values where the result is used.

Example::

    out, lse, _, rng = _flash_attn_forward(q, k, v, 0.0, scale, True, -1, -1, 0.0, None, False)
    # becomes
    out, lse, _, rng = flashport.integrations.flash_attn_compat._flash_attn_forward(q, k, v, 0.0, scale, True, -1, -1, 0.0, None, False)
"""

from __future__ import annotations

import libcst as cst

from flashport.rules.base import Refuse, Report, Rewrite, Rule, register
from flashport.rules.common import values
from flashport.rules.common.calls import dotted, on_drop_in
from flashport.rules.common.literals import is_none, literal_bool
from flashport.rules.flash_attn import fa3_private, private_kernels
from flashport.rules.flash_attn.arguments import COMPAT

TRITON = tuple(
    f"flash_attn.flash_attn_triton.{name}"
    for name in ("flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func")
)
PRIVATE = tuple(
    f"flash_attn.flash_attn_interface.{prefix}flash_attn{kind}_{step}"
    for prefix in ("_", "_wrapped_")
    for kind in ("", "_varlen")
    for step in ("forward", "backward")
)
# FlashAttention-3's private kernels (megatron-core calls them through inspect-driven argument lists)
FA3_PRIVATE = fa3_private.SOURCES
_UNSUPPORTED_VARLEN = ("alibi_slopes", "block_table", "leftpad_k", "seqused_k")


@register
class FlashAttnTritonAndInternals(Rule):
    """Port flash-attn's private kernels to the drop-ins; report the Triton functions."""

    CODE = "FPA008"
    NAME = "flash-attn-triton-and-internals"
    API = "flash_attn.flash_attn_interface._flash_attn_forward"
    SOURCES = TRITON + PRIVATE + FA3_PRIVATE
    TRIGGERS = (b"flash_attn",)
    TARGET = "flashport.integrations.flash_attn_compat._flash_attn_* (drop-ins)"

    def check_call(self, call, ctx):
        """The private kernels go to the drop-in of the release the call was written for; Triton
        calls are refused."""
        if ctx.qualified_name in TRITON:
            raise Refuse(_triton_reason(ctx.qualified_name))
        if ctx.qualified_name in FA3_PRIVATE:
            return fa3_private.port_call(call, ctx)
        function = ctx.qualified_name.rsplit(".", 1)[-1].replace("_wrapped", "", 1)
        convention, bound, inferred = private_kernels.convention_for(call, function, ctx)
        _check_bound(bound, function)
        releases = "2.7+" if not convention.suffix else convention.suffix[2:].replace("_", ".") + ".x"
        releases = "2.0.2-2.2" if convention.suffix == "_v2_0" else releases
        target = function + convention.suffix
        note = (
            f"drop-in {target} (flash-attn {releases}'s signature, return convention and in-place gradients)"
        )
        notes = (note,) if inferred is None else (note, inferred)
        return on_drop_in(call, f"{COMPAT}.{target}", *notes)

    def check_reference(self, node, ctx):
        """Value uses are reported: the callers of a value are out of sight."""
        if ctx.qualified_name in TRITON:
            raise Refuse(f"used as a value: {_triton_reason(ctx.qualified_name)}")
        if ctx.qualified_name in FA3_PRIVATE:
            return fa3_private.port_value(node, ctx)
        why = values.probe(ctx)
        if why is not None and not values.inspects_signature(ctx):
            return Report(f"{why}: not a call to port; kept")
        function = ctx.qualified_name.rsplit(".", 1)[-1].replace("_wrapped", "", 1)
        convention = private_kernels.value_convention(function, ctx)
        target = function + convention.suffix
        note = (
            f"{values.describe(node, ctx)}: the value is now the drop-in {target}, which has the "
            "signature, defaults and return convention of the flash-attn releases the site runs under "
            "(its callers, and any inspection of its parameters, see the same function)"
        )
        return Rewrite(dotted(f"{COMPAT}.{target}"), imports=(COMPAT,), notes=(note,))


def _check_bound(bound: dict[str, cst.Arg], function: str) -> None:
    """Refuse what the drop-in would reject at run time."""
    if "return_softmax" in bound and literal_bool(bound["return_softmax"].value) is True:
        raise Refuse(
            f"{function}(return_softmax=True): flash-attn's dropout-encoded probabilities are not reproduced"
        )
    if "varlen" in function:
        for name in _UNSUPPORTED_VARLEN:
            value = bound[name].value if name in bound else None
            # a forwarded name (often None at run time) is checked by the drop-in, which raises
            if value is not None and not is_none(value) and not isinstance(value, (cst.Name, cst.Attribute)):
                raise Refuse(f"{function}({name}=...): not supported by flashport's varlen drop-in")


def _triton_reason(name: str) -> str:
    short = name.rsplit(".", 1)[-1]
    return (
        f"flash_attn_triton.{short} is the Triton implementation: its 4th positional argument is an "
        "additive bias (not dropout_p), so it is not the CUDA function; port it by hand to "
        "flashport.torch.attention(q, k, v, bias=..., causal=..., scale=..., layout='BSHD')"
    )
