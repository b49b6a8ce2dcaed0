"""The torch routes to TPU, for real: ``flashport.torch.attention`` on torch_xla and on torchax tensors.

torch_xla runs with ``PJRT_DEVICE=CPU`` (its XLA:CPU client: the same lowering of
``torch_xla.core.xla_builder.call_jax`` that runs on TPU), torchax on JAX's CPU backend. Forward,
backward (through ``out`` and ``lse``), GQA, causal, window, softcap, segments, bias, mask,
``flashport.torch.flex_attention`` with torch mods, ``flashport.varlen_attention``, ``xformers_compat.memory_efficient_attention`` and a rewritten example
model are compared with the float64 reference (tests/reference.py). The backward of the torch_xla
route is read from torch_xla's own HLO: it must hold no recomputed forward (tests/hlo_dots.py).

Marker ``torch_tpu_routes`` (deselected by default): these need torch 2.9 + torch_xla 2.9 + torchax
0.0.13 in their own venv. One command builds it and runs them (docs/torch_tpu_routes.md):

    bash .ci/torch_tpu_routes_venv.sh --test
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

# A missing route library skips the tests, not the module: where the marker is deselected (the
# default tier) nothing is reported as skipped; where it is selected the skip names the library.
_MISSING = [name for name in ("torch", "torch_xla", "torchax") if importlib.util.find_spec(name) is None]
pytestmark = [pytest.mark.torch_tpu_routes]
if _MISSING:
    pytestmark.append(
        pytest.mark.skip(reason=f"could not import {', '.join(_MISSING)} (.ci/torch_tpu_routes_venv.sh)")
    )

os.environ.setdefault("PJRT_DEVICE", "CPU")
torch = pytest.importorskip("torch")
if not _MISSING:
    import torch_xla
    import torchax

from hlo_dots import dot_shapes, output_products  # noqa: E402
from reference import reduce_to_shape, reference_attention, reference_attention_vjp  # noqa: E402

import flashport  # noqa: E402
import flashport.torch as ft  # noqa: E402
from flashport.integrations import xformers_compat  # noqa: E402

ATOL = 1e-5  # float32 against float64 on O(1) values; measured errors are ~1e-6
ROUTES = ("torch_xla", "torchax")
# Sq, Sk, D, Dv distinct (and distinct from B and the head counts): dot shapes say which product they are.
B, SQ, SK, HQ, HKV, D, DV = 2, 12, 20, 4, 2, 8, 6


class Route:
    """Moves CPU tensors onto one route's device and back, and opens its context."""

    def __init__(self, name):
        self.name = name
        self.env = torchax.default_env() if name == "torchax" else None
        self.device = torch_xla.device() if name == "torch_xla" else "jax"

    def __enter__(self):
        if self.env is not None:
            self.env.__enter__()
        return self

    def __exit__(self, *exc):
        if self.env is not None:
            self.env.__exit__(*exc)

    def put(self, x, grad=False):
        """A CPU numpy array / tensor as a leaf tensor on this route (float64 arrays become float32)."""
        if x is None:
            return None
        t = torch.as_tensor(x)
        if t.dtype == torch.float64:
            t = t.float()
        t = t.to(self.device)
        assert ft.device_kind(t) == ("xla" if self.name == "torch_xla" else "torchax"), type(t)
        return t.requires_grad_() if grad else t

    def numpy(self, t):
        """A route tensor as a float64 numpy array."""
        return t.detach().to("cpu").double().numpy()


@pytest.fixture(params=ROUTES)
def route(request):
    with Route(request.param) as r:
        yield r


def _close(got, want, what, atol=ATOL):
    err = float(np.max(np.abs(got - want))) if np.size(want) else 0.0
    assert np.all(np.isfinite(got)), f"{what}: non-finite values"
    assert err < atol, f"{what}: max |err| {err:.2e} >= {atol}"


def _inputs(seed):
    rng = np.random.default_rng(seed)
    return rng, {
        "query": rng.standard_normal((B, SQ, HQ, D)),
        "key": rng.standard_normal((B, SK, HKV, D)),
        "value": rng.standard_normal((B, SK, HKV, DV)),
    }


