"""Calls the codemod can only port to a drop-in (arguments known at run time, paged KV caches): the
rewritten source runs with the real flashport drop-ins and is compared with float64 references of
the source APIs (``tests/torch_semantics_reference.py``), and with the source API's own errors.
"""

from __future__ import annotations

import pytest

from flashport import rules as registry
from flashport.rewriter.engine.pipeline import transform_source
from flashport.rules.base import RuleOptions

torch = pytest.importorskip("torch")

from ported_code import port_and_run, rand  # noqa: E402
from torch_semantics_reference import flash_attn_ref, flash_attn_varlen_ref, sdpa_ref  # noqa: E402


def port(source: str, **options) -> dict:
    """Rewrite ``source`` (every call site rewritten, no GPU import left) and exec it (tests/ported_code.py)."""
    return port_and_run(source, "call", **options)[0]


SDPA_SPLAT = """
    import torch.nn.functional as F

    def attend(*args, **kwargs):
        return F.scaled_dot_product_attention(*args, **kwargs)
"""

SDPA_CASES = [  # (Hq, Hk, Sq, Sk, keyword arguments)
    (2, 2, 3, 5, {}),
    (2, 2, 5, 3, {"is_causal": True}),  # top-left causal with Sq > Sk
    (4, 2, 3, 5, {"enable_gqa": True, "scale": 0.3}),
    (2, 2, 3, 5, {"attn_mask": "bool"}),
    (2, 2, 3, 5, {"attn_mask": "float"}),
    (2, 2, 3, 5, {"attn_mask": "bool", "is_causal": True}),  # both: keys that both allow (SDPA on CPU)
]


@pytest.mark.parametrize("hq, hk, sq, sk, kwargs", SDPA_CASES)
def test_sdpa_splat_runs_on_the_drop_in_with_sdpa_semantics(hq, hk, sq, sk, kwargs):
    attend = port(SDPA_SPLAT)["attend"]
    q, k, v = rand(2, hq, sq, 8), rand(2, hk, sk, 8, seed=1), rand(2, hk, sk, 8, seed=2)
    kwargs = dict(kwargs)
    if kwargs.get("attn_mask") == "bool":
        mask = torch.from_numpy(__import__("numpy").random.default_rng(3).random((sq, sk)) > 0.4)
        mask[:, 0] = True  # every row sees a key (SDPA's math path gives NaN for an empty row)
        kwargs["attn_mask"] = mask
    elif kwargs.get("attn_mask") == "float":
        kwargs["attn_mask"] = rand(1, hq, sq, sk, seed=4)
    got = attend(q, k, v, **kwargs)
    want = sdpa_ref(q, k, v, **kwargs)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    # the positional form binds the same parameters
    if "attn_mask" in kwargs and "scale" not in kwargs:
        torch.testing.assert_close(
            attend(q, k, v, kwargs["attn_mask"], 0.0, kwargs.get("is_causal", False)).double(),
            want,
            atol=2e-5,
            rtol=2e-5,
        )


def test_sdpa_drop_in_keeps_sdpa_errors():
    """Unequal head counts without enable_gqa fail as in SDPA (the drop-in could group them)."""
    attend = port(SDPA_SPLAT)["attend"]
    q, k = rand(1, 4, 3, 8), rand(1, 2, 3, 8, seed=1)
    with pytest.raises(RuntimeError):
        torch.nn.functional.scaled_dot_product_attention(q, k, k)
    with pytest.raises(RuntimeError, match="enable_gqa"):
        attend(q, k, k)


def test_flash_attn_kwargs_splat_runs_on_the_drop_in():
    attend = port("""
        from flash_attn import flash_attn_func

        def attend(q, k, v, **flash_kwargs):
            return flash_attn_func(q, k, v, **flash_kwargs)
    """)["attend"]
    q, k, v = rand(2, 3, 4, 8), rand(2, 5, 2, 8, seed=1), rand(2, 5, 2, 8, seed=2)
    kwargs = {"causal": True, "window_size": (2, -1), "softmax_scale": 0.4}
    torch.testing.assert_close(
        attend(q, k, v, **kwargs).double(), flash_attn_ref(q, k, v, **kwargs), atol=2e-5, rtol=2e-5
    )


def test_a_star_args_splat_is_refused_before_flash_attn_2_6():
    """softcap moved the later positional parameters in 2.6; the drop-in follows 2.8."""
    source = "from flash_attn import flash_attn_func\ny = flash_attn_func(*args)\n"
    old = transform_source(
        source.encode(), "case.py", registry.all_rules(), RuleOptions(flash_attn_version=(2, 5, 0))
    )
    assert [s.status for s in old.sites] == ["refused"] and "2.6" in old.sites[0].reason
    new = transform_source(source.encode(), "case.py", registry.all_rules(), RuleOptions())
    assert [s.status for s in new.sites] == ["rewrite"]


