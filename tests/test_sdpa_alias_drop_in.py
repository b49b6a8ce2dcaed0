"""A module-level SDPA alias whose every read in its file is a ported call becomes the SDPA drop-in
(other modules import it), so the drop-in must replicate torch SDPA at every rank: checked against
torch's own ``scaled_dot_product_attention`` in float64 (the original function)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from ported_code import port_and_run, rand  # noqa: E402

from flashport.integrations.sdpa_compat import scaled_dot_product_attention  # noqa: E402

SOURCE = """
import torch.nn.functional as F

scaled_dot_product_attention = F.scaled_dot_product_attention


def attend(q, k, v):
    return scaled_dot_product_attention(q, k, v, is_causal=True)
"""

CASES = [  # query shape, key/value shape, mask shape (None: no mask), enable_gqa
    ((5, 8), (7, 8), None, False),
    ((3, 5, 8), (3, 7, 8), (5, 7), False),
    ((2, 4, 5, 8), (2, 2, 7, 8), (2, 1, 5, 7), True),
    ((2, 3, 4, 5, 8), (2, 3, 2, 7, 8), (3, 1, 5, 7), True),
    ((2, 3, 4, 5, 8), (1, 3, 4, 7, 8), (2, 3, 4, 5, 7), False),
]


def close(got, want, atol=2e-5):
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.allclose(got.double(), want, atol=atol), float((got.double() - want).abs().max())


@pytest.mark.parametrize("q_shape, kv_shape, mask_shape, gqa", CASES)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_drop_in_matches_torch_sdpa_at_every_rank(q_shape, kv_shape, mask_shape, gqa, kind):
    q, k, v = rand(*q_shape), rand(*kv_shape, seed=1), rand(*kv_shape, seed=2)
    mask = None if mask_shape is None else rand(*mask_shape, seed=3)
    if mask is not None and kind == "bool":
        mask = mask > -0.5
    ref_mask = mask.double() if mask is not None and kind == "float" else mask
    want = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=ref_mask, enable_gqa=gqa
    )
    close(scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa), want)


def test_rank_mismatch_is_a_clear_error():
    with pytest.raises(RuntimeError, match="same rank"):
        scaled_dot_product_attention(rand(2, 5, 8), rand(1, 2, 7, 8), rand(1, 2, 7, 8))


def test_module_alias_goes_to_the_drop_in_and_importers_get_sdpa():
    namespace, code = port_and_run(SOURCE, "reference")
    assert (
        "scaled_dot_product_attention = flashport.integrations.sdpa_compat.scaled_dot_product_attention"
        in code
    )
    q, k, v = rand(2, 4, 5, 8), rand(2, 4, 7, 8, seed=1), rand(2, 4, 7, 8, seed=2)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=True
    )
    close(namespace["attend"](q, k, v), want)
    # what an importing module does with the alias: any rank, mask, causal
    q3, k3, v3 = rand(3, 5, 8, seed=4), rand(3, 7, 8, seed=5), rand(3, 7, 8, seed=6)
    want = torch.nn.functional.scaled_dot_product_attention(
        q3.double(), k3.double(), v3.double(), is_causal=True
    )
    close(namespace["scaled_dot_product_attention"](q3, k3, v3, is_causal=True), want)
