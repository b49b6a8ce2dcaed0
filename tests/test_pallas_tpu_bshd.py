"""The Pallas TPU kernels on the caller's BSHD arrays (token-major), in the TPU interpreter on CPU.

By default (backend option ``read_bshd``, on unless set to False), a BSHD call whose head dims are
multiples of 128 runs the forward, dK/dV and dQ kernels on token-major blocks ``[rows, H, D]`` read
from the caller's arrays (no transpose around the kernels; tests/test_tpu_compile.py checks the
compiled HLO). The kernels copy the blocks heads-major into VMEM (``Operands.stage``): head by head
in the TPU interpreter, with strided loads/stores of reshaped (bf16: uint32) views of the block in
the plain interpreter and on a TPU; both are checked here. Here: the values against the float64 reference
of tests/reference.py (forward, lse and gradients, with GQA, per-head bias, segment ids and dropout),
and the structure the kernels are given, read from the traced program: operand shapes per layout,
the compact lse rows, and no lse output at all in an inference forward that does not return it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from reference import reduce_to_shape, reference_attention, reference_attention_vjp

import flashport
from flashport.kernels.backends.pallas_tpu import backend as pallas_backend
from flashport.kernels.backends.pallas_tpu import counting, layout, specs
from flashport.kernels.backends.pallas_tpu.blocks import resolve_blocks
from flashport.kernels.backends.pallas_tpu.specs import Operands
from flashport.kernels.contract import registry
from flashport.kernels.contract.spec import make_spec

SMALL = registry.use("pallas_tpu_interpret", block_q=32, block_k=128)  # read_bshd on by default
HEADS_MAJOR = registry.use("pallas_tpu_interpret", block_q=32, block_k=128, read_bshd=False)
SEED = 5
WORDS = (SEED >> 32, SEED & 0xFFFFFFFF)  # the seed words of jax.random.key(SEED)


def _inputs(b=2, sq=40, sk=200, hq=4, hkv=2, d=128, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    shapes = ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, hq, d))
    return [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]


def _close(got, want, tol, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(1.0, float(np.max(np.abs(want))))
    err = float(np.max(np.abs(got - want)))
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} > {tol * scale:.3g}"


CASES = {
    # GQA 4/2, per-head bias (its gradient too), segment ids, causal bottom-right with Sq < Sk.
    "gqa_bias_segments_causal": dict(
        kwargs=dict(causal=True), bias=(2, 4, 40, 200), segments=True, dropout=0.0
    ),
    # MQA 4/1, window + softcap, dropout (the kernels hash global query heads from the token-major loop).
    "mqa_window_softcap_dropout": dict(
        kwargs=dict(window=(30, 10), softcap=4.0), hkv=1, bias=None, segments=False, dropout=0.3
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bshd_forward_and_grads_match_reference(name):
    case = CASES[name]
    q, k, v, do = _inputs(hkv=case.get("hkv", 2))
    rng = np.random.default_rng(1)
    kwargs = dict(case["kwargs"])
    if case["segments"]:
        kwargs["q_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (2, 40)), axis=1), jnp.int32)
        kwargs["kv_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (2, 200)), axis=1), jnp.int32)
    bias = None if case["bias"] is None else jnp.asarray(rng.standard_normal(case["bias"]), jnp.float32)
    rate = case["dropout"]
    drop = dict(dropout_rate=rate, dropout_rng=jax.random.key(SEED)) if rate else {}
    ref_drop = dict(dropout_rate=rate, dropout_seed=WORDS) if rate else {}

    def f(q, k, v, bias):
        return flashport.attention(q, k, v, bias=bias, backend=SMALL, return_lse=True, **kwargs, **drop)

    (out, lse), vjp = jax.vjp(f, q, k, v, bias)
    grads = vjp((do, jnp.zeros_like(lse)))
    want_out, want_lse = reference_attention(q, k, v, bias=bias, **kwargs, **ref_drop)
    want = reference_attention_vjp(q, k, v, do, bias=bias, **kwargs, **ref_drop)
    _close(out, want_out, 2e-5, "out")
    finite = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    _close(np.asarray(lse)[finite], want_lse[finite], 2e-5, "lse")
    for what, got, ref in zip("qkv", grads[:3], want[:3], strict=True):
        _close(got, ref, 1e-4, f"d{what}")
    if bias is not None:
        _close(grads[3], reduce_to_shape(want[3], bias.shape), 1e-4, "dbias")


def test_bfloat16_bshd_matches_reference():
    q, k, v, do = _inputs(b=1, hq=2, hkv=1, dtype=jnp.bfloat16)

    def f(q, k, v):
        return flashport.attention(q, k, v, causal=True, backend=SMALL)

    out, vjp = jax.vjp(f, q, k, v)
    grads = vjp(do)
    want_out, _ = reference_attention(q, k, v, causal=True)
    want = reference_attention_vjp(q, k, v, do, causal=True)
    _close(out, want_out, 3e-2, "out")
    for what, got, ref in zip("qkv", grads, want[:3], strict=True):
        _close(got, ref, 6e-2, f"d{what}")


def test_inference_without_lse_matches_reference():
    # The forward that writes no lse: its output alone must still be right.
    q, k, v, _ = _inputs()
    out = jax.jit(lambda q, k, v: flashport.attention(q, k, v, causal=True, backend=SMALL))(q, k, v)
    _close(out, reference_attention(q, k, v, causal=True)[0], 2e-5, "out")


def _kernel_calls(fn, *args):
    """``{name: (operand shapes, output shapes)}`` of the pallas_calls in ``fn``'s jaxpr."""
    calls = {}
    for eqn, _ in counting._walk(jax.make_jaxpr(fn)(*args).jaxpr, ""):
        if eqn.primitive.name == "pallas_call":
            shapes = lambda vs: [tuple(v.aval.shape) for v in vs]  # noqa: E731
            calls[eqn.params["name"]] = (shapes(eqn.invars), shapes(eqn.outvars))
    return calls


