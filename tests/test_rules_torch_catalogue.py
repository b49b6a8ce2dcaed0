"""The PyTorch side of the rule catalogue: opt-in config rewrite fixtures and the rewrite targets at run time.

* FPA905 (opt-in, FPA901 answers for the same strings by default) golden fixtures under
  ``tests/fixtures/torch_catalogue/<RULE>/`` run with FPA901 ignored; same format and update switch
  (``FLASHPORT_UPDATE_FIXTURES=1``) as ``tests/test_rules_fixtures.py``.
* ``flashport.integrations.flash_attn_compat.kvcache_attention`` and
  ``flashport.integrations.xformers_compat`` against the independent float64 references of
  flash-attn's / xformers' documented semantics (``tests/torch_semantics_reference.py``).
* ``flashport.integrations.transformers``: a tiny random Llama (GQA, left padding) and Mistral
  (sliding window) with ``attn_implementation="flashport"`` against ``"eager"`` / ``"sdpa"``.
"""

from __future__ import annotations

import os
import pathlib

import pytest

from flashport import rules as registry
from flashport.rewriter.engine.pipeline import transform_source
from flashport.rules.base import RuleOptions

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "torch_catalogue"
CASES = sorted(FIXTURES.glob("FPA*/*.py"))
UPDATE = os.environ.get("FLASHPORT_UPDATE_FIXTURES") == "1"


def findings(result) -> str:
    """Findings as ``line:col RULE status kind reason [notes]`` lines (the fixtures' .txt format)."""
    return "".join(
        f"{s.line}:{s.column} {s.rule} {s.status} {s.kind}{(' ' + s.reason) if s.reason else ''}"
        f"{(' [' + '; '.join(s.notes) + ']') if s.notes else ''}\n"
        for s in result.sites
    )


