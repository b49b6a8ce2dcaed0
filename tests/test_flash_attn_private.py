"""flash-attn 2.7+'s private kernels: flashport's drop-ins against the float64 reference, and the
FPA008 port of a custom autograd function built on them (run, not just rewritten).

The backward drop-ins must use the ``out`` / ``softmax_lse`` they are given (as flash-attn's do):
the two-branch test merges two partial forwards through their lse and checks that the per-branch
backwards on the merged residuals add up to the full attention's float64 gradients.
"""

from __future__ import annotations

import pathlib
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ported_code import port_and_run, rand  # noqa: E402
from reference import reference_attention, reference_attention_vjp  # noqa: E402

from flashport.integrations import flash_attn_compat as fa  # noqa: E402

ATOL = 2e-5


def close(got, want, atol=ATOL):
    got = got.detach().double().numpy()
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, atol=atol, rtol=1e-4)


def flash_lse(lse):
    """The reference's lse with flash-attn's +inf for a row that sees no key."""
    return np.where(np.isneginf(lse), np.inf, lse)


def window_of(left, right):
    return None if left < 0 and right < 0 else (None if left < 0 else left, None if right < 0 else right)


@pytest.mark.parametrize(
    "causal, window, softcap",
    [(True, (-1, -1), 0.0), (False, (2, 1), 0.0), (False, (-1, -1), 5.0), (True, (1, -1), 0.0)],
    ids=str,
)
def test_dense_forward_and_backward_write_into_the_given_buffers(causal, window, softcap):
    q, k, v = rand(2, 5, 4, 8), rand(2, 7, 2, 8, seed=1), rand(2, 7, 2, 8, seed=2)
    dout = rand(2, 5, 4, 8, seed=3)
    contract = dict(scale=0.3, causal=causal, window=window_of(*window), softcap=softcap or None)
    out, lse, s_dmask, rng_state = fa._flash_attn_forward(
        q, k, v, 0.0, 0.3, causal, *window, softcap, None, False
    )
    want, want_lse = reference_attention(q.numpy(), k.numpy(), v.numpy(), **contract)
    close(out, want)
    close(lse, flash_lse(want_lse))
    assert s_dmask is None and rng_state is None
    dq, dkv = torch.full_like(q, 7.0), torch.full((2, 7, 2, 2, 8), 7.0)  # dk/dv: views into one buffer
    softmax_d = fa._flash_attn_backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        dq,
        dkv[:, :, 0],
        dkv[:, :, 1],
        0.0,
        0.3,
        causal,
        *window,
        softcap,
        None,
        False,
    )
    gq, gk, gv, _ = reference_attention_vjp(q.numpy(), k.numpy(), v.numpy(), dout.numpy(), **contract)
    close(dq, gq)
    close(dkv[:, :, 0], gk)
    close(dkv[:, :, 1], gv)
    close(softmax_d, np.einsum("bqhd,bqhd->bhq", dout.double().numpy(), want))


def test_backward_uses_the_given_out_and_lse_merged_branches_add_up():
    """Ring / two-branch attention: keys split in two, partial results merged through the lse, each
    branch's backward run on the *merged* out/lse; dq sums and dk/dv concatenate to the full gradient."""
    q, k, v = rand(1, 6, 2, 8), rand(1, 10, 2, 8, seed=1), rand(1, 10, 2, 8, seed=2)
    dout = rand(1, 6, 2, 8, seed=3)
    halves = (slice(0, 4), slice(4, 10))
    parts = [
        fa._flash_attn_forward(q, k[:, h], v[:, h], 0.0, 0.35, False, -1, -1, 0.0, None, False)
        for h in halves
    ]
    lse = torch.logaddexp(parts[0][1], parts[1][1])  # [B, H, Sq]
    weights = [torch.exp(p[1] - lse).transpose(1, 2)[..., None] for p in parts]
    out = sum(w * p[0] for w, p in zip(weights, parts, strict=True))
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for h in halves:
        dq_part = torch.empty_like(q)
        fa._flash_attn_backward(
            dout,
            q,
            k[:, h],
            v[:, h],
            out,
            lse,
            dq_part,
            dk[:, h],
            dv[:, h],
            0.0,
            0.35,
            False,
            -1,
            -1,
            0.0,
            None,
            False,
        )
        dq += dq_part
    want, want_lse = reference_attention(q.numpy(), k.numpy(), v.numpy(), scale=0.35)
    close(out, want)
    close(lse, want_lse)
    gq, gk, gv, _ = reference_attention_vjp(q.numpy(), k.numpy(), v.numpy(), dout.numpy(), scale=0.35)
    close(dq, gq)
    close(dk, gk)
    close(dv, gv)


