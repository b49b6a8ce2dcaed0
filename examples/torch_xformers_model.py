"""A tiny attention module written against xformers' ``memory_efficient_attention`` and its masks.

The *before* of the codemod: it imports ``xformers`` at the top, so without xformers (any CPU or TPU
machine) it stops with ``ModuleNotFoundError: No module named 'xformers'``. Port a copy and run it::

    cp examples/torch_xformers_model.py /tmp/ && flashport rewrite --write /tmp/torch_xformers_model.py
    python /tmp/torch_xformers_model.py

What it exercises (each an xformers ``attn_bias`` semantic the rewrite must keep):

* ``LowerTriangularMask()`` with ``Mq != Mk``: **top-left** causal;
* ``LowerTriangularFromBottomRightMask()``: bottom-right causal (the decode convention);
* ``LocalAttentionFromBottomRightMask(l, r)``: a two-sided local window;
* ``BlockDiagonalCausalMask`` via ``BlockDiagonalMask.from_seqlens(...).make_causal()``: packed
  sequences (B = 1) each causal on its own;
* an additive tensor bias.
"""

from __future__ import annotations

import torch
import xformers.ops as xops
from xformers.ops import fmha

DIM, HEADS, HEAD_DIM = 16, 2, 8


class MaskedAttention(torch.nn.Module):
    """Projections shared by every mask variant; inputs [B, M, DIM], attention in [B, M, H, K]."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.k = torch.nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.v = torch.nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)

    def split(self, x, proj):
        """[B, M, DIM] -> [B, M, H, K]."""
        return proj(x).unflatten(-1, (HEADS, HEAD_DIM))

    def attend(self, x_q, x_kv, bias):
        """memory_efficient_attention of x_q over x_kv with ``bias``; returns [B, Mq, H*K]."""
        q, k, v = self.split(x_q, self.q), self.split(x_kv, self.k), self.split(x_kv, self.v)
        return xops.memory_efficient_attention(q, k, v, attn_bias=bias).flatten(-2)

    def forward(self, x_q, x_kv, tensor_bias):
        """Every mask variant on the same inputs (Mq != Mk), summed."""
        top_left = self.attend(x_q, x_kv, xops.LowerTriangularMask())
        bottom_right = self.attend(x_q, x_kv, fmha.attn_bias.LowerTriangularFromBottomRightMask())
        local = self.attend(
            x_q, x_kv, fmha.attn_bias.LocalAttentionFromBottomRightMask(window_left=1, window_right=1)
        )
        biased = self.attend(x_q, x_kv, tensor_bias)
        return top_left, bottom_right, local, biased

    def packed(self, x, lengths):
        """Packed sequences x [1, sum(lengths), DIM], each causal on its own."""
        bias = fmha.BlockDiagonalMask.from_seqlens(lengths).make_causal()
        return self.attend(x, x, bias)


def main():
    """Every variant forward plus one backward pass; prints what it did."""
    torch.manual_seed(0)
    module = MaskedAttention()
    x_q, x_kv = torch.randn(2, 3, DIM), torch.randn(2, 5, DIM)
    outs = module(x_q, x_kv, torch.randn(2, HEADS, 3, 5))
    packed = module.packed(torch.randn(1, 9, DIM), [4, 2, 3])
    (sum(o.square().mean() for o in outs) + packed.square().mean()).backward()
    print(
        f"variants {[tuple(o.shape) for o in outs]}  packed {tuple(packed.shape)}  |grad q| {module.q.weight.grad.norm():.4f}"
    )


if __name__ == "__main__":
    main()