def _case(name, rng):
    """(contract options, extra tensors) of one named case."""
    if name == "causal_gqa":
        return {"causal": True}, {}
    ids_q = np.sort(rng.integers(0, 3, (B, SQ)), axis=-1)
    ids_k = np.sort(rng.integers(0, 3, (B, SK)), axis=-1)
    mask = rng.random((B, 1, SQ, SK)) > 0.2
    return (
        {"softcap": 3.0, "window": (6, 2), "align": "top_left"},
        {
            "bias": rng.standard_normal((1, HQ, SQ, SK)),
            "mask": mask,
            "q_segment_ids": ids_q.astype(np.int64),
            "kv_segment_ids": ids_k.astype(np.int64),
        },
    )


@pytest.mark.parametrize("case", ["causal_gqa", "softcap_window_segments_bias_mask"])
def test_attention_forward_backward_lse(route, case):
    """out, lse and the gradients of q, k, v (and bias) through a loss on both out and lse."""
    rng, x = _inputs(1)
    options, extra = _case(case, rng)
    t = {n: route.put(a, grad=True) for n, a in x.items()}
    bias = route.put(extra.get("bias"), grad=True)
    tensors = {n: route.put(extra.get(n)) for n in ("mask", "q_segment_ids", "kv_segment_ids")}
    out, lse = ft.attention(
        t["query"], t["key"], t["value"], bias=bias, **tensors, **options, return_lse=True, layout="BSHD"
    )
    assert ft.device_kind(out) == ft.device_kind(t["query"]) and ft.device_kind(lse) == ft.device_kind(out)

    ref_kw = dict(options, **{n: v for n, v in extra.items()})
    want_out, want_lse = reference_attention(x["query"], x["key"], x["value"], **ref_kw)
    got_lse = route.numpy(lse)
    _close(route.numpy(out), want_out, "out")
    assert np.array_equal(np.isinf(got_lse), np.isinf(want_lse)), "rows that see no key differ"
    _close(np.where(np.isinf(want_lse), 0, got_lse), np.where(np.isinf(want_lse), 0, want_lse), "lse")

    d_out, d_lse = rng.standard_normal(want_out.shape), rng.standard_normal(want_lse.shape)
    loss = (out * route.put(d_out)).sum() + (torch.where(torch.isinf(lse), 0, lse) * route.put(d_lse)).sum()
    loss.backward()
    want = reference_attention_vjp(x["query"], x["key"], x["value"], d_out, d_lse=d_lse, **ref_kw)
    for name, w in zip(("query", "key", "value"), want[:3], strict=True):
        _close(route.numpy(t[name].grad), w, f"d{name}")
    if bias is not None:
        _close(route.numpy(bias.grad), reduce_to_shape(want[3], bias.shape), "dbias")


# CPU tensors the mods close over, made outside any route's environment (module import).
FLEX_SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])
FLEX_DOCS = torch.tensor([0] * 7 + [1] * 9 + [2] * 4)


def test_flex_attention_with_torch_mods(route):
    """``flashport.torch.flex_attention`` on both routes: a torch ALiBi ``score_mod`` (closed-over
    slopes) and a document ``mask_mod`` (its ``create_block_mask``, called inside the route's
    context: torchax's environment) traced into JAX, GQA, Sq < Sk; out, lse and the q, k, v
    gradients through both against the float64 reference."""
    _flex_with_torch_mods(route)


