"""A small PyTorch model written against FlexAttention, the way GPU model code uses it.

One attention block whose ``variant`` picks the mods real models write: ALiBi with learnable
slopes, a learned relative-position bias table, softcapping (Gemma 2), document masking of packed
sequences, prefix-LM and a causal sliding window. ``flashport rewrite`` points every FlexAttention
call (and the ``torch.compile(flex_attention)`` wrapper) at ``flashport.torch``; the ported model
runs torch's own FlexAttention on CPU/CUDA and ``flashport.attention`` on TPU tensors.
"""

import torch
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

flex = torch.compile(flex_attention, dynamic=False)

VARIANTS = ("alibi", "relative_bias", "softcap", "document", "prefix_lm", "sliding_window")


class FlexBlock(nn.Module):
    """Multi-head self-attention with one FlexAttention ``score_mod`` / ``mask_mod`` variant."""

    def __init__(self, dim=32, heads=4, kv_heads=2, max_len=64, variant="alibi", window=8, prefix=5):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.variant, self.window, self.prefix, self.max_len = variant, window, prefix, max_len
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.slopes = nn.Parameter(2.0 ** (-torch.arange(1, heads + 1, dtype=torch.float32)))
        self.rel = nn.Parameter(torch.zeros(heads, 2 * max_len - 1))

    def score_mod(self):
        slopes, rel, max_len = self.slopes, self.rel, self.max_len
        if self.variant == "alibi":
            return lambda score, b, h, q_idx, kv_idx: score + slopes[h] * (kv_idx - q_idx)
        if self.variant == "relative_bias":
            return lambda score, b, h, q_idx, kv_idx: score + rel[h, q_idx - kv_idx + max_len - 1]
        if self.variant == "softcap":
            return lambda score, b, h, q_idx, kv_idx: 20.0 * torch.tanh(score / 20.0)
        return None

    def mask_mod(self, docs):
        window, prefix = self.window, self.prefix

        def causal(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        def document(b, h, q_idx, kv_idx):
            return (docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)

        def prefix_lm(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) | (kv_idx < prefix)

        def sliding_window(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)

        return {"document": document, "prefix_lm": prefix_lm, "sliding_window": sliding_window}.get(
            self.variant, causal
        )

    def forward(self, x, docs):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.wkv(x).view(b, s, 2, self.kv_heads, self.head_dim).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        block_mask = create_block_mask(self.mask_mod(docs), None, None, s, s, device=x.device)
        out = flex(q, k, v, score_mod=self.score_mod(), block_mask=block_mask, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def main():
    torch.manual_seed(0)
    x = torch.randn(2, 24, 32)
    docs = torch.tensor([0] * 9 + [1] * 15)
    for variant in VARIANTS:
        with torch.no_grad():
            y = FlexBlock(variant=variant)(x, docs)
        print(f"{variant}: out {tuple(y.shape)} mean |y| {y.abs().mean().item():.4f}")


if __name__ == "__main__":
    main()
