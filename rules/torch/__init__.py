"""Rules for torch: ``scaled_dot_product_attention``, SDPA backend selectors, FlexAttention."""