def test_flex_attention_mods_index_tensors_made_on_the_route(route):
    """Mods closing over tensors made inside the route's context (on torchax: one on its device,
    one a CPU tensor made inside its environment): a relative-bias table indexed ``table[h, i - j +
    shift]`` (a tuple index) and per-head slopes; out and the q, k, v gradients against the float64
    reference."""
    rng, x = _inputs(3)
    table_np = rng.standard_normal((HQ, SQ + SK - 1))
    slopes_np = np.array([0.5, -0.25, 0.125, 1.0])
    table = route.put(table_np)  # on the route's device
    slopes = torch.tensor(slopes_np, dtype=torch.float32)  # a CPU tensor, made in the context

    def bias(score, b, h, i, j):
        return score + table[h, i - j + SK - 1] * slopes[h]

    def ref_bias(s, b, h, i, j):
        return s + table_np[h, i - j + SK - 1] * slopes_np[h]

    t = {n: route.put(np.swapaxes(a, 1, 2), grad=True) for n, a in x.items()}
    out = ft.flex_attention(t["query"], t["key"], t["value"], score_mod=bias, enable_gqa=True)
    want_out, _ = reference_attention(x["query"], x["key"], x["value"], score_mod=ref_bias)
    _close(np.swapaxes(route.numpy(out), 1, 2), want_out, "out")
    d_out = rng.standard_normal(want_out.shape)
    (out * route.put(np.swapaxes(d_out, 1, 2))).sum().backward()
    want = reference_attention_vjp(x["query"], x["key"], x["value"], d_out, score_mod=ref_bias)
    for name, w in zip(("query", "key", "value"), want[:3], strict=True):
        _close(np.swapaxes(route.numpy(t[name].grad), 1, 2), w, f"d{name}", atol=1e-4)