def _grad_fn(layout, backend=SMALL):
    def loss(q, k, v):
        return jnp.sum(flashport.attention(q, k, v, causal=True, backend=backend, layout=layout))

    return jax.grad(loss, argnums=(0, 1, 2))


def test_bshd_call_gives_the_kernels_bshd_operands_and_compact_lse():
    q, k, v, _ = _inputs(b=1, sq=64, sk=256)  # whole blocks: no padding
    calls = _kernel_calls(_grad_fn("BSHD"), q, k, v)
    for name in ("flashport_flash_fwd", "flashport_flash_dkv", "flashport_flash_dq"):
        ins = calls[name][0]
        # q, k, v are the caller's [B, S, H, D] arrays (after the scalar-prefetch tables).
        assert (1, 64, 4, 128) in ins and (1, 256, 2, 128) in ins, (name, ins)
        assert not any(s[-1] == 128 and len(s) == 4 and s[1] in (4, 2) for s in ins), (name, ins)
    fwd_out = calls["flashport_flash_fwd"][1]
    # out in BSHD, lse as compact rows [B, Hq, nq, 1, bq] (not [B, Hq, Sq, 128]).
    assert fwd_out == [(1, 64, 4, 128), (1, 4, 2, 1, 32)]
    assert calls["flashport_flash_dq"][1] == [(1, 64, 4, 128)]
    assert calls["flashport_flash_dkv"][1] == [(1, 256, 2, 128), (1, 256, 2, 128)]


def test_bhsd_call_keeps_heads_major_operands():
    q, k, v, _ = (jnp.swapaxes(x, 1, 2) for x in _inputs(b=1, sq=64, sk=256))
    calls = _kernel_calls(_grad_fn("BHSD"), q, k, v)
    assert (1, 4, 64, 128) in calls["flashport_flash_fwd"][0]
    assert calls["flashport_flash_dq"][1] == [(1, 4, 64, 128)]


