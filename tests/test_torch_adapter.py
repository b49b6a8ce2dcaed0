"""flashport.torch.attention against the float64 reference of the contract, on every path this
machine can run: the JAX implementation through DLPack, the pure-torch math path, the CUDA path's
SDPA logic (run on CPU), flash-attn's argument mapping (a fake module with flash-attn 2 semantics),
and the torch_xla / torchax bridges (fake modules: neither installs next to torch 2.13 here).

Gradients are compared with central finite differences of the float64 reference (L = sum(g * out)),
so they are checked against the contract, not against another implementation.

Tolerances: float32 outputs and lse 2e-5, float32 gradients 2e-4; bfloat16 outputs 3e-2 (inputs are
rounded to bfloat16 before the reference sees them, so only output rounding and bf16 matmuls differ).
"""

from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from reference import reference_attention  # noqa: E402

import flashport.torch as ft  # noqa: E402
from flashport.torch import _checks, _jax, _native, _routing  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    layout: str
    sq: int
    sk: int
    hq: int
    hkv: int
    options: tuple = ()  # (key, value) pairs for scale/causal/window/align/softcap
    bias: tuple | None = None  # bias shape
    mask: tuple | None = None  # mask shape (random, with one all-False row where it has Sq)
    segments: bool = False
    gain: float = 1.0  # multiplies query (larger scores make softcap matter)
    batch: int = 2
    dim: int = 8


CASES = [
    Case("plain", "BSHD", 5, 5, 2, 2),
    Case("gqa_causal_bottom_right_sq<sk", "BHSD", 3, 7, 4, 2, (("causal", True),)),
    Case("mqa_causal_bottom_right_sq>sk_empty_rows", "BSHD", 7, 4, 2, 1, (("causal", True),)),
    Case("gqa_causal_top_left_sq<sk", "BSHD", 3, 7, 4, 2, (("causal", True), ("align", "top_left"))),
    Case("causal_top_left_sq>sk", "BHSD", 7, 4, 2, 2, (("causal", True), ("align", "top_left"))),
    Case("mqa_window_bottom_right", "BSHD", 4, 9, 4, 1, (("window", (2, 1)),)),
    Case("window_left_only_top_left", "BHSD", 6, 5, 2, 2, (("window", (1, None)), ("align", "top_left"))),
    Case("softcap_scale", "BSHD", 5, 6, 4, 2, (("softcap", 2.0), ("scale", 0.9)), gain=3.0),
    Case("bias_causal", "BSHD", 4, 6, 4, 2, (("causal", True),), bias=(2, 4, 4, 6)),
    Case("bias_broadcast_mask_2d", "BHSD", 5, 5, 4, 2, bias=(1, 4, 1, 5), mask=(5, 5)),
    Case("mask_per_batch", "BSHD", 4, 6, 2, 2, mask=(2, 1, 4, 6)),
    Case(
        "gqa_scale_bias_causal_square",
        "BHSD",
        6,
        6,
        4,
        2,
        (("causal", True), ("scale", 0.7)),
        bias=(2, 4, 6, 6),
    ),
    Case("segments_empty_rows", "BSHD", 6, 7, 4, 2, segments=True),
    Case(
        "everything",
        "BHSD",
        6,
        8,
        4,
        2,
        (("causal", True), ("window", (3, None)), ("align", "top_left"), ("softcap", 3.0)),
        bias=(2, 1, 6, 8),
        mask=(2, 4, 6, 8),
        segments=True,
        gain=2.0,
    ),
]
IDS = [c.name for c in CASES]
GRAD_NAMES = ("query", "key", "value", "bias")


@functools.cache
def numpy_inputs(case: Case, dtype: str = "float32"):
    """Deterministic inputs (numpy); for bfloat16 they are rounded to bf16 values first."""
    rng = np.random.default_rng(abs(hash(case.name)) % 2**32)
    b, d = case.batch, case.dim
    q_shape = (b, case.sq, case.hq, d) if case.layout == "BSHD" else (b, case.hq, case.sq, d)
    kv_shape = (b, case.sk, case.hkv, d) if case.layout == "BSHD" else (b, case.hkv, case.sk, d)
    x = {
        "query": rng.standard_normal(q_shape) * case.gain,
        "key": rng.standard_normal(kv_shape),
        "value": rng.standard_normal(kv_shape),
    }
    if case.bias:
        x["bias"] = rng.standard_normal(case.bias)
    if case.mask:
        mask = rng.random(case.mask) < 0.7
        mask[..., 1, :] = False  # one query row sees nothing
        x["mask"] = mask
    if case.segments:
        x["q_segment_ids"] = np.stack([np.sort(rng.integers(0, 3, case.sq)) for _ in range(b)])
        x["kv_segment_ids"] = np.stack([np.sort(rng.integers(0, 3, case.sk)) for _ in range(b)])
        x["q_segment_ids"][:, 0] = 7  # an id no key has: an empty row
    for name in ("query", "key", "value", "bias"):
        if name in x:
            x[name] = x[name].astype(np.float32)
            if dtype == "bfloat16":
                x[name] = torch.from_numpy(x[name]).bfloat16().float().numpy()
    return x