CU_Q, CU_K = torch.tensor([0, 2, 5, 6], dtype=torch.int32), torch.tensor([0, 4, 7, 11], dtype=torch.int32)


@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (False, (1, 0)), (False, (-1, -1))], ids=str)
def test_varlen_forward_and_backward_per_sequence(causal, window):
    q, k, v = rand(7, 2, 8), rand(11, 1, 8, seed=1), rand(11, 1, 8, seed=2)  # one padding query row
    dout = rand(7, 2, 8, seed=3)
    out, lse, _, _ = fa._flash_attn_varlen_forward(q, k, v, CU_Q, CU_K, 3, 4, 0.0, 0.4, causal, *window)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fa._flash_attn_varlen_backward(
        dout, q, k, v, out, lse, dq, dk, dv, CU_Q, CU_K, 3, 4, 0.0, 0.4, causal, *window, 0.0, None, True
    )
    assert lse.shape == (2, 7) and torch.isinf(lse[:, 6]).all() and (out[6] == 0).all() and (dq[6] == 0).all()
    for b in range(3):  # each sequence on its own: its own lengths and bottom-right alignment
        qs, ks = slice(int(CU_Q[b]), int(CU_Q[b + 1])), slice(int(CU_K[b]), int(CU_K[b + 1]))
        contract = dict(scale=0.4, causal=causal, window=window_of(*window))
        args = (q[None, qs].numpy(), k[None, ks].numpy(), v[None, ks].numpy())
        want, want_lse = reference_attention(*args, **contract)
        close(out[qs], want[0])
        close(lse[:, qs], flash_lse(want_lse[0]))
        gq, gk, gv, _ = reference_attention_vjp(*args, dout[None, qs].numpy(), **contract)
        close(dq[qs], gq[0])
        close(dk[ks], gk[0])
        close(dv[ks], gv[0])


def test_dropout_mask_comes_back_through_rng_state():
    q, k, v = rand(1, 6, 2, 8), rand(1, 6, 2, 8, seed=1), rand(1, 6, 2, 8, seed=2)
    dout = rand(1, 6, 2, 8, seed=3)
    torch.manual_seed(0)
    out, lse, _, rng_state = fa._flash_attn_forward(q, k, v, 0.3, 0.35, True, -1, -1, 0.0, None, False)
    words = [w & 0xFFFFFFFF for w in rng_state.tolist()]
    contract = dict(scale=0.35, causal=True, dropout_rate=0.3, dropout_seed=words)
    want, want_lse = reference_attention(q.numpy(), k.numpy(), v.numpy(), **contract)
    close(out, want)
    close(lse, want_lse)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fa._flash_attn_backward(
        dout, q, k, v, out, lse, dq, dk, dv, 0.3, 0.35, True, -1, -1, 0.0, None, False, rng_state
    )
    gq, gk, gv, _ = reference_attention_vjp(q.numpy(), k.numpy(), v.numpy(), dout.numpy(), **contract)
    close(dq, gq)
    close(dk, gk)
    close(dv, gv)
    with pytest.raises(ValueError, match="rng_state"):
        fa._flash_attn_backward(
            dout, q, k, v, out, lse, dq, dk, dv, 0.3, 0.35, True, -1, -1, 0.0, None, False
        )
    with pytest.raises(ValueError, match="return_softmax"):
        fa._flash_attn_forward(q, k, v, 0.0, 0.35, True, -1, -1, 0.0, None, True)


AUTOGRAD = """
import torch
from flash_attn.flash_attn_interface import _flash_attn_backward, _flash_attn_forward


class Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, causal):
        out, lse, _, rng_state = _flash_attn_forward(q, k, v, 0.0, scale, causal, -1, -1, 0.0, None, False)
        ctx.save_for_backward(q, k, v, out, lse, rng_state)
        ctx.scale, ctx.causal = scale, causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, rng_state = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _flash_attn_backward(
            dout, q, k, v, out, lse, dq, dk, dv, 0.0, ctx.scale, ctx.causal, -1, -1, 0.0, None, False,
            rng_state=rng_state,
        )
        return dq, dk, dv, None, None
"""


