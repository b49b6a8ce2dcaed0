"""The ``pallas_gpu`` and ``pallas_gpu_interpret`` backends: flashport's own Pallas (Triton) GPU flash attention.

Modules: ``backend`` (padding, ``custom_vjp``, options, registration), ``forward`` and ``backward``
(the kernels), ``tiling`` (geometry, in-tile masks, dropout rows and precision). The CUDA-only
lowering is the primitive shared with ``pallas_tpu`` (:mod:`flashport.kernels.backends.pallas_platform`).
"""

from flashport.kernels.backends.pallas_gpu.backend import (
    pallas_gpu_attention,
    pallas_gpu_interpret_attention,
)

__all__ = ["pallas_gpu_attention", "pallas_gpu_interpret_attention"]
