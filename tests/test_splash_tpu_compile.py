"""The ``splash`` backend through the real TPU compiler (libtpu), deviceless, forward and gradient.

Same setup as ``tests/test_tpu_compile.py`` (TPU devices of a topology, no TPU needed); marked
``tpu_compile`` and skipped without libtpu.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import pytest

import flashport

# A missing libtpu skips the tests, not the module: where the marker is deselected (the default
# tier) nothing is reported as skipped; where it is selected the skip names the fix.
pytestmark = [pytest.mark.tpu_compile]
if importlib.util.find_spec("libtpu") is None:
    pytestmark.append(
        pytest.mark.skip(reason='needs libtpu: pip install "jax[tpu]==<installed jax version>"')
    )
from test_tpu_compile import one_chip  # noqa: E402

S = 1024
# name -> (head_dim, kv heads, dtype, contract keywords, segment ids)
CONFIGS = {
    "causal_gqa_bf16": (128, 2, "bfloat16", dict(causal=True), False),
    "mqa_window_softcap_f32_d64": (64, 1, "float32", dict(window=(100, 0), softcap=30.0), False),
    "segments_causal_bf16": (128, 4, "bfloat16", dict(causal=True), True),
    "bottom_right_sq<sk_bf16": (128, 2, "bfloat16", dict(causal=True, scale=0.1), False),
}


@pytest.mark.parametrize("gen", ["v5e", "v6e"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_splash_forward_and_gradient_compile(gen, name):
    d, hkv, dtype, kwargs, segs = CONFIGS[name]
    sharding = one_chip(gen)
    sq = S // 2 if "sq<sk" in name else S
    spec = lambda s, dt: jax.ShapeDtypeStruct(s, jnp.dtype(dt), sharding=sharding)  # noqa: E731
    q, kv = spec((2, sq, 4, d), dtype), spec((2, S, hkv, d), dtype)
    extra = dict(q_segment_ids=spec((2, sq), "int32"), kv_segment_ids=spec((2, S), "int32")) if segs else {}

    def fwd(q, k, v, extra):
        return flashport.attention(q, k, v, backend="splash", **kwargs, **extra)

    def loss(q, k, v, extra):
        return jnp.sum(fwd(q, k, v, extra).astype(jnp.float32))

    texts = [
        jax.jit(fn).trace(q, kv, kv, extra).lower(lowering_platforms=("tpu",)).compile().as_text()
        for fn in (fwd, jax.value_and_grad(loss, argnums=(0, 1, 2)))
    ]
    kind = "mqa" if hkv == 1 else "mha"
    assert f"splash_{kind}_fwd" in texts[0]
    assert f"splash_{kind}_dkv" in texts[1] and f"splash_{kind}_dq" in texts[1]
