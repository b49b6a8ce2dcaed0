"""Rules for the JAX side: jax.nn and cuDNN dot_product_attention, Pallas-GPU, flash-attn-jax, keras,
TransformerEngine-JAX."""
