"""The attention backends: XLA, blockwise, cuDNN, splash and flashport's Pallas TPU and GPU kernels."""
