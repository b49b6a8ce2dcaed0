"""flashport.torch's FlexAttention route (``flashport/torch/_flex.py``) and the CUDA auto routing
(``flashport/torch/_routing.py``), on this CPU host.

The flex path runs here through the CUDA route itself (``cuda_attention(..., device_type="cuda")``
on CPU tensors), with flex in eager mode (torch 2.13 compiles flex for CPU only for inference
without lse, which the slow test covers). Every feature the route claims is compared with the
float64 reference (tests/reference.py), outputs, lse and gradients (query, key, value, bias, and
through the lse). torch's public ``flex_attention`` refuses CPU inputs that require grad at its entry
(``_validate_device``) although its eager backward is defined; the gradient tests lift that one check
to run flex's own backward on CPU (on CUDA the same score_mod/mask_mod go through its Triton kernels).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from reference import reference_attention, reference_attention_vjp  # noqa: E402

from flashport.torch import _checks, _flex, _routing  # noqa: E402

pytestmark = pytest.mark.skipif(_flex.import_flex() is None, reason="torch without FlexAttention")

B, HQ, HKV, D = 2, 4, 2, 16
PACKED = [0] * 7 + [1] * 9 + [2] * 8  # three documents in 24 positions
PADDED = [0] * 18 + [-1] * 6  # one sequence, then key padding (id -1 on both sides)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    sq: int
    sk: int
    options: tuple = ()  # (key, value) pairs of contract keywords
    hkv: int = HKV
    bias: tuple | None = None  # bias shape
    mask: tuple | None = None  # mask shape
    segments: tuple | None = None  # (q ids row, kv ids row), the same for each batch row
    layout: str = "BSHD"
    gain: float = 1.0


CASES = [
    Case("causal_bottom_right_sq<sk", 24, 40, (("causal", True),)),
    Case("causal_bottom_right_sq>sk_empty_rows", 40, 24, (("causal", True),), hkv=1),
    Case("causal_top_left_sq<sk", 24, 40, (("causal", True), ("align", "top_left"))),
    Case("window_both_sides", 40, 40, (("window", (5, 3)),)),
    Case(
        "causal_window_top_left_bhsd",
        40,
        24,
        (("causal", True), ("window", (6, None)), ("align", "top_left")),
        layout="BHSD",
    ),
    Case("softcap_scale_causal", 24, 24, (("softcap", 2.0), ("scale", 0.8), ("causal", True)), gain=3.0),
    Case("softcap_bias", 24, 40, (("softcap", 3.0),), bias=(B, HQ, 24, 40), gain=3.0),
    Case("key_padding_bias_causal", 24, 24, (("causal", True),), bias=(B, 1, 1, 24)),
    Case("mask_per_head", 24, 40, (), mask=(1, HQ, 24, 40)),
    Case("mask_per_batch_causal", 24, 24, (("causal", True),), mask=(B, 1, 24, 24)),
    Case("packed_documents_causal", 24, 24, (("causal", True),), segments=(PACKED, PACKED)),
    Case("key_padding_segments_mqa", 24, 24, (), hkv=1, segments=(PADDED, PADDED)),
]
IDS = [c.name for c in CASES]


def inputs(case: Case, dtype=torch.float32, seed: int = 0) -> dict:
    """Random inputs in the case's layout (torch), masks with one all-False query row."""
    rng = np.random.default_rng(seed)

    def tensor(seq, heads, scale=1.0):
        x = rng.standard_normal((B, seq, heads, D)).astype(np.float32) * scale
        x = x.transpose(0, 2, 1, 3) if case.layout == "BHSD" else x
        return torch.from_numpy(np.ascontiguousarray(x)).to(dtype)

    x = dict(
        query=tensor(case.sq, HQ, case.gain), key=tensor(case.sk, case.hkv), value=tensor(case.sk, case.hkv)
    )
    if case.bias is not None:
        x["bias"] = torch.from_numpy(rng.standard_normal(case.bias).astype(np.float32))
    if case.mask is not None:
        mask = rng.random(case.mask) < 0.6
        mask[..., 1, :] = False  # a query row that sees no key
        x["mask"] = torch.from_numpy(mask)
    if case.segments is not None:
        q_ids, kv_ids = (torch.tensor([ids] * B) for ids in case.segments)
        x["q_segment_ids"], x["kv_segment_ids"] = q_ids, kv_ids
    return x


