"""Rules for flash-attn (FA1/FA2 public and private entry points, bert_padding, rotary, FA3, FA4) and
their shared helpers: per-version argument binding, the KV-cache and FA3/FA4 mappings, private kernels."""