def test_flex_attention_mods_refusals_name_the_argument():
    """torchax: a closed-over tensor that requires grad is refused (its gradient would be lost), and
    create_block_mask (built on the CPU) refuses a mask_mod reading a tensor on the torchax device."""
    with Route("torchax") as route:
        q = route.put(np.zeros((1, HQ, SQ, D), np.float32), grad=True)
        slopes = torch.ones(HQ, requires_grad=True)
        with pytest.raises(TypeError, match="score_mod closes over a tensor that requires grad"):
            ft.flex_attention(q, q, q, score_mod=lambda s, b, h, i, j: s + slopes[h] * (j - i))
        ids = route.put(np.arange(SQ) // 3)
        with pytest.raises(TypeError, match=r"create_block_mask .* mask_mod may close over CPU tensors"):
            ft.create_block_mask(lambda b, h, i, j: ids[i] == ids[j], None, None, SQ, SQ, device="jax")


def _flex_with_torch_mods(route):
    rng, x = _inputs(2)
    slopes, docs = FLEX_SLOPES, FLEX_DOCS
    shift = SK - SQ  # query i sits at key position i + shift

    def alibi(score, b, h, i, j):
        return score + slopes[h] * (j - i - shift)

    def documents(b, h, i, j):
        return (docs[i + shift] == docs[j]) & (j <= i + shift)

    ref_mods = dict(
        score_mod=lambda s, b, h, i, j: s + slopes.numpy()[h] * (j - i - shift),
        mask_mod=lambda b, h, i, j: (docs.numpy()[i + shift] == docs.numpy()[j]) & (j <= i + shift),
    )
    block_mask = ft.create_block_mask(documents, None, None, SQ, SK, device="cpu")
    t = {n: route.put(np.swapaxes(a, 1, 2), grad=True) for n, a in x.items()}
    out, lse = ft.flex_attention(
        t["query"],
        t["key"],
        t["value"],
        score_mod=alibi,
        block_mask=block_mask,
        enable_gqa=True,
        return_lse=True,
    )
    assert ft.device_kind(out) == ft.device_kind(t["query"])
    want_out, want_lse = reference_attention(x["query"], x["key"], x["value"], **ref_mods)
    _close(np.swapaxes(route.numpy(out), 1, 2), want_out, "out")
    _close(route.numpy(lse), want_lse, "lse")

    d_out, d_lse = rng.standard_normal(want_out.shape), rng.standard_normal(want_lse.shape)
    loss = (out * route.put(np.swapaxes(d_out, 1, 2))).sum() + (lse * route.put(d_lse)).sum()
    loss.backward()
    want = reference_attention_vjp(x["query"], x["key"], x["value"], d_out, d_lse=d_lse, **ref_mods)
    for name, w in zip(("query", "key", "value"), want[:3], strict=True):
        _close(np.swapaxes(route.numpy(t[name].grad), 1, 2), w, f"d{name}", atol=1e-4)


def test_torch_xla_backward_hlo_reuses_the_forward_residuals():
    """torch_xla's backward graph (forward materialized first) holds no P·V product: the
    backward is flashport.attention_backward on out and lse, not a recomputed forward."""
    from torch_xla.core import xla_builder

    _, x = _inputs(2)
    with Route("torch_xla") as r:
        q, k, v = (r.put(x[n], grad=True) for n in ("query", "key", "value"))
        out, lse = ft.attention(q, k, v, causal=True, return_lse=True, layout="BSHD")
        torch_xla.sync()  # out and lse are now device data: the next graph is the backward alone
        (out.sum() + lse.sum()).backward()
        hlo = torch_xla._XLAC._get_xla_tensors_hlo([q.grad, k.grad, v.grad])
        dots = dot_shapes(hlo)
        assert dots, "no dot in the backward HLO: the staged JAX computation was not found"
        assert output_products(hlo, SQ, DV) == [], f"the backward recomputes the forward: {dots}"
        # Scores once, then dV, dP, dQ, dK (the xla backend on XLA:CPU at this size).
        assert len(dots) == 5, dots

        # The check can fail: the old backward (jax.vjp of the forward) staged the same way has P·V.
        def recomputing(q, k, v, d_out, d_lse):
            import jax

            return jax.vjp(
                lambda q, k, v: flashport.attention(q, k, v, causal=True, return_lse=True), q, k, v
            )[1]((d_out, d_lse))

        grads = xla_builder.call_jax(
            recomputing, (q.detach(), k.detach(), v.detach(), torch.ones_like(out), torch.ones_like(lse))
        )
        old = torch_xla._XLAC._get_xla_tensors_hlo(list(grads))
        assert output_products(old, SQ, DV) != [] and len(dot_shapes(old)) == 6


def test_backward_with_then_without_bias(route):
    """Same shapes, a bias in one call and none in the next (as two layers of one model): torch_xla's
    call_jax keeps one output tree per function, so without flashport's cache key the second backward
    unflattens (dq, dk, dv) into the (dq, dk, dv, dbias) slots and raises."""
    rng, x = _inputs(5)
    bias = rng.standard_normal((1, HQ, SQ, SK))
    for b in (bias, None):
        t = {n: route.put(a, grad=True) for n, a in x.items()}
        out = ft.attention(t["query"], t["key"], t["value"], bias=route.put(b), causal=True, layout="BSHD")
        d_out = rng.standard_normal(out.shape)
        (out * route.put(d_out)).sum().backward()
        want = reference_attention_vjp(x["query"], x["key"], x["value"], d_out, causal=True, bias=b)
        for name, w in zip(("query", "key", "value"), want[:3], strict=True):
            _close(route.numpy(t[name].grad), w, f"d{name} (bias {'given' if b is not None else 'absent'})")


def test_varlen_attention(route):
    """flashport.varlen_attention on route tensors: packed sequences, causal bottom-right per sequence."""
    rng = np.random.default_rng(3)
    lens_q, lens_k = [3, 5, 4], [4, 5, 7]
    cu_q, cu_k = np.cumsum([0] + lens_q), np.cumsum([0] + lens_k)
    q, k, v = (rng.standard_normal((n, h, D)) for n, h in ((cu_q[-1], HQ), (cu_k[-1], HKV), (cu_k[-1], HKV)))
    tq, tk, tv = (route.put(a, grad=True) for a in (q, k, v))
    out = flashport.varlen_attention(
        tq,
        tk,
        tv,
        cu_seqlens_q=route.put(cu_q.astype(np.int32)),
        cu_seqlens_k=route.put(cu_k.astype(np.int32)),
        causal=True,
    )
    d_out = rng.standard_normal(out.shape)
    (out * route.put(d_out)).sum().backward()
    want_out, want_grads = np.zeros(out.shape), [np.zeros(a.shape) for a in (q, k, v)]
    for b in range(len(lens_q)):
        sq_, sk_ = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        one = [a[None] for a in (q[sq_], k[sk_], v[sk_])]
        want_out[sq_] = reference_attention(*one, causal=True)[0][0]
        for g, gb, s in zip(
            want_grads,
            reference_attention_vjp(*one, d_out[sq_][None], causal=True),
            (sq_, sk_, sk_),
            strict=False,
        ):
            g[s] = gb[0]
    _close(route.numpy(out), want_out, "varlen out")
    for name, t, w in zip(("dq", "dk", "dv"), (tq, tk, tv), want_grads, strict=True):
        _close(route.numpy(t.grad), w, f"varlen {name}")


def test_xformers_memory_efficient_attention(route):
    """xformers_compat.memory_efficient_attention with a causal mask object and with a tensor bias."""
    rng, x = _inputs(4)
    q, k, v = (x[n] for n in ("query", "key", "value"))
    k, v = (np.repeat(a, HQ // HKV, axis=2) for a in (k, v))  # xformers' 4-D form has one head count
    tq, tk, tv = (route.put(a, grad=True) for a in (q, k, v))
    causal = xformers_compat.LowerTriangularMask()
    out = xformers_compat.memory_efficient_attention(tq, tk, tv, attn_bias=causal)
    _close(route.numpy(out), reference_attention(q, k, v, causal=True, align="top_left")[0], "causal out")
    d_out = rng.standard_normal(out.shape)
    (out * route.put(d_out)).sum().backward()
    want = reference_attention_vjp(q, k, v, d_out, causal=True, align="top_left")
    for name, t, w in zip(("dq", "dk", "dv"), (tq, tk, tv), want[:3], strict=True):
        _close(route.numpy(t.grad), w, f"xformers {name}")
    bias = rng.standard_normal((B, HQ, SQ, SK))
    out = xformers_compat.memory_efficient_attention(tq, tk, tv, attn_bias=route.put(bias), scale=0.3)
    _close(route.numpy(out), reference_attention(q, k, v, bias=bias, scale=0.3)[0], "bias out")


def test_rewritten_sdpa_example_model(route, tmp_path):
    """examples/torch_sdpa_model.py after `flashport rewrite --write`, run on the route: outputs (and,
    on torch_xla, parameter gradients) against the float64 reference of the original SDPA semantics."""
    import importlib.util
    import shutil

    from test_examples_torch_e2e import EXAMPLES, params64, sdpa_cross, sdpa_self

    from flashport.rewriter.app import cli

    shutil.copy(EXAMPLES / "torch_sdpa_model.py", tmp_path / "torch_sdpa_model.py")
    assert cli.main(["rewrite", "--write", "--isolated", "--no-color", str(tmp_path)]) == 0
    assert "flashport" in (tmp_path / "torch_sdpa_model.py").read_text()
    spec = importlib.util.spec_from_file_location("ported_torch_sdpa_model", tmp_path / "torch_sdpa_model.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)

    torch.manual_seed(0)
    block = m.Block()
    P = params64(block)  # float64 CPU copies, before the module moves
    x, memory = torch.randn(2, 6, m.DIM), torch.randn(2, 5, m.DIM)
    keep = torch.tensor([[True] * 5, [True, True, True, False, False]])[:, None, None, :]
    bias = torch.randn(1, m.HEADS, 6, 5)
    block.to(route.device)
    y = block(*(route.put(a) for a in (x, memory, keep, bias)))
    h = x.double() + sdpa_self(P, x.double(), m)
    want = h + sdpa_cross(P, h, memory.double(), keep, bias, m)
    _close(route.numpy(y), want.detach().numpy(), "model out", atol=2e-5)
    if route.name == "torchax":
        # torchax runs nn.functional.linear & co. in JAX below torch autograd (its models train
        # through jax.grad), so parameter gradients need torch_xla; attention's own gradients on
        # torchax are checked by the tests above.
        assert not y.requires_grad
        return
    y.square().mean().backward()
    want.square().mean().backward()
    for name, p in block.named_parameters():
        _close(route.numpy(p.grad), P[name].grad.numpy(), f"grad {name}", atol=2e-5)
