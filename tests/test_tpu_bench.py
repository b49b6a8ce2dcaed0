"""benchmarks/tpu_bench.py on CPU: its FLOP model against XLA's own count, and every program traces.

The timed run needs a TPU and ``--compile-only`` needs libtpu; what a CPU host can check is that the
model FLOPs behind the TFLOP/s and %-of-peak columns agree with an independent count (XLA's cost
analysis of the materialized jax.nn attention) and that every implementation's program traces to
the right shapes, forward and forward+backward.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import jax
import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "tpu_bench.py"


def _load():
    spec = importlib.util.spec_from_file_location("tpu_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("tpu_bench", module)
    spec.loader.exec_module(module)
    return module


tpu_bench = _load()


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2)])
def test_flop_model_matches_xla_cost_analysis(heads, kv_heads):
    cfg = tpu_bench.Config(seq=256, heads=heads, kv_heads=kv_heads, causal=False, backward=False)
    compiled = jax.jit(tpu_bench.program("xla", cfg, "v6e")).lower(*tpu_bench.specs("xla", cfg)).compile()
    counted = compiled.cost_analysis()["flops"]
    # XLA counts the two matmuls (the model) plus a few flops per score for the softmax (< D / 4 of them).
    assert cfg.flops <= counted <= 1.1 * cfg.flops, (counted, cfg.flops)


@pytest.mark.parametrize("impl", tpu_bench.IMPLS)
@pytest.mark.parametrize("backward", [False, True])
def test_every_program_traces(impl, backward):
    cfg = tpu_bench.Config(seq=512, heads=4, kv_heads=2, causal=True, backward=backward)
    specs = tpu_bench.specs(impl, cfg)
    out = jax.eval_shape(tpu_bench.program(impl, cfg, "v6e"), *specs)
    if backward:
        _, grads = out
        assert [g.shape for g in grads] == [s.shape for s in specs]
    else:
        assert out.shape == specs[0].shape


def test_configs_and_peaks():
    cfgs = tpu_bench.configs([2048, 4096])
    assert len(cfgs) == 2 * len(tpu_bench.HEADS) * 2 * 2
    full = tpu_bench.Config(2048, 8, 8, causal=False, backward=False)
    assert tpu_bench.Config(2048, 8, 8, causal=True, backward=True).flops == pytest.approx(
        full.flops * 0.5 * 3.5
    )
    assert set(tpu_bench.DEVICE_KINDS.values()) <= set(tpu_bench.PEAK_BF16_TFLOPS)
