"""Equivalence of real code before and after the port (slow tier).

Each unit under ``tests/fixtures/real_units/`` is a small excerpt of a real repository's attention
code (origin in its first line). The original runs on float64 CPU stand-ins of the GPU libraries
(``tests/gpu_standins.py``, written from their documentation); the ported unit runs on flashport
with every GPU library blocked from import and must call no stand-in. Outputs, lse and the gradients
of a fixed random projection of the outputs must agree.
"""

from __future__ import annotations

import importlib.abc
import pathlib
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gpu_standins  # noqa: E402

from flashport import rules as registry  # noqa: E402
from flashport.rewriter.engine.pipeline import transform_source  # noqa: E402
from flashport.rules.base import RuleOptions  # noqa: E402

UNITS = pathlib.Path(__file__).parent / "fixtures" / "real_units"
GPU = ("flash_attn", "flash_attn_interface", "flash_attn_3", "hopper", "xformers", "sglang", "sgl_kernel")
ATOL = 5e-5


class _Blocker(importlib.abc.MetaPathFinder):
    """GPU libraries are absent (a TPU host): importing one raises."""

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in GPU:
            raise ImportError(f"No module named {name!r} (blocked: a GPU library)")
        return None


def _rand(*shape, seed):
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape))


def _dense_inputs(b=2, sq=5, sk=7, h=4, hk=2, d=8):
    return {
        "q": _rand(b, sq, h, d, seed=1),
        "k": _rand(b, sk, hk, d, seed=2),
        "v": _rand(b, sk, hk, d, seed=3),
    }


def _cu(lengths):
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)


# unit -> (tensor inputs, other keyword arguments, differentiable through the port)
CASES = {
    "ring_flash_attn_block": (_dense_inputs(), {"softmax_scale": 0.3, "causal": True}, False),
    "colossalai_ring_misc_kwargs": (
        {"q": _rand(8, 4, 8, seed=20), "k": _rand(8, 2, 8, seed=21), "v": _rand(8, 2, 8, seed=22)},
        {"cu_seqlens": _cu([3, 5]), "max_seqlen": 5, "softmax_scale": 0.35},
        False,
    ),
    "hunyuan_parallel": (
        {"q": _rand(2, 4, 2, 8, seed=4), "k": _rand(2, 4, 2, 8, seed=5), "v": _rand(2, 4, 2, 8, seed=6)},
        {
            "cu_seqlens_q": _cu([4, 4]),
            "cu_seqlens_kv": _cu([4, 4]),
            "max_seqlen_q": 4,
            "max_seqlen_kv": 4,
            "batch_size": 2,
        },
        False,
    ),
    "wan_fa3_varlen": (_dense_inputs(sq=6, sk=6), {"causal": True, "softmax_scale": 0.5}, True),
    "xdit_fa2_lse": (
        {
            "query": _rand(2, 4, 5, 8, seed=7),
            "key": _rand(2, 4, 7, 8, seed=8),
            "value": _rand(2, 4, 7, 8, seed=9),
        },
        {"is_causal": True},
        True,
    ),
    "verl_window_probe": (
        {
            "query_states": _rand(2, 6, 4, 8, seed=10),
            "key_states": _rand(2, 6, 2, 8, seed=11),
            "value_states": _rand(2, 6, 2, 8, seed=12),
        },
        {"sliding_window": 2},
        True,
    ),
    "megatron_fa3_paged_prefill": (
        {"q": _rand(8, 1, 4, 8, seed=23), "k": _rand(5, 4, 2, 8, seed=24), "v": _rand(5, 4, 2, 8, seed=25)},
        {
            "cu_seqlens_q": _cu([3, 5]),
            "seqlens_k": torch.tensor([6, 7], dtype=torch.int32),
            "block_table": torch.tensor([[3, 0], [1, 4]], dtype=torch.int32),
            "softmax_scale": 0.3,
        },
        False,
    ),
    "mistral_block_bias": (
        {"xq": _rand(8, 2, 8, seed=13), "xk": _rand(8, 2, 8, seed=14), "xv": _rand(8, 2, 8, seed=15)},
        {"seqlens": (3, 5)},
        True,
    ),
    "yunchang_fa3_private": (_dense_inputs(), {"softmax_scale": 0.45}, False),
    "yunchang_versions": (_dense_inputs(sq=6, sk=6), {"causal": True, "window_size": (3, 0)}, False),
    "opensora_fa3_private": (_dense_inputs(), {"softmax_scale": 0.4}, False),
    "sglang_musa_decode_sinks": (
        {
            "q": _rand(3, 4, 8, seed=26),
            "k_cache": _rand(5, 4, 2, 8, seed=27),
            "v_cache": _rand(5, 4, 2, 8, seed=28),
            "sinks": _rand(4, seed=29),
        },
        {
            "cu_seqlens_q": _cu([1, 2]),
            "cache_seqlens": torch.tensor([6, 7], dtype=torch.int32),
            "page_table": torch.tensor([[3, 0], [1, 4]], dtype=torch.int32),
            "sliding_window_size": 3,
            "scaling": 0.4,
        },
        True,
    ),
    "sglang_musa_mha_lse": (
        {"q": _rand(8, 4, 8, seed=17), "k": _rand(8, 2, 8, seed=18), "v": _rand(8, 2, 8, seed=19)},
        {"cu_seqlens_q": _cu([3, 5]), "scaling": 0.3},
        True,
    ),
    "verl_logprobs": (
        {"logits": _rand(6, 11, seed=16)},
        {"labels": torch.tensor([3, 0, -100, 10, 7, 1])},
        True,
    ),
}

