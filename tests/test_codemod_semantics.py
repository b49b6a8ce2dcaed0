"""Semantic tests that execute code: does the rewritten call compute what the source API computes?

PyTorch rules: the rewritten source is executed with ``flashport`` bound to a stand-in whose
``torch.attention`` evaluates its keyword arguments with ``tests/reference.py`` (the float64
reference of the flashport contract); the result is compared with independent float64
implementations of the *source* APIs' documented semantics written below (flash-attn 2.x:
bottom-right causal/window, inclusive window bounds, -1 = unbounded, softcap after scale, contiguous
GQA, empty rows -> 0; SDPA: BHSD, top-left causal, bool True = attend, float mask additive). Shapes
include Sq < Sk, Sq > Sk and GQA.

JAX rules: the original call (with ``implementation="cudnn"`` replaced by ``"xla"``, since cuDNN
cannot run on CPU) and the rewritten ``flashport.attention`` call run on CPU; outputs must match.
"""

from __future__ import annotations

import functools
import textwrap
import types

import numpy as np
import pytest
from ported_code import DROPOUT_SEEN, reference_torch_attention

from flashport import rules as registry
from flashport.kernels.contract.varlen import varlen_attention
from flashport.kernels.semantics.sdpa_compat import sdpa_mask
from flashport.rewriter.engine.pipeline import transform_source
from flashport.rules.base import RuleOptions

torch = pytest.importorskip("torch")


# ----------------------------------------------------------------------------- independent references


