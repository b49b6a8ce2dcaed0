"""Fuzzer: random attention-like programs never crash the pass and keep their values when fused.

Programs are drawn from einsum spellings with every dimension order for q, k, v, the scores and the
output, softmax over any scores axis (only the key axis is attention), an optional where-mask
(causal or padding) and an optional transpose of the probabilities. Whatever is or is not fused,
``fuse_attention(f)(*x)`` must equal ``f(*x)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashport

SIZES = {"b": 2, "t": 3, "s": 4, "n": 2, "d": 4}


def _perm(draw, letters):
    return "".join(draw(st.permutations(letters)))


@st.composite
def programs(draw):
    """A random program spec."""
    return {
        "q": _perm(draw, "btnd"), "k": _perm(draw, "bsnd"), "v": _perm(draw, "bsnd"),
        "scores": _perm(draw, "bnts"), "out": _perm(draw, "btnd"),
        "axis": draw(st.sampled_from("bnts")),
        "mask": draw(st.sampled_from(["none", "causal", "padding"])),
        "p_transpose": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def _build(spec):
    scores_spec, axis = spec["scores"], spec["scores"].index(spec["axis"])

    def f(q, k, v, pad):
        s = jnp.einsum(f"{spec['q']},{spec['k']}->{scores_spec}", q, k) * 0.5
        if spec["mask"] != "none":
            if spec["mask"] == "causal":
                m, dims = jnp.tril(jnp.ones((SIZES["t"], SIZES["s"]), bool)), "ts"
            else:
                m, dims = pad, "bs"
            shape = [SIZES[c] if c in dims else 1 for c in scores_spec]
            order = sorted(dims, key=scores_spec.index)
            m = jnp.transpose(m, [dims.index(c) for c in order]).reshape(shape)
            s = jnp.where(m, s, jnp.finfo(s.dtype).min)
        p, p_spec = jax.nn.softmax(s, axis=axis), scores_spec
        if spec["p_transpose"]:
            p, p_spec = jnp.swapaxes(p, 0, -1), scores_spec[-1] + scores_spec[1:-1] + scores_spec[0]
        return jnp.einsum(f"{p_spec},{spec['v']}->{spec['out']}", p, v)

    rng = np.random.default_rng(spec["seed"])
    args = [jnp.asarray(rng.normal(size=[SIZES[c] for c in spec[x]]), jnp.float32) for x in ("q", "k", "v")]
    args.append(jnp.asarray(rng.random((SIZES["b"], SIZES["s"])) < 0.7).at[:, 0].set(True))
    return f, args


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(programs())
def test_fused_program_equals_original(spec):
    f, args = _build(spec)
    want = f(*args)
    got = flashport.fuse_attention(f)(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    flashport.find_attention(f)(*args)  # the report never raises either