# units written for another build of FA3's flash_attn_interface than flash-attention's own
FA3_BUILD = {
    "sglang_musa_mha_lse": "sgl-kernel",
    "sglang_musa_decode_sinks": "sgl-kernel",
    "yunchang_fa3_private": "2025-04-10",
}


def _run(code: str, name: str, tensors: dict, kwargs: dict, grads: bool):
    namespace: dict = {"__name__": f"unit_{name}"}
    exec(compile(code, f"{name}.py", "exec"), namespace)
    leaves = {key: t.clone().requires_grad_(grads) for key, t in tensors.items()}
    outputs = namespace["run"](**leaves, **kwargs)
    found = {key: value.detach().double() for key, value in outputs.items()}
    if grads:
        loss = sum(
            (value.double() * _rand(*value.shape, seed=99)).sum()
            for key, value in outputs.items()
            if key != "lse"
        )
        for key, g in zip(leaves, torch.autograd.grad(loss, list(leaves.values())), strict=True):
            found[f"d{key}"] = g.double()
    return found


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_ported_unit_matches_the_original_on_gpu_standins(name):
    source = (UNITS / f"{name}.py").read_text()
    tensors, kwargs, grads = CASES[name]
    gpu_standins.CALLS.clear()
    with gpu_standins.installed(FA3_BUILD.get(name, "flash-attention")):
        want = _run(source, name, tensors, kwargs, grads)
    assert gpu_standins.CALLS, "the original unit ran on the stand-ins"
    result = transform_source(source.encode(), f"{name}.py", registry.all_rules(), RuleOptions())
    counted = [s for s in result.sites if s.kind in ("call", "reference")]
    assert counted and all(s.status == "rewrite" for s in counted), [(s.line, s.reason) for s in counted]
    ported = result.new.decode()
    gpu_standins.CALLS.clear()
    blocker = _Blocker()
    sys.meta_path.insert(0, blocker)
    try:
        got = _run(ported, name, {key: t.float() for key, t in tensors.items()}, kwargs, grads)
    finally:
        sys.meta_path.remove(blocker)
    assert not gpu_standins.CALLS, f"the ported unit still called {dict(gpu_standins.CALLS)}"
    assert set(got) == set(want)
    for key in want:
        np.testing.assert_allclose(got[key].numpy(), want[key].numpy(), atol=ATOL, rtol=1e-4, err_msg=key)