def test_ported_custom_autograd_function_runs_and_matches_float64():
    namespace, code = port_and_run(AUTOGRAD, "call")
    assert (
        "flash_attn_compat._flash_attn_forward(" in code and "flash_attn_compat._flash_attn_backward(" in code
    )
    q, k, v = (
        x.requires_grad_() for x in (rand(2, 4, 4, 8), rand(2, 6, 2, 8, seed=1), rand(2, 6, 2, 8, seed=2))
    )
    dout = rand(2, 4, 4, 8, seed=3)
    out = namespace["Attention"].apply(q, k, v, 0.3, True)
    out.backward(dout)
    args = (q.detach().numpy(), k.detach().numpy(), v.detach().numpy())
    close(out, reference_attention(*args, scale=0.3, causal=True)[0])
    gq, gk, gv, _ = reference_attention_vjp(*args, dout.numpy(), scale=0.3, causal=True)
    close(q.grad, gq)
    close(k.grad, gk)
    close(v.grad, gv)


def test_2_7_calls_are_refused_when_the_configured_release_is_2_6():
    """The 2.7+ calls do not fit 2.6's signatures (window_size tuple, 8 return values): refused."""
    from flashport import rules as registry
    from flashport.rewriter.engine.pipeline import transform_source
    from flashport.rules.base import RuleOptions

    result = transform_source(
        AUTOGRAD.encode(), "case.py", registry.all_rules(), RuleOptions(flash_attn_version=(2, 6, 3))
    )
    calls = [s for s in result.sites if s.kind == "call"]
    assert calls and all(s.status == "refused" and "(flash-attn 2.6.3)" in s.reason for s in calls), [
        s.reason for s in calls
    ]
    assert result.new is None


BRANCHES = """
import torch
from flash_attn.flash_attn_interface import _flash_attn_backward, _flash_attn_forward
from packaging import version

flash_attn_version = version.parse("2.8.3")


def forward_backward(q, k, v, dout, scale):
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if flash_attn_version >= version.parse("2.7.0"):
        out, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, scale, causal=True, window_size_left=-1,
                                             window_size_right=-1, softcap=0.0, alibi_slopes=None,
                                             return_softmax=False)
        _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, scale, True, -1, -1, 0.0, None, False)
    elif flash_attn_version >= version.parse("2.6.0"):
        out, _, _, _, _, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, scale, causal=True, window_size=(-1, -1),
                                                         softcap=0.0, alibi_slopes=None, return_softmax=False)
        _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, scale, True, (-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, rng_state=None)
    else:
        out, _, _, _, _, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, scale, causal=True, window_size=(-1, -1),
                                                         alibi_slopes=None, return_softmax=False)
        _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, scale, True, (-1, -1),
                             alibi_slopes=None, deterministic=False, rng_state=None)
    return out, dq, dk, dv
"""


@pytest.mark.parametrize("installed", ["2.8.3", "2.6.3", "2.5.8"])
def test_version_branches_port_to_each_releases_drop_in_and_agree(installed):
    """Each branch (2.7+, 2.6, 2.4-2.5 signatures and return conventions) goes to its own drop-in,
    and every branch computes the float64 reference (the installed version picks the branch)."""
    from packaging import version

    namespace, code = port_and_run(BRANCHES, "call")
    for target in ("_flash_attn_forward(", "_flash_attn_forward_v2_6(", "_flash_attn_forward_v2_4("):
        assert f"flash_attn_compat.{target}" in code
    for target in ("_flash_attn_backward(", "_flash_attn_backward_v2_6(", "_flash_attn_backward_v2_4("):
        assert f"flash_attn_compat.{target}" in code
    namespace["flash_attn_version"] = version.parse(installed)
    q, k, v = rand(1, 4, 2, 8), rand(1, 6, 2, 8, seed=1), rand(1, 6, 2, 8, seed=2)
    dout = rand(1, 4, 2, 8, seed=3)
    out, dq, dk, dv = namespace["forward_backward"](q, k, v, dout, 0.4)
    args = (q.numpy(), k.numpy(), v.numpy())
    close(out, reference_attention(*args, scale=0.4, causal=True)[0])
    gq, gk, gv, _ = reference_attention_vjp(*args, dout.numpy(), scale=0.4, causal=True)
    close(dq, gq)
    close(dk, gk)
    close(dv, gv)


