"""FPA901 attn-implementation-config: reports transformers' flash-attention selection strings (scan only).

What it reports:
  the string literals ``"flash_attention_2"`` / ``"flash_attention_3"`` wherever they occur
  (``from_pretrained(..., attn_implementation="flash_attention_2")``, ``config._attn_implementation
  == "flash_attention_2"``, dispatch tables). They select a CUDA kernel by configuration instead of
  by call, so rewriting calls alone leaves them in place.

Semantics mapping:
  none here: FPA905 (opt-in, ``--ignore FPA901``) rewrites the strings that *set* the attention
  implementation to ``flashport.integrations.transformers.ATTN_IMPLEMENTATION``, which registers
  flashport's attention function with transformers.

What it refuses:
  every site (reported with the reason).

Example::

    model = AutoModel.from_pretrained(name, attn_implementation="flash_attention_2")  # reported
"""

from __future__ import annotations

from flashport.rules.base import Report, Rule, register


@register
class AttnImplementationConfig(Rule):
    """Report ``attn_implementation``-style strings that select flash-attn kernels."""

    CODE = "FPA901"
    NAME = "attn-implementation-config"
    API = "transformers attn_implementation"
    FRAMEWORK = "torch"
    STRINGS = ("flash_attention_2", "flash_attention_3")
    REWRITES = False

    def check_string(self, node, value, ctx):
        """Always a report (configuration, not a call)."""
        return Report(f"configuration string {value!r} selects a CUDA flash-attention kernel; not rewritten")
