"""``flashport.attention``: the portable attention contract that every rewrite targets.

Validation turns user arguments into the canonical form of :mod:`flashport.kernels.spec`; dispatch
picks a backend (explicitly, or per platform at lowering time for ``backend="auto"``) and calls it
inside a jit named ``flashport_attention`` so the op is visible in jaxprs, profiles and cost analyses.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from flashport.kernels import bias_grad, checks, deferred, dropout, registry
from flashport.kernels import block_mask as block_mask_lib
from flashport.kernels.keywords import SPEC_KEYWORDS, pick, takes_contract_keywords
from flashport.kernels.mods import Mods, trace
from flashport.kernels.spec import AttentionSpec, make_spec

# The canonical arrays a backend receives: (q, k, v, bias, mask, q_segment_ids, kv_segment_ids, seed).
CanonicalArrays = tuple[
    jax.Array,
    jax.Array,
    jax.Array,
    jax.Array | None,
    jax.Array | None,
    jax.Array | None,
    jax.Array | None,
    jax.Array | None,
]

log = logging.getLogger("flashport")

DTYPES = {
    jnp.dtype(jnp.float32): "float32",
    jnp.dtype(jnp.bfloat16): "bfloat16",
    jnp.dtype(jnp.float16): "float16",
}
# Platforms `auto` dispatches between at lowering time.
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


@dataclasses.dataclass(frozen=True)
class Call:
    """Everything static about one call: what backends' ``check``/``prefer`` hooks look at.

    Shapes are canonical (BHSD): ``q_shape`` = (B, Hq, Sq, D), ``kv_shape`` = (B, Hkv, Sk, D).
    """

    spec: AttentionSpec
    features: frozenset[str]
    q_shape: tuple[int, ...]
    kv_shape: tuple[int, ...]
    v_head_dim: int
    dtype: str
    bias_shape: tuple[int, ...] | None
    layout: str = "BHSD"  # the caller's layout (the spec's ``layout`` hint for the backend)


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
        :func:`flashport.backends`, or a :class:`flashport.kernels.registry.BackendChoice` carrying
        backend options (``registry.use("pallas_tpu", block_q=512)``).
      return_lse: also return the log-sum-exp of the scores, float32 [B, Hq, Sq].
      dropout_rate: probability of zeroing each entry of the normalized attention probabilities;
        kept entries are scaled by ``1 / (1 - dropout_rate)`` (flash-attn / torch SDPA semantics).
        The lse is that of the scores, unaffected by dropout.
      dropout_rng: a JAX PRNG key, required when ``dropout_rate > 0``. The keep-mask is a pure
        function of (key, batch, query head, query position, key position)
        (:mod:`flashport.kernels.dropout`): every backend draws the same mask for the same key,
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
    (:mod:`flashport.kernels.ring_partition`).
    """
    mods = prepare_mods(query, key, score_mod, mask_mod, block_mask, contract["layout"])
    if contract["bias"] is None and contract["mask"] is None and not dropout_rate and mods is None:
        from flashport.kernels import ring

        route = ring.detect(query, key, contract["layout"])
        if route is not None:
            return ring.ring_attention(
                query, key, value, backend=backend, return_lse=return_lse, **contract, **route
            )
        from flashport.kernels import ring_partition

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
    choice = _resolve_backend(backend, call)
    out, lse = flashport_attention(*arrays, mods, call=call, choice=choice)
    if contract["layout"] == "BSHD":
        out = jnp.swapaxes(out, 1, 2)
    return (out, lse) if "return_lse" in call.features else out


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
    backend form of :mod:`flashport.kernels.spec`; ``call`` is the static :class:`Call` that backend
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
    call = Call(
        spec=spec,
        features=frozenset(features),
        q_shape=tuple(q.shape),
        kv_shape=tuple(k.shape),
        v_head_dim=v.shape[-1],
        dtype=DTYPES[q.dtype],
        bias_shape=None if bias is None else tuple(bias.shape),
        layout=layout,
    )
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


@functools.partial(jax.jit, static_argnames=("call", "choice"))
def flashport_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    q_seg: jax.Array | None,
    kv_seg: jax.Array | None,
    seed: jax.Array | None,
    mods: Mods | None = None,
    *,
    call: Call,
    choice: registry.BackendChoice | None,
) -> tuple[jax.Array, jax.Array]:
    """The jitted op (its name is what jaxprs, profiles and cost analyses show). Canonical in/out."""
    args = (q, k, v, bias, mask, q_seg, kv_seg, seed)
    with jax.named_scope("flashport_attention"):
        if call.kv_shape[2] == 0:
            return _no_keys(call)
        run = functools.partial(_dispatch, call, choice, mods)
        if bias is None or mods is not None:  # with mods, only backends with bias gradients qualify
            return run(*args)
        # Whether the bias is differentiated shows only when JAX differentiates (kernels/bias_grad.py).
        if choice is not None and bias_grad.FEATURE not in registry.get(choice.name).features:
            return bias_grad.guarded(run, None, _bias_grad_refusal(choice.name, call), *args)
        with_grad = dataclasses.replace(call, features=call.features | {bias_grad.FEATURE})
        if choice is None and _names(_auto_picks(call)) != _names(_auto_picks(with_grad)):
            return bias_grad.guarded(run, functools.partial(_dispatch, with_grad, None, None), "", *args)
        return run(*args)


