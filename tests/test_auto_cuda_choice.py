"""``auto`` never picks a backend that then rejects the call, and every explicit backend either runs or
refuses before lowering.

The CUDA branch of ``auto`` is :func:`flashport.kernels.contract.registry.choose` for platform ``"cuda"`` (what
``flashport.attention`` evaluates per platform while lowering). It is exercised here without a GPU:
``cudnn.cuda_present`` is patched to True, and JAX's own cuDNN module is told a cuDNN version and an
Ampere (8.0) GPU, so ``jax.nn.dot_product_attention(implementation="cudnn")`` runs its real shape and
dtype checks while tracing (``check_layout``, and ``check_is_flash_attention`` in the forward and the
training forward). Those checks, not flashport's ``cudnn.check_call``, are the oracle: wherever
``auto`` picks cuDNN, tracing the cudnn backend forward and under ``jax.grad`` must not raise. Ampere
is the stricter target (head_dim <= 128, no differing value head_dim), so passing there passes on
Hopper too.

The matrix: every bias and mask shape broadcastable to [B, H, Sq, Sk] (ranks 2-4), float32/bfloat16/
float16, even, odd (ragged), square, Sq < Sk, Sq > Sk and decode lengths, and the contract's
features (causal in both alignments, windows, softcap, segment ids, GQA/MQA, dropout, lse, masks).
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.cudnn import fused_attention_stablehlo as jax_cudnn
from reference import reference_attention

import flashport
from flashport.kernels.backends import cudnn
from flashport.kernels.contract import api, registry

B, H, D = 2, 4, 64
SIZES = {"sq<sk": (8, 16), "square": (16, 16), "odd": (7, 13), "sq>sk": (16, 8), "decode": (1, 16)}
HEADS = {"mha": 4, "gqa": 2, "mqa": 1}
FEATURES = {
    "plain": dict(),
    "causal_tl": dict(causal=True, align="top_left"),
    "causal_br": dict(causal=True),
    "window_left_tl": dict(window=(4, 0), align="top_left"),
    "window_left_br": dict(window=(4, 0)),
    "window_causal_tl": dict(window=(3, None), causal=True, align="top_left"),
    "window_both_tl": dict(window=(3, 2), align="top_left"),
    "window_right_only": dict(window=(None, 0), align="top_left"),
    "softcap": dict(softcap=20.0),
    "segments": dict(segments=True),
    "dropout": dict(dropout_rate=0.1),
    "lse": dict(return_lse=True),
    "mask": dict(mask=(B, 1, None, None)),
}


def broadcast_shapes(sq, sk):
    """Every shape broadcastable to [B, H, Sq, Sk]: each dim 1 or full, at ranks 2-4 (left-padded)."""
    full = (B, H, sq, sk)
    shapes = set()
    for rank in (2, 3, 4):
        shapes |= set(itertools.product(*[(1, n) for n in full[-rank:]]))
    return sorted(shapes, key=lambda s: (len(s), s))


@pytest.fixture
def simulated_cuda(monkeypatch):
    """A CUDA process as far as the cudnn backend and JAX's cuDNN checks can tell (Ampere, cuDNN 9.10)."""
    monkeypatch.setattr(cudnn, "cuda_present", lambda: True)
    monkeypatch.setattr(jax_cudnn, "check_cudnn_version", lambda: 91000)
    ampere = (8, 0)
    monkeypatch.setattr(
        jax_cudnn, "check_compute_capability", lambda c: ampere >= tuple(int(x) for x in c.split("."))
    )
    monkeypatch.setattr(
        jax_cudnn, "is_cuda_compute_capability_equal", lambda c: ampere == tuple(int(x) for x in c.split("."))
    )
    _jax_cudnn_rejects.cache_clear()
    yield
    _jax_cudnn_rejects.cache_clear()


