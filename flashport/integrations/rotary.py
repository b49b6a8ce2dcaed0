"""``flash_attn.layers.rotary``'s drop-ins (:mod:`flashport.integrations.flash_attn.rotary`), at the import path ported code uses."""

from __future__ import annotations

from flashport.integrations.flash_attn import rotary

__all__ = rotary.__all__


def __getattr__(name):
    """Every drop-in of :mod:`flashport.integrations.flash_attn.rotary`, read through (its
    ``RotaryEmbedding`` is built on first use: importing this module does not import torch)."""
    return getattr(rotary, name)
