"""The ``splash`` and ``splash_interpret`` backends: JAX's own splash attention, for A/B runs on TPU.

``backend="splash"`` runs ``jax.experimental.pallas.ops.tpu.splash_attention`` (the kernel MaxText
uses) on the calls it computes exactly under the contract; ``auto`` never picks it, so flashport's
own ``pallas_tpu`` kernel stays the default and one argument swaps in JAX's for comparison.
``splash_interpret`` runs the same kernels in the Pallas interpreter (``interpret=True``) on CPU,
which is how the tests check it against the float64 reference.

How the contract maps onto splash (each refusal below names its reason before anything lowers):

* **scale**: splash computes ``q · kᵀ`` unscaled, so the backend passes ``q * scale`` (in q's dtype,
  as MaxText does; JAX differentiates the multiply).
* **causal / windows / alignment**: a static per-head mask, ``CausalMask(offset=)`` or
  ``LocalMask(window_size=(left, right), offset=)`` with the contract's ``offset`` (``Sk - Sq`` for
  bottom-right, 0 for top-left); causal caps the right reach at 0. Splash's ``q + offset >= kv`` is
  the contract's ``j <= i + offset`` for both alignments and any Sq, Sk. A call whose causal/window
  structure leaves a query row with no key at all (bottom-right Sq > Sk, windows past the keys) is
  refused: splash skips every block of such a row and divides 0 by 0.
* **segment ids**: ``SegmentIds(q, kv)`` per batch row (splash is vmapped over the batch). Splash
  gives a row whose every visible key has another segment the mean of those keys' values; the
  contract gives 0, so with segment ids the backend computes which rows see a key (an
  O(B·Sq·Sk) integer compare-and-reduce in XLA, no heads, no head_dim) and zeroes the others. Their
  cotangent is then 0, so splash's backward gives them zero gradients too.
* **GQA/MQA**: ``make_splash_mha`` with Hq % Hkv == 0 (its index maps share K/V), ``make_splash_mqa``
  when Hkv == 1. **softcap**: ``attn_logits_soft_cap`` (``cap * tanh(s / cap)`` of the scaled scores,
  before masking, as the contract).
* **gradients**: splash's own ``custom_vjp`` (its dK/dV and dQ kernels); called without
  ``save_residuals``, since splash refuses to differentiate a call that returns its lse.
* **refused** (features): bias, boolean masks, dropout, ``return_lse`` (see above) and float16
  (Mosaic cannot load float16 vectors on any TPU generation). **Refused** (limits, :func:`check_call`):
  Sq or Sk not a multiple of 128 (splash needs whole blocks and has no padding), a value head_dim
  different from the query's, rows without keys.

Options (``registry.use("splash", block_q=..., ...)``): the fields of splash's ``BlockSizes``
(``block_q``, ``block_kv``, ``block_kv_compute``, ``block_q_dkv``, ``block_kv_dkv``,
``block_kv_dkv_compute``, ``block_q_dq``, ``block_kv_dq``, ``use_fused_bwd_kernel``). Unset blocks
default to the largest of 512, 256, 128 that divides the sequence; a given block must divide it.
Sharded inputs are not partitioned for you: run the backend per shard inside ``shard_map``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from flashport.kernels.contract import registry
from flashport.kernels.contract.spec import AttentionSpec, positional_visible
from flashport.kernels.semantics.block_ranges import Ops, key_range

FEATURES = frozenset(
    {"causal", "window", "align_bottom_right", "softcap", "segment_ids", "gqa", "float32", "bfloat16"}
)
SEQ_ALIGN = 128  # splash's blocks are multiples of the 128 lanes
DEFAULT_BLOCK = 512
# option -> the sequence it tiles ("q" or "kv")
BLOCK_OPTIONS = {
    "block_q": "q",
    "block_kv": "kv",
    "block_kv_compute": "kv",
    "block_q_dkv": "q",
    "block_kv_dkv": "kv",
    "block_kv_dkv_compute": "kv",
    "block_q_dq": "q",
    "block_kv_dq": "kv",
}
NUMPY = Ops(np.minimum, np.maximum, np.where, np.floor_divide)


def first_row_without_keys(spec: AttentionSpec) -> int | None:
    """The first query row that causal/window structure leaves with no key, or None (static)."""
    rows = np.arange(spec.seq_q)
    lo, hi = key_range(spec, rows, rows + 1, NUMPY)
    empty = np.flatnonzero(np.broadcast_to(lo >= hi, rows.shape))
    return int(empty[0]) if empty.size else None


def check_call(call) -> str | None:
    """Return why splash cannot serve ``call`` exactly under the contract, or None."""
    sq, sk = call.q_shape[2], call.kv_shape[2]
    if sq % SEQ_ALIGN or sk % SEQ_ALIGN:
        return (
            f"Sq={sq}, Sk={sk} (splash needs both sequence lengths to be multiples of {SEQ_ALIGN} and "
            "does not pad; pad the inputs or use pallas_tpu)"
        )
    if call.v_head_dim != call.q_shape[3]:
        return "value head_dim differs from query head_dim"
    row = first_row_without_keys(call.spec)
    if row is not None:
        return (
            f"query row {row} sees no key under causal/window (splash divides 0 by 0 there, the "
            "contract returns 0); use pallas_tpu"
        )
    return None


def _block(options: dict, name: str, seq: int) -> int:
    """Block ``name`` from the options, else the largest of 512, 256, 128 that divides ``seq``."""
    if name not in options:
        return next(b for b in (DEFAULT_BLOCK, 256, SEQ_ALIGN) if seq % b == 0)
    block = options[name]
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0 or block % SEQ_ALIGN:
        raise ValueError(f"splash option {name}={block!r} must be a positive multiple of {SEQ_ALIGN}")
    if seq % block:
        raise ValueError(f"splash option {name}={block} must divide the sequence length {seq}")
    return block


def block_sizes(options: dict, sq: int, sk: int) -> splash.BlockSizes:
    """splash ``BlockSizes`` from the backend options (validated; unknown options are an error)."""
    unknown = set(options) - set(BLOCK_OPTIONS) - {"use_fused_bwd_kernel"}
    if unknown:
        known = ", ".join([*BLOCK_OPTIONS, "use_fused_bwd_kernel"])
        raise ValueError(f"backend 'splash' got unknown options {sorted(unknown)}; it takes: {known}")
    fused = options.get("use_fused_bwd_kernel", False)
    if not isinstance(fused, bool):
        raise ValueError(f"splash option use_fused_bwd_kernel must be a bool, got {fused!r}")
    seqs = {"q": sq, "kv": sk}
    blocks: dict[str, Any] = {name: _block(options, name, seqs[axis]) for name, axis in BLOCK_OPTIONS.items()}
    if fused:
        del blocks["block_q_dq"], blocks["block_kv_dq"]
    return splash.BlockSizes(**blocks, use_fused_bwd_kernel=fused)


def positional_mask(spec: AttentionSpec):
    """The splash mask (one head, [Sq, Sk]) of the spec's causal/window structure."""
    shape = (spec.seq_q, spec.seq_k)
    if spec.window_left is None and spec.window_right is None:
        return splash.CausalMask(shape, offset=spec.offset) if spec.causal else splash.FullMask(shape)
    right = spec.window_right
    if spec.causal:
        right = 0 if right is None else min(right, 0)
    return splash.LocalMask(shape, window_size=(spec.window_left, right), offset=spec.offset)


