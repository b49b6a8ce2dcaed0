"""The source APIs flashport ports, as data: qualified names, the signature of each supported
release, the return and lse conventions, and the drop-in that replicates the API.

Plain data only (no jax, no torch): the CLI reads it without importing either. The signatures are
upstream's (flash-attn's, torch's, xformers'), never read off flashport's drop-ins;
``tests/test_drop_in_signatures.py`` checks every drop-in against them, release by release.

The data model is :mod:`.model`; families: :mod:`.flash_attn` (FA1/FA2 public and private,
``bert_padding``, FA3, FA4), :mod:`.torch` (SDPA), :mod:`.xformers` (``memory_efficient_attention`` and the bias classes),
:mod:`.jax` (``jax.nn`` and cuDNN ``dot_product_attention``).
"""

from __future__ import annotations

from flashport.rules.apis import flash_attn, jax, torch, xformers
from flashport.rules.apis.model import Api


def catalogue() -> tuple[Api, ...]:
    """Every catalogued API, all families."""
    return flash_attn.APIS + torch.APIS + xformers.APIS + jax.APIS


def api(name: str) -> Api:
    """The catalogued API one of whose qualified names is ``name``.

    Raises:
      KeyError: when no catalogued API has that name.
    """
    for entry in catalogue():
        if name in entry.names:
            return entry
    raise KeyError(name)


def own_api() -> dict[str, frozenset[str]]:
    """Public names of ``flashport.integrations`` modules that are flashport's own API (no source
    API to replicate), per module: everything else they export must be a catalogued drop-in."""
    return {**flash_attn.OWN_API, **xformers.OWN_API, "flashport.integrations.transformers": _TRANSFORMERS}


_TRANSFORMERS = frozenset(("flashport_attention_forward", "register"))  # an attention registration
