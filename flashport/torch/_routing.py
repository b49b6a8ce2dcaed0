"""Which torch-native path ``backend="auto"`` takes for CUDA (and other non-CPU) tensors, and running it.

:func:`choose_route` is a pure function of the call, the device type and what is installed, so
every decision is tested on a CPU host. In order:

1. the exact math path when there are no keys or there is dropout (only it draws the contract's
   keep-mask: flash-attn and SDPA draw their own, FlexAttention has none);
2. flash-attn 2 when installed and the call fits it (:func:`_native.flash_unsupported`);
3. torch SDPA when its fused kernels take the call as it is: no positional mask beyond top-left
   causal (or Sq == Sk), no boolean mask or segment ids, no softcap, no lse (:func:`sdpa_fused_unsupported`);
4. on CUDA with Triton installed, FlexAttention (:mod:`flashport.torch._flex`): softcap, windows, segment ids,
   bottom-right causal, masks, biases under a mask, lse, in O(S) memory with block skipping;
5. SDPA with an explicit O(Sq*Sk) mask (other devices, or FlexAttention unavailable);
6. the exact math path for what none of them can do, with a DEBUG line naming every reason.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flashport.torch import _flex, _native
from flashport.torch._checks import CanonicalCall

log = _native.log

# Device types whose auto route may use FlexAttention (compiled with Triton).
FLEX_DEVICES = ("cuda",)


@dataclasses.dataclass(frozen=True)
class Route:
    """A routing decision: ``path`` is ``"flash_attn"``, ``"sdpa"``, ``"flex"`` or ``"math"``;
    ``reason`` says why (what the paths before it could not do, or why this one fits)."""

    path: str
    reason: str


def sdpa_fused_unsupported(call: CanonicalCall, return_lse: bool) -> str | None:
    """Why SDPA cannot run ``call`` without an O(Sq*Sk) mask built for it (None when it can).

    SDPA's flash/efficient kernels take ``is_causal`` (top-left) and an additive bias; anything
    else positional, boolean masks and segment ids would have to be materialized.
    """
    reason = _native.sdpa_unsupported(call, return_lse)
    if reason:
        return reason
    p = call.spec
    if p.window_left is not None or p.window_right is not None:
        return "a window (SDPA takes it only as an O(Sq*Sk) mask)"
    if call.q_seg is not None:
        return "segment ids (SDPA takes them only as an O(Sq*Sk) mask)"
    if p.causal and p.offset != 0:
        return f"bottom-right causal with Sq={p.seq_q} != Sk={p.seq_k} (SDPA's is_causal is top-left)"
    if call.mask is not None:
        return "a boolean mask (SDPA has no block skipping for it)"
    if call.bias is not None and p.causal:
        return "causal with a bias (SDPA takes is_causal or a mask, not both)"
    if call.bias is not None and call.bias.dtype != call.q.dtype:
        return f"a {call.bias.dtype} bias with {call.q.dtype} queries (SDPA would round the bias)"
    return None


def choose_route(
    call: CanonicalCall, return_lse: bool, *, device_type: str, flash: bool, triton: bool = True
) -> Route:
    """The path ``auto`` takes for ``call`` on ``device_type`` (``flash``: flash-attn installed;
    ``triton``: Triton installed, which compiling FlexAttention for CUDA needs).

    Pure: reads the call (its spec, tensors' shapes and, for varlen packing, segment ids), never
    the tensors' device, so decisions for ``"cuda"`` are testable with CPU tensors.
    """
    if call.k.shape[2] == 0:
        return Route("math", "no keys (Sk == 0)")
    if call.dropout_p > 0:
        return Route(
            "math",
            "dropout (only the math path draws the contract's keep-mask; flash-attn and SDPA draw "
            "their own and FlexAttention has no dropout)",
        )
    passed = []
    if flash:
        reason = _native.flash_unsupported(call)
        if reason is None and _native.lse_needs_grad(call, return_lse):
            reason = "a differentiable lse (flash-attn's backward ignores the lse cotangent)"
        if reason is None:
            return Route("flash_attn", "flash-attn fits the call")
        passed.append(f"flash-attn: {reason}")
    else:
        passed.append("flash-attn: not installed")
    reason = sdpa_fused_unsupported(call, return_lse)
    if reason is None:
        return Route("sdpa", "SDPA's fused kernels take the call")
    passed.append(f"SDPA: {reason}")
    if device_type in FLEX_DEVICES:
        reason = _flex.flex_unsupported(call)
        if reason is None and not triton:
            reason = "Triton is not installed (torch.compile builds flex's CUDA kernels with it)"
        if reason is None:
            return Route("flex", "; ".join(passed))
        passed.append(f"FlexAttention: {reason}")
    else:
        passed.append(f"FlexAttention: not used on {device_type} tensors")
    reason = _native.sdpa_unsupported(call, return_lse)
    if reason is None:
        return Route("sdpa", "; ".join(passed) + "; SDPA runs it with an explicit mask")
    return Route("math", "; ".join(passed))


def cuda_attention(
    call: CanonicalCall, return_lse: bool, flash: Any = "import", device_type: str | None = None
):
    """``backend="auto"`` for CUDA and other non-CPU tensors: run :func:`choose_route`'s path.

    ``flash`` is the flash-attn module (``"import"`` = import it now; ``None`` = not installed).
    ``device_type`` overrides the tensors' device type for the decision (tests run the CUDA route's
    FlexAttention path on CPU tensors with it; flex then runs eagerly). Returns ``(out, lse)``.
    """
    flash = _native.import_flash_attn() if flash == "import" else flash
    actual = call.q.device.type
    triton = _flex.triton_available() if actual in FLEX_DEVICES else True  # off CUDA flex runs eagerly
    route = choose_route(
        call, return_lse, device_type=device_type or actual, flash=flash is not None, triton=triton
    )
    if route.path == "math":
        log.debug("flashport.torch: exact math path runs this call (%s)", route.reason)
        return _native.math_attention(call)
    log.debug("flashport.torch: %s runs this call (%s)", _NAMES[route.path], route.reason)
    if route.path == "flash_attn":
        return _native.flash_attention(call, flash, return_lse)
    if route.path == "sdpa":
        return _native.sdpa_attention(call)
    return _flex.flex_attention(call, return_lse, compiled=actual in FLEX_DEVICES)


_NAMES = {"flash_attn": "flash-attn", "sdpa": "torch SDPA", "flex": "FlexAttention"}
