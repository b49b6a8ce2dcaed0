"""End to end: ``examples/torch_flex_model.py`` (FlexAttention) is ported by the CLI and runs.

The copy is rewritten with ``flashport rewrite --write``; every FlexAttention call must then go
through ``flashport.torch``. Each variant's ported model runs on CPU and is compared with the
float64 reference (tests/reference.py) fed the model's own projections and the same mods in numpy.
"""

from __future__ import annotations

import importlib.util
import pathlib
import shutil
import sys

import numpy as np
import pytest
from reference import reference_attention

torch = pytest.importorskip("torch")
pytest.importorskip("torch.nn.attention.flex_attention")

from flashport.rewriter.app import cli  # noqa: E402

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "torch_flex_model.py"


@pytest.fixture(scope="module")
def ported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ported_flex")
    path = folder / EXAMPLE.name
    shutil.copy(EXAMPLE, path)
    assert cli.main(["rewrite", "--write", "--isolated", "--no-color", str(folder)]) == 0
    source = path.read_text()
    assert "flashport.torch.flex_attention" in source and "flashport.torch.create_block_mask" in source
    assert "= torch.compile(flex_attention" not in source and "= create_block_mask(" not in source
    spec = importlib.util.spec_from_file_location("ported_torch_flex_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # torch's flex traces the mods and looks their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def _reference_mods(block, docs):
    slopes = block.slopes.detach().double().numpy()
    rel = block.rel.detach().double().numpy()
    d = docs.numpy()
    score = {
        "alibi": lambda s, b, h, i, j: s + slopes[h] * (j - i),
        "relative_bias": lambda s, b, h, i, j: s + rel[h, i - j + block.max_len - 1],
        "softcap": lambda s, b, h, i, j: 20.0 * np.tanh(s / 20.0),
    }.get(block.variant)
    mask = {
        "document": lambda b, h, i, j: (d[i] == d[j]) & (i >= j),
        "prefix_lm": lambda b, h, i, j: (j <= i) | (j < block.prefix),
        "sliding_window": lambda b, h, i, j: (i >= j) & (i - j <= block.window),
    }.get(block.variant, lambda b, h, i, j: i >= j)
    return score, mask


@pytest.mark.parametrize(
    "variant", ["alibi", "relative_bias", "softcap", "document", "prefix_lm", "sliding_window"]
)
def test_ported_example_runs_and_matches_reference(ported, variant):
    torch.manual_seed(0)
    block = ported.FlexBlock(variant=variant)
    with torch.no_grad():  # some mods would be learned to zero otherwise: give every table values
        block.rel.copy_(torch.randn(block.rel.shape))
    x = torch.randn(2, 24, 32)
    docs = torch.tensor([0] * 9 + [1] * 15)
    with torch.no_grad():
        y = block(x, docs)
        b, s, _ = x.shape
        q = block.wq(x).view(b, s, block.heads, block.head_dim)
        k, v = block.wkv(x).view(b, s, 2, block.kv_heads, block.head_dim).unbind(2)
    score, mask = _reference_mods(block, docs)
    out, _ = reference_attention(q.numpy(), k.numpy(), v.numpy(), score_mod=score, mask_mod=mask)
    want = out.reshape(b, s, -1) @ block.wo.weight.detach().double().numpy().T
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-4, atol=2e-5)
