"""flashport: port GPU flash-attention code to TPU.

Public API (imported lazily, so ``import flashport`` and the CLI never pay for importing jax):

* :func:`flashport.attention` -- the portable attention contract (``flashport.kernels.api``).
* :func:`flashport.attention_backward` -- its gradients from the forward's ``out`` and ``lse``.
* :func:`flashport.backends` -- which backends exist here and what each supports.
* :func:`flashport.fuse_attention` / :func:`flashport.find_attention` -- the jaxpr pass.
* ``flashport.torch.attention`` -- the PyTorch adapter (imports torch only when used).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> "module:attribute"; resolved on first access (PEP 562).
_LAZY = {
    "attention": "flashport.kernels.api:attention",
    "attention_backward": "flashport.kernels.backward:attention_backward",
    "backends": "flashport.kernels.registry:backends",
    "BackendInfo": "flashport.kernels.registry:BackendInfo",
    "fuse_attention": "flashport.rewriter.jaxpr.fuse:fuse_attention",
    "find_attention": "flashport.rewriter.jaxpr.fuse:find_attention",
    "varlen_attention": "flashport.kernels.varlen:varlen_attention",
    "sdpa_mask": "flashport.kernels.sdpa_compat:sdpa_mask",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        module_name, attr = _LAZY[name].split(":")
        value = getattr(importlib.import_module(module_name), attr)
        globals()[name] = value
        return value
    if name in ("torch", "kernels", "rewriter", "rules"):
        return importlib.import_module(f"flashport.{name}")
    raise AttributeError(f"module 'flashport' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
