"""benchmarks/tpu_hlo_ops.py and the op split of benchmarks/llo_profile.py, on CPU.

The TPU compile needs libtpu; what a CPU host can check is that the entry computation is cut out of
an optimized HLO module whole (every parameter, the root, nothing of the fused computations) with its
attributes dropped, and that the kernel/around split names the attention custom calls only.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    """Import ``benchmarks/<name>.py`` (registered under ``name``, as the scripts import each other)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    module = sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


llo_profile = _load("llo_profile")
tpu_hlo_ops = _load("tpu_hlo_ops")


def test_entry_ops_is_the_whole_entry_computation_without_attributes():
    def fn(a, b, c):
        return jnp.tanh(a @ b) + jnp.sum(c)

    x = jnp.ones((8, 8), jnp.float32)
    text = jax.jit(fn).lower(x, x, x).compile().as_text()
    ops = tpu_hlo_ops.entry_ops(text)
    params = [op for op in ops if " parameter(" in op]
    assert sorted(p.split("parameter(")[1][0] for p in params) == ["0", "1", "2"]
    assert sum(op.startswith("ROOT ") for op in ops) == 1
    assert not any("metadata=" in op for op in ops)
    # Instructions of the fused computations (after ENTRY or before it) are not in the list.
    entry = text[text.index("\nENTRY ") + 1 :].split("\n}", 1)[0]
    assert len(ops) == entry.count("\n")  # one line per instruction after the ENTRY header


def test_kernel_ops_are_the_attention_custom_calls():
    cycles = {"flashport_flash_fwd.1": 40, "splash_mha.2": 7, "copy.3": 5, "convert_reduce_fusion": 2}
    assert llo_profile.kernel_ops(cycles) == {"flashport_flash_fwd.1", "splash_mha.2"}
    assert llo_profile.kernel_cycles(cycles) == 47