def test_bshd_call_with_read_bshd_off_transposes_to_heads_major():
    q, k, v, _ = _inputs(b=1, sq=64, sk=256)
    calls = _kernel_calls(_grad_fn("BSHD", HEADS_MAJOR), q, k, v)
    assert (1, 4, 64, 128) in calls["flashport_flash_fwd"][0]
    assert calls["flashport_flash_dq"][1] == [(1, 4, 64, 128)]
    # The compact lse rows do not depend on the option.
    assert calls["flashport_flash_fwd"][1] == [(1, 4, 64, 128), (1, 4, 2, 1, 32)]


def test_read_bshd_option_must_be_a_bool():
    q, k, v, _ = _inputs(b=1, sq=64, sk=256)
    bad = registry.use("pallas_tpu_interpret", read_bshd="yes")
    with pytest.raises(ValueError, match="read_bshd"):
        flashport.attention(q, k, v, backend=bad)


@pytest.mark.parametrize("return_lse", [False, True])
def test_inference_forward_writes_lse_only_when_returned(return_lse):
    q, k, v, _ = _inputs(b=1, sq=64, sk=256)

    def fwd(q, k, v):
        return flashport.attention(q, k, v, causal=True, backend=SMALL, return_lse=return_lse)

    outs = _kernel_calls(fwd, q, k, v)["flashport_flash_fwd"][1]
    assert outs == ([(1, 64, 4, 128), (1, 4, 2, 1, 32)] if return_lse else [(1, 64, 4, 128)])
    # A gradient's forward writes it whatever return_lse says.
    assert len(_kernel_calls(_grad_fn("BSHD"), q, k, v)["flashport_flash_fwd"][1]) == 2


@pytest.mark.parametrize("dtype,heads", [("bfloat16", 6), ("bfloat16", 3), ("float32", 4)])
@pytest.mark.parametrize("strided", [True, False])
def test_stage_and_write_rows_move_heads_between_layouts(dtype, heads, strided):
    # Operands.stage copies a token-major block [rows, H, D] heads-major ([H, rows, D]): strided, bf16
    # with an even head count as uint32 pairs of heads, f32 as strided rows; an odd bf16 head count
    # (and strided=False) head by head. write_rows writes heads-major f32 rows back token-major (head
    # by head here: the interpreters cannot store through a reshaped ref; see the next test). Checked
    # against numpy's swapaxes in the plain interpreter (the TPU interpreter has no reshaped refs).
    ops = Operands(token_major=True, strided=strided, strided_stores=False)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, heads, 128)), dtype)

    def kernel(x_ref, staged_ref, back_ref, scratch):
        ops.stage(x_ref, scratch)
        staged_ref[...] = scratch[...]
        ops.write_rows(back_ref, scratch[...].astype(jnp.float32))

    staged, back = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((heads, 64, 128), x.dtype), jax.ShapeDtypeStruct(x.shape, x.dtype)],
        scratch_shapes=[pltpu.VMEM((heads, 64, 128), x.dtype)],
        interpret=True,
    )(x)
    np.testing.assert_array_equal(np.asarray(staged), np.swapaxes(np.asarray(x), 0, 1))
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))


def test_packed_pairs_are_the_bf16_blocks_32_bit_view():
    # The strided bf16 stores write pack_pair(even head, odd head) words: they must be exactly what
    # pltpu.bitcast (Mosaic's packing of a bf16 [2n, m] block into uint32 [n, m]) makes of the two
    # rows, and unpack_pair must give the rows back.
    x = jnp.asarray(np.random.default_rng(2).standard_normal((64, 128)), jnp.bfloat16)

    def kernel(x_ref, words_ref, packed_ref, even_ref, odd_ref):
        words = pltpu.bitcast(x_ref[...], jnp.uint32)
        words_ref[...] = words
        rows = x_ref[...].astype(jnp.float32).reshape(32, 2, 128)
        packed_ref[...] = specs.pack_pair(rows[:, 0], rows[:, 1])
        even_ref[...], odd_ref[...] = specs.unpack_pair(words)

    u32 = jax.ShapeDtypeStruct((32, 128), jnp.uint32)
    half = jax.ShapeDtypeStruct((32, 128), jnp.bfloat16)
    words, packed, even, odd = pl.pallas_call(kernel, out_shape=[u32, u32, half, half], interpret=True)(x)
    np.testing.assert_array_equal(np.asarray(packed), np.asarray(words))
    np.testing.assert_array_equal(np.asarray(even), np.asarray(x)[0::2])
    np.testing.assert_array_equal(np.asarray(odd), np.asarray(x)[1::2])


