"""End-to-end proof on CPU: the PyTorch examples are rewritten by the CLI, then run through flashport.torch.

For each example in ``examples/`` (written against flash-attn, torch SDPA and xformers): copy it,
run ``flashport rewrite --write`` on the copy, import the rewritten module, run its model forward and
backward on CPU torch (flashport.torch -> flashport's JAX path via DLPack) and compare outputs and
parameter gradients with an independent float64 reference of the *original* API's documented
semantics (``tests/torch_semantics_reference.py``) at float32 tolerance.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import shutil

import pytest

torch = pytest.importorskip("torch")

from torch_semantics_reference import flash_attn_ref, flash_attn_varlen_ref, sdpa_ref, xformers_ref  # noqa: E402

from flashport.rewriter.app import cli  # noqa: E402

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
NAMES = ("torch_flash_attn_model.py", "torch_sdpa_model.py", "torch_xformers_model.py")
ATOL = 2e-5  # float32 round-off on O(1) activations of these tiny models


@pytest.fixture(scope="module")
def ported(tmp_path_factory):
    """The examples after ``flashport rewrite --write``, imported as modules."""
    folder = tmp_path_factory.mktemp("ported")
    for name in NAMES:
        shutil.copy(EXAMPLES / name, folder / name)
    assert cli.main(["rewrite", "--write", "--isolated", "--no-color", str(folder)]) == 0
    modules = {}
    for name in NAMES:
        path = folder / name
        imported = {
            alias.name.split(".")[0]
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])
        }
        assert not imported & {"flash_attn", "xformers"}, (
            f"{name} still imports {imported & {'flash_attn', 'xformers'}}"
        )
        spec = importlib.util.spec_from_file_location(f"ported_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        modules[name] = module
    return modules


def params64(model):
    """float64 leaf copies of the model's parameters (reference gradients land on them)."""
    return {name: p.detach().double().requires_grad_() for name, p in model.named_parameters()}


def linear(x, weight):
    """``torch.nn.Linear`` without bias, spelled out."""
    return x @ weight.T


def close(got, want, what):
    """Assert max |got - want| < ATOL; returns the error."""
    err = (got.double() - want).abs().max().item()
    assert err < ATOL, f"{what}: max |err| {err:.2e} >= {ATOL}"
    print(f"{what}: max |err| {err:.2e}")  # shown with pytest -s (the measured errors)
    return err


def grads_close(model, ref_params, what):
    """Assert every parameter gradient matches the reference's; returns the worst error."""
    worst = 0.0
    for name, p in model.named_parameters():
        err = (p.grad.double() - ref_params[name].grad).abs().max().item()
        assert err < ATOL, f"{what} grad {name}: max |err| {err:.2e} >= {ATOL}"
        worst = max(worst, err)
    print(f"{what} (all parameter grads): max |err| {worst:.2e}")
    return worst


# ------------------------------------------------------------------------------------- flash-attn


def fa_layer(P, i, x, m, window, packed=None, decode_prefix=None):
    """Reference of Attention.forward / forward_packed / decode (flash-attn semantics)."""

    def proj(t, name, heads):
        return linear(t, P[f"layers.{i}.{name}.weight"]).unflatten(-1, (heads, m.HEAD_DIM))

    if decode_prefix is not None:
        full = torch.cat([decode_prefix, x], dim=1)
        q, k, v = proj(x, "q", m.HEADS), proj(full, "k", m.KV_HEADS), proj(full, "v", m.KV_HEADS)
        out = flash_attn_ref(q, k, v, causal=True)
    else:
        q, k, v = proj(x, "q", m.HEADS), proj(x, "k", m.KV_HEADS), proj(x, "v", m.KV_HEADS)
        if packed is not None:
            out = flash_attn_varlen_ref(q, k, v, packed, packed, causal=True)
        else:
            out = flash_attn_ref(
                q, k, v, causal=True, window_size=(window, 0) if window is not None else (-1, -1)
            )
    return linear(out.flatten(-2), P[f"layers.{i}.o.weight"])


