"""FPA102 sdpa-backend-selector: reports torch's SDPA backend selectors (scan only).

What it reports:
  ``torch.nn.attention.sdpa_kernel(...)`` and the deprecated ``torch.backends.cuda.sdp_kernel(...)``
  context managers, and the global switches ``torch.backends.cuda.enable_flash_sdp`` /
  ``enable_mem_efficient_sdp`` / ``enable_math_sdp`` / ``enable_cudnn_sdp``.

Semantics mapping:
  none: they pick a CUDA kernel for SDPA and have no effect on ``flashport.torch.attention``.
  After the SDPA calls in their body are rewritten (FPA101) they are dead weight; removing them
  safely needs the body's calls to be rewritten first, which a later rule does.

What it refuses:
  every site (left as is, reported with the reason).

Example::

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):   # reported: backend selector, kept
        y = F.scaled_dot_product_attention(q, k, v)  # FPA101 rewrites this
"""

from __future__ import annotations

from flashport.rules.base import Report, Rule, register

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
    REWRITES = False

    def check_call(self, call, ctx):
        """Always a report: the selector stays until its body's calls are rewritten."""
        return Report("SDPA backend selector: no effect on flashport calls; kept (remove once the body's SDPA calls are rewritten)")
