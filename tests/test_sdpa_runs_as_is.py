"""SDPA backend switches and kernel probes run as is on a host without CUDA: flashport.torch's CPU
path does not depend on them, and a ported file that keeps them computes what the original means.

A switch or a probe is kept byte-identical and reported with the reason prefix ``RUNS_AS_IS``
(benchmarks/real_repos.py counts them apart); this checks that keeping them is safe: torch SDPA's
backend flags, switched off or narrowed to a CUDA-only kernel, leave ``flashport.torch.attention``
on CPU tensors equal to the float64 reference and the caller's flags as they were.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ported_code import rand  # noqa: E402
from reference import reference_attention  # noqa: E402

import flashport.torch  # noqa: E402
from flashport import rules as registry  # noqa: E402
from flashport.rewriter.engine.pipeline import transform_source  # noqa: E402
from flashport.rules.base import RUNS_AS_IS, RuleOptions  # noqa: E402

FLAGS = ("flash", "math", "mem_efficient", "cudnn")


def flags():
    return {name: getattr(torch.backends.cuda, f"{name}_sdp_enabled")() for name in FLAGS}


@pytest.fixture
def restore_flags():
    before = flags()
    yield
    for name, on in before.items():
        getattr(torch.backends.cuda, f"enable_{name}_sdp")(on)


def test_flashport_cpu_path_ignores_switches_and_selectors(restore_flags):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (
        x.requires_grad_() for x in (rand(1, 2, 5, 8), rand(1, 2, 5, 8, seed=1), rand(1, 2, 5, 8, seed=2))
    )
    want = reference_attention(
        *(x.detach().numpy() for x in (q, k, v)), causal=True, align="top_left", layout="BHSD"
    )[0]
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_math_sdp(False)  # torch SDPA itself has no kernel left on CPU
    with pytest.raises(RuntimeError):
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
    switched = flags()
    out = flashport.torch.attention(q, k, v, causal=True, align="top_left", layout="BHSD")
    out.sum().backward()
    assert flags() == switched  # the caller's flags are left as they were
    np.testing.assert_allclose(out.detach().numpy(), want, atol=2e-5)
    torch.backends.cuda.enable_flash_sdp(True)
    torch.backends.cuda.enable_math_sdp(True)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):  # a CUDA-only kernel: nothing on CPU
        out = flashport.torch.attention(q, k, v, causal=True, align="top_left", layout="BHSD")
    np.testing.assert_allclose(out.detach().numpy(), want, atol=2e-5)


SOURCE = """
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

torch.backends.cuda.enable_cudnn_sdp(False)
torch.backends.cuda.enable_mem_efficient_sdp(False)


def cudnn_runs():
    q = torch.zeros((1, 2, 8, 64))
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(q, q, q)
    except RuntimeError:
        return False
    return True


def attend(q, k, v):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION if cudnn_runs() else SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
"""


def test_ported_file_keeps_switches_and_probe_and_runs(restore_flags):
    result = transform_source(
        textwrap.dedent(SOURCE).encode(), "case.py", registry.all_rules(), RuleOptions()
    )
    kept = [s for s in result.sites if s.status != "rewrite"]
    assert {(s.rule, s.line) for s in kept} == {("FPA102", 6), ("FPA102", 7), ("FPA102", 13), ("FPA101", 14)}
    assert all(s.reason.startswith(RUNS_AS_IS) for s in kept), [s.reason for s in kept]
    code = result.new.decode()
    assert "flashport.torch.attention(" in code and "enable_cudnn_sdp(False)" in code
    namespace: dict = {}
    exec(compile(code, "ported.py", "exec"), namespace)
    assert namespace["cudnn_runs"]() is False  # the probe answers for this (CPU) host, unchanged
    q, k, v = rand(1, 2, 6, 8), rand(1, 2, 6, 8, seed=1), rand(1, 2, 6, 8, seed=2)
    want = reference_attention(q.numpy(), k.numpy(), v.numpy(), causal=True, align="top_left", layout="BHSD")[
        0
    ]
    np.testing.assert_allclose(namespace["attend"](q, k, v).numpy(), want, atol=2e-5)


MATH_SOURCE = """
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

DEFAULT_BACKENDS = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


def default_backends():
    return sdpa_kernel(DEFAULT_BACKENDS, set_priority=True)


def attend(q, k, v, mask):
    with default_backends():
        kept = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # flashport: ignore[FPA101]
    with sdpa_kernel(SDPBackend.MATH):
        ported = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        also_kept = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # flashport: ignore[FPA101]
    return kept, ported, also_kept
"""


def test_selectors_keeping_the_math_kernel_run_as_is():
    """A selector whose backends include SDPBackend.MATH is kept wherever it is used; torch SDPA calls
    left under it still find a kernel on a CPU host and compute the float64 reference."""
    result = transform_source(
        textwrap.dedent(MATH_SOURCE).encode(), "case.py", registry.all_rules(), RuleOptions()
    )
    selectors = [s for s in result.sites if s.rule == "FPA102"]
    assert [s.line for s in selectors] == [14, 20] and all(s.status == "as_is" for s in selectors)
    assert all(s.reason.startswith(RUNS_AS_IS) for s in selectors), [s.reason for s in selectors]
    code = result.new.decode()
    assert "return sdpa_kernel(DEFAULT_BACKENDS, set_priority=True)" in code
    assert "with sdpa_kernel(SDPBackend.MATH):" in code and "ported = flashport.torch.attention(" in code
    namespace: dict = {}
    exec(compile(code, "ported.py", "exec"), namespace)
    q, k, v = rand(1, 2, 6, 8), rand(1, 2, 6, 8, seed=1), rand(1, 2, 6, 8, seed=2)
    mask = torch.rand(6, 6, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[:, 0] = True
    masked = reference_attention(q.numpy(), k.numpy(), v.numpy(), mask=mask.numpy(), layout="BHSD")[0]
    causal = reference_attention(
        q.numpy(), k.numpy(), v.numpy(), causal=True, align="top_left", layout="BHSD"
    )[0]
    kept, ported, also_kept = namespace["attend"](q, k, v, mask)
    np.testing.assert_allclose(kept.numpy(), masked, atol=2e-5)
    np.testing.assert_allclose(ported.numpy(), masked, atol=2e-5)
    np.testing.assert_allclose(also_kept.numpy(), causal, atol=2e-5)


def test_selectors_without_the_math_kernel_may_leave_cpu_sdpa_without_a_kernel():
    """Why a selector without SDPBackend.MATH stays refused when torch SDPA may run under it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = rand(1, 2, 6, 8)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        with pytest.raises(RuntimeError):
            torch.nn.functional.scaled_dot_product_attention(q, q, q)