RING_VALUES = """
import inspect

from flash_attn.flash_attn_interface import _flash_attn_forward


def get_default_args(func):
    spec = inspect.signature(func)
    return {k: v.default for k, v in spec.parameters.items() if v.default is not inspect.Parameter.empty}


def block(q, k, v, scale, causal, dropout_p=0.0):
    # ring-attention style: the kernel's defaults read from its signature, then called with **params
    params = get_default_args(_flash_attn_forward).copy()
    params.update({"q": q, "k": k, "v": v, "dropout_p": dropout_p, "softmax_scale": scale, "causal": causal,
                   "window_size_left": -1, "window_size_right": -1, "softcap": 0.0, "alibi_slopes": None,
                   "return_softmax": True and dropout_p > 0})
    out, lse, *_ = _flash_attn_forward(**params)
    return out, lse
"""


def test_kernel_values_read_for_their_signature_and_starred_results_run_on_the_drop_in():
    namespace, code = port_and_run(RING_VALUES, "reference")
    assert "get_default_args(flashport.integrations.flash_attn_compat._flash_attn_forward)" in code
    q, k, v = rand(2, 5, 2, 8, seed=1), rand(2, 7, 2, 8, seed=2), rand(2, 7, 2, 8, seed=3)
    out, lse = namespace["block"](q, k, v, 0.3, True)
    want_out, want_lse = reference_attention(q.numpy(), k.numpy(), v.numpy(), scale=0.3, causal=True)
    close(out, want_out)
    close(lse, flash_lse(want_lse))
    with pytest.raises(ValueError, match="return_softmax"):  # flash-attn's S_dmask is not produced
        namespace["block"](q, k, v, 0.3, True, dropout_p=0.1)


def test_varlen_kernels_written_for_2_6_run_on_their_drop_ins():
    source = (
        pathlib.Path(__file__).parent / "fixtures" / "codemod" / "FPA008" / "varlen_written_for_2_6.py"
    ).read_text()
    namespace, code = port_and_run(source.split("\n\ndef written_for_2_5")[0], "call")
    assert "_flash_attn_varlen_forward_v2_6(" in code and "_flash_attn_varlen_backward_v2_6(" in code
    lengths = [3, 5]
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q, k, v = rand(8, 4, 8, seed=1), rand(8, 2, 8, seed=2), rand(8, 2, 8, seed=3)
    out, lse = namespace["ring_step"](q, k, v, cu, 5, 0.0, 0.4, True, (-1, -1), 0.0, None)
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        want_out, want_lse = reference_attention(
            q[part][None].numpy(), k[part][None].numpy(), v[part][None].numpy(), scale=0.4, causal=True
        )
        close(out[part], want_out[0])
        close(lse[:, part], want_lse[0])
        start += n
    dout = rand(8, 4, 8, seed=4)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    namespace["ring_grad"](
        dout, q, k, v, out, lse, dq, dk, dv, cu, 5, 0.0, 0.4, True, (-1, -1), 0.0, None, False, None
    )
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        grads = reference_attention_vjp(
            q[part][None].numpy(),
            k[part][None].numpy(),
            v[part][None].numpy(),
            dout[part][None].numpy(),
            scale=0.4,
            causal=True,
        )
        for got, want in zip((dq, dk, dv), grads[:3], strict=True):
            close(got[part], want[0])
        start += n


