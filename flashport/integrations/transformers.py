"""Hugging Face transformers integration: ``attn_implementation="flashport"``.

Importing this module registers, once:

* ``flashport_attention_forward`` with ``transformers.AttentionInterface`` under the name
  :data:`ATTN_IMPLEMENTATION` (``"flashport"``), so ``from_pretrained(...,
  attn_implementation="flashport")`` / ``model.set_attn_implementation("flashport")`` route every
  attention layer through :func:`flashport.torch.attention` (the Pallas kernel on TPU via torch_xla,
  flashport's JAX path on CPU, flash-attn/SDPA on CUDA);
* transformers' SDPA mask builder under the same name with ``transformers.AttentionMaskInterface``,
  so models hand the function the same masks they hand SDPA: a boolean ``[B, 1, Sq, Sk]`` mask
  (True = attend; padding, causal and sliding window included) or ``None`` when the mask is purely
  causal and SDPA would use ``is_causal`` instead.

The codemod rule FPA905 rewrites ``attn_implementation="flash_attention_2"`` to
``flashport.integrations.transformers.ATTN_IMPLEMENTATION``; evaluating that name imports this
module, so the registration happens before the model is built. Tested with transformers 4.57.
"""

from __future__ import annotations

ATTN_IMPLEMENTATION = "flashport"


def flashport_attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    is_causal=None,
    softcap=None,
    **kwargs,
):
    """A transformers attention function (the signature ``AttentionInterface`` calls) on flashport.

    Args:
      module: the attention layer (``is_causal`` is read from it when not passed).
      query: [B, Hq, Sq, D]; key, value: [B, Hkv, Sk, D] (GQA: Hkv divides Hq, no ``repeat_kv`` needed).
      attention_mask: None, a boolean mask (True = attend) or an additive float mask, broadcastable
        to [B, Hq, Sq, Sk] (sliced to Sk like SDPA's integration does).
      dropout: the attention dropout probability, applied when ``module.training`` (transformers'
        attention layers pass ``0.0 if not self.training else self.attention_dropout``) as
        ``dropout_p`` of :func:`flashport.torch.attention` (the contract's keep-mask, seeded from
        torch's default generator, so ``torch.manual_seed`` reproduces it); ignored in eval mode.
      scaling: the softmax scale (None = 1/sqrt(D)).
      is_causal: as SDPA's integration: default ``module.is_causal``; only used when there is no mask
        and Sq > 1, with SDPA's **top-left** alignment.
      softcap: Gemma-2 style logit soft-capping (``softcap * tanh(scores / softcap)``).
      **kwargs: ``sliding_window`` (already folded into the mask by the mask builder),
        ``output_attentions``, ``position_ids`` ... are ignored; ``s_aux`` (attention sinks) and
        ``head_mask`` are refused.

    Returns:
      ``(attn_output [B, Sq, Hq, D], None)`` like transformers' SDPA integration.

    Raises:
      NotImplementedError: for attention sinks or a head mask.
    """
    import flashport.torch

    for name in ("s_aux", "head_mask"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"attn_implementation='flashport' does not support {name}")
    out = flashport.torch.attention(
        query,
        key,
        value,
        scale=scaling,
        softcap=softcap or None,
        **_mask_keywords(module, attention_mask, is_causal, query.shape[2], key.shape[-2]),
        layout="BHSD",
        dropout_p=(dropout or 0.0) if getattr(module, "training", True) else 0.0,
    )
    return out.transpose(1, 2).contiguous(), None


def _mask_keywords(module, attention_mask, is_causal, s_q: int, s_k: int) -> dict:
    """The contract's ``causal``/``align``/``mask``/``bias`` keywords for transformers' mask arguments,
    as its SDPA integration reads them (mask sliced to ``s_k``; causal only without a mask, Sq > 1)."""
    import flashport

    if attention_mask is not None and attention_mask.ndim == 4:
        attention_mask = attention_mask[:, :, :, :s_k]
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    causal = bool(is_causal) and attention_mask is None and s_q > 1
    return dict(flashport.sdpa_mask(attention_mask), causal=causal, align="top_left")


def register(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register flashport with transformers' attention and mask registries under ``name``; returns it.

    Idempotent; importing this module calls it with the default name.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(name, flashport_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    return name


register()
