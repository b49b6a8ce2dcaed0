"""The drop-in for ``jax.nn.dot_product_attention`` calls whose implementation is known only at run
time: ``"xla"`` stays jax.nn's XLA path; None/``"cudnn"`` run the contract with jax.nn's meaning,
compared with jax.nn's ``implementation="xla"`` (the stand-in for ``"cudnn"``) on the rows both
compute, lse included; and the FPA201 port of a wrapper forwarding ``implementation`` runs."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashport import rules as registry
from flashport.integrations import jax_nn_compat
from flashport.rewriter.engine.pipeline import transform_source
from flashport.rules.base import RuleOptions

FIXTURE = (
    pathlib.Path(__file__).parent
    / "fixtures"
    / "codemod"
    / "FPA201"
    / "runtime_implementation_and_lengths.py"
)


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    return tuple(
        jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((2, 6, 4, 8), (2, 6, 2, 8), (2, 6, 2, 8))
    )


@pytest.mark.parametrize("implementation", [None, "cudnn"])
@pytest.mark.parametrize("causal", [False, True])
def test_lengths_window_and_residual_match_jax_nn_xla(implementation, causal):
    q, k, v = _inputs()
    lengths = jnp.array([6, 4], jnp.int32)
    kwargs = dict(
        is_causal=causal, query_seq_lengths=lengths, key_value_seq_lengths=lengths, local_window_size=(2, 1)
    )
    out, lse = jax_nn_compat.dot_product_attention(
        q, k, v, scale=0.4, implementation=implementation, return_residual=True, **kwargs
    )
    want, want_lse = jax.nn.dot_product_attention(
        q, k, v, scale=0.4, implementation="xla", return_residual=True, **kwargs
    )
    rows = np.arange(6)[None, :] < np.asarray(lengths)[:, None]
    np.testing.assert_allclose(np.asarray(out)[rows], np.asarray(want)[rows], atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse)[rows], np.asarray(want_lse)[rows], atol=2e-5)
    assert lse.shape == (2, 6, 4)


def test_explicit_xla_stays_jax_nn_and_unbatched_inputs_work():
    q, k, v = _inputs(seed=1)
    mask = jnp.asarray(np.random.default_rng(2).random((2, 1, 6, 6)) > 0.3) | jnp.eye(6, dtype=bool)
    got = jax_nn_compat.dot_product_attention(q, k, v, mask=mask, implementation="xla")
    np.testing.assert_array_equal(
        np.asarray(got), np.asarray(jax.nn.dot_product_attention(q, k, v, mask=mask))
    )
    flash = jax_nn_compat.dot_product_attention(q, k, v, mask=mask)
    np.testing.assert_allclose(np.asarray(flash), np.asarray(got), atol=2e-5)
    one = jax_nn_compat.dot_product_attention(q[0], k[0], v[0], is_causal=True)
    np.testing.assert_allclose(
        np.asarray(one), np.asarray(jax.nn.dot_product_attention(q[0], k[0], v[0], is_causal=True)), atol=2e-5
    )
    with pytest.raises(ValueError, match="implementation"):
        jax_nn_compat.dot_product_attention(q, k, v, implementation="pallas")


def test_ported_forwarding_wrapper_runs():
    result = transform_source(FIXTURE.read_bytes(), FIXTURE.name, registry.all_rules(), RuleOptions())
    assert [s.status for s in result.sites] == ["rewrite"] * 3
    namespace: dict = {}
    exec(compile(result.new.decode(), "ported.py", "exec"), namespace)
    q, k, v = _inputs(seed=3)
    lengths = jnp.array([6, 6], jnp.int32)
    a, b, c, d = namespace["attend"](q, k, v, lengths, implementation="cudnn")
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    np.testing.assert_allclose(np.asarray(a), np.asarray(want), atol=2e-5)
    for other in (b, c, d):
        np.testing.assert_allclose(
            np.asarray(other), np.asarray(jax.nn.dot_product_attention(q, k, v)), atol=2e-5
        )
    wrapped = namespace["wrapper"](q, k, v, is_causal=True, implementation="cudnn")
    np.testing.assert_allclose(np.asarray(wrapped), np.asarray(want), atol=2e-5)
