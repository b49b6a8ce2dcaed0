"""Rules for xformers: ``memory_efficient_attention`` and its attention-bias classes."""
