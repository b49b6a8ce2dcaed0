"""FPA001 flash-attn-func: ``flash_attn.flash_attn_func`` (flash-attn 2.x) -> ``flashport.torch.attention``.

What it rewrites:
  ``flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
  deterministic, return_attn_probs)`` imported from ``flash_attn`` or
  ``flash_attn.flash_attn_interface`` (any alias, module or function-level import, guarded or not).

Semantics mapping:
  layout ``[B, S, H, D]`` -> ``layout="BSHD"``; ``causal`` is bottom-right since 2.1 ->
  ``align="bottom_right"`` (``"top_left"`` with ``flash-attn-version`` < 2.1); ``softmax_scale``
  (None = 1/sqrt(D)) -> ``scale``; ``window_size=(l, r)`` inclusive, -1 = unbounded -> ``window``
  with ``None`` for -1 (non-literal windows are converted at run time); ``softcap`` (0.0 = off) ->
  ``softcap`` (None = off); GQA (Hk divides Hq, contiguous groups) is the same in the contract;
  ``deterministic`` is dropped (backward-only);
  ``dropout_p`` -> ``dropout_p`` verbatim (same meaning: dropout on the normalized probabilities,
  kept ones scaled by 1/(1-p), applied whenever p > 0, drawn from torch's default generator);
  the expression is evaluated once, in its source order among the carried arguments (a literal 0
  is dropped; ``--inference`` drops a training-gated ``p if self.training else 0.0``). Positional arguments are bound against the
  configured flash-attn version's signature (2.x inserted parameters mid-signature).

What it refuses:
  ``return_attn_probs`` with a dropout that may be non-zero (the dropout-encoded probabilities are
  not reproduced), unknown arguments; the drop-in cases below with flash-attn 2.0 (top-left
  causal) or, before 2.6, with positional arguments after ``window_size`` (or a ``*args`` splat).

Drop-in:
  a call with ``alibi_slopes``, or whose dropout expression has side effects and would be evaluated
  out of its source order by the explicit rewrite, keeps its arguments and calls
  ``flashport.integrations.flash_attn_compat.flash_attn_func`` (flash-attn's signature and
  semantics: ALiBi added as flash-attn's kernel adds it, dropout passed to the contract). So does a
  call with a ``*args``/``**kwargs`` splat (its arguments are bound at run time), in every flash-attn
  rule (FPA001-FPA007, each to its own drop-in). And so does a call whose ``return_attn_probs`` may
  be true without dropout (FPA001-FPA006): flash-attn then returns ``(out, softmax_lse, S_dmask)``
  with an empty ``S_dmask`` (its kernel fills it only with dropout), which the drop-in reproduces.

Example::

    out = flash_attn_func(q, k, v, 0.0, softmax_scale=s, causal=True, window_size=(128, 0))
    # becomes
    out = flashport.torch.attention(q, k, v, scale=s, causal=True, window=(128, 0), align="bottom_right", layout="BSHD")
    out = flash_attn_func(q, k, v, dropout_p=self.p if self.training else 0.0, causal=True)
    # becomes
    out = flashport.torch.attention(q, k, v, dropout_p=self.p if self.training else 0.0, causal=True, align="bottom_right", layout="BSHD")
"""

from __future__ import annotations

from flashport.rules.base import register
from flashport.rules.flash_attn.dense_varlen import DenseRule


@register
class FlashAttnFunc(DenseRule):
    """Rewrite flash-attn 2.x ``flash_attn_func`` to ``flashport.torch.attention``."""

    CODE = "FPA001"
    NAME = "flash-attn-func"
    FUNCTION = "flash_attn_func"
