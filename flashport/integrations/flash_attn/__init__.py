"""flash-attn's APIs on the flashport contract: the drop-ins and their shared core.

Layers, each importing only the ones above it:

* :mod:`.core` -- flash-attn's conventions in the contract's terms (window, lse, ALiBi, dropout,
  cache lengths) and :func:`.core.varlen_core`, the packed variable-length call every release's
  varlen drop-in runs;
* :mod:`.kvcache` -- FA2's ``flash_attn_with_kvcache`` (in-place cache updates, rotary, paged and
  batch-indexed caches); :mod:`.fa3_kvcache` -- FA3's additions to it;
* the drop-ins: :mod:`.fa2` (FA1/FA2 public functions), :mod:`.private` (FA2's private kernel
  entry points per release, on :mod:`flashport.torch.kernel_calls`), :mod:`.fa3` (with sgl-kernel's
  build of it), :mod:`.fa3_private` (FA3's private kernels per build, on :mod:`.fa3` and :mod:`.private`),
  :mod:`.fa4`,
  :mod:`.bert_padding`, :mod:`.rotary`; flash-attn's non-attention helpers that model code imports
  beside the attention call: :mod:`.cross_entropy` (the fused Triton cross entropy) and
  :mod:`.distributed` (sequence-parallel collectives).

Ported code imports the drop-ins by their stable paths, which re-export these modules:
``flashport.integrations.flash_attn_compat`` (FA2 with its kvcache, ``bert_padding`` helpers and
private kernels), ``flash_attn3_compat`` (FA3 with its private kernels), ``flash_attn4_compat``, ``flash_attn_private``,
``bert_padding``, ``rotary``, ``cross_entropy``, ``distributed`` and ``flash_attn_core``. The modules import torch only when a function
runs, so importing them costs neither torch nor jax.
"""