def fa2_reference(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
    """flash-attn 2.x (>= 2.1) forward, from its docstring; loops, float64, BSHD."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    left, right = window_size
    out = np.zeros((b, sq, hq, v.shape[-1]))
    for bi in range(b):
        for h in range(hq):
            kh = h // (hq // hk)
            for i in range(sq):
                allowed = []
                for j in range(sk):
                    ok = True
                    anchor = i + sk - sq
                    if causal and j > anchor:
                        ok = False
                    if left >= 0 and j < anchor - left:
                        ok = False
                    if right >= 0 and j > anchor + right:
                        ok = False
                    if ok:
                        allowed.append(j)
                if not allowed:
                    continue  # flash-attn: a row with no key gives 0
                s = np.array([scale * q[bi, i, h] @ k[bi, j, kh] for j in allowed])
                if softcap > 0:
                    s = softcap * np.tanh(s / softcap)
                p = np.exp(s - s.max())
                p /= p.sum()
                out[bi, i, h] = sum(pj * v[bi, j, kh] for pj, j in zip(p, allowed, strict=True))
    return out


def sdpa_reference(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """torch SDPA (>= 2.5) from its documentation: BHSD, top-left causal, bool True = attend."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    L, S = q.shape[-2], k.shape[-2]
    if enable_gqa:
        k = np.repeat(k, q.shape[-3] // k.shape[-3], axis=-3)
        v = np.repeat(v, q.shape[-3] // v.shape[-3], axis=-3)
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    bias = np.zeros((L, S))
    if is_causal:
        bias = np.where(np.tril(np.ones((L, S), bool)), 0.0, -np.inf)
    if attn_mask is not None:
        m = np.asarray(attn_mask)
        bias = bias + (np.where(m, 0.0, -np.inf) if m.dtype == bool else m.astype(np.float64))
    s = q @ np.swapaxes(k, -1, -2) * scale + bias
    mx = np.max(s, axis=-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0)
    p = np.exp(s - mx)
    denom = p.sum(-1, keepdims=True)
    return np.where(denom > 0, p / np.where(denom > 0, denom, 1), 0) @ v  # empty rows: 0 (torch >= 2.5)


# ----------------------------------------------------------------------------- harness


FAKE_FLASHPORT = types.SimpleNamespace(
    torch=types.SimpleNamespace(attention=reference_torch_attention),
    varlen_attention=functools.partial(varlen_attention, attention=reference_torch_attention),
    sdpa_mask=sdpa_mask,
)


def rewrite(source: str, **options) -> str:
    result = transform_source(
        textwrap.dedent(source).encode(), "case.py", registry.all_rules(), RuleOptions(**options)
    )
    assert result.new is not None, [s.reason for s in result.sites]
    assert all(s.status == "rewrite" for s in result.sites if s.kind == "call"), result.sites
    return result.new.decode()


def load(code: str, flashport_module=FAKE_FLASHPORT) -> dict:
    """Exec rewritten code; imports of GPU packages are stubbed, ``flashport`` is the stand-in."""
    namespace: dict = {}
    code = "\n".join(
        line for line in code.splitlines() if not line.startswith(("import flashport", "from flash_attn"))
    )
    exec(compile(code, "rewritten.py", "exec"), namespace)
    namespace["flashport"] = flashport_module
    return namespace


def rand(*shape, seed=0):
    return torch.from_numpy(np.random.default_rng(seed + sum(shape)).standard_normal(shape))


SHAPES = [  # (B, Sq, Sk, Hq, Hk, D)
    (2, 3, 7, 4, 2, 8),  # decode-like: Sq < Sk, GQA
    (1, 5, 5, 2, 2, 4),  # square
    (1, 6, 4, 2, 1, 8),  # Sq > Sk: bottom-right causal leaves the first rows empty (0)
]

FA_CASES = [  # (argument source, flash-attn keyword meaning)
    ("q, k, v", {}),
    ("q, k, v, 0.0, None, True", {"causal": True}),
    ("q, k, v, 0.0, 0.3, True, (2, 0)", {"softmax_scale": 0.3, "causal": True, "window_size": (2, 0)}),
    ("q, k, v, causal=False, window_size=(1, 2)", {"window_size": (1, 2)}),
    (
        "q, k, v, causal=True, softcap=0.5, softmax_scale=2.0",
        {"causal": True, "softcap": 0.5, "softmax_scale": 2.0},
    ),
    ("q, k, v, causal=True, window_size=(w, -1)", {"causal": True, "window_size": (1, -1)}),
    ("q, k, v, causal=True, window_size=(-1, -1), deterministic=True", {"causal": True}),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("args,meaning", FA_CASES, ids=[c[0] for c in FA_CASES])
def test_flash_attn_func_rewrite_matches_flash_attn_semantics(shape, args, meaning):
    b, sq, sk, hq, hk, d = shape
    code = rewrite(f"""
        from flash_attn import flash_attn_func
        def f(q, k, v, w):
            return flash_attn_func({args})
    """)
    q, k, v = rand(b, sq, hq, d), rand(b, sk, hk, d, seed=1), rand(b, sk, hk, d, seed=2)
    got = load(code)["f"](q, k, v, 1).numpy()
    np.testing.assert_allclose(got, fa2_reference(q, k, v, **meaning), atol=1e-10)


def fa4_lse_reference(q, k, causal):
    """FA4's lse [B, H, Sq]: log-sum-exp of the scaled scores over the bottom-right causal keys."""
    q, k = (np.asarray(x, np.float64) for x in (q, k))
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    lse = np.full((b, hq, sq), -np.inf)
    for bi in range(b):
        for h in range(hq):
            for i in range(sq):
                keys = [j for j in range(sk) if not causal or j <= i + sk - sq]
                if keys:
                    s = np.array([d**-0.5 * q[bi, i, h] @ k[bi, j, h // (hq // hk)] for j in keys])
                    lse[bi, h, i] = s.max() + np.log(np.exp(s - s.max()).sum())
    return lse


@pytest.mark.parametrize("flag", ["", ", return_lse=False", ", return_lse=True"])
def test_fa4_rewrite_keeps_the_out_lse_tuple_whatever_return_lse_says(flag):
    """FA4 flash_attn_func always returns (out, lse): unpacking the rewritten call must still work."""
    code = rewrite(f"""
        from flash_attn.cute import flash_attn_func
        def f(q, k, v):
            out, lse = flash_attn_func(q, k, v, causal=True{flag})
            return out, lse
    """)
    b, sq, sk, hq, hk, d = SHAPES[0]
    q, k, v = rand(b, sq, hq, d), rand(b, sk, hk, d, seed=1), rand(b, sk, hk, d, seed=2)
    out, lse = load(code)["f"](q, k, v)
    np.testing.assert_allclose(out.numpy(), fa2_reference(q, k, v, causal=True), atol=1e-10)
    np.testing.assert_allclose(lse.numpy(), fa4_lse_reference(q, k, causal=True), atol=1e-10)


@pytest.mark.parametrize("args,meaning", FA_CASES[:5], ids=[c[0] for c in FA_CASES[:5]])
def test_qkvpacked_and_kvpacked_rewrites(args, meaning):
    tail = args.split(", ", 3)[3:] or []
    extra = (", " + tail[0]) if tail else ""
    code = rewrite(f"""
        from flash_attn import flash_attn_qkvpacked_func, flash_attn_kvpacked_func
        def packed(qkv):
            return flash_attn_qkvpacked_func(qkv{extra})
        def kvpacked(q, kv):
            return flash_attn_kvpacked_func(q, kv{extra})
    """)
    ns = load(code)
    qkv = rand(2, 5, 3, 4, 8)
    np.testing.assert_allclose(
        ns["packed"](qkv).numpy(),
        fa2_reference(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], **meaning),
        atol=1e-10,
    )
    q, kv = rand(2, 3, 4, 8), rand(2, 6, 2, 2, 8)  # Sq != Sk and GQA
    np.testing.assert_allclose(
        ns["kvpacked"](q, kv).numpy(), fa2_reference(q, kv[:, :, 0], kv[:, :, 1], **meaning), atol=1e-10
    )


def varlen_reference(q, k, v, cu_q, cu_k, **meaning):
    """flash-attn varlen: each sequence on its own (bottom-right per sequence); padding rows 0."""
    out = np.zeros(q.shape[:2] + (v.shape[-1],))
    for i in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        out[qs] = fa2_reference(q[None, qs], k[None, ks], v[None, ks], **meaning)[0]
    return out


VARLEN_CASES = [
    ("0.0, None, True", {"causal": True}),
    (
        "dropout_p=0.0, softmax_scale=0.5, causal=True, window_size=(1, 0)",
        {"softmax_scale": 0.5, "causal": True, "window_size": (1, 0)},
    ),
    ("causal=False, window_size=(2, 1)", {"window_size": (2, 1)}),
    ("causal=False", {}),
]


@pytest.mark.parametrize("args,meaning", VARLEN_CASES, ids=[c[0] for c in VARLEN_CASES])
def test_varlen_rewrite_keeps_per_sequence_bottom_right(args, meaning):
    code = rewrite(f"""
        from flash_attn import flash_attn_varlen_func
        def f(q, k, v, cu_q, cu_k, max_q, max_k):
            return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, {args})
    """)
    cu_q, cu_k = [0, 2, 5, 6], [0, 4, 7, 12]  # per-sequence Sq=2,3,1 vs Sk=4,3,5; one padding query
    q, k, v = rand(7, 4, 8), rand(12, 2, 8, seed=1), rand(12, 2, 8, seed=2)
    got = load(code)["f"](
        q, k, v, torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32), 3, 5
    ).numpy()
    np.testing.assert_allclose(
        got, varlen_reference(q.numpy(), k.numpy(), v.numpy(), cu_q, cu_k, **meaning), atol=1e-10
    )
    assert np.all(got[6] == 0)  # past cu_seqlens_q[-1]


def test_varlen_helper_on_jax_matches_per_sequence_reference():
    jnp = pytest.importorskip("jax.numpy")
    cu_q, cu_k = np.array([0, 2, 5, 6], np.int32), np.array([0, 4, 7, 12], np.int32)
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((7, 4, 8), (12, 2, 8), (12, 2, 8)))
    got = varlen_attention(
        jnp.asarray(q),
        jnp.asarray(k),
        jnp.asarray(v),
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        causal=True,
        window=(2, None),
        align="bottom_right",
        layout="THD",
    )
    want = varlen_reference(q, k, v, cu_q, cu_k, causal=True, window_size=(2, -1))
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


SDPA_CASES = [  # (argument source, mask kind, SDPA meaning)
    ("q, k, v", None, {}),
    ("q, k, v, is_causal=True", None, {"is_causal": True}),
    ("q, k, v, None, 0.0, True, scale=0.7", None, {"is_causal": True, "scale": 0.7}),
    ("q, k, v, m", "bool", {}),
    ("q, k, v, attn_mask=m, scale=0.2", "float", {"scale": 0.2}),
    ("q, k, v, is_causal=True, enable_gqa=True", None, {"is_causal": True, "enable_gqa": True}),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("args,mask_kind,meaning", SDPA_CASES, ids=[c[0] for c in SDPA_CASES])
def test_sdpa_rewrite_matches_sdpa_semantics(shape, args, mask_kind, meaning):
    b, sq, sk, hq, hk, d = shape
    if "enable_gqa" not in args:
        hk = hq  # without enable_gqa SDPA needs equal head counts
    code = rewrite(f"""
        import torch.nn.functional as F
        def f(q, k, v, m):
            return F.scaled_dot_product_attention({args})
    """)
    q, k, v = rand(b, hq, sq, d), rand(b, hk, sk, d, seed=1), rand(b, hk, sk, d, seed=2)
    m = None
    if mask_kind == "bool":
        m = torch.from_numpy(np.random.default_rng(5).random((sq, sk)) > 0.3)
        m[:, 0] = True
    elif mask_kind == "float":
        m = rand(b, 1, sq, sk, seed=9)
    got = load(code)["f"](q, k, v, m).numpy()
    want = sdpa_reference(q, k, v, None if m is None else m.numpy(), **meaning)
    np.testing.assert_allclose(got, want, atol=1e-10)
    if meaning.get("is_causal") and sq != sk:  # the alignment really differs from flash-attn's
        bottom_right = fa2_reference(
            q.transpose(1, 2),
            torch.repeat_interleave(k, hq // hk, 1).transpose(1, 2),
            torch.repeat_interleave(v, hq // hk, 1).transpose(1, 2),
            meaning.get("scale"),
            True,
        )
        assert not np.allclose(got, bottom_right.transpose(0, 2, 1, 3), atol=1e-6)


DROPOUT_MODULE = """
    import torch
    import torch.nn.functional as F
    from flash_attn import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func

    class Attention(torch.nn.Module):
        def __init__(self, p):
            super().__init__()
            self.dropout = p
            self.calls = []

        def rate(self, name):
            self.calls.append(name)
            return self.dropout if self.training else 0.0

        def forward(self, q, k, v, qkv, kv, heads_first):
            a = flash_attn_func(q, k, v, dropout_p=self.dropout if self.training else 0.0, causal=True)
            b = flash_attn_func(q, k, v, self.rate("b"), None, True)
            c = flash_attn_qkvpacked_func(qkv, self.dropout if self.training else 0.0)
            d = flash_attn_kvpacked_func(q, kv, causal=True, dropout_p=self.rate("d"))
            e = F.scaled_dot_product_attention(heads_first, heads_first, heads_first, None,
                                               self.dropout if self.training else 0.0, True)
            return a, b, c, d, e
"""


def test_training_gated_dropout_is_carried_and_eval_mode_matches_the_original():
    """Dropout expressions are ported (not refused, not dropped): in eval mode they evaluate to 0 and
    the rewritten module computes what flash-attn / SDPA compute (float64 references); in training
    mode the target receives exactly the module's rate, each expression evaluated once."""
    code = rewrite(DROPOUT_MODULE)
    assert code.count("dropout_p=") == 5 and "flash_attn_func(" not in code
    module = load(code)["Attention"](0.25)
    q, k, v = rand(2, 3, 4, 8), rand(2, 6, 2, 8, seed=1), rand(2, 6, 2, 8, seed=2)
    qkv, x = rand(2, 5, 3, 4, 8, seed=3), rand(1, 2, 5, 4, seed=4)
    kv = torch.stack([k, v], dim=2)
    DROPOUT_SEEN.clear()
    a, b, c, d, e = module.eval()(q, k, v, qkv, kv, x)
    assert DROPOUT_SEEN == [0.0] * 5 and module.calls == ["b", "d"]
    want = fa2_reference(q, k, v, causal=True)
    for got in (a, b, d):
        np.testing.assert_allclose(got.numpy(), want, atol=1e-10)
    np.testing.assert_allclose(c.numpy(), fa2_reference(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]), atol=1e-10)
    np.testing.assert_allclose(e.numpy(), sdpa_reference(x, x, x, is_causal=True), atol=1e-10)
    DROPOUT_SEEN.clear()
    with pytest.raises(AssertionError, match=r"dropout_p=0\.25"):
        module.train()(q, k, v, qkv, kv, x)
    assert DROPOUT_SEEN == [0.25]


def test_dropout_with_side_effects_is_evaluated_once_in_source_order():
    """``dropout_p=next(rates)`` written between two other calls keeps its place (or is refused)."""
    code = rewrite("""
        from flash_attn import flash_attn_func
        def f(q, k, v, log):
            def p():
                log.append("dropout")
                return 0.0
            def c():
                log.append("causal")
                return True
            return flash_attn_func(q, k, v, causal=c(), dropout_p=p(), softmax_scale=0.5)
    """)
    log: list = []
    q, k, v = rand(1, 3, 2, 4), rand(1, 5, 2, 4, seed=1), rand(1, 5, 2, 4, seed=2)
    got = load(code)["f"](q, k, v, log).numpy()
    assert log == ["causal", "dropout"]
    np.testing.assert_allclose(got, fa2_reference(q, k, v, softmax_scale=0.5, causal=True), atol=1e-10)


def test_keyword_arguments_with_side_effects_keep_their_evaluation_order():
    """``causal=c(), softmax_scale=s()``: the contract's keyword order (scale before causal) must not
    swap the two calls; the rewrite puts them back in source order (regression: scale went first)."""
    code = rewrite("""
        from flash_attn import flash_attn_func
        def f(q, k, v, log):
            def c():
                log.append("causal")
                return True
            def s():
                log.append("scale")
                return 0.5
            return flash_attn_func(q, k, v, causal=c(), softmax_scale=s(), window_size=(2, 0))
    """)
    log: list = []
    q, k, v = rand(1, 3, 2, 4), rand(1, 5, 2, 4, seed=1), rand(1, 5, 2, 4, seed=2)
    got = load(code)["f"](q, k, v, log).numpy()
    assert log == ["causal", "scale"]
    want = fa2_reference(q, k, v, softmax_scale=0.5, causal=True, window_size=(2, 0))
    np.testing.assert_allclose(got, want, atol=1e-10)


def test_positional_target_arguments_out_of_source_order_are_refused_when_impure():
    """``v=a(), k=b(), q=c()`` would be evaluated q, k, v by the positional rewrite: refused; the
    same with plain names (nothing to observe) is rewritten."""
    impure = "from flash_attn import flash_attn_func\ny = flash_attn_func(v=a(), k=b(), q=c())\n"
    result = transform_source(impure.encode(), "case.py", registry.all_rules(), RuleOptions())
    assert result.new is None
    [site] = [s for s in result.sites if s.kind == "call"]
    assert site.status != "rewrite" and "original order" in site.reason, site
    pure = impure.replace("a()", "a").replace("b()", "b").replace("c()", "c")
    rewritten = transform_source(pure.encode(), "case.py", registry.all_rules(), RuleOptions())
    assert [s.status for s in rewritten.sites if s.kind == "call"] == ["rewrite"]


def test_inference_flag_drops_training_gated_dropout():
    code = rewrite(
        """
        from flash_attn import flash_attn_func
        def f(self, q, k, v):
            return flash_attn_func(q, k, v, self.p if self.training else 0.0, causal=True)
    """,
        inference=True,
    )
    q, k, v = rand(1, 3, 2, 4), rand(1, 5, 2, 4, seed=1), rand(1, 5, 2, 4, seed=2)
    got = load(code)["f"](types.SimpleNamespace(p=0.5, training=False), q, k, v).numpy()
    np.testing.assert_allclose(got, fa2_reference(q, k, v, causal=True), atol=1e-10)


# ----------------------------------------------------------------------------- JAX: run both


JAX_CASES = [
    "q, k, v, is_causal=True, implementation='cudnn'",
    "q, k, v, bias, None, scale=0.5, implementation='cudnn'",
    "q, k, v, None, mask, implementation='cudnn'",
    "q, k, v, local_window_size=(2, 0), is_causal=True, implementation='cudnn'",
    "q, k, v, local_window_size=1, implementation='cudnn'",
    "q, k, v, bias=bias, mask=mask, is_causal=True, implementation='cudnn'",
]


@pytest.mark.parametrize(
    "shape",
    [
        (2, 5, 7, 4, 2, 8),  # T < S with GQA: top-left alignment matters
        pytest.param((1, 6, 6, 2, 2, 16), marks=pytest.mark.slow),
        pytest.param((1, 4, 3, 2, 1, 8), marks=pytest.mark.slow),  # T > S, MQA
    ],
    ids=str,
)
@pytest.mark.parametrize("args", JAX_CASES)
def test_jax_cudnn_rewrite_matches_jax_nn_on_cpu(shape, args):
    pytest.importorskip("jax")
    import flashport

    b, t, s, n, kh, d = shape
    source = f"""
        import jax
        def f(q, k, v, bias, mask):
            return jax.nn.dot_product_attention({args})
    """
    code = rewrite(source)
    original = load(textwrap.dedent(source).replace("'cudnn'", "'xla'"), flashport_module=flashport)["f"]
    rewritten = load(code, flashport_module=flashport)["f"]
    rng = np.random.default_rng(7)
    q = rng.standard_normal((b, t, n, d)).astype(np.float32)
    k, v = (rng.standard_normal((b, s, kh, d)).astype(np.float32) for _ in range(2))
    bias = rng.standard_normal((b, n, t, s)).astype(np.float32)
    mask = rng.random((1, 1, t, s)) > 0.3
    mask[..., 0] = True
    mask[..., :, :] |= np.eye(t, s, dtype=bool)  # keep every row non-empty under any window
    want = np.asarray(original(q, k, v, bias, mask))
    got = np.asarray(rewritten(q, k, v, bias, mask))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def fa1_varlen_reference(q, k, v, cu_q, cu_k, softmax_scale=None, causal=False):
    """flash-attn 1.x ``flash_attn_unpadded_func``: each sequence on its own, causal **top-left**
    (query i sees keys j <= i of its sequence; bottom-right only came with 2.1); loops, float64."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out = np.zeros(q.shape[:2] + (v.shape[-1],))
    for b in range(len(cu_q) - 1):
        for i in range(cu_q[b + 1] - cu_q[b]):
            for h in range(q.shape[1]):
                keys = [j for j in range(cu_k[b + 1] - cu_k[b]) if not causal or j <= i]
                s = np.array([scale * q[cu_q[b] + i, h] @ k[cu_k[b] + j, h] for j in keys])
                p = np.exp(s - s.max())
                out[cu_q[b] + i, h] = sum(
                    pj * v[cu_k[b] + j, h] for pj, j in zip(p / p.sum(), keys, strict=True)
                )
    return out


def test_fa1_unpadded_rewrites_keep_top_left_causal_and_1x_argument_order():
    code = rewrite("""
        from flash_attn.flash_attn_interface import (flash_attn_unpadded_func, flash_attn_unpadded_kvpacked_func,
                                                     flash_attn_unpadded_qkvpacked_func)
        def f(q, k, v, cu_q, cu_k, max_q, max_k):
            return flash_attn_unpadded_func(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, 0.5, True, False, True)
        def kvpacked(q, kv, cu_q, cu_k, max_q, max_k):
            return flash_attn_unpadded_kvpacked_func(q, kv, cu_q, cu_k, max_q, max_k, 0.0, causal=True)
        def qkvpacked(qkv, cu, max_len):
            return flash_attn_unpadded_qkvpacked_func(qkv, cu, max_len, 0.0, None, False)
    """)
    ns = load(code)
    cu_q, cu_k = [0, 2, 5], [0, 4, 7]  # Sq=2,3 vs Sk=4,3: top-left and bottom-right differ
    q, k, v = rand(5, 2, 8), rand(7, 2, 8, seed=1), rand(7, 2, 8, seed=2)
    tq, tk = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    want = fa1_varlen_reference(q.numpy(), k.numpy(), v.numpy(), cu_q, cu_k, softmax_scale=0.5, causal=True)
    np.testing.assert_allclose(ns["f"](q, k, v, tq, tk, 3, 4).numpy(), want, atol=1e-10)
    kv = torch.stack([k, v], dim=1)
    np.testing.assert_allclose(
        ns["kvpacked"](q, kv, tq, tk, 3, 4).numpy(),
        fa1_varlen_reference(q.numpy(), k.numpy(), v.numpy(), cu_q, cu_k, causal=True),
        atol=1e-10,
    )
    qkv = torch.stack([rand(5, 2, 8, seed=3), rand(5, 2, 8, seed=4), rand(5, 2, 8, seed=5)], dim=1)
    np.testing.assert_allclose(
        ns["qkvpacked"](qkv, tq, 3).numpy(),
        fa1_varlen_reference(*(qkv[:, i].numpy() for i in range(3)), cu_q, cu_q),
        atol=1e-10,
    )