def test_flash_attn_model(ported):
    m = ported["torch_flash_attn_model.py"]
    torch.manual_seed(0)
    model = m.TinyDecoder()
    P = params64(model)
    ids = torch.randint(0, m.VOCAB, (2, 7))

    logits = model(ids)
    x = P["embed.weight"][ids]
    for i, window in enumerate((m.WINDOW, None)):
        x = x + fa_layer(P, i, x, m, window)
    want = linear(x, P["head.weight"])
    close(logits, want, "forward")

    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
    loss.backward()
    torch.nn.functional.cross_entropy(want.flatten(0, 1), ids.flatten()).backward()
    grads_close(model, P, "backward")

    lengths, cu = [3, 5, 2], torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    packed_ids = torch.randint(0, m.VOCAB, (10,))
    with torch.no_grad():
        got = model.forward_packed(packed_ids, cu, max(lengths))
        x = P["embed.weight"][packed_ids].detach()
        for i in range(2):
            x = x + fa_layer(P, i, x, m, None, packed=cu)
        close(got, linear(x, P["head.weight"]), "varlen forward")

        got = model.decode_logits(ids[:, :5], ids[:, 5:])
        e = P["embed.weight"]
        new = e[ids[:, 5:]]
        close(
            got,
            linear(new + fa_layer(P, 0, new, m, None, decode_prefix=e[ids[:, :5]]), P["head.weight"]),
            "decode (Sq != Sk, bottom-right)",
        )
        # the alignment matters here: the same decode with SDPA's top-left causal is far off
        layer = model.layers[0]
        q, _, _ = (t.double() for t in layer.project(model.embed(ids[:, 5:])))
        _, k, v = (t.double() for t in layer.project(model.embed(ids)))
        top_left = sdpa_ref(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        bottom_right = flash_attn_ref(q, k, v, causal=True)
        assert (top_left.transpose(1, 2) - bottom_right).abs().max() > 1e-2


# ------------------------------------------------------------------------------------- SDPA


def sdpa_self(P, x, m, queries_from=0):
    """Reference of Block.self_attention (SDPA semantics: top-left causal, GQA)."""
    heads = lambda t, n: t.unflatten(-1, (n, m.HEAD_DIM)).transpose(1, 2)  # noqa: E731
    q = heads(linear(x[:, queries_from:], P["q.weight"]), m.HEADS)
    k, v = (heads(t, m.KV_HEADS) for t in linear(x, P["kv.weight"]).chunk(2, dim=-1))
    out = sdpa_ref(q, k, v, is_causal=True, enable_gqa=True)
    return linear(out.transpose(1, 2).flatten(-2), P["o.weight"])


def sdpa_cross(P, x, memory, keep, bias, m):
    """Reference of Block.cross_attention (bool mask True = attend; float mask added; scale=0.5)."""
    heads = lambda t, n: t.unflatten(-1, (n, m.HEAD_DIM)).transpose(1, 2)  # noqa: E731
    q = heads(linear(x, P["cq.weight"]), m.HEADS)
    k, v = (heads(t, m.HEADS) for t in linear(memory, P["ckv.weight"]).chunk(2, dim=-1))
    out = sdpa_ref(q, k, v, attn_mask=keep) + sdpa_ref(q, k, v, attn_mask=bias.double(), scale=0.5)
    return linear(out.transpose(1, 2).flatten(-2), P["o.weight"])


def test_sdpa_model(ported):
    m = ported["torch_sdpa_model.py"]
    torch.manual_seed(0)
    block = m.Block()
    P = params64(block)
    x, memory = torch.randn(2, 6, m.DIM), torch.randn(2, 5, m.DIM)
    keep = torch.tensor([[True] * 5, [True, True, True, False, False]])[:, None, None, :]
    bias = torch.randn(1, m.HEADS, 6, 5)

    y = block(x, memory, keep, bias)
    x64, mem64 = x.double(), memory.double()
    h = x64 + sdpa_self(P, x64, m)
    want = h + sdpa_cross(P, h, mem64, keep, bias, m)
    close(y, want, "forward")

    chunk = block.self_attention(x, queries_from=3)
    want_chunk = sdpa_self(P, x64, m, queries_from=3)
    close(chunk, want_chunk, "chunked prefill (Sq != Sk, top-left)")
    with torch.no_grad():  # the alignment matters here: flash-attn's bottom-right causal is far off
        q = block.q(x[:, 3:]).unflatten(-1, (m.HEADS, m.HEAD_DIM)).double()
        k, v = (t.unflatten(-1, (m.KV_HEADS, m.HEAD_DIM)).double() for t in block.kv(x).chunk(2, dim=-1))
        bottom_right = flash_attn_ref(q, k, v, causal=True).flatten(-2) @ P["o.weight"].detach().T
        assert (bottom_right - want_chunk.detach()).abs().max() > 1e-2

    (y.square().mean() + chunk.square().mean()).backward()
    (want.square().mean() + want_chunk.square().mean()).backward()
    grads_close(block, P, "backward")


# ------------------------------------------------------------------------------------- xformers


def test_xformers_model(ported):
    m = ported["torch_xformers_model.py"]
    torch.manual_seed(0)
    module = m.MaskedAttention()
    P = params64(module)
    x_q, x_kv = torch.randn(2, 3, m.DIM), torch.randn(2, 5, m.DIM)
    tensor_bias = torch.randn(2, m.HEADS, 3, 5)
    outs = module(x_q, x_kv, tensor_bias)
    packed_x = torch.randn(1, 9, m.DIM)
    packed = module.packed(packed_x, [4, 2, 3])

    def attend(xq, xkv, bias):
        split = lambda t, w: linear(t.double(), P[w]).unflatten(-1, (m.HEADS, m.HEAD_DIM))  # noqa: E731
        return xformers_ref(
            split(xq, "q.weight"), split(xkv, "k.weight"), split(xkv, "v.weight"), bias
        ).flatten(-2)

    wants = [
        attend(x_q, x_kv, {"kind": "lower_triangular"}),
        attend(x_q, x_kv, {"kind": "bottom_right"}),
        attend(x_q, x_kv, {"kind": "local_bottom_right", "left": 1, "right": 1}),
        attend(x_q, x_kv, {"kind": "tensor", "bias": tensor_bias}),
    ]
    for got, want, what in zip(
        outs,
        wants,
        ("LowerTriangularMask (top-left)", "FromBottomRight", "LocalAttentionFromBottomRight", "tensor bias"),
        strict=False,
    ):
        close(got, want, what)
    assert (wants[0] - wants[1]).abs().max() > 1e-2  # top-left vs bottom-right differ for Mq != Mk
    want_packed = attend(packed_x, packed_x, {"kind": "block_causal", "q": [4, 2, 3], "kv": [4, 2, 3]})
    close(packed, want_packed, "BlockDiagonalCausalMask")

    (sum(o.square().mean() for o in outs) + packed.square().mean()).backward()
    (sum(w.square().mean() for w in wants) + want_packed.square().mean()).backward()
    grads_close(module, P, "backward")
