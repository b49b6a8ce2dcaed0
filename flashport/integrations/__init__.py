"""``flashport.integrations``: drop-in pieces that rewritten code (and users) call instead of GPU-only APIs.

* :mod:`flashport.integrations.flash_attn_compat` -- drop-ins for flash-attn 2.x's public functions
  (dense, varlen, flash-attn 1.x names, ``flash_attn_with_kvcache`` with in-place cache updates,
  the ``bert_padding`` helpers) and the functional KV-cache attention FPA007 rewrites use.
* :mod:`flashport.integrations.flash_attn3_compat` / :mod:`flashport.integrations.flash_attn4_compat`
  -- FlashAttention-3 / -4 ``flash_attn_func`` and ``flash_attn_varlen_func`` with their return types.
* :mod:`flashport.integrations.bert_padding` -- ``flash_attn.bert_padding`` in plain torch.
* :mod:`flashport.integrations.rotary` -- ``flash_attn.layers.rotary`` (``apply_rotary_emb``, the packed
  in-place variants, the ``RotaryEmbedding`` module) in plain torch.
* :mod:`flashport.integrations.cross_entropy` -- ``flash_attn.ops.triton.cross_entropy.cross_entropy_loss``
  in plain torch; :mod:`flashport.integrations.distributed` -- ``flash_attn.utils.distributed``'s
  collectives on ``torch.distributed``.
* :mod:`flashport.integrations.sdpa_compat` -- ``torch.nn.functional.scaled_dot_product_attention``'s
  signature on the contract, for SDPA calls whose arguments are only known at run time (splats) and
  for every SDPA call of a repository that patches SDPA at run time: it runs the installed patch
  when there is one (arguments verbatim), flashport's SDPA otherwise.
* :mod:`flashport.integrations.xformers_compat` -- xformers' ``memory_efficient_attention`` and its
  ``attn_bias`` classes on the flashport contract.
* :mod:`flashport.integrations.jax_cudnn_compat` -- JAX's private cuDNN ``dot_product_attention``
  (padding lengths, lse residual, seed dropout) on the contract.
* :mod:`flashport.integrations.jax_nn_compat` -- ``jax.nn.dot_product_attention`` whose
  ``implementation`` is known at run time ("xla" stays XLA; None/"cudnn" on the contract).
* :mod:`flashport.integrations.transformers` -- registers ``attn_implementation="flashport"`` with
  Hugging Face transformers' attention-function registry.

Submodules are imported explicitly (``import flashport.integrations.xformers_compat``); importing
this package imports neither torch nor jax.
"""
