"""FPA903 maxtext-attention-config: MaxText's GPU-only ``attention=`` values (scan only).

What it reports:
  the string literals ``"cudnn_flash_te"`` and ``"cudnn_flash_jax"`` wherever they occur in Python
  (``attention="cudnn_flash_te"`` in configs, overrides, launch scripts). MaxText selects its
  attention kernel by this config value instead of by call: ``cudnn_flash_te`` is
  TransformerEngine's cuDNN fused attention and ``cudnn_flash_jax`` JAX's private cuDNN
  ``dot_product_attention`` -- both CUDA-only. Rewriting calls alone leaves them in place.

Semantics mapping:
  none: on TPU MaxText's own ``attention="flash"`` (its Pallas splash-attention kernel) or
  ``"dot_product"`` is the portable choice; ``"flash"``, ``"dot_product"`` and ``"autoselected"``
  are therefore not reported. YAML config files are not scanned (Python sources only).

What it refuses:
  every site (reported with the reason; a config value has no call to rewrite).

Example::

    config = pyconfig.initialize(argv, attention="cudnn_flash_te")   # reported
"""

from __future__ import annotations

from flashport.rules.base import Report, Rule, register

VALUES = {
    "cudnn_flash_te": "TransformerEngine cuDNN fused attention",
    "cudnn_flash_jax": "JAX's private cuDNN dot_product_attention",
}


@register
class MaxTextAttentionConfig(Rule):
    """Report MaxText ``attention=`` values that select CUDA-only kernels."""

    CODE = "FPA903"
    NAME = "maxtext-attention-config"
    API = "MaxText attention= config"
    FRAMEWORK = "jax"
    STRINGS = tuple(VALUES)
    REWRITES = False

    def check_string(self, node, value, ctx):
        """Always a report (configuration, not a call)."""
        return Report(
            f"MaxText attention={value!r} selects {VALUES[value]} (CUDA only); on TPU use "
            "attention='flash' (Pallas splash attention) or 'dot_product'"
        )
