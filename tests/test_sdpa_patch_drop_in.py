"""The SDPA drop-in honours a run-time patch of ``torch.nn.functional.scaled_dot_product_attention``
(context-parallel SDPA, kernel-picking wrappers): it calls the installed patch with the arguments
verbatim, runs flashport's SDPA inside the patch (re-entrancy guard) and when nothing is patched.
Checked in float64 against the contract's reference and torch's own SDPA."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from ported_code import rand  # noqa: E402
from reference import reference_attention  # noqa: E402

import flashport.torch  # noqa: E402
from flashport.integrations import sdpa_compat  # noqa: E402

TORCH_SDPA = torch.nn.functional.scaled_dot_product_attention  # torch's own (nothing patched yet)


def want(q, k, v, causal=False):
    """float64 reference of SDPA (BHSD, top-left causal)."""
    out, _ = reference_attention(q, k, v, causal=causal, align="top_left", layout="BHSD")
    return torch.from_numpy(out)


def close(got, expected, atol=2e-5):
    assert got.shape == expected.shape, (got.shape, expected.shape)
    assert torch.allclose(got.double(), expected, atol=atol), float((got.double() - expected).abs().max())


def qkv():
    return rand(2, 4, 5, 8), rand(2, 4, 7, 8, seed=1), rand(2, 4, 7, 8, seed=2)


def test_torch_sdpa_is_unpatched_at_import():
    assert TORCH_SDPA is torch._C._nn.scaled_dot_product_attention


def test_no_patch_runs_flashport(monkeypatch):
    q, k, v = qkv()
    close(sdpa_compat.scaled_dot_product_attention(q, k, v, None, 0.0, True), want(q, k, v, causal=True))


def test_patch_gets_the_call_with_its_arguments_verbatim(monkeypatch):
    calls = []

    def patch(*args, **kwargs):
        calls.append((args, kwargs))
        return 2 * TORCH_SDPA(*args, **kwargs)  # changes the result: the drop-in must return it

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", patch)
    q, k, v = qkv()
    got = sdpa_compat.scaled_dot_product_attention(q, k, v, None, is_causal=True)
    close(got, 2 * want(q, k, v, causal=True))
    assert len(calls) == 1
    args, kwargs = calls[0]
    assert len(args) == 4 and all(a is b for a, b in zip(args, (q, k, v), strict=False)) and args[3] is None
    assert kwargs == {"is_causal": True}  # nothing added: a patch with a narrow signature still works


def test_patch_that_calls_a_ported_call_inside_runs_flashport(monkeypatch):
    calls = []

    def context_parallel_like(query, key, value, **kwargs):
        calls.append(kwargs)  # a ported call inside the patch: the guard sends it to flashport
        return sdpa_compat.scaled_dot_product_attention(query, key, value, **kwargs) + 1.0

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", context_parallel_like)
    q, k, v = qkv()
    close(sdpa_compat.scaled_dot_product_attention(q, k, v, is_causal=True), want(q, k, v, causal=True) + 1)
    assert calls == [{"is_causal": True}]
    assert not getattr(sdpa_compat._GUARD, "active", False)  # reset after the call


def test_guard_is_reset_when_the_patch_raises(monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("patch failed")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", broken)
    q, k, v = qkv()
    with pytest.raises(ValueError, match="patch failed"):
        sdpa_compat.scaled_dot_product_attention(q, k, v)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", lambda *a, **kw: a[0] * 0)
    assert torch.count_nonzero(sdpa_compat.scaled_dot_product_attention(q, k, v)) == 0  # patch ran again


def test_guard_is_per_thread(monkeypatch):
    """A call on another thread while a patch runs on this one still reaches the patch."""
    seen = []

    def patch(query, key, value, **kwargs):
        seen.append(threading.current_thread().name)
        if len(seen) == 1:
            worker = threading.Thread(
                target=lambda: sdpa_compat.scaled_dot_product_attention(query, key, value), name="other"
            )
            worker.start()
            worker.join()
        return sdpa_compat.scaled_dot_product_attention(query, key, value, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", patch)
    q, k, v = qkv()
    close(sdpa_compat.scaled_dot_product_attention(q, k, v), want(q, k, v))
    assert seen == [threading.current_thread().name, "other"]


def test_the_drop_in_installed_as_the_patch_does_not_recurse(monkeypatch):
    monkeypatch.setattr(
        torch.nn.functional, "scaled_dot_product_attention", sdpa_compat.scaled_dot_product_attention
    )
    q, k, v = qkv()
    close(sdpa_compat.scaled_dot_product_attention(q, k, v, is_causal=True), want(q, k, v, causal=True))


def test_flashport_torch_attention_never_calls_a_patch(monkeypatch):
    """flashport's own CPU path uses torch's SDPA function, not whatever is patched in."""

    def patch(*args, **kwargs):
        raise AssertionError("flashport.torch.attention called the patched SDPA")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", patch)
    q, k, v = qkv()
    got = flashport.torch.attention(q, k, v, causal=True, align="top_left", layout="BHSD")
    close(got, want(q, k, v, causal=True))
    close(sdpa_compat.flashport_sdpa(q, k, v, is_causal=True), want(q, k, v, causal=True))