@pytest.mark.parametrize("case", CASES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_opt_in_fixture(case):
    rules = registry.select(ignore=["FPA901"])
    data = case.read_bytes()
    result = transform_source(data, case.name, rules, RuleOptions())
    assert result.status != "error", result.error
    out_path, txt_path = case.with_suffix(".py.out"), case.with_suffix(".txt")
    if UPDATE:
        out_path.write_bytes(result.new) if result.new is not None else None
        txt_path.write_text(findings(result))
    assert (result.new if result.new is not None else data) == (
        out_path.read_bytes() if out_path.exists() else data
    )
    assert findings(result) == txt_path.read_text()
    assert any(s.rule == case.parent.name for s in result.sites)
    if result.new is not None:
        compile(result.new, case.name, "exec")
        again = transform_source(result.new, case.name, rules, RuleOptions())
        assert again.new is None


def test_fpa905_is_shadowed_by_fpa901_by_default():
    data = (FIXTURES / "FPA905" / "attn_implementation.py").read_bytes()
    result = transform_source(data, "x.py", registry.all_rules(), RuleOptions())
    assert result.new is None and {s.rule for s in result.sites} == {"FPA901"}


# ------------------------------------------------------------------------------------- run time


@pytest.fixture(scope="module")
def torch():
    """torch, or skip."""
    return pytest.importorskip("torch")


def _close(got, want, atol=2e-5):
    err = (got.double() - want).abs().max().item()
    assert err < atol, f"max |err| {err:.2e}"


@pytest.mark.parametrize("new_rows", [0, 2])
@pytest.mark.parametrize("window", [None, (2, 0)])
def test_kvcache_attention_matches_flash_attn_semantics(torch, new_rows, window):
    from torch_semantics_reference import flash_attn_kvcache_ref

    from flashport.integrations.flash_attn_compat import kvcache_attention

    g = torch.Generator().manual_seed(new_rows)
    q = torch.randn(3, 2, 4, 8, generator=g)
    k_cache, v_cache = torch.randn(3, 9, 2, 8, generator=g), torch.randn(3, 9, 2, 8, generator=g)
    k = v = None
    if new_rows:
        k, v = torch.randn(3, new_rows, 2, 8, generator=g), torch.randn(3, new_rows, 2, 8, generator=g)
    lengths = torch.tensor([0, 3, 7 - new_rows], dtype=torch.int32)
    fa_window = (-1, -1) if window is None else window
    want, want_k, want_v = flash_attn_kvcache_ref(
        q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True, window_size=fa_window
    )
    before = k_cache.clone()
    out, lse, new_k, new_v = kvcache_attention(
        q,
        k_cache,
        v_cache,
        k,
        v,
        cache_seqlens=lengths,
        causal=True,
        window=window,
        return_lse=True,
        return_cache=True,
        backend="torch",
    )
    _close(out, want)
    _close(new_k, want_k)
    _close(new_v, want_v)
    assert torch.equal(k_cache, before), "the caller's cache must not be mutated"
    assert lse.shape == (3, 4, 2)


def test_kvcache_attention_rejects_inconsistent_arguments(torch):
    from flashport.integrations.flash_attn_compat import kvcache_attention

    q, cache = torch.randn(1, 1, 2, 4), torch.randn(1, 4, 2, 4)
    with pytest.raises(ValueError, match="both k and v"):
        kvcache_attention(q, cache, cache, k=cache[:, :1], cache_seqlens=1)
    with pytest.raises(ValueError, match="exceeds the cache length"):
        kvcache_attention(q, cache, cache, cache[:, :2], cache[:, :2], cache_seqlens=3)


def test_xformers_compat_ranks_and_biases(torch):
    from torch_semantics_reference import xformers_ref

    from flashport.integrations import xformers_compat as xf

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, n, 3, 8, generator=g) for n in (4, 6, 6))
    bias = torch.randn(2, 3, 4, 6, generator=g)
    run = lambda *a, **kw: xf.memory_efficient_attention(*a, backend="torch", **kw)  # noqa: E731
    _close(run(q, k, v, xf.LowerTriangularMask().add_bias(bias)), _masked_bias_ref(q, k, v, bias))
    _close(
        run(q, k, v, xf.LowerTriangularFromBottomRightMask().make_local_attention(2)),
        xformers_ref(q, k, v, {"kind": "local_bottom_right", "left": 1, "right": 0}),
    )
    # 3-D = one head; 5-D = [B, M, G, H, K] with expanded K/V
    _close(
        run(q[:, :, 0], k[:, :, 0], v[:, :, 0], scale=0.3),
        xformers_ref(q[:, :, :1], k[:, :, :1], v[:, :, :1], scale=0.3)[:, :, 0],
    )
    q5 = q.reshape(2, 4, 3, 1, 8).expand(2, 4, 3, 2, 8)
    k5, v5 = (t.reshape(2, 6, 3, 1, 8).expand(2, 6, 3, 2, 8) for t in (k, v))
    got5 = run(q5, k5, v5, xf.LowerTriangularMask(), output_dtype=torch.float64)
    assert got5.shape == (2, 4, 3, 2, 8) and got5.dtype == torch.float64
    _close(got5[:, :, :, 1], xformers_ref(q, k, v, {"kind": "lower_triangular"}))


def _masked_bias_ref(q, k, v, bias):
    """Top-left causal plus an additive bias, float64 (xformers' LowerTriangularMaskWithTensorBias)."""
    import torch

    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * q.shape[-1] ** -0.5 + bias.double()
    keep = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril()
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", p, v.double())


