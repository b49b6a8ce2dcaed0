"""FPA102 sdpa-backend-selector: torch's SDPA backend selectors; made neutral once their body is rewritten.

What it reports:
  ``torch.nn.attention.sdpa_kernel(...)`` and the deprecated ``torch.backends.cuda.sdp_kernel(...)``
  context managers, and the global switches ``torch.backends.cuda.enable_flash_sdp`` /
  ``enable_mem_efficient_sdp`` / ``enable_math_sdp`` / ``enable_cudnn_sdp``.

Semantics mapping:
  none: they pick a CUDA kernel for SDPA and have no effect on ``flashport.torch.attention``.
  A ``with sdpa_kernel(...)`` / ``with sdp_kernel(...)`` whose body only calls
  ``torch.nn.functional.scaled_dot_product_attention`` (resolved through the file's imports) in
  ways FPA101 rewrites, plus plain tensor methods, becomes ``with contextlib.nullcontext():``
  (``rules/_selector_body.py``).

What it refuses:
  selectors whose body calls anything else (it may run SDPA indirectly), holds an SDPA call that
  is refused, or has no SDPA call; selectors not used as a ``with`` item; the global switches
  (left as is, reported with the reason).

Example::

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):   # reported: backend selector, kept
        y = F.scaled_dot_product_attention(q, k, v)  # FPA101 rewrites this
"""

from __future__ import annotations

from flashport.rules import _selector_body
from flashport.rules.base import Report, Rule, register
from flashport.rules.fpa101_torch_sdpa import TorchSDPA

SWITCHES = ("enable_flash_sdp", "enable_mem_efficient_sdp", "enable_math_sdp", "enable_cudnn_sdp")


@register
class SDPABackendSelector(Rule):
    """Report SDPA backend selectors and switches (GPU kernel choice; kept as is)."""

    CODE = "FPA102"
    NAME = "sdpa-backend-selector"
    API = "torch.nn.attention.sdpa_kernel"
    FRAMEWORK = "torch"
    SOURCES = ("torch.nn.attention.sdpa_kernel", "torch.backends.cuda.sdp_kernel") + tuple(
        f"torch.backends.cuda.{name}" for name in SWITCHES
    )
    TRIGGERS = (b"sdpa_kernel", b"sdp_kernel") + tuple(name.encode() for name in SWITCHES)
    TARGET = "contextlib.nullcontext"

    def check_call(self, call, ctx):
        """Neutral once every call in the ``with`` body is a rewritten SDPA call; else a report."""
        if ctx.qualified_name.rsplit(".", 1)[-1] in SWITCHES:
            return Report("SDPA backend switch: no effect on flashport calls; kept")
        outcome = _selector_body.neutral_selector(call, ctx, TorchSDPA())
        if isinstance(outcome, str):
            return Report(f"SDPA backend selector kept: {outcome}")
        return outcome
