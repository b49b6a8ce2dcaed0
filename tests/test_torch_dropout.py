"""Dropout in the torch adapter: ``flashport.torch.attention(..., dropout_p=, generator=)``.

Every path that runs dropout draws the contract's keep-mask (kernels/semantics/dropout.py), so the pure-torch
math path, the JAX path (DLPack, and the torch_xla / torchax bridges, faked here) and
``flashport.attention`` with the same seed words agree, and all of them match the float64 reference
of tests/reference.py, whose mask is written from the definition. Also: the integrations that carry
dropout over (varlen, xformers ``p``, transformers ``dropout``) and the errors for bad arguments.
"""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from reference import dropout_keep, reference_attention, reference_attention_vjp  # noqa: E402
from test_torch_adapter import FakeFlashAttn, fake_torch_xla, fake_torchax  # noqa: E402,F401

import flashport  # noqa: E402
import flashport.torch as ft  # noqa: E402
from flashport.kernels.contract.varlen import varlen_layout  # noqa: E402
from flashport.kernels.semantics import dropout as kdropout  # noqa: E402
from flashport.torch import _checks, _dropout, _jax, _native  # noqa: E402

RATE = 0.3


def words_of(seed: int) -> tuple[int, int]:
    """The seed words a call with ``generator=torch.Generator().manual_seed(seed)`` draws first."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, 2**32, (2,), generator=g, dtype=torch.int64).tolist())


# ------------------------------------------------------------------------------ the mask itself


@pytest.mark.parametrize("words", [(0, 0), (7, 123456789), (0xFFFFFFFF, 0x80000001), (2**31, 1)])
@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_torch_mask_is_bit_equal_to_the_jax_definition_and_the_reference(words, rate):
    b, h, sq, sk = 2, 3, 19, 37
    got = _dropout.keep_mask(words, rate, b, h, sq, sk).numpy()
    np.testing.assert_array_equal(got, dropout_keep(words, rate, (b, h, sq, sk)))
    seed = kdropout.seed_words(jnp.asarray(words, jnp.uint32))
    t_bh = kdropout.head_seed(seed, jnp.arange(b)[:, None, None, None], jnp.arange(h)[None, :, None, None])
    want = kdropout.keep_mask(rate, t_bh, jnp.arange(sq)[:, None], jnp.arange(sk))
    np.testing.assert_array_equal(got, np.asarray(want))
    bits = _dropout.hash_bits(words, b, h, sq, sk, None).numpy()
    np.testing.assert_array_equal(
        bits, np.asarray(kdropout.hash_bits(t_bh, jnp.arange(sq)[:, None], jnp.arange(sk)))
    )
    assert kdropout.threshold(rate) == min(
        int(np.floor(rate * 2.0**32)), 0xFFFFFFFF
    )  # the written cut (one threshold)


def test_seed_tensor_holds_the_words_bit_patterns():
    words = (0xFFFFFFFF, 5)
    t = _dropout.seed_tensor(words, torchax_like(torch.zeros(3, requires_grad=True)).detach())
    assert t.dtype == torch.int32 and not t.requires_grad and type(t) is TorchaxLike
    back = jax.lax.bitcast_convert_type(_jax.to_jax(t), jnp.uint32)
    assert tuple(int(w) for w in np.asarray(back)) == words


# ------------------------------------------------------------------------------ outputs and gradients

CONFIGS = {
    "plain": {},
    "causal_gqa": dict(causal=True),
    "softcap_bias": dict(softcap=4.0, bias=(1, 4, 12, 20)),
    "segments_window_top_left": dict(window=(5, 2), align="top_left", segments=True),
    "empty_rows_causal": dict(causal=True, sq=24, sk=8),  # bottom-right: the first 16 rows see no key
}


def make_inputs(cfg):
    sq, sk = cfg.get("sq", 12), cfg.get("sk", 20)
    rng = np.random.default_rng(0)
    x = {
        "query": rng.standard_normal((2, sq, 4, 8)),
        "key": rng.standard_normal((2, sk, 2, 8)),
        "value": rng.standard_normal((2, sk, 2, 8)),
    }
    if cfg.get("bias"):
        x["bias"] = rng.standard_normal(cfg["bias"])
    options = {k: v for k, v in cfg.items() if k not in ("bias", "segments", "sq", "sk")}
    ints = {}
    if cfg.get("segments"):
        ints["q_segment_ids"] = np.broadcast_to((np.arange(sq) >= sq // 3).astype(np.int32), (2, sq))
        ints["kv_segment_ids"] = np.broadcast_to((np.arange(sk) >= sk // 2).astype(np.int32), (2, sk))
    return x, ints, options


def run_torch(x, ints, options, backend, seed, d_out):
    t = {n: torch.tensor(v, dtype=torch.float32, requires_grad=True) for n, v in x.items()}
    t_ints = {n: torch.tensor(np.ascontiguousarray(v)) for n, v in ints.items()}
    out, lse = ft.attention(
        **t,
        **t_ints,
        **options,
        backend=backend,
        return_lse=True,
        dropout_p=RATE,
        generator=torch.Generator().manual_seed(seed),
        layout="BSHD",
    )
    (out * torch.tensor(d_out, dtype=torch.float32)).sum().backward()
    return out.detach().numpy(), lse.detach().numpy(), {n: v.grad.numpy() for n, v in t.items()}


@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_math_and_jax_paths_match_each_other_flashport_attention_and_the_float64_reference(cfg):
    x, ints, options = make_inputs(CONFIGS[cfg])
    seed, words = 11, words_of(11)
    d_out = np.random.default_rng(1).standard_normal(x["query"].shape)
    ref_kwargs = dict(options, **ints, bias=x.get("bias"), dropout_rate=RATE, dropout_seed=words)
    ref_out, ref_lse = reference_attention(x["query"], x["key"], x["value"], **ref_kwargs)
    rdq, rdk, rdv, rdb = reference_attention_vjp(x["query"], x["key"], x["value"], d_out, **ref_kwargs)
    ref_grads = {"query": rdq, "key": rdk, "value": rdv}
    if "bias" in x:  # the reference gives the full-shape bias gradient; the bias broadcasts over batch
        ref_grads["bias"] = rdb.sum(axis=0, keepdims=True)
    results = {
        backend: run_torch(x, ints, options, backend, seed, d_out) for backend in ("torch", "auto", "xla")
    }
    jx = {n: jnp.asarray(v, jnp.float32) for n, v in x.items()}
    jax_out, jax_lse = flashport.attention(
        **jx,
        **{n: jnp.asarray(v) for n, v in ints.items()},
        **options,
        return_lse=True,
        dropout_rate=RATE,
        dropout_rng=jnp.asarray(words, jnp.uint32),
    )
    for backend, (out, lse, grads) in results.items():
        np.testing.assert_allclose(out, ref_out, atol=2e-5, rtol=2e-5, err_msg=backend)
        np.testing.assert_allclose(lse, ref_lse, atol=2e-5, rtol=2e-5, err_msg=backend)
        np.testing.assert_allclose(out, np.asarray(jax_out), atol=2e-6, rtol=2e-6, err_msg=backend)
        np.testing.assert_allclose(lse, np.asarray(jax_lse), atol=2e-6, rtol=2e-6, err_msg=backend)
        for n, want in ref_grads.items():
            np.testing.assert_allclose(grads[n], want, atol=1e-4, rtol=1e-4, err_msg=f"{backend} d{n}")
    math_out, _, math_grads = results["torch"]
    for backend in ("auto", "xla"):
        np.testing.assert_allclose(results[backend][0], math_out, atol=2e-6, rtol=2e-6)
        for n in ref_grads:
            np.testing.assert_allclose(results[backend][2][n], math_grads[n], atol=1e-5, rtol=1e-5)
    # Dropout did something, and lse is that of the scores.
    no_drop, lse_no_drop = reference_attention(
        x["query"], x["key"], x["value"], **dict(ref_kwargs, dropout_rate=0.0)
    )
    assert np.abs(no_drop - ref_out).max() > 1e-2
    np.testing.assert_allclose(ref_lse, lse_no_drop)


def test_math_path_gradcheck_float64():
    """Gradients of out and lse are exact for fixed words (central differences in float64)."""
    rng = np.random.default_rng(2)
    q, k, v = (
        torch.tensor(rng.standard_normal(s), dtype=torch.float64, requires_grad=True)
        for s in ((1, 3, 4, 4), (1, 5, 2, 4), (1, 5, 2, 4))
    )
    bias = torch.tensor(rng.standard_normal((1, 4, 3, 5)), dtype=torch.float64, requires_grad=True)
    template = _checks.check(
        *(x.float() for x in (q, k, v)), bias=bias.float(), causal=True, softcap=3.0, dropout_p=0.4
    )
    words = (0x12345678, 0x9ABCDEF0)
    assert not _dropout.keep_mask(words, 0.4, 1, 4, 3, 5).all()  # some entries dropped

    def f(q, k, v, bias):
        call = dataclasses.replace(
            template, q=q.transpose(1, 2), k=k.transpose(1, 2), v=v.transpose(1, 2), bias=bias, seed=words
        )
        out, lse = _native.math_attention(call)
        assert out.dtype == torch.float64
        return out, lse

    assert torch.autograd.gradcheck(f, (q, k, v, bias), eps=1e-6, atol=1e-6)


def test_backward_reuses_the_forward_words():
    """Drawing from the generator between forward and backward does not change the gradients."""
    x, _ints, options = make_inputs(CONFIGS["causal_gqa"])
    for backend in ("torch", "auto"):
        g = torch.Generator().manual_seed(3)
        t = {n: torch.tensor(v, dtype=torch.float32, requires_grad=True) for n, v in x.items()}
        out = ft.attention(**t, **options, backend=backend, dropout_p=RATE, generator=g, layout="BSHD")
        torch.randint(0, 10, (5,), generator=g)
        ft.attention(
            **t, **options, backend=backend, dropout_p=RATE, generator=g, layout="BSHD"
        )  # another draw
        out.sum().backward()
        _, _, want, _ = reference_attention_vjp(
            x["query"],
            x["key"],
            x["value"],
            np.ones(out.shape),
            **options,
            dropout_rate=RATE,
            dropout_seed=words_of(3),
        )
        np.testing.assert_allclose(t["value"].grad.numpy(), want, atol=1e-4, rtol=1e-4, err_msg=backend)


def test_activation_checkpointing_recomputes_the_same_mask():
    """torch.utils.checkpoint restores the default generator for the recomputed forward."""
    x, _, options = make_inputs(CONFIGS["causal_gqa"])
    grads = []
    for checkpointed in (False, True):
        t = {n: torch.tensor(v, dtype=torch.float32, requires_grad=True) for n, v in x.items()}

        def f(q, k, v):
            return ft.attention(q, k, v, **options, dropout_p=RATE, backend="torch", layout="BSHD")

        torch.manual_seed(30)
        out = (
            torch.utils.checkpoint.checkpoint(f, *t.values(), use_reentrant=False)
            if checkpointed
            else f(*t.values())
        )
        out.sum().backward()
        grads.append([v.grad for v in t.values()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


# ------------------------------------------------------------------------------ the mask, read back


def read_mask(backend, rate, generator, b=1, h=2, s=96):
    """With zero scores and V = I, out = Z / ((1 - rate) * S): the keep-mask [B, H, Sq, Sk]."""
    q = torch.zeros(b, s, h, s)
    v = torch.eye(s)[None, :, None, :].expand(b, s, h, s).contiguous()
    out = ft.attention(q, q, v, backend=backend, dropout_p=rate, generator=generator, layout="BSHD")
    return out.transpose(1, 2).numpy() != 0


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_kept_fraction_is_one_minus_p_within_binomial_error(backend, rate):
    mask = read_mask(backend, rate, torch.Generator().manual_seed(21), b=2, h=3)
    np.testing.assert_array_equal(mask, dropout_keep(words_of(21), rate, mask.shape))
    sigma = np.sqrt(rate * (1 - rate) / mask.size)
    assert abs(mask.mean() - (1 - rate)) < 5 * sigma


def test_mean_over_draws_is_the_no_dropout_output():
    rng = np.random.default_rng(9)
    q, k, v = (
        torch.tensor(rng.standard_normal(s), dtype=torch.float32)
        for s in ((1, 6, 2, 4), (1, 9, 2, 4), (1, 9, 2, 4))
    )
    plain = ft.attention(q, k, v, backend="torch", layout="BSHD").numpy()
    g, n = torch.Generator().manual_seed(0), 400
    outs = np.stack(
        [
            ft.attention(q, k, v, backend="torch", dropout_p=0.3, generator=g, layout="BSHD").numpy()
            for _ in range(n)
        ]
    )
    sem = outs.std(axis=0) / np.sqrt(n)
    assert np.all(np.abs(outs.mean(axis=0) - plain) < 5 * sem + 1e-6)


def test_seeded_generator_is_deterministic_and_the_default_generator_draws_fresh_masks():
    for backend in ("torch", "auto"):
        first = read_mask(backend, 0.5, torch.Generator().manual_seed(4))
        again = read_mask(backend, 0.5, torch.Generator().manual_seed(4))
        other = read_mask(backend, 0.5, torch.Generator().manual_seed(5))
        np.testing.assert_array_equal(first, again)
        assert (first != other).mean() > 0.3
        torch.manual_seed(8)
        a, b = read_mask(backend, 0.5, None), read_mask(backend, 0.5, None)
        assert (a != b).mean() > 0.3  # each call draws new words
        torch.manual_seed(8)
        np.testing.assert_array_equal(read_mask(backend, 0.5, None), a)  # torch.manual_seed reproduces


def test_no_dropout_draws_nothing_and_matches_the_plain_call():
    x, _, _ = make_inputs({})
    t = {n: torch.tensor(v, dtype=torch.float32) for n, v in x.items()}
    g = torch.Generator().manual_seed(1)
    state = g.get_state()
    out = ft.attention(**t, dropout_p=0.0, generator=g, backend="torch", layout="BSHD")
    assert torch.equal(g.get_state(), state)
    assert torch.equal(out, ft.attention(**t, backend="torch", layout="BSHD"))


# ------------------------------------------------------------------------------ routing


def test_auto_on_cuda_and_other_devices_runs_the_contract_mask_not_flash_or_sdpa(monkeypatch):
    x, _, _ = make_inputs({})
    t = {n: torch.tensor(v, dtype=torch.float32) for n, v in x.items()}
    want = ft.attention(
        **t, backend="torch", dropout_p=RATE, generator=torch.Generator().manual_seed(2), layout="BSHD"
    )
    fake = FakeFlashAttn()
    monkeypatch.setattr(_native, "import_flash_attn", lambda: fake)
    monkeypatch.setattr(_native, "TORCH_SDPA", lambda *a, **k: pytest.fail("SDPA ran a dropout call"))
    for kind in ("cuda", "mps"):
        monkeypatch.setattr(ft, "device_kind", lambda _t, kind=kind: kind)
        got = ft.attention(
            **{n: v.half() for n, v in t.items()} if kind == "cuda" else t,
            dropout_p=RATE,
            generator=torch.Generator().manual_seed(2),
            layout="BSHD",
        )
        atol = 5e-3 if kind == "cuda" else 0
        np.testing.assert_allclose(got.float().numpy(), want.numpy(), atol=atol)
    assert fake.calls == []


@pytest.mark.parametrize("bridge", ["fake_torch_xla", "fake_torchax"])
def test_bridges_pass_the_words_as_a_tensor_and_reuse_them_in_the_backward(bridge, request):
    log = request.getfixturevalue(bridge)
    x, _, options = make_inputs(CONFIGS["causal_gqa"])
    d_out = np.random.default_rng(1).standard_normal(x["query"].shape)
    out, _lse, grads = run_torch(x, {}, options, "auto", 9, d_out)
    want = run_torch(x, {}, options, "torch", 9, d_out)
    np.testing.assert_allclose(out, want[0], atol=2e-6)
    for n in grads:
        np.testing.assert_allclose(grads[n], want[2][n], atol=1e-5, err_msg=n)
    assert [name for name, _, _ in log] == ["jax_forward", "jax_backward"]
    for _, shapes, static in log:
        assert static["dropout_rate"] == RATE and "dropout_rng" not in static  # words are not static
        assert torch.Size([2]) in shapes
    # A new draw reuses the bridge's compilation: nothing static changes between calls.
    run_torch(x, {}, options, "auto", 10, d_out)
    assert log[2][2] == log[0][2]


# ------------------------------------------------------------------------------ bad arguments


@pytest.mark.parametrize(
    "value, error, words",
    [
        (1.0, ValueError, "dropout_p must be in [0, 1)"),
        (-0.1, ValueError, "pass 0.0 to disable dropout"),
        (float("nan"), ValueError, "dropout_p must be in [0, 1)"),
        ("0.1", TypeError, "dropout_p must be a Python float"),
        (True, TypeError, "dropout_p must be a Python float"),
        (None, TypeError, "dropout_p must be a Python float"),
    ],
)
def test_bad_dropout_p(value, error, words):
    t = torch.zeros(1, 4, 2, 8)
    for backend in ("auto", "torch"):
        with pytest.raises(error, match=words.replace("[", r"\[").replace(")", r"\)")):
            ft.attention(t, t, t, dropout_p=value, backend=backend, layout="BSHD")
    with pytest.raises(TypeError, match="not a tensor"):
        ft.attention(t, t, t, dropout_p=torch.tensor(0.1), layout="BSHD")


@pytest.mark.parametrize("value", [0, "cpu", np.random.default_rng(0)])
def test_bad_generator(value):
    t = torch.zeros(1, 4, 2, 8)
    with pytest.raises(TypeError, match=r"generator must be a torch.Generator .*manual_seed"):
        ft.attention(t, t, t, dropout_p=0.1, generator=value, layout="BSHD")


@pytest.mark.parametrize("backend", ["sdpa", "flash_attn"])
def test_sdpa_and_flash_attn_refuse_dropout_naming_the_reason_and_the_alternatives(backend):
    t = torch.zeros(1, 4, 2, 8)
    with pytest.raises(
        ValueError,
        match=rf"backend='{backend}' cannot run dropout_p=0.2: .* draws its own "
        r"dropout mask.*use backend='torch'.*'auto'.*'xla'",
    ):
        ft.attention(t, t, t, dropout_p=0.2, backend=backend, layout="BSHD")
    with pytest.raises(ValueError, match="query must have rank 4"):  # argument errors still come first
        ft.attention(t[0], t, t, dropout_p=0.2, backend=backend, layout="BSHD")


# ------------------------------------------------------------------------------ integrations


def varlen_case():
    cu_q, cu_k = np.array([0, 5, 12]), np.array([0, 7, 16])
    rng = np.random.default_rng(4)
    q, k, v = (
        rng.standard_normal((n, h, 8)) for n, h in ((14, 4), (18, 2), (18, 2))
    )  # 2 padding rows / keys
    # Per-sequence bottom-right causal, written out here (independent of varlen_layout).
    mask = np.zeros((14, 18), bool)
    for (q0, q1), (k0, k1) in zip(itertools.pairwise(cu_q), itertools.pairwise(cu_k), strict=True):
        for i in range(q0, q1):
            mask[i, k0 : k0 + (i - q0) + (k1 - k0) - (q1 - q0) + 1] = True
    return q, k, v, cu_q, cu_k, mask


def test_varlen_dropout_draws_batch_0_at_packed_positions_on_torch_and_jax():
    q, k, v, cu_q, cu_k, mask = varlen_case()
    words = words_of(6)
    want, _ = reference_attention(
        q[None], k[None], v[None], mask=mask[None, None], dropout_rate=RATE, dropout_seed=words
    )
    tq, tk, tv = (torch.tensor(x, dtype=torch.float32) for x in (q, k, v))
    for backend in ("torch", "auto"):
        got = flashport.varlen_attention(
            tq,
            tk,
            tv,
            cu_seqlens_q=torch.tensor(cu_q),
            cu_seqlens_k=torch.tensor(cu_k),
            causal=True,
            backend=backend,
            dropout_p=RATE,
            generator=torch.Generator().manual_seed(6),
        )
        assert isinstance(got, torch.Tensor)
        np.testing.assert_allclose(got.numpy(), want[0], atol=2e-5, err_msg=backend)
    got = flashport.varlen_attention(
        *(jnp.asarray(x, jnp.float32) for x in (q, k, v)),
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        causal=True,
        dropout_rate=RATE,
        dropout_rng=jnp.asarray(words, jnp.uint32),
    )
    assert isinstance(got, jax.Array)
    np.testing.assert_allclose(np.asarray(got), want[0], atol=2e-5)
    plain = flashport.varlen_attention(
        tq, tk, tv, cu_seqlens_q=torch.tensor(cu_q), cu_seqlens_k=torch.tensor(cu_k), causal=True
    )
    assert np.abs(plain.numpy() - want[0]).max() > 1e-2  # dropout did something


def test_jax_varlen_never_imports_the_torch_adapter():
    code = (
        "import sys, numpy as np, jax.numpy as jnp\n"
        "from flashport.kernels.contract.varlen import varlen_attention\n"
        "x = jnp.ones((4, 1, 8))\n"
        "varlen_attention(x, x, x, cu_seqlens_q=np.array([0, 4]), cu_seqlens_k=np.array([0, 4]), causal=True)\n"
        "import flashport\n"
        "flashport.varlen_attention(x, x, x, cu_seqlens_q=np.array([0, 4]), cu_seqlens_k=np.array([0, 4]))\n"
        "assert 'flashport.torch' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    from flashport.kernels.contract.varlen import varlen_attention

    t = torch.zeros(4, 1, 8)
    with pytest.raises(TypeError, match=r"flashport\.torch\.varlen_attention"):
        varlen_attention(t, t, t, cu_seqlens_q=torch.tensor([0, 4]), cu_seqlens_k=torch.tensor([0, 4]))


# A torch.Tensor subclass whose type lives in a ``torchax`` module, as torchax's tensors do.
TorchaxLike = type("Tensor", (torch.Tensor,), {"__module__": "torchax.tensor"})


def torchax_like(x):
    """``x`` as a :data:`TorchaxLike` tensor."""
    return x.as_subclass(TorchaxLike)


def test_torchax_tensors_are_accepted_by_varlen_and_xformers(fake_torchax):  # noqa: F811 (the fixture)
    q, k, v, cu_q, cu_k, _ = varlen_case()
    tq, tk, tv = (torch.tensor(x, dtype=torch.float32) for x in (q, k, v))
    want = flashport.varlen_attention(
        tq,
        tk,
        tv,
        cu_seqlens_q=torch.tensor(cu_q),
        cu_seqlens_k=torch.tensor(cu_k),
        causal=True,
        backend="torch",
    )
    ids = varlen_layout(
        torchax_like(torch.tensor(cu_q)), torchax_like(torch.tensor(cu_k)), 14, 18, causal=True
    )
    assert all(isinstance(a, torch.Tensor) for a in ids)
    got = flashport.varlen_attention(
        *(torchax_like(x) for x in (tq, tk, tv)),
        cu_seqlens_q=torchax_like(torch.tensor(cu_q)),
        cu_seqlens_k=torchax_like(torch.tensor(cu_k)),
        causal=True,
    )
    np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=2e-6)
    assert [name for name, _, _ in fake_torchax] == ["jax_forward"]  # ran the torchax bridge

    from flashport.integrations import xformers_compat as xf

    bias = torch.randn(1, 4, 14, 18)
    assert xf.contract_kwargs(torchax_like(bias), 14, 18, "cpu")["bias"] is not None
    want = xf.memory_efficient_attention(
        tq[None],
        tk[None].repeat_interleave(2, 2),
        tv[None].repeat_interleave(2, 2),
        attn_bias=bias,
        backend="torch",
    )
    got = xf.memory_efficient_attention(
        *(
            torchax_like(x)
            for x in (tq[None], tk[None].repeat_interleave(2, 2), tv[None].repeat_interleave(2, 2))
        ),
        attn_bias=torchax_like(bias),
    )
    np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=2e-6)


@pytest.mark.parametrize("rank", [4, 5])
def test_xformers_p_is_the_contract_dropout(rank):
    from flashport.integrations import xformers_compat as xf

    rng = np.random.default_rng(5)
    shape = (2, 10, 3, 8) if rank == 4 else (2, 10, 2, 3, 8)
    q, k, v = (torch.tensor(rng.standard_normal(shape), dtype=torch.float32) for _ in range(3))
    got = xf.memory_efficient_attention(
        q, k, v, p=RATE, generator=torch.Generator().manual_seed(7), attn_bias=xf.LowerTriangularMask()
    )
    flat = [x.reshape(2, 10, -1, 8).numpy() for x in (q, k, v)]  # 5-D: head g * H + h
    want, _ = reference_attention(
        *flat, causal=True, align="top_left", dropout_rate=RATE, dropout_seed=words_of(7)
    )
    np.testing.assert_allclose(got.numpy(), want.reshape(got.shape), atol=2e-5)
    with pytest.raises(
        ValueError, match=r"memory_efficient_attention: p is flashport's dropout_p: .*\[0, 1\)"
    ):
        xf.memory_efficient_attention(q, k, v, p=1.5)


def test_xformers_block_diagonal_dropout_uses_packed_positions():
    from flashport.integrations import xformers_compat as xf

    q, k, v, _, _, _ = varlen_case()
    q, k, v = (torch.tensor(x[:12], dtype=torch.float32)[None] for x in (q, k, v))
    k, v = (x.repeat_interleave(2, 2) for x in (k, v))
    bias = xf.BlockDiagonalCausalMask.from_seqlens([5, 7])
    got = xf.memory_efficient_attention(
        q, k, v, attn_bias=bias, p=RATE, generator=torch.Generator().manual_seed(2)
    )
    mask = bias.materialize((12, 12)).numpy() == 0
    want, _ = reference_attention(
        q.numpy(), k.numpy(), v.numpy(), mask=mask[None, None], dropout_rate=RATE, dropout_seed=words_of(2)
    )
    np.testing.assert_allclose(got.numpy(), want, atol=2e-5)


def test_transformers_dropout_applies_in_training_only():
    pytest.importorskip("transformers")
    from flashport.integrations.transformers import flashport_attention_forward

    rng = np.random.default_rng(6)
    q = torch.tensor(rng.standard_normal((1, 4, 6, 8)), dtype=torch.float32)
    k, v = (torch.tensor(rng.standard_normal((1, 2, 6, 8)), dtype=torch.float32) for _ in range(2))
    layer = torch.nn.Module()
    layer.is_causal = True
    torch.manual_seed(12)
    got, _ = flashport_attention_forward(layer.train(), q, k, v, None, dropout=RATE)
    torch.manual_seed(12)
    words = tuple(torch.randint(0, 2**32, (2,), dtype=torch.int64).tolist())
    want, _ = reference_attention(
        q.numpy(),
        k.numpy(),
        v.numpy(),
        causal=True,
        align="top_left",
        layout="BHSD",
        dropout_rate=RATE,
        dropout_seed=words,
    )
    np.testing.assert_allclose(got.numpy(), want.transpose(0, 2, 1, 3), atol=2e-5)
    plain, _ = reference_attention(
        q.numpy(), k.numpy(), v.numpy(), causal=True, align="top_left", layout="BHSD"
    )
    got, _ = flashport_attention_forward(layer.eval(), q, k, v, None, dropout=RATE)
    np.testing.assert_allclose(got.numpy(), plain.transpose(0, 2, 1, 3), atol=2e-5)
