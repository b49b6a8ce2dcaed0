"""FPA004 flash-attn-varlen-func: ``flash_attn_varlen_func`` -> ``flashport.varlen_attention``.

What it rewrites:
  ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
  return_attn_probs, block_table)`` from ``flash_attn`` / ``flash_attn.flash_attn_interface``, and
  its flash-attn 1.x name ``flash_attn_unpadded_func(q, k, v, cu_seqlens_q, cu_seqlens_k,
  max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, return_attn_probs, deterministic)``
  from ``flash_attn.flash_attn_interface`` (1.x order: ``deterministic`` last).
  Calls with dropout go to the ``flash_attn_compat`` drop-in of the same name (see Dropout).

Semantics mapping:
  packed ``[total, H, D]`` tensors with int32 ``cu_seqlens`` ``(B+1,)`` -> ``layout="THD"`` and
  ``flashport.varlen_attention`` (``flashport/kernels/contract/varlen.py``), which runs the contract with
  batch 1, segment ids from ``cu_seqlens`` and a mask that keeps **per-sequence** bottom-right
  causal/window alignment (offset ``len_k[b] - len_q[b]`` for each sequence, not one global
  ``Sk - Sq``), so ``align="bottom_right"`` means what flash-attn means. Tokens past
  ``cu_seqlens[-1]`` attend nothing (output 0). ``max_seqlen_q/k`` are dropped (they only size
  flash-attn's kernel launch). Scale, window, softcap as FPA001. flash-attn 1.x causal is
  **top-left** (bottom-right only since 2.1), so the 1.x name gets ``align="top_left"``.

Dropout:
  ``flashport.varlen_attention`` has no dropout, so a call whose ``dropout_p`` may be non-zero (and
  is not a training-gated one dropped by ``--inference``) keeps its arguments and calls the drop-in
  of the same name, ``flashport.integrations.flash_attn_compat.<function>`` (flash-attn's signature
  and semantics; ``dropout_p`` goes to ``flashport.torch.attention``). Not with flash-attn 2.0
  (top-left causal) or ``return_attn_probs``; 2.x positional arguments after ``dropout_p``
  are refused (their order changed between releases). ALiBi (``alibi_slopes``; the drop-in adds
  flash-attn's bias per sequence, one dense call each), a paged KV cache (``block_table``) and a
  ``*args``/``**kwargs`` splat (``flash_attn_varlen_func(**flash_kwargs)``, bound at run time) go to
  the same drop-in (it gathers the pages through ``block_table``).

What it refuses:
  dropout the drop-in cannot take (see Dropout), ``return_attn_probs`` with a dropout that
  may be non-zero (without dropout the call goes to the drop-in, as in FPA001), unknown arguments.

Example::

    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal=True)
    # becomes
    out = flashport.varlen_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, align="bottom_right", layout="THD")
"""

from __future__ import annotations

from flashport.rules.base import register
from flashport.rules.flash_attn.dense_varlen import VarlenRule


@register
class FlashAttnVarlenFunc(VarlenRule):
    """Rewrite flash-attn 2.x ``flash_attn_varlen_func`` to ``flashport.varlen_attention``."""

    CODE = "FPA004"
    NAME = "flash-attn-varlen-func"
    FUNCTION = "flash_attn_varlen_func"