def contract(case: Case, x: dict) -> dict:
    return dict(
        case.options, layout=case.layout, **{n: t for n, t in x.items() if n not in ("query", "key", "value")}
    )


def numpy_kw(case: Case, x: dict) -> dict:
    return {
        n: (
            t.detach().double().numpy()
            if isinstance(t, torch.Tensor) and t.is_floating_point()
            else t.numpy()
            if isinstance(t, torch.Tensor)
            else t
        )
        for n, t in contract(case, x).items()
    }


def run_flex(case: Case, x: dict, return_lse: bool):
    """The CUDA auto route for ``x`` (decided for "cuda", no flash-attn), which must be FlexAttention."""
    call = _checks.check(x["query"], x["key"], x["value"], **contract(case, x), return_lse=return_lse)
    route = _routing.choose_route(call, return_lse, device_type="cuda", flash=False)
    assert route.path == "flex", route
    return _routing.cuda_attention(call, return_lse, flash=None, device_type="cuda")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_flex_forward_and_lse_match_reference(case):
    x = inputs(case)
    out, lse = run_flex(case, x, return_lse=True)
    want_out, want_lse = reference_attention(
        *(x[n].double().numpy() for n in ("query", "key", "value")), **numpy_kw(case, x)
    )
    np.testing.assert_allclose(out.numpy(), want_out, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(np.isneginf(lse.numpy()), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse.numpy()[finite], want_lse[finite], atol=2e-5, rtol=2e-5)
    assert lse.dtype == torch.float32 and lse.shape == (B, HQ, case.sq)


@pytest.fixture
def cpu_backward(monkeypatch):
    """Lift flex's entry-point refusal of CPU inputs that require grad (its eager backward exists)."""
    module = _flex.import_flex()
    assert hasattr(module, "_validate_device"), "torch moved flex's device check; update this fixture"
    monkeypatch.setattr(module, "_validate_device", lambda *args: None)
    # flex's eager autograd path is itself a dynamo trace (backend="eager"); after a few shapes
    # dynamo marks them dynamic and that trace fails on a softcap (an unbacked-symbol error in
    # torch 2.13), so each test starts from static shapes.
    torch._dynamo.reset()


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_flex_gradients_match_reference(case, cpu_backward):
    x = inputs(case, seed=1)
    names = [n for n in ("query", "key", "value", "bias") if n in x]
    for n in names:
        x[n].requires_grad_(True)
    out, lse = run_flex(case, x, return_lse=True)
    rng = np.random.default_rng(2)
    g = rng.standard_normal(tuple(out.shape))
    g_lse = rng.standard_normal(tuple(lse.shape))
    (
        torch.sum(out * torch.from_numpy(g).float())
        + torch.sum(torch.where(torch.isfinite(lse), lse, 0.0) * torch.from_numpy(g_lse).float())
    ).backward()
    dq, dk, dv, dbias_full = reference_attention_vjp(
        *(x[n].detach().double().numpy() for n in ("query", "key", "value")),
        g,
        d_lse=g_lse,
        **numpy_kw(case, x),
    )
    want = dict(query=dq, key=dk, value=dv)
    if "bias" in x:  # sum the full gradient over the bias's broadcast dims
        axes = tuple(i for i, n in enumerate(case.bias) if n == 1)
        want["bias"] = dbias_full.sum(axis=axes, keepdims=True)
    for n in names:
        got = x[n].grad
        assert got is not None and torch.isfinite(got).all(), n
        np.testing.assert_allclose(got.numpy(), want[n], atol=2e-4, rtol=2e-4, err_msg=n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flex_low_precision(dtype):
    case = CASES[6]  # softcap + full bias
    x = inputs(case, dtype=dtype)
    out, _ = run_flex(case, x, return_lse=False)
    assert out.dtype == dtype
    want, _ = reference_attention(
        *(x[n].double().numpy() for n in ("query", "key", "value")), **numpy_kw(case, x)
    )
    np.testing.assert_allclose(out.float().numpy(), want, atol=3e-2, rtol=3e-2)


def test_explicit_flex_backend():
    """``backend="flex"`` through the public API: runs (eagerly on CPU, no grad) or says why not."""
    import flashport.torch as ft

    case = CASES[10]  # packed documents, causal
    x = inputs(case)
    kw = contract(case, x)
    q, k, v = x["query"], x["key"], x["value"]
    out, lse = ft.attention(q, k, v, **kw, softcap=2.0, backend="flex", return_lse=True)
    want_out, want_lse = reference_attention(
        *(t.double().numpy() for t in (q, k, v)), **numpy_kw(case, x), softcap=2.0
    )
    np.testing.assert_allclose(out.numpy(), want_out, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse.numpy(), want_lse, atol=2e-5, rtol=2e-5)
    with pytest.raises(
        ValueError, match=r"backend='flex' cannot run dropout_p=0.1: FlexAttention has no dropout"
    ):
        ft.attention(q, k, v, **kw, backend="flex", dropout_p=0.1)
    with pytest.raises(ValueError, match=r"gradients on cpu \(query require grad.*torch.no_grad\(\)"):
        ft.attention(q.clone().requires_grad_(True), k, v, **kw, backend="flex")
    with pytest.raises(ValueError, match=r"head_dim 8 < 16"):
        ft.attention(q[..., :8], k[..., :8], v[..., :8], **kw, backend="flex")


def test_ragged_lengths_through_the_flex_route():
    """``varlen_attention`` (cu_seqlens, per-sequence bottom-right causal) on the CUDA route's flex
    path equals the reference run sequence by sequence."""
    from flashport.torch import varlen_attention

    cu_q, cu_k = [0, 5, 17, 24], [0, 9, 20, 40]
    rng = np.random.default_rng(3)
    q = torch.from_numpy(rng.standard_normal((24, HQ, D)).astype(np.float32))
    k, v = (torch.from_numpy(rng.standard_normal((40, HKV, D)).astype(np.float32)) for _ in range(2))
    routes = []

    def on_cuda_route(query, key, value, *, backend, **kw):
        call = _checks.check(query, key, value, **kw)
        routes.append(_routing.choose_route(call, False, device_type="cuda", flash=False).path)
        return _routing.cuda_attention(call, False, flash=None, device_type="cuda")[0]

    out = varlen_attention(
        q,
        k,
        v,
        cu_seqlens_q=torch.tensor(cu_q),
        cu_seqlens_k=torch.tensor(cu_k),
        causal=True,
        softcap=4.0,
        attention=on_cuda_route,
    )
    assert routes == ["flex"]
    for (q0, q1), (k0, k1) in zip(itertools.pairwise(cu_q), itertools.pairwise(cu_k), strict=True):
        want, _ = reference_attention(
            q[None, q0:q1].double().numpy(),
            k[None, k0:k1].double().numpy(),
            v[None, k0:k1].double().numpy(),
            causal=True,
            softcap=4.0,
        )
        np.testing.assert_allclose(out[q0:q1].numpy(), want[0], atol=2e-5, rtol=2e-5)


# ------------------------------------------------------------------------------------ routing


def _call(sq=16, sk=16, hkv=HKV, dtype=torch.bfloat16, d=D, return_lse=False, dropout_p=0.0, **kw):
    q = torch.zeros(B, sq, HQ, d, dtype=dtype)
    k = torch.zeros(B, sk, hkv, d, dtype=dtype)
    seed = (1, 2) if dropout_p else None
    return _checks.check(q, k, k, return_lse=return_lse, dropout_p=dropout_p, seed=seed, **kw)


IDS_16 = torch.tensor([[0] * 8 + [1] * 8] * B)
ROUTES = [  # (name, call keywords, device, flash-attn installed, path, fragment of the reason)
    ("cuda_softcap_no_flash", dict(causal=True, softcap=30.0), "cuda", False, "flex", "softcap"),
    ("cuda_window_no_flash", dict(causal=True, window=(4, 0)), "cuda", False, "flex", "a window"),
    (
        "cuda_segments_no_flash",
        dict(q_segment_ids=IDS_16, kv_segment_ids=IDS_16),
        "cuda",
        False,
        "flex",
        "segment ids",
    ),
    ("cuda_bottom_right_no_flash", dict(sq=8, causal=True), "cuda", False, "flex", "bottom-right"),
    (
        "cuda_mask_no_flash",
        dict(mask=torch.ones(16, 16, dtype=torch.bool)),
        "cuda",
        False,
        "flex",
        "boolean mask",
    ),
    (
        "cuda_bias_causal_no_flash",
        dict(causal=True, bias=torch.zeros(B, 1, 1, 16)),
        "cuda",
        False,
        "flex",
        "causal with a bias",
    ),
    ("cuda_lse_no_flash", dict(causal=True, return_lse=True), "cuda", False, "flex", "return_lse"),
    (
        "cuda_mask_with_flash",
        dict(mask=torch.ones(16, 16, dtype=torch.bool)),
        "cuda",
        True,
        "flex",
        "flash-attn: mask",
    ),
    (
        "cuda_float32_softcap_with_flash",
        dict(dtype=torch.float32, softcap=5.0),
        "cuda",
        True,
        "flex",
        "dtype",
    ),
    ("cuda_softcap_with_flash", dict(causal=True, softcap=30.0), "cuda", True, "flash_attn", "fits"),
    ("cuda_causal_no_flash", dict(causal=True), "cuda", False, "sdpa", "fused kernels"),
    (
        "cuda_bias_no_flash",
        dict(bias=torch.zeros(B, 1, 1, 16, dtype=torch.bfloat16)),
        "cuda",
        False,
        "sdpa",
        "fused kernels",
    ),
    (
        "cuda_float32_bias_no_flash",
        dict(bias=torch.zeros(B, 1, 1, 16)),
        "cuda",
        False,
        "flex",
        "round the bias",
    ),
    ("cuda_dropout", dict(causal=True, softcap=30.0, dropout_p=0.1), "cuda", False, "math", "dropout"),
    ("cuda_no_keys", dict(sk=0, softcap=30.0), "cuda", False, "math", "no keys"),
    ("cuda_small_head_softcap", dict(d=8, softcap=30.0), "cuda", False, "math", "head_dim 8 < 16"),
    ("cuda_small_head_window", dict(d=8, window=(2, 2)), "cuda", False, "sdpa", "explicit mask"),
    (
        "cuda_softcap_no_triton",
        dict(softcap=30.0, triton=False),
        "cuda",
        False,
        "math",
        "Triton is not installed",
    ),
    ("cuda_window_no_triton", dict(window=(2, 2), triton=False), "cuda", False, "sdpa", "explicit mask"),
    ("other_device_softcap", dict(softcap=30.0), "mps", False, "math", "not used on mps"),
    ("other_device_window", dict(window=(2, 2)), "xpu", False, "sdpa", "explicit mask"),
]


@pytest.mark.parametrize("name,kw,device,flash,path,fragment", ROUTES, ids=[r[0] for r in ROUTES])
def test_choose_route(name, kw, device, flash, path, fragment):
    kw = dict(kw)
    return_lse, triton = kw.get("return_lse", False), kw.pop("triton", True)
    route = _routing.choose_route(_call(**kw), return_lse, device_type=device, flash=flash, triton=triton)
    assert route.path == path, route
    assert fragment in route.reason, route


def test_math_path_logs_why(caplog, monkeypatch):
    """Neither flex nor SDPA can run dropout: the math path runs, and a DEBUG line says why."""
    call = _call(dtype=torch.float32, causal=True, dropout_p=0.1)
    with caplog.at_level(logging.DEBUG, logger="flashport"):
        _routing.cuda_attention(call, False, flash=None, device_type="cuda")
    assert "exact math path runs this call (dropout" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="flashport"):
        _routing.cuda_attention(
            _call(dtype=torch.float32, d=8, softcap=3.0), False, flash=None, device_type="cuda"
        )
    assert "exact math path runs this call" in caplog.text and "head_dim 8 < 16" in caplog.text
    assert "SDPA: softcap" in caplog.text


def test_flex_route_logs_and_matches_math(caplog):
    """The DEBUG line names FlexAttention and what the paths before it lacked."""
    call = _call(dtype=torch.float32, causal=True, softcap=30.0)
    call = dataclasses.replace(
        call, q=torch.randn(call.q.shape), k=torch.randn(call.k.shape), v=torch.randn(call.v.shape)
    )
    with caplog.at_level(logging.DEBUG, logger="flashport"):
        _routing.cuda_attention(call, False, flash=None, device_type="cuda")
    assert "FlexAttention runs this call (flash-attn: not installed; SDPA: softcap" in caplog.text


# ------------------------------------------------------------------------------------ caches


def test_compiled_runner_cached_per_signature(monkeypatch):
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append((fn, kw)) or fn)
    monkeypatch.setattr(_flex, "_COMPILED", type(_flex._COMPILED)())
    a, b = _call(causal=True, softcap=30.0), _call(causal=True, softcap=30.0)
    first = _flex.compiled_runner(_flex.signature(a, False))
    assert _flex.compiled_runner(_flex.signature(b, False)) is first and len(compiled) == 1
    assert compiled[0][1] == dict(fullgraph=True, dynamic=False)
    other = [_call(causal=True, softcap=20.0), _call(sq=8, causal=True, softcap=30.0)]
    runners = [_flex.compiled_runner(_flex.signature(c, False)) for c in other]
    runners.append(_flex.compiled_runner(_flex.signature(a, True)))  # return_lse is part of it
    assert len(compiled) == 4 and len({id(r) for r in [first, *runners]}) == 4
    codes = {id(fn.__code__) for fn, _ in compiled}  # code objects compare by content: use identity
    assert len(codes) == 4  # each signature has its own code object (dynamo's cache lives there)
    monkeypatch.setattr(_flex, "MAX_COMPILED", 2)
    _flex.compiled_runner(_flex.signature(_call(causal=True), False))
    assert len(_flex._COMPILED) == 2


