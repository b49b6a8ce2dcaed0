"""A tiny encoder-decoder block written against ``torch.nn.functional.scaled_dot_product_attention``.

The *before* of the codemod; it runs anywhere torch runs, and after
``flashport rewrite --write`` (on a copy) its attention goes through ``flashport.torch.attention``
(flashport's JAX path on CPU, the Pallas kernel on TPU via torch_xla)::

    cp examples/torch_sdpa_model.py /tmp/ && flashport rewrite --write /tmp/torch_sdpa_model.py
    python /tmp/torch_sdpa_model.py

What it exercises (each an SDPA semantic the rewrite must keep):

* decoder self-attention with ``is_causal=True`` and **GQA** (``enable_gqa=True``);
* a chunked-prefill step where the last 3 queries attend to all keys with ``is_causal=True``:
  ``Sq != Sk``, so SDPA's causal is **top-left** (query ``i`` sees keys ``j <= i``, *not* the
  flash-attn bottom-right);
* cross-attention with a **boolean padding mask** (True = attend) and an **additive float mask**.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DIM, HEADS, KV_HEADS, HEAD_DIM = 24, 4, 2, 6


class Block(torch.nn.Module):
    """Causal GQA self-attention + masked cross-attention, [B, H, S, D] layout like SDPA."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.kv = torch.nn.Linear(DIM, 2 * KV_HEADS * HEAD_DIM, bias=False)
        self.cq = torch.nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.ckv = torch.nn.Linear(DIM, 2 * HEADS * HEAD_DIM, bias=False)
        self.o = torch.nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)

    @staticmethod
    def heads(x, n):
        """[B, S, n*D] -> [B, n, S, D]."""
        return x.unflatten(-1, (n, HEAD_DIM)).transpose(1, 2)

    def self_attention(self, x, queries_from=0):
        """Causal GQA self-attention of the tokens from ``queries_from`` on (top-left when Sq < Sk)."""
        q = self.heads(self.q(x[:, queries_from:]), HEADS)
        k, v = (self.heads(t, KV_HEADS) for t in self.kv(x).chunk(2, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(out.transpose(1, 2).flatten(-2))

    def cross_attention(self, x, memory, keep, bias):
        """x attends to memory where ``keep`` [B, 1, 1, M] is True, plus the additive ``bias``."""
        q = self.heads(self.cq(x), HEADS)
        k, v = (self.heads(t, HEADS) for t in self.ckv(memory).chunk(2, dim=-1))
        masked = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        biased = F.scaled_dot_product_attention(q, k, v, bias, scale=0.5)
        return self.o((masked + biased).transpose(1, 2).flatten(-2))

    def forward(self, x, memory, keep, bias):
        """x [B, S, DIM], memory [B, M, DIM] -> [B, S, DIM]."""
        x = x + self.self_attention(x)
        return x + self.cross_attention(x, memory, keep, bias)


def main():
    """Forward, a chunked-prefill step and one backward pass; prints what it did."""
    torch.manual_seed(0)
    block = Block()
    x, memory = torch.randn(2, 6, DIM), torch.randn(2, 5, DIM)
    keep = torch.tensor([[True] * 5, [True, True, True, False, False]])[:, None, None, :]
    bias = torch.randn(1, HEADS, 6, 5)
    y = block(x, memory, keep, bias)
    chunk = block.self_attention(x, queries_from=3)
    (y.square().mean() + chunk.square().mean()).backward()
    print(f"y {tuple(y.shape)}  chunk {tuple(chunk.shape)}  |grad q| {block.q.weight.grad.norm():.4f}")


if __name__ == "__main__":
    main()
