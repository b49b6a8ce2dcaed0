"""FPA904 nvte-fused-attn-env: TransformerEngine's attention environment switches (scan only).

What it reports:
  the string literals ``"NVTE_FUSED_ATTN"``, ``"NVTE_FLASH_ATTN"``, ``"NVTE_FUSED_ATTN_BACKEND"`` and
  ``"NVTE_FUSED_ATTN_USE_FAv2_BWD"`` (``os.environ["NVTE_FUSED_ATTN"] = "1"``,
  ``os.getenv("NVTE_FLASH_ATTN")``, launcher env tables). They select TransformerEngine's GPU
  attention backend (cuDNN fused vs flash-attn) by environment instead of by call.

Semantics mapping:
  none: they have no effect on flashport or on TPU; the TransformerEngine attention calls
  themselves are FPA208/FPA209. They are reported so a port does not leave GPU assumptions behind.

What it refuses:
  every site (reported with the reason).

Example::

    os.environ["NVTE_FUSED_ATTN"] = "1"   # reported
"""

from __future__ import annotations

from flashport.rules.base import Report, Rule, register

NAMES = ("NVTE_FUSED_ATTN", "NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN_BACKEND", "NVTE_FUSED_ATTN_USE_FAv2_BWD")


@register
class NVTEFusedAttnEnv(Rule):
    """Report TransformerEngine's attention-backend environment variables."""

    CODE = "FPA904"
    NAME = "nvte-fused-attn-env"
    API = "TransformerEngine NVTE_FUSED_ATTN"
    FRAMEWORK = "jax"
    STRINGS = NAMES
    TRIGGERS = (b"NVTE_",)
    REWRITES = False

    def check_string(self, node, value, ctx):
        """Always a report (environment switch)."""
        return Report(
            f"environment switch {value!r} selects TransformerEngine's CUDA attention backend; "
            "no effect on flashport/TPU (not rewritten)"
        )
