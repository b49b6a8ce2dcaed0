"""FPA102 sdpa-backend-selector: torch's SDPA backend selectors; made neutral once their body is rewritten.

What it reports:
  ``torch.nn.attention.sdpa_kernel(...)`` and the deprecated ``torch.backends.cuda.sdp_kernel(...)``
  context managers, and the global switches ``torch.backends.cuda.enable_flash_sdp`` /
  ``enable_mem_efficient_sdp`` / ``enable_math_sdp`` / ``enable_cudnn_sdp``.

Semantics mapping:
  none: they pick a CUDA kernel for SDPA and have no effect on ``flashport.torch.attention``.
  A ``with sdpa_kernel(...)`` / ``with sdp_kernel(...)`` whose body only calls
  ``torch.nn.functional.scaled_dot_product_attention`` (resolved through the file's imports) plus
  plain tensor methods becomes ``with contextlib.nullcontext():`` (``rules/torch/selector_body.py``) --
  only when every one of those SDPA calls ends rewritten. That is decided in the engine's per-file
  phase from their final status (``Rewrite.requires``), never by asking FPA101: an SDPA call that
  is refused, suppressed with ``# flashport: ignore[FPA101]``, left out by ``--ignore FPA101`` or
  declined in ``--interactive`` review still runs torch SDPA, so its selector is kept.

Runs as is:
  the global switches (``enable_math_sdp`` only when switched on) and their values (a table of
  switches), the selector of a kernel probe (FPA101's "runs as is" probes, plus tensor methods,
  in its body), and every selector whose backends statically include ``SDPBackend.MATH``
  (``sdpa_kernel([SDPBackend.CUDNN_ATTENTION, ..., SDPBackend.MATH], set_priority=True)``, also
  through a module-level constant the file binds once and only passes to ``sdpa_kernel``, with
  imports at module level, in module-level ``try`` blocks or in the function, or a variable an
  enclosing function binds once (a list it builds for its selectors), and ``sdp_kernel(...)``
  unless ``enable_math`` may be false; ``rules/torch/selector_backends.py``) wherever it is used --
  returned by a helper, bound to a name, over a body that calls other functions: the math kernel
  runs every input on every host, so torch SDPA calls under it keep a kernel and their meaning.
  A selector made only on a CUDA device (in the body of ``if q.device.type == "cuda":``, of
  ``sdpa_kernel(...) if x.is_cuda and ... else nullcontext()``, or under ``torch.cuda.is_available()``)
  never runs on a TPU host, wherever it is used (made neutral instead where its body allows).
  They only pick torch SDPA's kernels, and ``flashport.torch.attention`` does not read them (on
  CPU it enables torch's CPU kernels for its own SDPA call). Kept byte-identical, reported with the
  reason prefix "runs as is on a TPU host".

What it refuses:
  selectors without ``SDPBackend.MATH`` (on a TPU host's CPU torch a kept ``FLASH_ATTENTION``-only
  or ``CUDNN_ATTENTION`` selector can leave SDPA without a kernel) whose body calls anything else
  (it may run SDPA indirectly), holds an SDPA call that does not end rewritten, or has no SDPA
  call; such selectors not used as a ``with`` item; ``enable_math_sdp`` with a value that may be
  false (a CPU host may be left without a kernel for torch SDPA calls).

Example::

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):   # reported: backend selector, kept
        y = F.scaled_dot_product_attention(q, k, v)  # FPA101 rewrites this
"""

from __future__ import annotations

from flashport.rules.base import Report, Rule, register, runs_as_is
from flashport.rules.common import node_context
from flashport.rules.common.literals import literal_bool
from flashport.rules.torch import selector_backends, selector_body

SWITCHES = ("enable_flash_sdp", "enable_mem_efficient_sdp", "enable_math_sdp", "enable_cudnn_sdp")


@register
class SDPABackendSelector(Rule):
    """Report SDPA backend selectors and switches (GPU kernel choice; kept as is)."""

    CODE = "FPA102"
    NAME = "sdpa-backend-selector"
    SOURCES = ("torch.nn.attention.sdpa_kernel", "torch.backends.cuda.sdp_kernel") + tuple(
        f"torch.backends.cuda.{name}" for name in SWITCHES
    )
    TARGET = "contextlib.nullcontext"

    def check_call(self, call, ctx):
        """Neutral when every call in the ``with`` body is an SDPA call that ends rewritten (the
        engine checks that in its per-file phase); else runs as is (a switch, a probe's selector, a
        selector keeping the math kernel) or a report saying why it is kept."""
        switch = ctx.qualified_name.rsplit(".", 1)[-1]
        if switch in SWITCHES:
            value = call.args[0].value if len(call.args) == 1 and not call.args[0].star else None
            if switch == "enable_math_sdp" and literal_bool(value) is not True:
                return Report(
                    "SDPA backend switch kept: turning the math kernel off may leave torch SDPA calls on "
                    "a CPU host without a kernel"
                )
            return runs_as_is(SWITCH_REASON)
        if node_context.backend_probe(ctx) is not None and selector_body.probe_only(call, ctx):
            return runs_as_is(PROBE_REASON)  # its SDPA calls are FPA101's probes: never rewritten
        kept = None
        if selector_backends.includes_math(call, ctx):
            kept = runs_as_is(MATH_REASON)
        elif (guard := node_context.cuda_only_guard(ctx)) is not None:
            kept = runs_as_is(f"SDPA backend selector made only when {guard}: {CUDA_REASON}")
        otherwise = (
            kept.reason if kept else "SDPA backend selector kept: an SDPA call in its body is not rewritten"
        )
        outcome = selector_body.neutral_selector(call, ctx, otherwise)
        if isinstance(outcome, str):
            return kept or Report(f"SDPA backend selector kept: {outcome}")
        return outcome

    def check_reference(self, node, ctx):
        """A switch used as a value (a table of switches) runs as is, as its calls do; else as
        :meth:`Rule.check_reference`."""
        switch = ctx.qualified_name.rsplit(".", 1)[-1]
        if switch in SWITCHES and switch != "enable_math_sdp":
            return runs_as_is(f"a value of an {SWITCH_REASON}")
        return super().check_reference(node, ctx)


PROBE_REASON = (
    "SDPA backend selector of a kernel probe on tensors its function makes itself: it asks torch "
    "whether that kernel runs on this host; flashport calls do not depend on it"
)
MATH_REASON = (
    "SDPA backend selector whose backends include SDPBackend.MATH: the math kernel runs every SDPA "
    "input on every host, so torch SDPA calls under it keep a kernel and their meaning, and "
    "flashport.torch.attention does not read it"
)
CUDA_REASON = "a TPU host has no CUDA device, so the selector never runs there"
SWITCH_REASON = (
    "SDPA backend switch: it selects torch SDPA's kernels (a global flag every torch build has), and "
    "flashport.torch.attention does not read it"
)