def torch_inputs(case: Case, dtype=torch.float32, grad=True):
    x = {}
    for name, value in numpy_inputs(case, "bfloat16" if dtype == torch.bfloat16 else "float32").items():
        t = torch.from_numpy(value.copy())
        if name in GRAD_NAMES:
            t = t.to(dtype if name != "bias" else torch.float32).requires_grad_(grad)
        x[name] = t
    return x


def reference(case: Case, x, **overrides):
    kw = dict(case.options, layout=case.layout, **overrides)
    inputs = {n: np.asarray(v, np.float64) if n in GRAD_NAMES else v for n, v in x.items()}
    return reference_attention(inputs.pop("query"), inputs.pop("key"), inputs.pop("value"), **inputs, **kw)


@functools.cache
def reference_grads(case: Case):
    """Float64 gradients of L = sum(g * out) by central differences, and the cotangent g."""
    x = {n: np.asarray(v, np.float64) if n in GRAD_NAMES else v for n, v in numpy_inputs(case).items()}
    out, _ = reference(case, x)
    g = np.random.default_rng(1).standard_normal(out.shape)
    eps = 1e-6
    grads = {}
    for name in GRAD_NAMES:
        if name not in x:
            continue
        grad = np.zeros_like(x[name])
        flat = x[name].reshape(-1)  # a view: perturbing it perturbs x[name]
        for idx in range(flat.size):
            keep = flat[idx]
            flat[idx] = keep + eps
            plus = np.sum(g * reference(case, x)[0])
            flat[idx] = keep - eps
            minus = np.sum(g * reference(case, x)[0])
            flat[idx] = keep
            grad.reshape(-1)[idx] = (plus - minus) / (2 * eps)
        grads[name] = grad
    return g, grads


def run(path, x, case, return_lse, flash=None):
    """Run one path of the adapter."""
    kw = dict(case.options, layout=case.layout, return_lse=return_lse, **x)
    if path == "jax":
        return ft.attention(**kw)
    if path == "torch":
        return ft.attention(**kw, backend="torch")
    assert path == "cuda"
    kw.pop("return_lse")
    out, lse = _routing.cuda_attention(_checks.check(**kw, return_lse=return_lse), return_lse, flash=flash)
    return (out, lse) if return_lse else out


def check_grads(case, x, out, atol):
    g, want = reference_grads(case)
    out.backward(torch.from_numpy(g).to(out.dtype))
    for name, grad in want.items():
        got = x[name].grad
        assert got is not None, name
        assert torch.isfinite(got).all(), name
        np.testing.assert_allclose(got.float().numpy(), grad, atol=atol, rtol=atol, err_msg=name)


def check_empty_rows(case, x, out):
    """Rows that see no key: output exactly 0 (and query gradient exactly 0 once backward ran)."""
    _, lse = reference(case, numpy_inputs(case))
    empty = np.isneginf(lse)  # [B, Hq, Sq]
    if not empty.any():
        return
    out_bhsd = out.detach().transpose(1, 2) if case.layout == "BSHD" else out.detach()
    assert (out_bhsd[torch.from_numpy(empty)] == 0).all()


