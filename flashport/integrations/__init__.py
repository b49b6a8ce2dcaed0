"""``flashport.integrations``: drop-in pieces that rewritten code (and users) call instead of GPU-only APIs.

* :mod:`flashport.integrations.flash_attn_compat` -- flash-attn's KV-cache attention, functionally.
* :mod:`flashport.integrations.xformers_compat` -- xformers' ``memory_efficient_attention`` and its
  ``attn_bias`` classes on the flashport contract.
* :mod:`flashport.integrations.transformers` -- registers ``attn_implementation="flashport"`` with
  Hugging Face transformers' attention-function registry.

Submodules are imported explicitly (``import flashport.integrations.xformers_compat``); importing
this package imports neither torch nor jax.
"""
