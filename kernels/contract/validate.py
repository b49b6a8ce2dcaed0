"""Validate ``flashport.attention``'s arguments into the canonical arrays and the static :class:`Call`.

The canonical form is that of :mod:`flashport.kernels.contract.spec`: BHSD arrays, the bias and mask
left-padded to rank 4 (broadcast dims kept), int32 segment ids and the dropout seed words.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from flashport.kernels.contract import checks
from flashport.kernels.contract.call import DTYPES, Call, CanonicalArrays
from flashport.kernels.contract.keywords import SPEC_KEYWORDS, pick, takes_contract_keywords
from flashport.kernels.contract.spec import make_spec
from flashport.kernels.semantics import block_mask as block_mask_lib
from flashport.kernels.semantics import dropout
from flashport.kernels.semantics.mods import Mods, trace


@takes_contract_keywords()
def prepare(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    return_lse: bool = False,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    **contract: Any,
) -> tuple[CanonicalArrays, Call]:
    """Validate ``attention``'s arguments and return ``(canonical_arrays, call)``.

    ``canonical_arrays`` is ``(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, seed)`` in the
    backend form of :mod:`flashport.kernels.contract.spec`; ``call`` is the static :class:`Call` that backend
    checks and ``auto`` look at. Useful to ask which backend would run, without running it.
    """
    q, k, v = (_as_array(x, name) for x, name in ((query, "query"), (key, "key"), (value, "value")))
    layout = checks.check_choice("layout", contract["layout"], checks.LAYOUTS)
    if layout == "BSHD":
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    batch, hq, sq, _ = q.shape
    _, hkv, sk, _ = k.shape
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"query, key and value must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    checks.check_head_shapes(q.shape, k.shape, v.shape, layout)
    rate = dropout.check_rate("dropout_rate", dropout_rate)
    spec = make_spec(q.shape, k.shape, dropout_rate=rate, **pick(contract, SPEC_KEYWORDS))
    full = (batch, hq, sq, sk)
    bias = _check_broadcast("bias", contract["bias"], full, kind="float")
    mask = _check_broadcast("mask", contract["mask"], full, kind="bool")
    q_seg, kv_seg = _check_segments(contract["q_segment_ids"], contract["kv_segment_ids"], batch, sq, sk)
    return_lse = checks.check_bool("return_lse", return_lse)
    seed = dropout.seed_words(dropout_rng) if spec.dropout_rate > 0 else None

    features = {DTYPES[q.dtype], *spec.positional_features}
    for name, present in (
        ("softcap", spec.softcap is not None),
        ("bias", bias is not None),
        ("mask", mask is not None),
        ("segment_ids", q_seg is not None),
        ("gqa", hq != hkv),
        ("return_lse", return_lse),
        ("dropout", spec.dropout_rate > 0),
    ):
        if present:
            features.add(name)
    call = Call.over(spec, features, q, k, v, None if bias is None else tuple(bias.shape), layout)
    return (q, k, v, bias, mask, q_seg, kv_seg, seed), call


def prepare_mods(
    query: Any, key: Any, score_mod: Any, mask_mod: Any, blocks: Any, layout: str
) -> Mods | None:
    """Trace ``score_mod`` / ``mask_mod`` and find the block mask (the one given, or one built and
    cached for this shape); ``None`` when the call has no mods."""
    if score_mod is None and mask_mod is None and blocks is None:
        return None
    batch, sq, hq = query.shape[:3]
    sk = key.shape[1]
    if layout == "BHSD":
        hq, sq, sk = query.shape[1], query.shape[2], key.shape[2]
    return trace_mods(score_mod, mask_mod, blocks, (batch, hq, sq, sk))


def trace_mods(
    score_mod: Any, mask_mod: Any, blocks: Any, shape: tuple[int, int, int, int], *, build_blocks: bool = True
) -> Mods | None:
    """:func:`prepare_mods` for a call of canonical ``shape`` ``(B, Hq, Sq, Sk)``; ``build_blocks=False``
    leaves a bare ``mask_mod`` without a block mask (and drops a given one's classes, keeping its
    ``mask_mod``)."""
    if score_mod is None and mask_mod is None and blocks is None:
        return None
    score, score_consts = trace(score_mod, "score_mod") if score_mod is not None else (None, ())
    if blocks is not None and not isinstance(blocks, block_mask_lib.BlockMask):
        raise TypeError(f"block_mask must be a flashport.block_mask(...), got {type(blocks).__name__}")
    if blocks is not None:
        if mask_mod is not None and trace(mask_mod, "mask_mod")[0] != blocks.mod:
            raise ValueError("mask_mod and block_mask.mask_mod differ; pass the block_mask alone")
        block_mask_lib.check_for_call(blocks, *shape)
        mask, mask_consts = blocks.mod, blocks.consts
    elif mask_mod is not None:
        mask, mask_consts = trace(mask_mod, "mask_mod")
        if build_blocks:
            blocks = block_mask_lib.cached_block_mask(mask, mask_consts, *shape)
    else:
        mask, mask_consts = None, ()
    return Mods(score, score_consts, mask, mask_consts, blocks if build_blocks else None)


def _as_array(x: Any, name: str) -> jax.Array:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        try:
            x = jnp.asarray(x)
        except TypeError as err:
            raise TypeError(f"{name} must be an array, got {type(x).__name__}") from err
    if x.ndim != 4:
        raise ValueError(
            f"{name} must have rank 4 ([batch, seq, heads, head_dim] for BSHD), got shape {tuple(x.shape)}"
        )
    if jnp.dtype(x.dtype) not in DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    return x


def _check_broadcast(
    name: str, x: ArrayLike | None, full: tuple[int, int, int, int], *, kind: str
) -> jax.Array | None:
    """Left-pad ``x`` to rank 4 and check each dim is 1 or the full size; dims stay unbroadcast."""
    if x is None:
        return None
    x = jnp.asarray(x)
    if kind == "bool" and x.dtype != jnp.bool_:
        raise TypeError(checks.MASK_DTYPE_ERROR.format(name=name, dtype=x.dtype))
    if kind == "float" and not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(checks.BIAS_DTYPE_ERROR.format(name=name, dtype=x.dtype))
    x = x.reshape(checks.broadcast_shape(name, x.shape, full))
    return x.astype(jnp.float32) if kind == "float" else x


def _check_segments(
    q_seg: ArrayLike | None, kv_seg: ArrayLike | None, batch: int, sq: int, sk: int
) -> tuple[jax.Array, jax.Array] | tuple[None, None]:
    if not checks.check_segments_given(q_seg, kv_seg):
        return None, None
    out = []
    for name, given, seq in (("q_segment_ids", q_seg, sq), ("kv_segment_ids", kv_seg, sk)):
        ids = jnp.asarray(given)
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array, got {ids.dtype}")
        checks.check_segment_shape(name, ids.shape, batch, seq)
        out.append(ids.astype(jnp.int32))
    return out[0], out[1]