@functools.lru_cache(maxsize=32)
def make_kernel(spec: AttentionSpec, heads: int, mqa: bool, blocks: splash.BlockSizes, interpret: bool):
    """The splash kernel of one static configuration (its mask tables are built once, in numpy)."""
    mask = splash.MultiHeadMask([positional_mask(spec)] * heads)
    make = splash.make_splash_mqa if mqa else splash.make_splash_mha
    with jax.ensure_compile_time_eval():  # concrete mask tables, reusable across traces
        return make(
            mask,
            block_sizes=blocks,
            attn_logits_soft_cap=spec.softcap,
            head_shards=1,
            q_seq_shards=1,
            interpret=interpret,
        )


def rows_with_keys(spec: AttentionSpec, q_seg, kv_seg):
    """bool [B, Sq]: query rows that see at least one key of their segment under causal/window."""
    visible = positional_visible(spec, jnp.arange(spec.seq_q)[:, None], jnp.arange(spec.seq_k)[None, :])
    same = q_seg[:, :, None] == kv_seg[:, None, :]
    return jnp.any(same & visible, axis=-1)


def _make_backend_fn(name: str, interpret: bool):
    def fn(q, k, v, bias, mask, q_seg, kv_seg, seed, *, spec: AttentionSpec, options):
        if bias is not None or mask is not None or seed is not None:
            raise ValueError(f"backend {name!r} takes no bias, mask or dropout (refused by its features)")
        b, hq, sq, _ = q.shape
        mqa = k.shape[1] == 1
        kernel = make_kernel(spec, hq, mqa, block_sizes(dict(options), sq, k.shape[2]), interpret)
        q = q * jnp.asarray(spec.scale, q.dtype)
        if mqa:
            k, v = k[:, 0], v[:, 0]
        if q_seg is None:
            out = jax.vmap(kernel)(q, k, v)
        else:
            segments = splash.SegmentIds(q_seg, kv_seg)
            out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=s))(q, k, v, segments)
            out = jnp.where(rows_with_keys(spec, q_seg, kv_seg)[:, None, :, None], out, 0).astype(q.dtype)
        # "return_lse" is not a splash feature (splash returns its lse only where it cannot be
        # differentiated), so this placeholder never reaches a user.
        return out, jnp.zeros((b, hq, sq), jnp.float32)

    fn.__name__ = f"{name}_attention"
    fn.__doc__ = (
        f"The ``{name}`` backend over the canonical arrays: splash attention per batch row; returns "
        "``(out, lse)`` with the lse unset (``return_lse`` is refused). Options are validated before "
        "anything is lowered."
    )
    return fn


splash_attention = _make_backend_fn("splash", interpret=False)
splash_interpret_attention = _make_backend_fn("splash_interpret", interpret=True)

registry.register(
    registry.BackendInfo(
        name="splash",
        description="JAX's own splash attention (jax.experimental.pallas.ops.tpu.splash_attention) for "
        "A/B runs; TPU only, never chosen by auto; sequences in multiples of 128, no bias/mask/dropout/lse.",
        platforms=("tpu",),
        features=FEATURES,
        fn=splash_attention,
        check=check_call,
        interpret=registry.InterpretTwin(
            description="The splash kernels in the Pallas interpreter on CPU (slow; for tests, never "
            "chosen by auto).",
            fn=splash_interpret_attention,
        ),
    )
)