@pytest.mark.parametrize("path", ["jax", "torch", "cuda"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_float32_forward_lse_and_grads(path, case, monkeypatch):
    sdpa_calls = []
    real_sdpa = _native.TORCH_SDPA  # flashport's own calls of torch SDPA (never a patch of F's)
    monkeypatch.setattr(_native, "TORCH_SDPA", lambda *a, **k: sdpa_calls.append(k) or real_sdpa(*a, **k))
    x = torch_inputs(case)
    want_out, want_lse = reference(case, numpy_inputs(case))
    # The CUDA path's SDPA branch has no lse; its lse (math branch) is checked without gradients.
    out, lse = (
        run(path, {n: v.detach() for n, v in x.items()}, case, True)
        if path == "cuda"
        else run(path, x, case, True)
    )
    np.testing.assert_allclose(lse.detach().numpy(), want_lse, atol=2e-5, rtol=2e-5)
    assert lse.dtype == torch.float32 and lse.requires_grad == (path != "cuda")  # see test_torch_lse_grad
    sdpa_calls.clear()
    if path == "cuda":
        out = run(path, x, case, False)
        assert len(sdpa_calls) == (0 if "softcap" in dict(case.options) else 1)
        for kwargs in sdpa_calls:  # no all-masked row reaches SDPA (fused CUDA kernels may NaN on one)
            mask = kwargs.get("attn_mask")
            if mask is not None:
                assert (mask if mask.dtype == torch.bool else mask > float("-inf")).any(dim=-1).all()
    assert out.dtype == torch.float32 and out.shape == x["query"].shape
    np.testing.assert_allclose(out.detach().numpy(), want_out, atol=2e-5, rtol=2e-5)
    check_empty_rows(case, x, out)
    check_grads(case, x, out, atol=2e-4)


@pytest.mark.parametrize("path", ["jax", "torch", "cuda"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_bfloat16_forward(path, case):
    x = torch_inputs(case, torch.bfloat16, grad=False)
    want_out, _ = reference(case, numpy_inputs(case, "bfloat16"))
    out = run(path, x, case, False)
    assert out.dtype == torch.bfloat16
    np.testing.assert_allclose(out.float().numpy(), want_out, atol=3e-2, rtol=3e-2)
    check_empty_rows(case, x, out)


@pytest.mark.parametrize("path", ["jax", "torch", "cuda"])
@pytest.mark.parametrize("case", [CASES[2], CASES[9]], ids=[CASES[2].name, CASES[9].name])
def test_bfloat16_grads(path, case):
    x = torch_inputs(case, torch.bfloat16)
    check_grads(case, x, run(path, x, case, False), atol=1e-1)


def test_jax_path_blockwise_backend_grads():
    """An explicit JAX backend (the blockwise custom_vjp, several blocks) through the adapter."""
    from flashport.kernels.contract.registry import use

    case = CASES[1]
    x = torch_inputs(case)
    out = ft.attention(
        **x, **dict(case.options), layout=case.layout, backend=use("blockwise", block_q=2, block_k=3)
    )
    np.testing.assert_allclose(out.detach().numpy(), reference(case, numpy_inputs(case))[0], atol=2e-5)
    check_grads(case, x, out, atol=2e-4)


# ------------------------------------------------------------------------------ CPU dispatch


# The calls torch SDPA expresses exactly (float32: bias of the query's dtype); auto on CPU sends
# them to SDPA, everything else (windows, segments, softcap, bottom-right causal with Sq != Sk) to JAX.
SDPA_CPU_CASES = {
    "plain",
    "gqa_causal_top_left_sq<sk",
    "causal_top_left_sq>sk",
    "bias_broadcast_mask_2d",
    "mask_per_batch",
    "gqa_scale_bias_causal_square",
}


def spy_paths(monkeypatch):
    """Record which implementation ``auto`` ran: ``"sdpa"`` (torch SDPA) or ``"jax"`` (DLPack)."""
    paths = []
    real_sdpa = _native.TORCH_SDPA
    real_forward = _jax.DLPackRunner.forward
    monkeypatch.setattr(_native, "TORCH_SDPA", lambda *a, **k: paths.append("sdpa") or real_sdpa(*a, **k))
    monkeypatch.setattr(
        _jax.DLPackRunner, "forward", lambda self, *a: paths.append("jax") or real_forward(self, *a)
    )
    return paths


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_cpu_auto_routes_exact_calls_to_sdpa(case, monkeypatch):
    """auto on CPU: SDPA runs exactly the calls it expresses, and both routes meet the float64
    reference (output, rows without keys, gradients of query, key, value and bias)."""
    paths = spy_paths(monkeypatch)
    x = torch_inputs(case)
    out = ft.attention(**x, **dict(case.options), layout=case.layout)
    assert paths == ["sdpa" if case.name in SDPA_CPU_CASES else "jax"]
    assert out.dtype == torch.float32 and out.shape == x["query"].shape
    np.testing.assert_allclose(
        out.detach().numpy(), reference(case, numpy_inputs(case))[0], atol=2e-5, rtol=2e-5
    )
    check_empty_rows(case, x, out)
    check_grads(case, x, out, atol=2e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("case", [c for c in CASES if c.name in SDPA_CPU_CASES], ids=lambda c: c.name)
def test_cpu_auto_sdpa_half_precision(case, dtype, monkeypatch):
    """Half-precision calls routed to SDPA (a bias of another dtype is not: SDPA would round it)."""
    paths = spy_paths(monkeypatch)
    x = {
        n: v.to(dtype) if n in ("query", "key", "value") else v
        for n, v in torch_inputs(case, grad=False).items()
    }
    out = ft.attention(**x, **dict(case.options), layout=case.layout)
    assert paths == ["jax" if case.bias else "sdpa"]
    rounded = {n: v.float().numpy() if v.is_floating_point() else v.numpy() for n, v in x.items()}
    assert out.dtype == dtype
    np.testing.assert_allclose(out.float().numpy(), reference(case, rounded)[0], atol=3e-2, rtol=3e-2)
    check_empty_rows(case, x, out)


def test_cpu_auto_keeps_lse_and_dropout_calls_on_jax(monkeypatch):
    """return_lse and dropout_p > 0 (the contract's keep-mask) are not SDPA's to give."""
    paths = spy_paths(monkeypatch)
    x = torch_inputs(CASES[0], grad=False)
    out, lse = ft.attention(**x, return_lse=True, layout="BSHD")
    want_out, want_lse = reference(CASES[0], numpy_inputs(CASES[0]))
    np.testing.assert_allclose(out.numpy(), want_out, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse.numpy(), want_lse, atol=2e-5, rtol=2e-5)
    ft.attention(**x, dropout_p=0.5, generator=torch.Generator().manual_seed(0), layout="BSHD")
    assert paths == ["jax", "jax"]


def test_cpu_auto_goes_through_jax_zero_copy(monkeypatch):
    """torch -> jax and jax -> torch share memory: data pointers match both ways, forward and grads
    (a softcap call: SDPA cannot run it, so auto takes the JAX path)."""
    seen = []
    real_to_jax, real_to_torch = _jax.to_jax, _jax.to_torch

    def spy_to_jax(t):
        a = real_to_jax(t)
        if a is not None:
            seen.append(("to_jax", t.data_ptr(), a.unsafe_buffer_pointer()))
        return a

    def spy_to_torch(a):
        t = real_to_torch(a)
        if t is not None:
            seen.append(("to_torch", a.unsafe_buffer_pointer(), t.data_ptr()))
        return t

    monkeypatch.setattr(_jax, "to_jax", spy_to_jax)
    monkeypatch.setattr(_jax, "to_torch", spy_to_torch)
    # Fresh torch allocations: XLA shares only suitably aligned buffers, which numpy's may not be.
    x = {n: torch.randn(2, 5, 2, 8, requires_grad=True) for n in ("query", "key", "value")}
    out = ft.attention(**x, softcap=30.0, layout="BSHD")
    out.backward(torch.ones_like(out))  # a contiguous cotangent (sum()'s is an expanded view)
    directions = [s[0] for s in seen]
    assert directions.count("to_jax") == 5  # q, k, v forward; d_out, d_lse backward
    assert directions.count("to_torch") == 5  # out, lse; dq, dk, dv
    for _, src, dst in seen:
        assert src == dst
    assert seen[0][1] == x["query"].data_ptr() and seen[3][2] == out.data_ptr()


def test_cpu_falls_back_to_torch_math_without_jax(monkeypatch):
    """Without jax, auto on CPU runs SDPA where it is exact and the math path for the rest."""
    calls = []
    monkeypatch.setattr(ft, "jax_available", lambda: False)
    monkeypatch.setattr(_native, "math_attention", lambda call: calls.append(call) or ("out", "lse"))
    x = torch_inputs(CASES[0])
    assert ft.attention(**x, softcap=30.0, layout="BSHD") == "out" and len(calls) == 1
    out = ft.attention(**x, layout="BSHD")  # SDPA: no jax needed
    assert len(calls) == 1
    np.testing.assert_allclose(
        out.detach().numpy(), reference(CASES[0], numpy_inputs(CASES[0]))[0], atol=2e-5
    )
    with pytest.raises(ValueError, match="jax is not importable"):
        ft.attention(**x, backend="blockwise", layout="BSHD")


def test_lazy_imports_and_no_jax_process():
    """import flashport never imports torch; import flashport.torch imports torch but not jax; with jax
    unimportable, flashport.torch still runs (the math path) and matches torch's own SDPA."""
    code = (
        "import sys, flashport\n"
        "assert 'torch' not in sys.modules, 'flashport imported torch'\n"
        "import flashport.torch as ft\n"
        "assert 'torch' in sys.modules and 'jax' not in sys.modules, 'flashport.torch imported jax'\n"
        "sys.modules['jax'] = None\n"
        "import torch\n"
        "torch.manual_seed(0); q = torch.randn(1, 4, 2, 8, requires_grad=True)\n"
        "out, lse = ft.attention(q, q, q, causal=True, return_lse=True, layout='BSHD'); out.sum().backward()\n"
        "want = torch.nn.functional.scaled_dot_product_attention(*(q.detach().transpose(1, 2),) * 3, is_causal=True)\n"
        "assert torch.allclose(out.detach(), want.transpose(1, 2), atol=1e-5), 'mismatch'\n"
        "assert torch.isfinite(q.grad).all()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("softcap", [None, 30.0], ids=["sdpa", "jax"])
def test_in_place_change_before_backward_is_refused(softcap):
    x = torch_inputs(CASES[0])
    out = ft.attention(**x, softcap=softcap, layout="BSHD")
    with torch.no_grad():
        out.mul_(2)  # JAX's residuals alias out: torch must refuse, not use the changed values
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_no_grad_call_skips_the_vjp(monkeypatch):
    flags = []
    real = _jax.DLPackRunner.forward
    monkeypatch.setattr(
        _jax.DLPackRunner, "forward", lambda self, a, s, need: flags.append(need) or real(self, a, s, need)
    )
    x = torch_inputs(CASES[0])
    with torch.no_grad():
        out = ft.attention(**x, softcap=30.0, layout="BSHD")  # softcap: auto takes the JAX path
    assert not out.requires_grad
    ft.attention(**x, softcap=30.0, layout="BSHD")
    ft.attention(**{n: v.detach() for n, v in x.items()}, softcap=30.0, layout="BSHD")
    assert flags == [False, True, False]


def test_cpu_auto_validates_each_call_once(monkeypatch):
    """auto on CPU checks the torch arguments once: keywords that rule SDPA out skip the canonical
    call (the JAX path checks them), and a call validated to test SDPA is not checked again."""
    checks_run, tensors_checked = [], []
    real_check, real_check_tensor = ft.check, _checks.check_tensor
    monkeypatch.setattr(ft, "check", lambda *a, **k: checks_run.append(1) or real_check(*a, **k))
    monkeypatch.setattr(
        _checks, "check_tensor", lambda *a: tensors_checked.append(a[0]) or real_check_tensor(*a)
    )
    q, kv = torch.randn(1, 3, 2, 8), torch.randn(1, 5, 2, 8)
    want = ft.attention(q, kv, kv, softcap=30.0, backend="torch", layout="BSHD")
    checks_run.clear(), tensors_checked.clear()
    np.testing.assert_allclose(
        ft.attention(q, kv, kv, softcap=30.0, layout="BSHD").numpy(), want.numpy(), atol=1e-5
    )
    assert checks_run == [] and tensors_checked == ["query", "key", "value"]  # JAX path's own checks
    checks_run.clear(), tensors_checked.clear()
    ft.attention(
        q, kv, kv, causal=True, layout="BSHD"
    )  # bottom-right with Sq != Sk: validated, then the JAX path
    assert checks_run == [1] and tensors_checked == ["query", "key", "value"]


# ------------------------------------------------------------------------------ validation

BAD = [
    (dict(query=torch.zeros(2, 3, 4)), ValueError, "query must have rank 4"),
    (dict(key=torch.zeros(1, 5, 3, 8), value=torch.zeros(1, 5, 3, 8)), ValueError, "must divide query heads"),
    (dict(key=torch.zeros(1, 5, 2, 4)), ValueError, "key head_dim must equal query head_dim"),
    (dict(query=torch.zeros(1, 5, 4, 8, dtype=torch.float64)), TypeError, "query must be float32"),
    (dict(layout="SBHD"), ValueError, "layout='SBHD' is not supported"),
    (dict(align="center"), ValueError, "align='center' is not supported"),
    (dict(window=(-1, 0)), ValueError, "window left must be >= 0"),
    (dict(window=4), ValueError, "window must be a \\(left, right\\) pair"),
    (dict(softcap=0.0), ValueError, "softcap must be > 0"),
    (dict(mask=torch.ones(5, 5)), TypeError, "mask must be boolean"),
    (dict(mask=torch.ones(4, 5, dtype=torch.bool)), ValueError, "mask of shape .* does not broadcast"),
    (dict(bias=torch.ones(5, 5, dtype=torch.int32)), TypeError, "bias must be a float array"),
    (dict(q_segment_ids=torch.zeros(1, 5, dtype=torch.int32)), ValueError, "must be given together"),
    (
        dict(
            q_segment_ids=torch.zeros(1, 4, dtype=torch.int32),
            kv_segment_ids=torch.zeros(1, 5, dtype=torch.int32),
        ),
        ValueError,
        "q_segment_ids must have shape",
    ),
    (dict(causal=1), TypeError, "causal must be a Python bool"),
]


@pytest.mark.parametrize("backend", ["torch", "auto"])  # auto on CPU: the JAX API validates
@pytest.mark.parametrize("bad, error, message", BAD, ids=[m for _, _, m in BAD])
def test_bad_input_names_the_argument(backend, bad, error, message):
    args = dict(query=torch.zeros(1, 5, 4, 8), key=torch.zeros(1, 5, 2, 8), value=torch.zeros(1, 5, 2, 8))
    args.update({"layout": "BSHD", **bad})
    with pytest.raises(error, match=message):
        ft.attention(**args, backend=backend)


def test_explicit_native_backends_refuse_what_they_lack():
    q = torch.zeros(1, 5, 2, 8)
    with pytest.raises(ValueError, match="backend='sdpa' does not support softcap"):
        ft.attention(q, q, q, softcap=3.0, backend="sdpa", layout="BSHD")
    with pytest.raises(ValueError, match="backend='sdpa' does not support return_lse"):
        ft.attention(q, q, q, return_lse=True, backend="sdpa", layout="BSHD")
    if _native.import_flash_attn() is None:
        with pytest.raises(ValueError, match="needs the flash-attn package"):
            ft.attention(q, q, q, backend="flash_attn", layout="BSHD")
    with pytest.raises(TypeError, match=r"query must be a torch\.Tensor"):
        ft.attention(np.zeros((1, 5, 2, 8), np.float32), q, q, layout="BSHD")


# ------------------------------------------------------------------------------ flash-attn mapping


class FakeFlashAttn(types.ModuleType):
    """flash-attn 2.8 semantics written from its documentation, computed by the float64 reference:
    bottom-right causal/window anchored at Sk - Sq, window -1 = unbounded, causal forces right = 0,
    softcap 0 = off, lse +inf on rows with no key, varlen lse as [H, total]."""

    def __init__(self):
        super().__init__("flash_attn")
        self.calls = []

    @staticmethod
    def _run(q, k, v, softmax_scale, causal, window_size, softcap):
        left, right = window_size
        right = 0 if causal else right
        window = (None if left < 0 else left, None if right < 0 else right)
        out, lse = reference_attention(
            *(t.detach().float().numpy() for t in (q, k, v)),
            scale=softmax_scale,
            window=window,
            softcap=softcap or None,
        )
        return torch.from_numpy(out).to(q.dtype), torch.from_numpy(
            np.where(np.isneginf(lse), np.inf, lse)
        ).float()

    def flash_attn_func(
        self,
        q,
        k,
        v,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
    ):
        self.calls.append(
            (
                "func",
                dict(
                    dropout_p=dropout_p,
                    softmax_scale=softmax_scale,
                    causal=causal,
                    window_size=window_size,
                    softcap=softcap,
                    return_attn_probs=return_attn_probs,
                ),
            )
        )
        assert q.shape[-1] == k.shape[-1] and q.dtype in (torch.float16, torch.bfloat16)
        out, lse = self._run(q, k, v, softmax_scale, causal, window_size, softcap)
        return (out, lse, None) if return_attn_probs else out

    def flash_attn_varlen_func(
        self,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
        block_table=None,
    ):
        assert cu_seqlens_q.dtype == torch.int32 and isinstance(max_seqlen_q, int)
        self.calls.append(
            (
                "varlen",
                dict(
                    cu_seqlens_q=cu_seqlens_q.tolist(),
                    max_seqlen_q=max_seqlen_q,
                    causal=causal,
                    window_size=window_size,
                ),
            )
        )
        outs, lses = [], []
        for lo, hi in zip(cu_seqlens_q.tolist()[:-1], cu_seqlens_q.tolist()[1:], strict=True):
            out, lse = self._run(
                q[None, lo:hi], k[None, lo:hi], v[None, lo:hi], softmax_scale, causal, window_size, softcap
            )
            outs.append(out[0])
            lses.append(lse[0])
        out, lse = torch.cat(outs), torch.cat(lses, dim=-1)
        return (out, lse, None) if return_attn_probs else out


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_flash_attn_mapping_matches_the_contract(case):
    """bf16 calls that flash-attn can express go to it (with the right arguments); others to SDPA."""
    fake = FakeFlashAttn()
    x = torch_inputs(case, torch.bfloat16, grad=False)
    want_out, want_lse = reference(case, numpy_inputs(case, "bfloat16"))
    out, lse = run("cuda", x, case, True, flash=fake)
    call = _checks.check(**x, **dict(case.options), layout=case.layout, return_lse=True)
    expected_flash = _native.flash_unsupported(call) is None
    assert bool(fake.calls) == expected_flash
    np.testing.assert_allclose(out.float().numpy(), want_out, atol=3e-2, rtol=3e-2)
    np.testing.assert_allclose(lse.detach().numpy(), want_lse, atol=2e-5 if expected_flash else 2e-2)


def test_flash_attn_takes_exactly_the_calls_it_can_express():
    expressible = {
        c.name
        for c in CASES
        if _native.flash_unsupported(
            _checks.check(
                **torch_inputs(c, torch.bfloat16, False), **dict(c.options), layout=c.layout, return_lse=False
            )
        )
        is None
    }
    assert expressible == {
        "plain",
        "gqa_causal_bottom_right_sq<sk",
        "mqa_causal_bottom_right_sq>sk_empty_rows",
        "causal_top_left_sq>sk",
        "mqa_window_bottom_right",
        "window_left_only_top_left",
        "softcap_scale",
    }


def _flash_kwargs(q, k, **options):
    fake = FakeFlashAttn()
    call = _checks.check(q, k, k, **options)
    _routing.cuda_attention(call, False, flash=fake)
    return fake.calls[-1][1] if fake.calls else None


def test_flash_attn_argument_mapping():
    q, k = torch.zeros(1, 3, 4, 64, dtype=torch.bfloat16), torch.zeros(1, 7, 2, 64, dtype=torch.bfloat16)
    base = dict(dropout_p=0.0, softmax_scale=0.125, return_attn_probs=False, softcap=0.0)
    assert _flash_kwargs(q, k) == dict(base, causal=False, window_size=(-1, -1))
    assert _flash_kwargs(q, k, causal=True) == dict(base, causal=True, window_size=(-1, -1))
    assert _flash_kwargs(q, k, window=(5, 0), scale=0.5, softcap=30.0) == dict(
        base, causal=False, window_size=(5, 0), softmax_scale=0.5, softcap=30.0
    )
    # top-left: the window shifts by Sk - Sq = 4 when that stays expressible ...
    assert _flash_kwargs(q, k, window=(1, 6), align="top_left") == dict(
        base, causal=False, window_size=(5, 2)
    )
    # ... and causal top-left with Sq < Sk is not (SDPA's is_causal runs it instead).
    assert _flash_kwargs(q, k, causal=True, align="top_left") is None
    long_q, short_k = (
        torch.zeros(1, 7, 4, 64, dtype=torch.bfloat16),
        torch.zeros(1, 3, 2, 64, dtype=torch.bfloat16),
    )
    assert _flash_kwargs(long_q, short_k, causal=True, align="top_left") == dict(
        base, causal=False, window_size=(-1, 4)
    )
    assert _flash_kwargs(q.float(), k.float()) is None  # float32: not flash-attn's
    assert _flash_kwargs(q, k, mask=torch.ones(3, 7, dtype=torch.bool)) is None


def test_flash_attn_varlen_for_packed_segments():
    fake = FakeFlashAttn()
    rng = np.random.default_rng(0)
    q = torch.from_numpy(rng.standard_normal((2, 8, 4, 16)).astype(np.float32)).bfloat16()
    k, v = (
        torch.from_numpy(rng.standard_normal((2, 8, 2, 16)).astype(np.float32)).bfloat16() for _ in range(2)
    )
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [5, 5, 5, 5, 5, 3, 3, 9]])
    kw = dict(causal=True, window=(2, None), q_segment_ids=ids, kv_segment_ids=ids)
    out, lse = ft.attention(
        q, k, v, **kw, return_lse=True, backend="torch", layout="BSHD"
    )  # the math path, for the shape
    call = _checks.check(q, k, v, **kw)
    out, lse = _routing.cuda_attention(call, True, flash=fake)
    assert fake.calls[-1][0] == "varlen"
    assert fake.calls[-1][1] == dict(
        cu_seqlens_q=[0, 3, 5, 8, 13, 15, 16], max_seqlen_q=5, causal=True, window_size=(2, -1)
    )
    want_out, want_lse = reference_attention(*(t.detach().float().numpy() for t in (q, k, v)), **kw)
    np.testing.assert_allclose(out.float().numpy(), want_out, atol=3e-2)
    np.testing.assert_allclose(lse.detach().numpy(), want_lse, atol=2e-5)
    # an id in two separate runs may see itself across runs: varlen cannot say that.
    split = torch.tensor([[0, 0, 1, 1, 0, 0, 2, 2]] * 2)
    call = dataclasses.replace(call, q_seg=split, kv_seg=split)
    assert "repeat an id" in _native.flash_unsupported(call)


# ------------------------------------------------------------------------------ torch_xla / torchax


def _fake_call_jax(log):
    """A stand-in for torch_xla's / torchax's call_jax on CPU: jit-traces ``fn`` with the torch
    tensors as JAX inputs and every other leaf static, as the real bridges do."""
    import jax

    def call_jax(fn, args, kwargs):
        assert fn in (_jax.jax_forward, _jax.jax_backward), "the bridge caches by function: must be stable"
        leaves, tree = jax.tree.flatten((args, kwargs))
        tensor_at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        for i, leaf in enumerate(leaves):
            if i not in tensor_at:
                hash(leaf)  # static leaves key the bridge's compilation cache
            else:
                assert leaf.dtype != torch.int64, "int64 would not survive JAX without x64"
        log.append((fn.__name__, [leaves[i].shape for i in tensor_at], _jax.unpack_static(dict(kwargs))))

        def traced(*tensors):
            new = list(leaves)
            for i, t in zip(tensor_at, tensors, strict=True):
                new[i] = t
            a, kw = jax.tree.unflatten(tree, new)
            return fn(*a, **kw)

        result = jax.jit(traced)(*(_jax.to_jax(leaves[i]) for i in tensor_at))
        return jax.tree.map(lambda a: torch.from_numpy(np.asarray(a).copy()), result)

    return call_jax


@pytest.fixture
def fake_torch_xla(monkeypatch):
    log = []
    call_jax = _fake_call_jax(log)
    builder = types.ModuleType("torch_xla.core.xla_builder")

    def xla_call_jax(fn, args, kwargs=None, name=None, override_hash=None):
        assert name == "flashport_attention"
        assert override_hash == (fn.__module__, fn.__qualname__, tuple(a is None for a in args))
        return call_jax(fn, args, kwargs or {})

    builder.call_jax = xla_call_jax
    core = types.ModuleType("torch_xla.core")
    core.xla_builder = builder
    root = types.ModuleType("torch_xla")
    root.core = core
    for name, module in (
        ("torch_xla", root),
        ("torch_xla.core", core),
        ("torch_xla.core.xla_builder", builder),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    # torch_xla's call_jax imports torchax (the runner checks that it is importable).
    torchax, interop = types.ModuleType("torchax"), types.ModuleType("torchax.interop")
    torchax.interop = interop
    monkeypatch.setitem(sys.modules, "torchax", torchax)
    monkeypatch.setitem(sys.modules, "torchax.interop", interop)
    monkeypatch.setattr(ft, "device_kind", lambda t: "xla")
    return log


@pytest.fixture
def fake_torchax(monkeypatch):
    log = []
    call_jax = _fake_call_jax(log)
    interop = types.ModuleType("torchax.interop")
    interop.call_jax = lambda fn, *args, **kwargs: call_jax(fn, args, kwargs)
    root = types.ModuleType("torchax")
    root.interop = interop
    monkeypatch.setitem(sys.modules, "torchax", root)
    monkeypatch.setitem(sys.modules, "torchax.interop", interop)
    monkeypatch.setattr(ft, "device_kind", lambda t: "torchax")
    return log


@pytest.mark.parametrize("bridge", ["fake_torch_xla", "fake_torchax"])
def test_bridges_stage_forward_and_vjp(bridge, request):
    log = request.getfixturevalue(bridge)
    case = CASES[-1]  # every feature, segment ids int64 on the torch side
    x = torch_inputs(case)
    x["q_segment_ids"], x["kv_segment_ids"] = x["q_segment_ids"].long(), x["kv_segment_ids"].long()
    out, lse = ft.attention(**x, **dict(case.options), layout=case.layout, return_lse=True)
    want_out, want_lse = reference(case, numpy_inputs(case))
    np.testing.assert_allclose(out.detach().numpy(), want_out, atol=2e-5)
    np.testing.assert_allclose(lse.detach().numpy(), want_lse, atol=2e-5)
    check_grads(case, x, out, atol=2e-4)
    assert [name for name, _, _ in log] == ["jax_forward", "jax_backward"]
    static = dict(case.options, layout=case.layout, backend="auto", scale=None)
    assert log[0][2] == static and log[1][2] == static
    assert log[0][1] == [
        x[n].shape for n in ("query", "key", "value", "bias", "mask", "q_segment_ids", "kv_segment_ids")
    ]
    # the residuals out and lse, then the cotangents of out and lse: the backward reuses the forward's.
    assert log[1][1] == log[0][1] + [out.shape, lse.shape, out.shape, lse.shape]


def test_torch_xla_without_torchax_names_the_missing_package(fake_torch_xla, monkeypatch):
    """torch_xla's call_jax needs torchax; without it torch_xla's own error is a bare AssertionError."""
    monkeypatch.setitem(sys.modules, "torchax", None)  # makes `import torchax` raise ImportError
    monkeypatch.setitem(sys.modules, "torchax.interop", None)
    q = torch.ones(1, 4, 2, 8)
    with pytest.raises(ImportError, match=r"needs the torchax package \(pip install torchax"):
        ft.attention(q, q, q, layout="BSHD")


def test_device_kind():
    assert ft.device_kind(torch.zeros(1)) == "cpu"
    assert ft.device_kind(torch.zeros(1, device="meta")) == "meta"
    fake = type("Tensor", (torch.Tensor,), {"__module__": "torchax.tensor"})
    assert ft.device_kind(torch.zeros(1).as_subclass(fake)) == "torchax"