def test_paged_varlen_runs_on_the_drop_in():
    """``block_table``: sequence b's keys are the first len_k[b] rows of its pages."""
    attend = port("""
        from flash_attn import flash_attn_varlen_func

        def attend(q, k_pages, v_pages, cu_q, cu_k, table):
            return flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 4, 6, causal=True, block_table=table)
    """)["attend"]
    page, lengths_q, lengths_k = 4, [3, 4], [6, 5]
    cu_q = torch.tensor([0, 3, 7], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 11], dtype=torch.int32)
    k_pages, v_pages = rand(5, page, 2, 8, seed=1), rand(5, page, 2, 8, seed=2)
    table = torch.tensor([[3, 0], [4, 1]], dtype=torch.int32)  # sequence b uses pages table[b]
    q = rand(sum(lengths_q), 2, 8)
    k = torch.cat([k_pages[table[b]].reshape(-1, 2, 8)[:n] for b, n in enumerate(lengths_k)])
    v = torch.cat([v_pages[table[b]].reshape(-1, 2, 8)[:n] for b, n in enumerate(lengths_k)])
    want = flash_attn_varlen_ref(q, k, v, cu_q, cu_k, causal=True)
    torch.testing.assert_close(
        attend(q, k_pages, v_pages, cu_q, cu_k, table).double(), want, atol=2e-5, rtol=2e-5
    )


def bert_padding_reference(hidden, mask):
    """flash-attn's ``unpad_input`` (>= 2.7) from its docstring, by loops: the valid tokens of each
    sequence in order, their flat indices, int32 cu_seqlens, the longest length, seqused."""
    rows, indices, lengths = [], [], []
    batch, seqlen = mask.shape
    for b in range(batch):
        valid = [s for s in range(seqlen) if bool(mask[b, s])]
        rows += [hidden[b, s] for s in valid]
        indices += [b * seqlen + s for s in valid]
        lengths.append(len(valid))
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return (
        torch.stack(rows),
        torch.tensor(indices),
        torch.tensor(cu, dtype=torch.int32),
        max(lengths),
        lengths,
    )


BERT_PADDING = """
    from flash_attn.bert_padding import index_first_axis, pad_input, unpad_input

    def round_trip(hidden, mask):
        packed, indices, cu_seqlens, max_len, *rest = unpad_input(hidden, mask)
        rows = index_first_axis(hidden.flatten(0, 1), indices)
        return packed, indices, cu_seqlens, max_len, rest, rows, pad_input(packed * 2, indices, *mask.shape)
"""


@pytest.mark.parametrize("version, extra", [((2, 8, 3), 1), ((2, 6, 3), 0)])
def test_bert_padding_helpers_run_on_the_drop_ins(version, extra):
    """Same results as flash-attn's helpers; before 2.7 ``unpad_input`` returns four values."""
    round_trip = port(BERT_PADDING, flash_attn_version=version)["round_trip"]
    hidden = rand(2, 4, 3)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    packed, indices, cu, max_len, rest, rows, padded = round_trip(hidden, mask)
    want_rows, want_indices, want_cu, want_max, want_used = bert_padding_reference(hidden, mask)
    torch.testing.assert_close(packed, want_rows)
    torch.testing.assert_close(rows, want_rows)
    assert indices.tolist() == want_indices.tolist() and cu.tolist() == want_cu.tolist()
    assert cu.dtype == torch.int32 and max_len == want_max and len(rest) == extra
    if extra:
        assert rest[0].tolist() == want_used
    torch.testing.assert_close(padded, 2 * hidden * mask[..., None])


@pytest.mark.parametrize("api", ["flash_attn", "flash_attn_interface"])
def test_kvcache_lse_of_an_empty_cache_row_keeps_each_release_convention(api):
    # flash-attn 2 reports lse = +inf for a row that sees no key, FA3 -inf; the contract's functional
    # form says -inf, so a call asking for lse must keep the API's own drop-in.
    import torch

    source = f"""
        from {api} import flash_attn_with_kvcache

        def decode(q, k_cache, v_cache, lengths):
            out, lse, *rest = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True, return_softmax_lse=True)
            return out, lse
    """
    namespace, _ = port_and_run(source, "call")
    torch.manual_seed(0)
    q, k_cache, v_cache = torch.randn(2, 1, 2, 8), torch.randn(2, 5, 2, 8), torch.randn(2, 5, 2, 8)
    lengths = torch.tensor([0, 3], dtype=torch.int32)
    out, lse = namespace["decode"](q, k_cache, v_cache, lengths)
    empty = float("inf") if api == "flash_attn" else float("-inf")
    assert torch.all(lse[0] == empty) and torch.all(out[0] == 0)
    scores = torch.einsum("qhd,khd->hqk", q[1].double(), k_cache[1, :3].double()) * 8**-0.5
    torch.testing.assert_close(lse[1].double(), torch.logsumexp(scores, -1), rtol=1e-5, atol=1e-5)
