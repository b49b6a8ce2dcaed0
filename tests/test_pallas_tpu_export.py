"""TPU lowering of every shipped pallas_tpu configuration, proven on CPU with ``jax.export``.

``jax.export(..., platforms=["tpu"])`` runs the Pallas -> Mosaic Python lowering and the MLIR
verifier for the forward and both backward kernels (block shape rules, unsupported primitives,
64-bit types, gathers...). It does not run Mosaic's layout passes, VMEM allocation or per-chip
dtype legalisation: those only happen inside libtpu (tests/test_tpu_compile.py runs those).

Each export runs under an abstract mesh whose device kind is the generation's TPU, so the backend
picks that generation's default block sizes (and chip-dependent lowering rules have a chip).
Sequences of 2000 are ragged against every default block and long enough that no default is clipped.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import pytest
from jax.extend import core as jax_core
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

import flashport
from flashport.kernels.backends.pallas_tpu.blocks import GENERATION_DEFAULTS, resolve_blocks
from flashport.kernels.contract import registry

S = jax.ShapeDtypeStruct
# device_kind strings as JAX reports them; TPU7x has no table of its own and uses the fallback.
KINDS = {"v4": "TPU v4", "v5e": "TPU v5 lite", "v5p": "TPU v5", "v6e": "TPU v6 lite", "tpu7x": "TPU7x"}
DTYPES = ("float32", "bfloat16", "float16")
SEQ = 2000

# feature name -> (static kwargs, array kwargs builder(b, hq, sq, sk), shape overrides)
FEATURES = {
    "plain": ({}, {}, {}),
    "causal_br": (dict(causal=True), {}, dict(sq=SEQ // 2)),
    "causal_tl": (dict(causal=True, align="top_left"), {}, {}),
    "window": (dict(window=(256, 0)), {}, {}),
    "softcap": (dict(softcap=30.0), {}, {}),
    "bias_full": ({}, dict(bias=lambda b, h, q, k: S((b, h, q, k), jnp.float32)), {}),
    "bias_bcast": ({}, dict(bias=lambda b, h, q, k: S((b, 1, 1, k), jnp.float32)), {}),
    "mask": ({}, dict(mask=lambda b, h, q, k: S((b, 1, q, k), jnp.bool_)), {}),
    "segments": (
        {},
        dict(
            q_segment_ids=lambda b, h, q, k: S((b, q), jnp.int32),
            kv_segment_ids=lambda b, h, q, k: S((b, k), jnp.int32),
        ),
        {},
    ),
    "mqa": ({}, {}, dict(hkv=1)),
    "decode_sq1": (dict(causal=True), {}, dict(sq=1)),
    "d64": ({}, {}, dict(d=64)),
    "d96": ({}, {}, dict(d=96)),
    "d256": ({}, {}, dict(d=256)),
    "dropout": (
        dict(causal=True, dropout_rate=0.1),
        dict(dropout_rng=lambda b, h, q, k: S((2,), jnp.uint32)),
        dict(hkv=1),
    ),
    "everything": (
        dict(causal=True, window=(512, None), softcap=20.0),
        dict(
            bias=lambda b, h, q, k: S((1, h, q, k), jnp.float32),
            mask=lambda b, h, q, k: S((b, 1, 1, k), jnp.bool_),
            q_segment_ids=lambda b, h, q, k: S((b, q), jnp.int32),
            kv_segment_ids=lambda b, h, q, k: S((b, k), jnp.int32),
        ),
        {},
    ),
}


def abstract_tpu(kind):
    """An abstract one-chip mesh of the given TPU kind (no TPU needed)."""
    return AbstractMesh(
        (1,),
        ("x",),
        (AxisType.Auto,),
        abstract_device=AbstractDevice(device_kind=kind, num_cores=1, platform="tpu"),
    )


def export_train_step(kind, dtype, feature, backend="pallas_tpu", platforms=("tpu",)):
    """Export value_and_grad of a loss through flashport.attention; returns the module text."""
    static, builders, shape = FEATURES[feature]
    b, hq = 2, 4
    hkv, sq, sk, d = shape.get("hkv", 2), shape.get("sq", SEQ), SEQ, shape.get("d", 128)
    q, kv = S((b, sq, hq, d), jnp.dtype(dtype)), S((b, sk, hkv, d), jnp.dtype(dtype))
    arrays = {name: make(b, hq, sq, sk) for name, make in builders.items()}
    bias = arrays.pop("bias", None)
    diff = (0, 1, 2, 3) if bias is not None else (0, 1, 2)

    def loss(q, k, v, bias, arrays):
        out = flashport.attention(q, k, v, bias=bias, backend=backend, **static, **arrays)
        return jnp.sum(out.astype(jnp.float32))

    fn = jax.jit(jax.value_and_grad(loss, argnums=diff))
    with jax.sharding.use_abstract_mesh(abstract_tpu(kind)):
        exported = jax.export.export(fn, platforms=list(platforms))(q, kv, kv, bias, arrays)
    return exported.mlir_module()


def assert_three_kernels(text):
    # forward, dK/dV and dQ: one Mosaic custom call each.
    assert text.count("tpu_custom_call") == 3, text.count("tpu_custom_call")
    for name in ("flashport_flash_fwd", "flashport_flash_dkv", "flashport_flash_dq"):
        assert name in text, name


@pytest.mark.parametrize("gen,dtype", list(itertools.product(KINDS, DTYPES)))
def test_every_generation_and_dtype_lowers_fwd_and_bwd(gen, dtype):
    assert_three_kernels(export_train_step(KINDS[gen], dtype, "everything"))


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_every_feature_lowers_fwd_and_bwd(feature):
    assert_three_kernels(export_train_step(KINDS["v6e"], "bfloat16", feature))


@pytest.mark.slow
@pytest.mark.parametrize("gen,dtype,feature", list(itertools.product(KINDS, DTYPES, sorted(FEATURES))))
def test_full_cross_product_lowers(gen, dtype, feature):
    assert_three_kernels(export_train_step(KINDS[gen], dtype, feature))


def test_generation_detected_from_abstract_device():
    for gen, kind in KINDS.items():
        with jax.sharding.use_abstract_mesh(abstract_tpu(kind)):
            detected, blocks = resolve_blocks({}, "pallas_tpu")
        assert detected == (gen if gen in GENERATION_DEFAULTS else "v6e")
        assert blocks == GENERATION_DEFAULTS[detected]


def test_auto_picks_pallas_tpu_when_exported_for_tpu():
    text = export_train_step(KINDS["v5e"], "bfloat16", "causal_br", backend="auto")
    assert_three_kernels(text)


def test_auto_exports_for_cpu_and_tpu_together():
    text = export_train_step(KINDS["v6e"], "bfloat16", "causal_br", backend="auto", platforms=("cpu", "tpu"))
    assert text.count("tpu_custom_call") == 3  # the TPU branch; the CPU branch is plain XLA


def test_explicit_user_blocks_lower():
    backend = registry.use("pallas_tpu", block_q=256, block_k=512, block_q_dkv=128, block_k_dkv=256)
    assert_three_kernels(export_train_step(KINDS["v5p"], "bfloat16", "everything", backend=backend))


def test_vmap_of_grad_lowers():
    q = S((3, 1, 512, 2, 128), jnp.bfloat16)
    f = jax.jit(
        jax.vmap(jax.grad(lambda q: flashport.attention(q, q, q, causal=True, backend="pallas_tpu").sum()))
    )
    with jax.sharding.use_abstract_mesh(abstract_tpu(KINDS["v6e"])):
        text = jax.export.export(f, platforms=["tpu"])(q).mlir_module()
    assert_three_kernels(text)


def export_without_mesh(backend, platforms, grad, dtype="bfloat16", dropout=False):
    """Export forward (or value_and_grad) for ``platforms`` with no abstract mesh: a CPU build host.

    With ``dropout`` the call drops with rate 0.1 and a traced raw uint32[2] key.
    """
    q = S((2, 300, 4, 128), jnp.dtype(dtype))
    kv = S((2, 300, 2, 128), jnp.dtype(dtype))
    key = S((2,), jnp.uint32)

    def f(q, k, v, key):
        drop = dict(dropout_rate=0.1, dropout_rng=key) if dropout else {}
        return flashport.attention(q, k, v, causal=True, softcap=20.0, backend=backend, **drop)

    fn = jax.value_and_grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2)) if grad else f
    assert jax.sharding.get_abstract_mesh().abstract_device is None
    return jax.export.export(jax.jit(fn), platforms=list(platforms))(q, kv, kv, key).mlir_module()


@pytest.mark.parametrize(
    "backend",
    [
        "pallas_tpu",
        "auto",
        registry.use("pallas_tpu", generation="v5e"),
        registry.use("pallas_tpu", generation="v4"),
    ],
)
@pytest.mark.parametrize("platforms", [("tpu",), ("cpu", "tpu")])
@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "grad"])
def test_export_for_tpu_without_abstract_mesh(backend, platforms, grad):
    # Regression: Mosaic asked the default device (a CPU here) for its TPU generation and raised
    # "Unsupported TPU device kind: cpu"; the backend now names a chip (its generation option or the
    # default) when the computation itself names none.
    text = export_without_mesh(backend, platforms, grad)
    if grad:
        assert_three_kernels(text)
    else:
        assert text.count("tpu_custom_call") == 1 and "flashport_flash_fwd" in text


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gen", ["v4", "v5e", "v5p", "v6e"])
def test_dropout_exports_without_abstract_mesh(gen, dtype):
    text = export_without_mesh(
        registry.use("pallas_tpu", generation=gen), ("tpu",), grad=True, dtype=dtype, dropout=True
    )
    assert_three_kernels(text)


def test_dropout_exports_for_cpu_and_tpu_together():
    text = export_without_mesh("auto", ("cpu", "tpu"), grad=True, dropout=True)
    assert_three_kernels(text)


def test_generation_option_is_validated():
    with pytest.raises(ValueError, match="generation='v9'"):
        export_without_mesh(registry.use("pallas_tpu", generation="v9"), ("tpu",), grad=False)


def _pallas_call_dtypes(closed):
    """Dtypes of every operand and result of every pallas_call inside a (closed) jaxpr, recursively."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                found.extend(str(v.aval.dtype) for v in (*eqn.invars, *eqn.outvars))
            for p in eqn.params.values():
                for sub in p if isinstance(p, (tuple, list)) else (p,):
                    if isinstance(sub, jax_core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax_core.Jaxpr):
                        walk(sub)

    walk(closed.jaxpr)
    return found


@pytest.mark.parametrize("bias", [False, True], ids=["plain", "f16_bias"])
def test_float16_never_reaches_the_kernels(bias):
    # Regression: Mosaic rejects float16 vector loads on every TPU generation ("Invalid vector type
    # for load", found compiling with libtpu); float16 operands must enter the kernels as float32.
    q = jnp.ones((1, 300, 2, 128), jnp.float16)
    b = jnp.zeros((1, 2, 300, 300), jnp.float16) if bias else None

    def loss(q, k, v, b):
        return jnp.sum(
            flashport.attention(q, k, v, bias=b, causal=True, backend="pallas_tpu").astype(jnp.float32)
        )

    argnums = (0, 1, 2, 3) if bias else (0, 1, 2)
    closed = jax.make_jaxpr(jax.value_and_grad(loss, argnums=argnums))(q, q, q, b)
    dtypes = _pallas_call_dtypes(closed)
    assert dtypes, "no pallas_call found"
    assert "float16" not in dtypes, dtypes
    grads = jax.eval_shape(jax.grad(loss, argnums=argnums), q, q, q, b)
    assert all(g.dtype == jnp.float16 for g in grads)  # the caller still gets float16 gradients
