"""``flashport.attention``: the portable attention contract that every rewrite targets.

Validation turns user arguments into the canonical form of :mod:`flashport.kernels.contract.spec`; dispatch
picks a backend (explicitly, or per platform at lowering time for ``backend="auto"``) and calls it
inside a jit named ``flashport_attention`` so the op is visible in jaxprs, profiles and cost analyses.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from flashport.kernels.contract import dispatch, execute, registry
from flashport.kernels.contract.call import DTYPES, PLATFORMS, Call, CanonicalArrays
from flashport.kernels.contract.dispatch import flashport_attention, platform_branches
from flashport.kernels.contract.keywords import takes_contract_keywords
from flashport.kernels.contract.validate import prepare, prepare_mods
from flashport.kernels.parallel import ring, ring_partition
from flashport.kernels.semantics import bias_grad
from flashport.kernels.semantics import block_mask as block_mask_lib

# The names of the attention layer's modules that callers reach through ``api``.
__all__ = [
    "DTYPES",
    "PLATFORMS",
    "Call",
    "CanonicalArrays",
    "attention",
    "flashport_attention",
    "platform_branches",
    "prepare",
    "prepare_mods",
]


@takes_contract_keywords()
def attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    backend: str | registry.BackendChoice = "auto",
    return_lse: bool = False,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    score_mod: Any = None,
    mask_mod: Any = None,
    block_mask: block_mask_lib.BlockMask | None = None,
    **contract: Any,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Scaled dot-product attention with one contract on every platform.

    Args:
      query: [B, Sq, Hq, D] (``layout="BSHD"``) or [B, Hq, Sq, D] (``"BHSD"``); float32, bfloat16 or
        float16.
      key, value: [B, Sk, Hkv, D] / [B, Hkv, Sk, D] with Hq % Hkv == 0 (GQA/MQA: query head h uses kv
        head h // (Hq // Hkv)); same dtype as ``query``. ``value`` may have its own head_dim.
      scale: multiplier of Q·Kᵀ; ``None`` means 1/sqrt(D).
      causal: keep keys ``j <= i + offset`` (see ``align``).
      window: ``(left, right)``: keep ``i + offset - left <= j <= i + offset + right`` (inclusive);
        ``None`` on a side means unbounded.
      align: ``"bottom_right"`` (offset = Sk - Sq, flash-attn >= 2.1) or ``"top_left"`` (offset = 0,
        torch SDPA and jax.nn).
      softcap: if set, scores become ``softcap * tanh(scores / softcap)`` (before bias and masking).
      bias: additive float bias broadcastable to [B, Hq, Sq, Sk] (always in that order).
      mask: boolean, True = attend, broadcastable to [B, Hq, Sq, Sk].
      q_segment_ids, kv_segment_ids: int [B, Sq] / [B, Sk]; attend only where the ids are equal.
      layout: ``"BSHD"`` or ``"BHSD"``; the output uses the same layout.
      backend: ``"auto"`` (chosen per platform when lowering), a backend name from
        :func:`flashport.backends`, or a :class:`flashport.kernels.contract.registry.BackendChoice` carrying
        backend options (``registry.use("pallas_tpu", block_q=512)``).
      return_lse: also return the log-sum-exp of the scores, float32 [B, Hq, Sq].
      dropout_rate: probability of zeroing each entry of the normalized attention probabilities;
        kept entries are scaled by ``1 / (1 - dropout_rate)`` (flash-attn / torch SDPA semantics).
        The lse is that of the scores, unaffected by dropout.
      dropout_rng: a JAX PRNG key, required when ``dropout_rate > 0``. The keep-mask is a pure
        function of (key, batch, query head, query position, key position)
        (:mod:`flashport.kernels.semantics.dropout`): every backend draws the same mask for the same key,
        and gradients are exact for a fixed key. Split the key per step for fresh masks.
      score_mod: FlexAttention's ``score_mod(score, batch, head, q_idx, kv_idx) -> score``, a JAX
        function of scalars (float32 score, int32 indices: raw positions and the query head),
        applied to every score after ``scale``, ``softcap`` and ``bias`` and before masking. It may
        close over arrays (slopes, bias tables); they are differentiated like q, k and v.
      mask_mod: FlexAttention's ``mask_mod(batch, head, q_idx, kv_idx) -> bool`` (True = attend),
        and-ed with causal, window, mask and segment ids. Tiles it hides entirely are skipped
        (a block mask is built and cached per shape; see ``block_mask``).
      block_mask: a :func:`flashport.block_mask` built once for this shape (carries its mask_mod;
        pass it instead of ``mask_mod``, or with the same ``mask_mod``). See ``docs/flex.md``.

    Returns:
      The output in ``query``'s layout and dtype, or ``(out, lse)``. Softmax and accumulation run in
      float32. A query row that sees no key (all masked) returns 0 with lse = -inf, and its
      gradients are 0, never NaN. Precision: float32 inputs get float32 matmuls (``HIGHEST``; XLA's
      CUDA default would be TF32) unless ``jax.default_matmul_precision`` is set, which is then
      honoured; bfloat16/float16 inputs use the platform default with float32 accumulation.

    Raises:
      ValueError / TypeError naming the argument for shapes, dtypes or options that do not fit, and
      ValueError naming the missing feature when an explicit backend cannot serve the call (for
      ``bias_grad``, a backend without bias gradients, when JAX differentiates w.r.t. ``bias``).

    Sequence parallelism: when ``query`` and ``key`` are sharded along their sequence dim over a mesh
    axis and no ``bias``/``mask``/dropout is given, the call runs as :func:`flashport.ring_attention`
    over that axis instead of gathering the sequence: for concrete arrays with a ``NamedSharding``
    and under ``jit`` with explicit-sharding axes this is decided when tracing; under ``jit`` with
    ``Auto`` axes (in/out shardings) when XLA partitions the program
    (:mod:`flashport.kernels.parallel.ring_partition`).
    """
    mods = prepare_mods(query, key, score_mod, mask_mod, block_mask, contract["layout"])
    if contract["bias"] is None and contract["mask"] is None and not dropout_rate and mods is None:
        route = ring.detect(query, key, contract["layout"])
        if route is not None:
            return ring.ring_attention(
                query, key, value, backend=backend, return_lse=return_lse, **contract, **route
            )
        if ring_partition.wanted(query, key):  # sharding known only when partitioning: decide then
            return ring_partition.attention(
                query, key, value, backend=backend, return_lse=return_lse, **contract
            )
    arrays, call = prepare(
        query,
        key,
        value,
        return_lse=return_lse,
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
        **contract,
    )
    if mods is not None:
        needs = mods.features | ({bias_grad.FEATURE} if "bias" in call.features else set())
        call = dataclasses.replace(call, features=call.features | needs)
    choice = execute.resolve_backend(backend, call)
    out, lse = dispatch.flashport_attention(*arrays, mods, call=call, choice=choice)
    if contract["layout"] == "BSHD":
        out = jnp.swapaxes(out, 1, 2)
    return (out, lse) if "return_lse" in call.features else out