def test_strided_copies_in_the_kernels_match_reference(monkeypatch):
    # The whole BSHD gradient with the strided copies (the plain interpreter, as on a TPU): bf16 GQA
    # 8/2 (uint32 head pairs) against the float64 reference.
    monkeypatch.setattr(pallas_backend.Config, "interpret_mode", property(lambda self: self.interpret))
    q, k, v, do = _inputs(b=1, sq=64, sk=160, hq=8, hkv=2, dtype=jnp.bfloat16)

    def f(q, k, v):
        return flashport.attention(q, k, v, causal=True, backend=SMALL)

    out, vjp = jax.vjp(f, q, k, v)
    grads = vjp(do)
    _close(out, reference_attention(q, k, v, causal=True)[0], 3e-2, "out")
    want = reference_attention_vjp(q, k, v, do, causal=True)
    for what, got, ref in zip("qkv", grads, want[:3], strict=True):
        _close(got, ref, 6e-2, f"d{what}")


def _config(gen, hq, hkv, s, **options):
    spec = make_spec(
        (1, hq, s, 128),
        (1, hkv, s, 128),
        scale=None,
        causal=True,
        window=None,
        align="top_left",
        softcap=None,
    )
    _, blocks = resolve_blocks(dict(options, generation=gen), "pallas_tpu")
    q, kv = jnp.zeros((1, hq, s, 128), jnp.bfloat16), jnp.zeros((1, hkv, s, 128), jnp.bfloat16)
    cfg = pallas_backend.Config(
        dataclasses.replace(spec, layout="BSHD"), blocks, False, gen, options.get("read_bshd")
    )
    return cfg, q, kv


def test_layout_byte_model_matches_the_hand_count():
    # v6e, S = 4096, H = 8, D = 128 bf16, causal: Q, K, V, O are 8 MiB each, so the forward's
    # transposes move 64 MiB (read + write); heads-major 1024 x 512 tiles visit 20 key blocks per
    # query-block row set: K/V (8 MiB + 8 MiB per 4096 rows) stream 20 x 512 rows x 8 heads = 40 MiB.
    cfg, q, kv = _config("v6e", 8, 8, 4096)
    g = cfg.geometry("fwd", q, kv, kv, token_major=False)
    assert (g.bq, g.bk, g.visited_tiles) == (1024, 512, 20)
    assert layout.transposed_bytes(("fwd",), q, kv, kv) == 64 * 2**20
    assert layout.streamed_bytes("fwd", g, q, kv, kv) == 40 * 2**20
    # The backward: Q, K, V, dO in and dQ, dK, dV out, 7 operands of 8 MiB read and written.
    assert layout.transposed_bytes(("dkv", "dq"), q, kv, kv) == 112 * 2**20


@pytest.mark.parametrize(
    "gen,hq,hkv,s,option,token_major",
    [
        ("v6e", 8, 8, 4096, None, True),  # the shape: same tiles either way, no transposes
        ("v5e", 8, 2, 2048, None, True),
        # 32 heads share a step's VMEM: 16 MiB of v4 VMEM leaves token-major 32-row query blocks,
        # re-streaming K/V far more than the transposes move.
        ("v4", 32, 32, 4096, None, False),
        ("v4", 32, 32, 4096, True, True),
        ("v6e", 8, 8, 4096, False, False),
    ],
)
def test_default_layout_follows_the_byte_model(gen, hq, hkv, s, option, token_major):
    cfg, q, kv = _config(gen, hq, hkv, s, **({} if option is None else {"read_bshd": option}))
    for kinds in (("fwd",), ("dkv", "dq")):
        assert cfg.operands(q, kv, kv, kinds).token_major is token_major, kinds