def make_call(sq, sk, dtype="bfloat16", hkv=H, bias=None, d=D, **feature):
    """The static ``Call`` (and the user arguments) of one matrix entry; arrays are zeros."""
    kwargs = dict(feature)
    q = jnp.zeros((B, sq, H, d), dtype)
    k = jnp.zeros((B, sk, hkv, d), dtype)
    if bias is not None:
        kwargs["bias"] = jnp.zeros(bias, jnp.float32)
    if kwargs.get("mask") is not None:
        shape = tuple(
            sq if n is None and i == 2 else sk if n is None else n for i, n in enumerate(kwargs["mask"])
        )
        kwargs["mask"] = jnp.ones(shape, bool)
    if kwargs.pop("segments", False):
        kwargs["q_segment_ids"] = jnp.zeros((B, sq), jnp.int32)
        kwargs["kv_segment_ids"] = jnp.zeros((B, sk), jnp.int32)
    if kwargs.get("dropout_rate"):
        kwargs["dropout_rng"] = jax.random.key(0)
    return api.prepare(q, k, k, **kwargs)[1]


@functools.cache
def _jax_cudnn_rejects(call: api.Call) -> str | None:
    """JAX's own verdict: the error its cuDNN path raises while tracing the cudnn backend on this call
    (forward, then under ``jax.grad`` w.r.t. q, k, v, where it checks as for training), or None."""
    q = jax.ShapeDtypeStruct(call.q_shape, jnp.dtype(call.dtype))
    k = jax.ShapeDtypeStruct(call.kv_shape, jnp.dtype(call.dtype))
    v = jax.ShapeDtypeStruct(call.kv_shape[:3] + (call.v_head_dim,), jnp.dtype(call.dtype))
    bias = None if call.bias_shape is None else jax.ShapeDtypeStruct(call.bias_shape, jnp.float32)

    def out(q, k, v, bias):
        return cudnn.cudnn_attention(q, k, v, bias, None, None, None, None, spec=call.spec, options={})[0]

    def loss(q, k, v, bias):
        return jnp.sum(out(q, k, v, bias).astype(jnp.float32))

    try:
        jax.make_jaxpr(out)(q, k, v, bias)
        jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, bias)
    except (ValueError, NotImplementedError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def assert_cuda_choice_accepted(call, label):
    """auto's CUDA pick passes its own check, and a cuDNN pick passes JAX's cuDNN checks."""
    name, why = registry.choose("cuda", call)
    assert registry.missing_features(registry.get(name), call) == [], (label, name, why)
    if name == "cudnn":
        assert _jax_cudnn_rejects(call) is None, (label, _jax_cudnn_rejects(call))
    return name, why


def test_the_oracle_sees_the_reported_key_padding_failure(simulated_cuda):
    """The issue's failure, reproduced by JAX's checks (so the oracle can fail): a [B, 1, 1, Sk] bias
    and, under grad, an odd sequence length (with or without a bias)."""
    pad = make_call(8, 16, bias=(B, 1, 1, 16))
    assert "Bias must have same seq length as QKV" in _jax_cudnn_rejects(pad)
    for odd in (make_call(7, 13, bias=(1, 1, 7, 13)), make_call(1, 16, causal=True, align="top_left")):
        assert "Unsupported sequence length" in _jax_cudnn_rejects(odd)
        assert "odd sequence length" in cudnn.check_call(odd)
    assert _jax_cudnn_rejects(make_call(8, 16, bias=(B, 1, 8, 16), causal=True, align="top_left")) is None


@pytest.mark.parametrize("size", sorted(SIZES))
def test_every_bias_shape(simulated_cuda, size):
    """Every broadcast bias shape, with and without top-left causal and a left window."""
    sq, sk = SIZES[size]
    for shape, feature in itertools.product(
        broadcast_shapes(sq, sk), ("plain", "causal_tl", "window_left_tl")
    ):
        call = make_call(sq, sk, bias=shape, **FEATURES[feature])
        name, why = assert_cuda_choice_accepted(call, (shape, feature))
        spans = tuple((1,) * (4 - len(shape)) + shape)[2:] == (sq, sk)
        rows_see_keys = feature != "window_left_tl" or sq <= sk + 4  # window (4, 0), top-left
        if spans and sq % 2 == 0 and sk % 2 == 0 and rows_see_keys:
            assert name == "cudnn", (shape, feature, why)  # auto uses cuDNN wherever it is eligible
        if not spans:
            assert name != "cudnn", (shape, feature, why)
            assert "bias of shape" in why or sq % 2 or sk % 2, (shape, feature, why)


def test_explicit_cudnn_refuses_a_key_padding_bias_before_lowering(simulated_cuda):
    q = jnp.zeros((B, 8, H, D), jnp.bfloat16)
    k = jnp.zeros((B, 16, H, D), jnp.bfloat16)
    with pytest.raises(
        ValueError, match=r"backend='cudnn' does not support this call: bias of shape \[2, 1, 1, 16\]"
    ):
        jax.eval_shape(
            lambda q, k: flashport.attention(q, k, k, bias=jnp.zeros((B, 1, 1, 16)), backend="cudnn"), q, k
        )


@pytest.mark.parametrize("size", ["sq<sk", "odd"])
def test_every_mask_shape(simulated_cuda, size):
    sq, sk = SIZES[size]
    for shape in broadcast_shapes(sq, sk):
        call = make_call(sq, sk, mask=shape, causal=True)
        name, _ = assert_cuda_choice_accepted(call, shape)
        assert name == "pallas_gpu"  # cuDNN has no boolean mask with the contract's empty rows


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("heads", sorted(HEADS))
def test_every_feature_size_and_dtype(simulated_cuda, dtype, heads):
    for size, feature in itertools.product(sorted(SIZES), sorted(FEATURES)):
        sq, sk = SIZES[size]
        call = make_call(sq, sk, dtype=dtype, hkv=HEADS[heads], **FEATURES[feature])
        name, why = assert_cuda_choice_accepted(call, (size, feature))
        assert name in ("cudnn", "pallas_gpu"), (size, feature, name, why)  # never the O(S^2) xla path


@pytest.mark.parametrize("d", [8, 40, 72, 128, 136, 256, 512])
def test_head_dims(simulated_cuda, d):
    for hkv in (H, 2):
        call = make_call(16, 16, hkv=hkv, d=d, causal=True, align="top_left")
        name, why = assert_cuda_choice_accepted(call, d)
        if d <= 128:
            assert name == "cudnn", why
    big = make_call(16, 16, d=512)
    assert registry.choose("cuda", big)[0] not in ("cudnn", "pallas_gpu")  # both refuse, with a reason


def test_long_sequences_never_take_the_materialized_path(simulated_cuda):
    """Where neither cuDNN nor pallas_gpu can serve a long call (head_dim 512), auto on CUDA takes the
    O(S) blockwise path, never the O(S^2) xla one."""
    name, why = registry.choose("cuda", make_call(2048, 2048, d=512, causal=True))
    assert name == "blockwise" and "head_dim 512" in why


def test_no_cudnn_without_a_gpu():
    """In a process without a CUDA device (this one), auto's CUDA branch never traces cuDNN."""
    assert not cudnn.cuda_present()
    name, why = registry.choose("cuda", make_call(8, 16))
    assert name == "pallas_gpu" and "CUDA device" in why


# ------------------------------------------------------------------------------ auto, end to end


@pytest.mark.parametrize(
    "case",
    [
        dict(bias=(B, 1, 1, 16)),  # the key-padding bias: pallas_gpu
        dict(bias=(1, H, 8, 16), causal=True, align="top_left"),  # cuDNN
        dict(bias=(8, 16), window=(4, 0), align="top_left"),  # cuDNN with a 2-D bias
    ],
    ids=["key_padding", "head_bias_causal", "bias_2d_window"],
)
def test_auto_lowers_for_cuda(simulated_cuda, case):
    """``flashport.attention(backend="auto")`` lowered for CUDA on this host, forward and training:
    the CUDA branch holds exactly the kernel ``choose`` names (cuDNN custom call or Triton)."""
    case = dict(case)
    bias = jax.ShapeDtypeStruct(case.pop("bias"), jnp.float32)
    q = jax.ShapeDtypeStruct((B, 8, H, D), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((B, 16, H, D), jnp.bfloat16)
    want, _ = registry.choose("cuda", make_call(8, 16, bias=bias.shape, **case))

    def loss(q, k, v, bias):
        return jnp.sum(flashport.attention(q, k, v, bias=bias, **case).astype(jnp.float32))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    text = grad.trace(q, k, k, bias).lower(lowering_platforms=("cuda",)).as_text()
    assert ("__cudnn$fmha" in text) == (want == "cudnn"), want
    assert ("__gpu$xla.gpu.triton" in text) == (want == "pallas_gpu"), want


# ------------------------------------------------------------------------------ explicit backends

EXPLICIT = {  # together: every feature, ragged lengths, a bias cuDNN takes and one it does not
    "plain_odd": dict(sq=7, sk=13),
    "causal_tl_bias_full": dict(causal=True, align="top_left", bias=(1, H, 8, 16)),
    "causal_br_key_padding_segments_mask_gqa": dict(
        causal=True, bias=(B, 1, 1, 16), segments=True, mask=(B, 1, None, None), hkv=2
    ),
    "window_softcap_dropout_lse_mqa": dict(
        window=(3, 2), softcap=5.0, dropout_rate=0.25, return_lse=True, hkv=1
    ),
}


def _explicit_inputs(case, dtype):
    case = dict(case)
    sq, sk, hkv = case.pop("sq", 8), case.pop("sk", 16), case.pop("hkv", H)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, sq, H, 16)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((B, sk, hkv, 16)), dtype) for _ in range(2))
    kwargs, ref = {}, {}
    for key, value in case.items():
        if key == "bias":
            kwargs["bias"] = jnp.asarray(rng.standard_normal(value), jnp.float32)
        elif key == "mask":
            kwargs["mask"] = jnp.asarray(rng.random((B, 1, sq, sk)) < 0.7)
        elif key == "segments":
            for name, n in (("q_segment_ids", sq), ("kv_segment_ids", sk)):
                kwargs[name] = jnp.asarray(np.sort(rng.integers(0, 2, (B, n)), axis=1), jnp.int32)
        elif key == "dropout_rate":
            kwargs.update(dropout_rate=value, dropout_rng=jnp.asarray([0, 9], jnp.uint32))
            ref.update(dropout_rate=value, dropout_seed=(0, 9))
        else:
            kwargs[key] = value
    ref.update({n: x for n, x in kwargs.items() if n not in ("dropout_rate", "dropout_rng", "return_lse")})
    return q, k, v, kwargs, ref


