"""flashport: port GPU flash-attention code to TPU.

Public API (imported lazily, so ``import flashport`` and the CLI never pay for importing jax):

* :func:`flashport.attention` -- the portable attention contract (``flashport.kernels.contract.api``).
* :func:`flashport.ring_attention` -- the contract with the sequence sharded over a mesh axis
  (``flashport.kernels.parallel.ring``); :mod:`flashport.seq_layout` lays sequences out for it (zigzag).
* :func:`flashport.attention_backward` -- its gradients from the forward's ``out`` and ``lse``.
* :func:`flashport.backends` -- which backends exist here and what each supports.
* :func:`flashport.block_mask` -- FlexAttention's block sparsity from a ``mask_mod`` (``docs/flex.md``).
* :func:`flashport.fuse_attention` / :func:`flashport.find_attention` -- the jaxpr pass.
* :func:`flashport.varlen_attention` -- flash-attn's packed variable-length convention, for JAX
  arrays and torch tensors alike.
* ``flashport.torch.attention`` -- the PyTorch adapter (imports torch only when used).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers (no import at run time)
    from flashport.fusion.fuse import find_attention as find_attention
    from flashport.fusion.fuse import fuse_attention as fuse_attention
    from flashport.kernels.contract.api import attention as attention
    from flashport.kernels.contract.backward import attention_backward as attention_backward
    from flashport.kernels.contract.registry import BackendInfo as BackendInfo
    from flashport.kernels.contract.registry import backends as backends
    from flashport.kernels.parallel.ring import ring_attention as ring_attention
    from flashport.kernels.semantics import seq_layout as seq_layout
    from flashport.kernels.semantics.block_mask import block_mask as block_mask
    from flashport.kernels.semantics.sdpa_compat import sdpa_mask as sdpa_mask

__version__ = "0.1.0"

# name -> "module:attribute"; resolved on first access (PEP 562).
_LAZY = {
    "attention": "flashport.kernels.contract.api:attention",
    "attention_backward": "flashport.kernels.contract.backward:attention_backward",
    "backends": "flashport.kernels.contract.registry:backends",
    "block_mask": "flashport.kernels.semantics.block_mask:block_mask",
    "BackendInfo": "flashport.kernels.contract.registry:BackendInfo",
    "fuse_attention": "flashport.fusion.fuse:fuse_attention",
    "find_attention": "flashport.fusion.fuse:find_attention",
    "sdpa_mask": "flashport.kernels.semantics.sdpa_compat:sdpa_mask",
    "ring_attention": "flashport.kernels.parallel.ring:ring_attention",
}
# name -> module, resolved on first access.
_SUBMODULES = {"seq_layout": "flashport.kernels.semantics.seq_layout"}

__all__ = ["__version__", "varlen_attention", *_LAZY, *_SUBMODULES]


def varlen_attention(query: Any, key: Any, value: Any, **kwargs: Any) -> Any:
    """Attention over packed variable-length sequences (flash-attn's varlen convention).

    Dispatches on the tensor type: torch tensors (torchax and torch_xla tensors included) go to
    :func:`flashport.torch.varlen_attention` (dropout keywords ``dropout_p`` / ``generator``), JAX
    arrays to :func:`flashport.kernels.contract.varlen.varlen_attention` (``dropout_rate`` /
    ``dropout_rng``). Both take ``cu_seqlens_q``, ``cu_seqlens_k``, ``scale``, ``causal``,
    ``window``, ``align``, ``softcap``, ``layout="THD"`` and ``backend``, and return
    ``[total_q, Hq, D]``; see those functions for the details.
    """
    from flashport.kernels.contract.varlen import is_torch_tensor

    if is_torch_tensor(query):
        from flashport.torch import varlen_attention as torch_impl

        return torch_impl(query, key, value, **kwargs)
    from flashport.kernels.contract.varlen import varlen_attention as jax_impl

    return jax_impl(query, key, value, **kwargs)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module_name, attr = _LAZY[name].split(":")
        value = getattr(importlib.import_module(module_name), attr)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        value = importlib.import_module(_SUBMODULES[name])
        globals()[name] = value
        return value
    if name in ("torch", "kernels", "rewriter", "rules"):
        return importlib.import_module(f"flashport.{name}")
    raise AttributeError(f"module 'flashport' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