def test_xformers_block_diagonal_variants(torch):
    from torch_semantics_reference import flash_attn_varlen_ref, xformers_ref

    from flashport.integrations import xformers_compat as xf

    g = torch.Generator().manual_seed(2)
    q_lens, kv_lens = [2, 3, 1], [4, 3, 2]
    q, k, v = (
        torch.randn(1, 6, 2, 8, generator=g),
        torch.randn(1, 9, 2, 8, generator=g),
        torch.randn(1, 9, 2, 8, generator=g),
    )
    run = lambda bias: xf.memory_efficient_attention(q, k, v, bias, backend="torch")  # noqa: E731
    _close(
        run(xf.BlockDiagonalCausalFromBottomRightMask.from_seqlens(q_lens, kv_lens)),
        xformers_ref(
            q, k, v, {"kind": "block_causal", "q": q_lens, "kv": kv_lens, "from_bottom_right": True}
        ),
    )
    _close(
        run(xf.BlockDiagonalMask.from_seqlens(q_lens, kv_lens).make_causal()),
        xformers_ref(q, k, v, {"kind": "block_causal", "q": q_lens, "kv": kv_lens}),
    )
    cu_q, cu_k = torch.tensor([0, 2, 5, 6]), torch.tensor([0, 4, 7, 9])
    _close(
        run(xf.BlockDiagonalMask.from_seqlens(q_lens, kv_lens)),
        flash_attn_varlen_ref(q[0], k[0], v[0], cu_q, cu_k)[None],
    )
    # window_size=w keeps keys in (i - w, i] per block: flash-attn's left = w - 1 (top-left per block)
    same = xf.BlockDiagonalMask.from_seqlens([4, 5]).make_causal().make_local_attention(2)
    x = torch.randn(1, 9, 2, 8, generator=g)
    cu = torch.tensor([0, 4, 9])
    _close(
        xf.memory_efficient_attention(x, x, x, same, backend="torch"),
        flash_attn_varlen_ref(x[0], x[0], x[0], cu, cu, causal=True, window_size=(1, 0))[None],
    )
    bias, cat = xf.BlockDiagonalMask.from_tensor_list([torch.randn(2, 3, 2, 8), torch.randn(1, 4, 2, 8)])
    assert cat.shape == (1, 10, 2, 8) and [t.shape[:2] for t in bias.split(cat)] == [(2, 3), (1, 4)]
    with pytest.raises(ValueError, match="batch 1"):
        xf.memory_efficient_attention(
            q.expand(2, -1, -1, -1),
            k.expand(2, -1, -1, -1),
            v.expand(2, -1, -1, -1),
            xf.BlockDiagonalMask.from_seqlens(q_lens, kv_lens),
            backend="torch",
        )
    with pytest.raises(
        ValueError, match="dropout_p must be in"
    ):  # p > 0 is dropout (tests/test_torch_dropout.py)
        xf.memory_efficient_attention(q, k, v, p=1.0)


def test_xformers_compat_reads_real_xformers_objects_by_class(torch):
    from flashport.integrations import xformers_compat as xf

    class _SeqInfo:
        def __init__(self, starts):
            self.seqstart_py = starts

    BlockDiagonalCausalMask = type("BlockDiagonalCausalMask", (), {})  # stands in for xformers' class
    real = BlockDiagonalCausalMask()
    real.q_seqinfo, real.k_seqinfo = _SeqInfo([0, 2, 5]), _SeqInfo([0, 2, 5])
    got = xf.contract_kwargs(real, 5, 5, "cpu")
    mirror = xf.contract_kwargs(xf.BlockDiagonalCausalMask.from_seqlens([2, 3]), 5, 5, "cpu")
    assert all(
        torch.equal(a, b) for a, b in zip(got.pop("cu_seqlens"), mirror.pop("cu_seqlens"), strict=True)
    )
    assert got == mirror
    PagedBlockDiagonalPaddedKeysMask = type("PagedBlockDiagonalPaddedKeysMask", (), {})
    with pytest.raises(ValueError, match="no flashport equivalent"):
        xf.contract_kwargs(PagedBlockDiagonalPaddedKeysMask(), 5, 5, "cpu")