@pytest.mark.parametrize("backend", sorted(registry.all_backends()))
def test_explicit_backends_run_or_refuse_before_lowering(simulated_cuda, backend):
    """Each registered backend, named explicitly: if its checks refuse the call, ``flashport.attention``
    raises a ValueError naming the backend and the reason while tracing abstractly (``jax.eval_shape``
    lowers nothing); otherwise it runs here and matches the float64 reference (CPU backends, the
    interpreter twins included) or lowers for its accelerator (``cuda``; TPU lowering has its own
    tests in tests/test_pallas_tpu_export.py)."""
    info = registry.get(backend)
    dtype = "bfloat16" if backend == "cudnn" else "float32"
    for name, case in sorted(EXPLICIT.items()):
        q, k, v, kwargs, ref = _explicit_inputs(case, dtype)
        missing = registry.missing_features(info, api.prepare(q, k, v, **kwargs)[1])
        run = functools.partial(flashport.attention, backend=backend, **kwargs)
        if missing:
            with pytest.raises(ValueError, match=rf"backend='{backend}' does not support this call: .+"):
                jax.eval_shape(run, q, k, v)
        elif "cpu" in info.platforms:
            got = run(q, k, v)
            want, _ = reference_attention(q, k, v, **ref)
            out = np.asarray(got[0] if kwargs.get("return_lse") else got, np.float64)
            err = float(np.max(np.abs(out - want)))
            assert err < 2e-5 * max(1.0, float(np.max(np.abs(want)))), (name, err)
        elif "cuda" in info.platforms:
            jax.jit(run).trace(q, k, v).lower(lowering_platforms=("cuda",))
        else:
            jax.make_jaxpr(run)(q, k, v)
