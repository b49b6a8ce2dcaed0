"""A tiny GQA decoder written against flash-attn 2.x, the way GPU code uses it.

This file is the *before* of the codemod: it imports ``flash_attn`` at the top, so on a machine
without flash-attn (any CPU or TPU machine) it stops with ``ModuleNotFoundError: No module named
'flash_attn'``. Port a copy and run it::

    cp examples/torch_flash_attn_model.py /tmp/ && flashport rewrite --write /tmp/torch_flash_attn_model.py
    python /tmp/torch_flash_attn_model.py

What it exercises (each is a flash-attn semantic the rewrite must keep):

* ``flash_attn_func`` with ``causal=True`` and a **sliding window** ``window_size=(W, 0)`` (layer 0)
  and plain causal (layer 1), with **GQA** (4 query heads share 2 KV heads);
* ``flash_attn_varlen_func`` over **packed sequences** of different lengths (``cu_seqlens``);
* a **decode step** where 2 new queries attend to all ``S + 2`` keys: ``Sq != Sk``, so causal is
  **bottom-right** (the last query sees every key).
"""

from __future__ import annotations

import torch
from flash_attn import flash_attn_func, flash_attn_varlen_func

VOCAB, DIM, HEADS, KV_HEADS, HEAD_DIM, WINDOW = 50, 32, 4, 2, 8, 3


class Attention(torch.nn.Module):
    """GQA self-attention; ``window`` limits each query to the last ``window + 1`` keys."""

    def __init__(self, window: int | None):
        super().__init__()
        self.window = window
        self.q = torch.nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.k = torch.nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.v = torch.nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.o = torch.nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)

    def project(self, x):
        """[..., S, DIM] -> q [..., S, H, D], k/v [..., S, Hk, D]."""
        q = self.q(x).unflatten(-1, (HEADS, HEAD_DIM))
        k = self.k(x).unflatten(-1, (KV_HEADS, HEAD_DIM))
        v = self.v(x).unflatten(-1, (KV_HEADS, HEAD_DIM))
        return q, k, v

    def forward(self, x):
        """Batched causal (windowed) attention, x: [B, S, DIM]."""
        q, k, v = self.project(x)
        if self.window is not None:
            out = flash_attn_func(q, k, v, 0.0, causal=True, window_size=(self.window, 0))
        else:
            out = flash_attn_func(q, k, v, dropout_p=0.0, causal=True)
        return self.o(out.flatten(-2))

    def forward_packed(self, x, cu_seqlens, max_seqlen):
        """Packed variable-length sequences, x: [total, DIM]; each sequence is causal on its own."""
        q, k, v = self.project(x)
        out = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True)
        return self.o(out.flatten(-2))

    def decode(self, x_prefix, x_new):
        """The last ``x_new.shape[1]`` tokens attend to prefix + themselves (Sq < Sk, bottom-right)."""
        _, k, v = self.project(torch.cat([x_prefix, x_new], dim=1))
        q, _, _ = self.project(x_new)
        out = flash_attn_func(q, k, v, causal=True, softmax_scale=HEAD_DIM**-0.5)
        return self.o(out.flatten(-2))


class TinyDecoder(torch.nn.Module):
    """Embedding, a windowed and a full causal attention layer (residual), an output head."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList([Attention(WINDOW), Attention(None)])
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        """ids [B, S] -> logits [B, S, VOCAB]."""
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)

    def forward_packed(self, ids, cu_seqlens, max_seqlen):
        """Packed ids [total] with int32 cu_seqlens -> logits [total, VOCAB]."""
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer.forward_packed(x, cu_seqlens, max_seqlen)
        return self.head(x)

    def decode_logits(self, prefix_ids, new_ids):
        """Logits of the new tokens given the prefix, using the first layer's decode path."""
        x_prefix, x_new = self.embed(prefix_ids), self.embed(new_ids)
        return self.head(x_new + self.layers[0].decode(x_prefix, x_new))


def main():
    """Forward, packed forward, a decode step and one training step; prints what it did."""
    torch.manual_seed(0)
    model = TinyDecoder()
    ids = torch.randint(0, VOCAB, (2, 7))
    logits = model(ids)
    lengths = [3, 5, 2]
    cu = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    packed = model.forward_packed(torch.randint(0, VOCAB, (sum(lengths),)), cu, max(lengths))
    step = model.decode_logits(ids[:, :5], ids[:, 5:])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    print(
        f"logits {tuple(logits.shape)}  packed {tuple(packed.shape)}  decode {tuple(step.shape)}  "
        f"loss {loss.item():.4f} -> {torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).item():.4f}"
    )


if __name__ == "__main__":
    main()
