"""Value uses ported to the drop-ins (``functools.partial``, dispatch tables, callbacks, attributes,
kept aliases): the rewritten source runs with the real flashport drop-ins and is compared with
float64 references of the source APIs (``tests/torch_semantics_reference.py``); the GPU imports are
gone. Probes keep the GPU name, so the code that decides between GPU and fallback paths still does.
"""

from __future__ import annotations

import textwrap

import pytest

from flashport import rules as registry
from flashport.rewriter.engine.pipeline import transform_source
from flashport.rules.base import RuleOptions

torch = pytest.importorskip("torch")

from ported_code import port_and_run, rand  # noqa: E402
from torch_semantics_reference import flash_attn_ref, flash_attn_varlen_ref  # noqa: E402


def port(source: str, **options) -> tuple[dict, str]:
    """Rewrite ``source`` (every reference site rewritten, no GPU import left) and exec it (tests/ported_code.py)."""
    return port_and_run(source, "reference", **options)


def close(got, want):
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


PARTIAL = """
    import functools

    from flash_attn import flash_attn_func

    causal_attention = functools.partial(flash_attn_func, causal=True, softmax_scale=0.3)
    windowed = functools.partial(flash_attn_func, window_size=(2, 0))
"""


@pytest.mark.parametrize("sq, sk", [(4, 4), (3, 6)])  # Sq < Sk: bottom-right alignment matters
def test_a_partial_of_flash_attn_func_runs_on_the_drop_in(sq, sk):
    namespace, _ = port(PARTIAL)
    q, k, v = rand(2, sq, 4, 8), rand(2, sk, 2, 8, seed=1), rand(2, sk, 2, 8, seed=2)  # GQA 4:2
    close(namespace["causal_attention"](q, k, v), flash_attn_ref(q, k, v, causal=True, softmax_scale=0.3))
    close(namespace["windowed"](q, k, v), flash_attn_ref(q, k, v, window_size=(2, 0)))
    close(
        namespace["windowed"](q, k, v, causal=True), flash_attn_ref(q, k, v, window_size=(2, 0), causal=True)
    )


TABLE = """
    import xformers.ops as xops
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    KERNELS = {"fa2": flash_attn_func, "varlen": flash_attn_varlen_func, "mea": xops.memory_efficient_attention}


    def attend(kind, *args, **kwargs):
        return KERNELS[kind](*args, **kwargs)
"""


def test_a_dispatch_table_runs_every_entry_on_its_drop_in():
    namespace, code = port(TABLE)
    assert (
        "flash_attn_compat.flash_attn_varlen_func" in code
        and "xformers_compat.memory_efficient_attention" in code
    )
    attend = namespace["attend"]
    q, k, v = rand(1, 5, 2, 8), rand(1, 7, 2, 8, seed=1), rand(1, 7, 2, 8, seed=2)
    close(attend("fa2", q, k, v, causal=True), flash_attn_ref(q, k, v, causal=True))
    close(attend("fa2", q, k, v, 0.0, 0.5), flash_attn_ref(q, k, v, softmax_scale=0.5))  # positional
    cu_q, cu_k = torch.tensor([0, 2, 6], dtype=torch.int32), torch.tensor([0, 3, 9], dtype=torch.int32)
    vq, vk, vv = rand(6, 2, 8, seed=3), rand(9, 2, 8, seed=4), rand(9, 2, 8, seed=5)
    close(
        attend("varlen", vq, vk, vv, cu_q, cu_k, 4, 6, causal=True),
        flash_attn_varlen_ref(vq, vk, vv, cu_q, cu_k, causal=True),
    )
    # xformers: [B, M, H, K], no mask = full attention, scale K ** -0.5 (= flash-attn's non-causal call)
    close(attend("mea", q, k, v), flash_attn_ref(q, k, v))
    close(attend("mea", q, k, v, scale=0.2), flash_attn_ref(q, k, v, softmax_scale=0.2))


CALLBACK = """
    from flash_attn import flash_attn_func


    class Block:
        def __init__(self):
            self.kernel = flash_attn_func

        def forward(self, q, k, v):
            return self.kernel(q, k, v, causal=True)


    def run(fn, *args, **kwargs):
        return fn(*args, **kwargs)


    def attend(q, k, v):
        return run(flash_attn_func, q, k, v, softcap=2.0)
"""


def test_a_callback_and_an_attribute_run_on_the_drop_in():
    namespace, _ = port(CALLBACK)
    q, k, v = rand(2, 3, 2, 8), rand(2, 6, 2, 8, seed=1), rand(2, 6, 2, 8, seed=2)
    close(namespace["attend"](q, k, v), flash_attn_ref(q, k, v, softcap=2.0))
    close(namespace["Block"]().forward(q, k, v), flash_attn_ref(q, k, v, causal=True))


def test_a_kept_alias_becomes_the_drop_in_and_its_value_uses_follow():
    namespace, code = port("""
        from flash_attn import flash_attn_func

        attention = flash_attn_func


        def both(q, k, v, table):
            table.append(attention)
            return attention(q, k, v, causal=True)
    """)
    assert "attention = flashport.integrations.flash_attn_compat.flash_attn_func" in code
    q, k, v = rand(1, 4, 2, 8), rand(1, 4, 2, 8, seed=1), rand(1, 4, 2, 8, seed=2)
    table: list = []
    close(namespace["both"](q, k, v, table), flash_attn_ref(q, k, v, causal=True))
    close(table[0](q, k, v), flash_attn_ref(q, k, v))


def test_a_probe_keeps_deciding_between_gpu_and_fallback():
    source = """
        try:
            from flash_attn import flash_attn_func
        except ImportError:
            flash_attn_func = None

        HAS_FLASH = callable(flash_attn_func)
        KERNELS = {"fa2": flash_attn_func}


        def kernel():
            return KERNELS["fa2"] if KERNELS["fa2"] is not None else "fallback"
    """
    result = transform_source(
        textwrap.dedent(source).encode(), "case.py", registry.all_rules(), RuleOptions()
    )
    assert result.new is None  # every value may be the None fallback: nothing is replaced
    assert {s.status for s in result.sites} == {"refused"}
    namespace: dict = {}
    exec(compile(textwrap.dedent(source), "kept.py", "exec"), namespace)  # no flash_attn here
    assert namespace["HAS_FLASH"] is False and namespace["kernel"]() == "fallback"
