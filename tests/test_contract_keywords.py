"""The contract's keywords are defined once (``flashport.kernels.contract.keywords``) and every entry point
shows and accepts them: signatures checked against the documented public API, written out here."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import flashport
from flashport.kernels.contract import api, varlen
from flashport.kernels.contract.keywords import takes_contract_keywords

CONTRACT = (
    "scale=None, causal=False, window=None, align='bottom_right', softcap=None, bias=None, mask=None, "
    "q_segment_ids=None, kv_segment_ids=None, layout='BSHD'"
)
MODS = "score_mod=None, mask_mod=None, block_mask=None"  # FlexAttention's user functions (docs/flex.md)
VARLEN = "scale=None, causal=False, window=None, align='bottom_right', softcap=None, layout='THD'"

SIGNATURES = {
    "attention": (
        lambda: flashport.attention,
        f"(query, key, value, *, {CONTRACT}, backend='auto', return_lse=False, dropout_rate=0.0, dropout_rng=None, "
        f"{MODS})",
    ),
    "prepare": (
        lambda: api.prepare,
        f"(query, key, value, *, {CONTRACT}, return_lse=False, dropout_rate=0.0, dropout_rng=None)",
    ),
    "attention_backward": (
        lambda: flashport.attention_backward,
        f"(query, key, value, out, lse, d_out, d_lse=None, *, {CONTRACT}, backend='auto', dropout_rate=0.0, "
        f"dropout_rng=None, {MODS})",
    ),
    "ring_attention": (
        lambda: flashport.ring_attention,
        f"(query, key, value, *, mesh, axis_name, {CONTRACT}, seq_layout='contiguous', "
        "batch_axis=None, head_axis=None, backend='auto', return_lse=False, dropout_rate=0.0, dropout_rng=None, "
        f"{MODS})",
    ),
    "varlen_attention": (
        lambda: varlen.varlen_attention,
        f"(query, key, value, *, cu_seqlens_q, cu_seqlens_k, {VARLEN}, backend='auto', dropout_rate=0.0, "
        "dropout_rng=None, attention=None)",
    ),
}


def _plain(signature: inspect.Signature) -> str:
    """The signature's names, kinds and defaults (annotations are for type checkers, not compared)."""
    params = [p.replace(annotation=p.empty) for p in signature.parameters.values()]
    return str(signature.replace(parameters=params, return_annotation=signature.empty))


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_jax_entry_points_show_the_contract_keywords(name):
    fn, want = SIGNATURES[name]
    assert _plain(inspect.signature(fn())) == want


def test_torch_entry_points_show_the_contract_keywords():
    pytest.importorskip("torch")
    import flashport.torch
    from flashport.torch import _checks

    no_default_layout = CONTRACT.replace("layout='BSHD'", "layout=None")  # torch code holds both layouts
    want = f"(query, key, value, *, {no_default_layout}, backend='auto', return_lse=False, dropout_p=0.0, generator=None)"
    assert _plain(inspect.signature(flashport.torch.attention)) == want
    want = f"(query, key, value, *, {CONTRACT}, return_lse=False, dropout_p=0.0, seed=None)"
    assert _plain(inspect.signature(_checks.check)) == want
    want = (
        f"(query, key, value, *, cu_seqlens_q, cu_seqlens_k, {VARLEN}, backend='auto', dropout_p=0.0, "
        "generator=None, attention=None)"
    )
    assert _plain(inspect.signature(flashport.torch.varlen_attention)) == want


def test_unknown_and_positional_keywords_are_refused():
    q = np.zeros((1, 4, 1, 8), np.float32)
    with pytest.raises(TypeError, match="caual"):
        flashport.attention(q, q, q, caual=True)
    with pytest.raises(TypeError, match="positional"):
        flashport.attention(q, q, q, None)


def test_decorator_fills_defaults_and_overrides():
    seen = {}

    @takes_contract_keywords(("causal", "layout"), layout="THD")
    def f(x, *, extra=1, **contract):
        seen.update(contract, x=x, extra=extra)

    f(3, causal=True)
    assert seen == {"x": 3, "extra": 1, "causal": True, "layout": "THD"}
    with pytest.raises(ValueError, match="does not add"):
        takes_contract_keywords(("causal",), layout="THD")