def test_kernels_written_for_2_0_run_on_their_drop_ins():
    """flash-attn 2.0.2-2.2's private signatures (no window, softcap or ALiBi; ``rng_state`` last):
    the ported calls give the float64 reference's outputs, lse and in-place gradients."""
    source = (
        pathlib.Path(__file__).parent / "fixtures" / "codemod" / "FPA008" / "written_for_2_0.py"
    ).read_text()
    namespace, code = port_and_run(source.split("\n\ndef ambiguous_grad")[0], "call")
    for name in (
        "_flash_attn_forward",
        "_flash_attn_backward",
        "_flash_attn_varlen_forward",
        "_flash_attn_varlen_backward",
    ):
        assert f"{name}_v2_0(" in code
    q, k, v, dout = (
        rand(2, 5, 2, 8),
        rand(2, 5, 2, 8, seed=1),
        rand(2, 5, 2, 8, seed=2),
        rand(2, 5, 2, 8, seed=3),
    )
    out, lse, rng_state = namespace["dense_step"](q, k, v, 0.3)
    want, want_lse = reference_attention(q.numpy(), k.numpy(), v.numpy(), scale=0.3, causal=True)
    close(out, want)
    close(lse, flash_lse(want_lse))
    assert rng_state is None
    buffers = [torch.empty_like(x) for x in (q, k, v)]
    dq, dk, dv = namespace["dense_grad"](dout, q, k, v, out, lse, *buffers, 0.3)
    grads = reference_attention_vjp(q.numpy(), k.numpy(), v.numpy(), dout.numpy(), scale=0.3, causal=True)
    for got, want_grad, buffer in zip((dq, dk, dv), grads[:3], buffers, strict=True):
        assert got is buffer  # written in place, as flash-attn does
        close(got, want_grad)
    cu, lengths = torch.tensor([0, 3, 8], dtype=torch.int32), [3, 5]
    q, k, v, dout = rand(8, 4, 8, seed=4), rand(8, 2, 8, seed=5), rand(8, 2, 8, seed=6), rand(8, 4, 8, seed=7)
    out, lse = namespace["varlen_step"](q, k, v, cu, 5, 0.4)
    dq, dk, dv = namespace["varlen_grad"](
        dout, q, k, v, out, lse, *(torch.empty_like(x) for x in (q, k, v)), cu, 5, 0.4
    )
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        args = (q[part][None].numpy(), k[part][None].numpy(), v[part][None].numpy())
        want, want_lse = reference_attention(*args, scale=0.4, causal=True)
        close(out[part], want[0])
        close(lse[:, part], flash_lse(want_lse[0]))
        grads = reference_attention_vjp(*args, dout[part][None].numpy(), scale=0.4, causal=True)
        for got, want_grad in zip((dq, dk, dv), grads[:3], strict=True):
            close(got[part], want_grad[0])
        start += n


def test_a_dict_splat_with_known_keys_picks_the_release_that_has_them():
    """``**kwargs`` built as a dict display in the function around the call (colossalai's ring
    attention): a key a release lacks (``softcap`` before 2.6) would raise there, so only the
    releases with every key remain; a key removed by ``del``/``pop`` does not count."""
    from flashport import rules as registry
    from flashport.rewriter.engine.pipeline import transform_source
    from flashport.rules.base import RuleOptions

    source = textwrap.dedent(
        """
        import flash_attn
        from flash_attn.flash_attn_interface import _flash_attn_varlen_forward
        from packaging import version

        def forward(q, k, v, cu, m, scale):
            misc = {"softmax_scale": scale, "dropout_p": 0.0, "softcap": 0.0, "alibi_slopes": None,
                    "return_softmax": False}
            misc["window_size"] = (-1, -1)
            def attend(q, k, v):
                if version.parse(flash_attn.__version__) <= version.parse("2.6.3"):
                    out, _, _, _, _, lse, _, rng = _flash_attn_varlen_forward(q, k, v, cu, cu, m, m, causal=True, **misc)
                    return out, lse
            return attend(q, k, v)

        def popped(q, k, v, cu, m, scale):
            misc = {"softmax_scale": scale, "dropout_p": 0.0, "softcap": 0.0, "window_size": (-1, -1)}
            misc.pop("softcap")
            if version.parse(flash_attn.__version__) <= version.parse("2.6.3"):
                out, _, _, _, _, lse, _, rng = _flash_attn_varlen_forward(q, k, v, cu, cu, m, m, causal=True, **misc)
                return out
        """
    )
    result = transform_source(source.encode(), "case.py", registry.all_rules(), RuleOptions())
    sites = {s.line: s for s in result.sites if s.kind == "call"}
    assert [(line, s.status) for line, s in sites.items()] == [(12, "rewrite"), (20, "refused")], [
        (line, s.reason) for line, s in sites.items()
    ]
    assert "_flash_attn_varlen_forward_v2_6" in " ".join(sites[12].notes)
    assert "several flash-attn releases" in sites[20].reason