def _dispatch(
    call: Call, choice: registry.BackendChoice | None, mods: Mods | None, *args: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """Run an explicit backend, or the one ``auto`` picks per platform (chosen when lowering)."""
    if choice is not None:
        return _run(choice, call, args, mods)
    picks = _auto_picks(call)
    log.debug(
        "flashport_attention %s: auto picks %s",
        _describe(call),
        "; ".join(f"{p}->{name} ({why})" for p, (name, why) in picks.items()),
    )
    names = {name for name, _ in picks.values()}
    if len(names) == 1:
        return _run(registry.BackendChoice(names.pop()), call, args, mods)
    branches = platform_branches(
        picks,
        call,
        functools.partial(_run_positional, mods=mods),
        functools.partial(deferred.run, mods=mods),
    )
    return jax.lax.platform_dependent(*args, **branches)


def platform_branches(
    picks: dict[str, tuple[str, str]], call: Call, traced: Any, later: Any = None
) -> dict[str, Any]:
    """``platform_dependent`` branches for per-platform ``picks``: ``traced(choice, call, *args)`` for
    the backend picked on this process's platform (and for backends that cannot be deferred),
    ``later(choice, call, *args)`` (traced only if a module is lowered for that platform,
    :mod:`flashport.kernels.deferred`) for the others, or ``traced`` for every one when ``later`` is
    None; one branch per backend, with ``cpu``'s as the default."""
    here = picks.get(deferred.host_platform(), (None, ""))[0]
    by_name = {
        name: functools.partial(
            traced if later is None or name == here or not registry.get(name).deferrable else later,
            registry.BackendChoice(name),
            call,
        )
        for name, _ in picks.values()
    }
    branches = {p: by_name[name] for p, (name, _) in picks.items()}
    return dict(branches, default=branches["cpu"])


def _auto_picks(call: Call) -> dict[str, tuple[str, str]]:
    """``auto``'s ``(backend, why)`` on every platform for ``call``."""
    return {p: registry.choose(p, call) for p in PLATFORMS}


def _names(picks: dict[str, tuple[str, str]]) -> dict[str, str]:
    return {platform: name for platform, (name, _) in picks.items()}


def _bias_grad_refusal(name: str, call: Call) -> str:
    """The error for a differentiated bias on an explicit backend without bias gradients."""
    features = call.features | {bias_grad.FEATURE}
    alternatives = registry.backends_with(features) or ["none"]
    return (
        f"backend={name!r} does not give gradients w.r.t. bias (feature {bias_grad.FEATURE!r}), and this "
        f"call differentiates its bias; backends that support these features: {', '.join(alternatives)} "
        f"(or use backend='auto', or jax.lax.stop_gradient the bias)"
    )


def _no_keys(call: Call) -> tuple[jax.Array, jax.Array]:
    """The contract for Sk == 0, on every backend: every query row sees no key, so out is 0 and lse
    is -inf (their gradients are 0). Kernels need not handle empty key blocks."""
    b, hq, sq, _ = call.q_shape
    return jnp.zeros((b, hq, sq, call.v_head_dim), jnp.dtype(call.dtype)), jnp.full(
        (b, hq, sq), -jnp.inf, jnp.float32
    )


def _run(
    choice: registry.BackendChoice, call: Call, args: tuple[jax.Array | None, ...], mods: Mods | None = None
) -> tuple[jax.Array, jax.Array]:
    info = registry.get(choice.name)
    log.debug("flashport_attention %s: running backend %s", _describe(call), info.name)
    # The spec's hints (kernels/spec.py): the caller's layout, and whether it keeps the lse.
    spec = dataclasses.replace(call.spec, layout=call.layout, lse_used="return_lse" in call.features)
    if mods is not None:  # only backends that declare the mod features get (and take) mods=
        return info.fn(*args, spec=spec, options=choice.options_dict, mods=mods)
    return info.fn(*args, spec=spec, options=choice.options_dict)


def _run_positional(
    choice: registry.BackendChoice, call: Call, *args: jax.Array | None, mods: Mods | None = None
) -> tuple[jax.Array, jax.Array]:
    return _run(choice, call, args, mods)


def _describe(call: Call) -> str:
    return f"q{list(call.q_shape)} kv{list(call.kv_shape)} {call.dtype} features={sorted(call.features)}"


def _resolve_backend(backend: object, call: Call) -> registry.BackendChoice | None:
    """Return None for auto, else a BackendChoice that is known to support ``call``."""
    if isinstance(backend, str):
        if backend == "auto":
            return None
        choice = registry.BackendChoice(backend)
    elif isinstance(backend, registry.BackendChoice):
        choice = backend
    else:
        raise TypeError(
            f"backend must be 'auto', a backend name or flashport.kernels.registry.use(name, **options); "
            f"got {type(backend).__name__}"
        )
    info = registry.get(choice.name)
    missing = registry.missing_features(info, call)
    if missing:
        alternatives = registry.backends_with(call.features) or ["none"]
        raise ValueError(
            f"backend={choice.name!r} does not support this call: {'; '.join(missing)}; "
            f"backends that support these features: {', '.join(alternatives)} (or use backend='auto')"
        )
    return choice


# ----------------------------------------------------------------------------------- validation


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