def test_band_block_mask_cached():
    _flex._band_block_mask.cache_clear()
    x = inputs(CASES[0])
    for _ in range(2):
        run_flex(CASES[0], x, return_lse=False)
    info = _flex._band_block_mask.cache_info()
    assert (info.misses, info.hits) == (1, 1)


def test_segment_block_mask_reused_while_ids_unchanged(monkeypatch):
    module = _flex.import_flex()
    built = []
    real = module.create_block_mask
    monkeypatch.setattr(module, "create_block_mask", lambda *a, **kw: built.append(a) or real(*a, **kw))
    monkeypatch.setattr(_flex, "_SEGMENT_MASKS", type(_flex._SEGMENT_MASKS)(maxlen=8))
    case = CASES[10]  # packed documents
    x = inputs(case)
    want = run_flex(case, x, return_lse=False)[0]
    run_flex(case, x, return_lse=False)
    assert len(built) == 1
    x["q_segment_ids"], x["kv_segment_ids"] = x["q_segment_ids"].clone(), x["kv_segment_ids"].clone()
    run_flex(case, x, return_lse=False)  # equal ids in other tensors: built again ...
    run_flex(case, x, return_lse=False)  # ... and reused
    assert len(built) == 2
    for name in ("q_segment_ids", "kv_segment_ids"):  # the same tensors written in place: rebuilt
        x[name][:, :7] = 1  # documents 0 and 1 merge
    merged = run_flex(case, x, return_lse=False)[0]
    assert len(built) == 3 and not torch.allclose(merged, want)
    ref, _ = reference_attention(
        *(x[n].double().numpy() for n in ("query", "key", "value")), **numpy_kw(case, x)
    )
    np.testing.assert_allclose(merged.numpy(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.slow
def test_compiled_flex_on_cpu_inference():
    """The compiled runner (fullgraph, inductor's CPU backend: inference without lse) traces our
    score_mod/mask_mod closures and matches the reference (~40-60 s of compilation)."""
    case = dataclasses.replace(
        CASES[6],
        options=(("softcap", 3.0), ("causal", True), ("window", (5, None))),
        segments=(PACKED, PACKED),
        sq=24,
        sk=24,
        bias=(B, 1, 1, 24),
    )
    x = inputs(case)
    call = _checks.check(x["query"], x["key"], x["value"], **contract(case, x))
    with torch.no_grad():
        out, lse = _flex.flex_attention(call, False, compiled=True)
    want, _ = reference_attention(
        *(x[n].double().numpy() for n in ("query", "key", "value")), **numpy_kw(case, x)
    )
    assert lse is None
    np.testing.assert_allclose(out.numpy(), want, atol=2e-5, rtol=2e-5)