def test_transformers_attn_implementation_flashport(torch):
    transformers = pytest.importorskip("transformers")
    import flashport.integrations.transformers as fpt

    assert fpt.ATTN_IMPLEMENTATION in transformers.AttentionInterface._global_mapping
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
    ).eval()
    ids = torch.randint(0, 64, (2, 9))
    pad = torch.ones(2, 9, dtype=torch.long)
    pad[1, :3] = 0  # left padding: padded query rows differ between eager (uniform) and SDPA/flashport (0)

    def logits(model, impl, **kw):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            return model(input_ids=ids, **kw).logits.double()

    got = logits(llama, fpt.ATTN_IMPLEMENTATION, attention_mask=pad)
    assert llama.config._attn_implementation == "flashport"
    _close(got, logits(llama, "sdpa", attention_mask=pad), atol=1e-5)
    _close(got[pad.bool()], logits(llama, "eager", attention_mask=pad)[pad.bool()], atol=1e-5)
    _close(
        logits(llama, fpt.ATTN_IMPLEMENTATION), logits(llama, "eager"), atol=1e-5
    )  # no mask: is_causal path

    mistral = transformers.MistralForCausalLM(
        transformers.MistralConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=1,
            sliding_window=4,
            max_position_embeddings=32,
        )
    ).eval()
    windowed = logits(mistral, fpt.ATTN_IMPLEMENTATION)
    _close(windowed, logits(mistral, "eager"), atol=1e-5)
    mistral.config.sliding_window = None  # the window must matter for this test to mean anything
    assert (windowed - logits(mistral, "eager")).abs().max() > 1e-3


def test_transformers_attention_function_carries_dropout_in_training(torch):
    """``dropout`` becomes dropout_p when the module trains (values: tests/test_torch_dropout.py)."""
    pytest.importorskip("transformers")
    from flashport.integrations.transformers import flashport_attention_forward

    q = torch.randn(1, 2, 8, 4)
    layer = torch.nn.Module()
    torch.manual_seed(0)
    first, _ = flashport_attention_forward(layer.train(), q, q, q, None, dropout=0.5)
    torch.manual_seed(0)
    again, _ = flashport_attention_forward(layer, q, q, q, None, dropout=0.5)
    plain, _ = flashport_attention_forward(layer.eval(), q, q, q, None, dropout=0.5)
    assert torch.equal(first, again) and not torch.allclose(first, plain)
    with pytest.raises(ValueError, match="dropout_p must be in"):
        flashport_attention_forward(layer.train(), q, q, q, None, dropout=1.0)


def test_fpa905_leaves_a_file_that_dispatches_on_the_string_working():
    """Issue 10: FPA905 switched a config to "flashport" in code that looks the string up itself
    (``KeyError: 'flashport'``). The ported file must still pick the same entry as the original."""
    source = (
        b"ATTENTION_CLASSES = {'eager': 'eager-class', 'flash_attention_2': 'flash-class'}\n\n\n"
        b"def build(config):\n"
        b"    config._attn_implementation = 'flash_attention_2'\n"
        b"    return ATTENTION_CLASSES[config._attn_implementation]\n"
    )
    result = transform_source(source, "modeling_x.py", registry.select(ignore=["FPA901"]), RuleOptions())
    assert result.status != "error", result.error
    assert any(s.rule == "FPA905" and "dispatches" in s.reason for s in result.sites)

    def run(code: bytes) -> str:
        namespace: dict = {}
        exec(compile(code, "modeling_x.py", "exec"), namespace)
        return namespace["build"](type("Config", (), {})())

    assert run(result.new or source) == run(source) == "flash-class"


def test_fpa905_keeps_settings_without_remote_code_or_dispatch():
    source = b"from transformers import AutoModel\nm = AutoModel.from_pretrained('x', trust_remote_code=False, attn_implementation='flash_attention_2')\n"
    result = transform_source(source, "x.py", registry.select(ignore=["FPA901"]), RuleOptions())
    assert [s.status for s in result.sites] == ["rewrite"]
