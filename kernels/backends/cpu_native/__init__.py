"""The ``cpu_native`` backend: a FlashAttention-2 CPU kernel in C++ behind ``jax.ffi`` (see :mod:`.backend`)."""
