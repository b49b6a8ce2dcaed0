"""``flashport.torch.varlen_attention``: flash-attn's packed variable-length convention on torch tensors."""

from __future__ import annotations

from flashport.kernels.keywords import VARLEN_KEYWORDS, takes_contract_keywords
from flashport.kernels.varlen import run_varlen


@takes_contract_keywords(VARLEN_KEYWORDS, layout="THD")
def varlen_attention(
    query,
    key,
    value,
    *,
    cu_seqlens_q,
    cu_seqlens_k,
    backend="auto",
    dropout_p=0.0,
    generator=None,
    attention=None,
    **contract,
):
    """Attention over packed variable-length torch tensors (torchax / torch_xla tensors included),
    flash-attn varlen semantics, through :func:`flashport.torch.attention`.

    Args:
      query: [total_q, Hq, D]; key, value: [total_k, Hkv, D] (``layout="THD"``).
      cu_seqlens_q, cu_seqlens_k: int (B+1,) cumulative sequence starts (flash-attn's convention).
      scale, softcap, backend: as :func:`flashport.torch.attention`.
      causal, window: applied per sequence with ``align`` (``"bottom_right"``: offset
        ``len_k[b] - len_q[b]``, flash-attn >= 2.1; ``"top_left"``: offset 0).
      layout: must be ``"THD"``.
      dropout_p, generator: as :func:`flashport.torch.attention`; the sequences are packed into one
        batch row, so the keep-mask is drawn at batch 0 and the packed token positions.
      attention: the contract implementation to call (default: :func:`flashport.torch.attention`);
        tests pass a reference. Dropout keywords reach a custom one only when ``dropout_p`` is
        non-zero or a generator is given.

    Returns:
      [total_q, Hq, D]; rows of tokens past ``cu_seqlens_q[-1]`` are 0.
    """
    if attention is None:
        from flashport.torch import attention
    extra = dict(dropout_p=dropout_p, generator=generator) if dropout_p or generator is not None else {}
    cu = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    return run_varlen(attention, query, key, value, **cu, backend=backend, contract=contract, extra=extra)
