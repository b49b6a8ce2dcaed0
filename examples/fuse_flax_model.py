"""Apply ``flashport.fuse_attention`` to an unmodified Flax model and print what it found.

The model below is plain Flax: ``flax.linen.MultiHeadDotProductAttention`` with a causal mask
built by ``nn.make_causal_mask``, i.e. softmax(Q·Kᵀ)·V written out by the library, with no GPU
kernel and no flashport call anywhere. Nothing in it is edited. ``flashport.find_attention``
traces it and reports each attention subgraph (shapes, layout, scale, mask kind, GQA) and each
near-miss with its reason; ``flashport.fuse_attention`` returns the same function with every
match replaced by ``flashport.attention``, so it runs the Pallas kernel on TPU and the O(S)
blockwise kernel on CPU. Run::

    python examples/fuse_flax_model.py

It prints the report table and the largest difference between the fused and the original output.
"""

from __future__ import annotations

import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.table import Table

import flashport

DIM, HEADS, LAYERS, VOCAB = 64, 4, 2, 128


class Block(nn.Module):
    """Pre-norm transformer block using Flax's own attention module."""

    @nn.compact
    def __call__(self, x, mask):
        """x: [batch, seq, DIM], mask: [batch, 1, seq, seq] -> [batch, seq, DIM]."""
        attention = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=DIM, deterministic=True)
        x = x + attention(nn.LayerNorm()(x), mask=mask)
        return x + nn.Dense(DIM)(jax.nn.gelu(nn.Dense(4 * DIM)(nn.LayerNorm()(x))))


class TinyLM(nn.Module):
    """A causal language model made of :class:`Block` s."""

    @nn.compact
    def __call__(self, tokens):
        """tokens: int [batch, seq] -> logits [batch, seq, VOCAB]."""
        x = nn.Embed(VOCAB, DIM)(tokens)
        mask = nn.make_causal_mask(tokens)
        for _ in range(LAYERS):
            x = Block()(x, mask)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def build(batch: int = 2, seq: int = 64, seed: int = 0):
    """Return ``(apply, params, tokens)`` for a freshly initialized :class:`TinyLM`."""
    tokens = jax.random.randint(jax.random.PRNGKey(seed), (batch, seq), 0, VOCAB)
    model = TinyLM()
    params = model.init(jax.random.PRNGKey(seed + 1), tokens)
    return model.apply, params, tokens


def compact_table(report) -> Table:
    """The report's key columns (the full table, ``report.table()``, has every field)."""
    table = Table(
        title=f"flashport.find_attention: {len(report.matches)} fused, {len(report.near_misses)} near-miss"
    )
    for column in ("status", "location", "q shape", "layout", "scale", "mask", "gqa", "reason"):
        table.add_column(column, overflow="fold")
    for site in report.to_dicts():
        location = site["location"].split("/")[-1]
        table.add_row(
            site["status"],
            location,
            str(site["q"]),
            site["layout"],
            str(site["scale"]),
            site["mask"],
            str(site["gqa"]),
            site["reason"],
        )
    return table


def main() -> dict:
    """Print the ``find_attention`` report and the fused-vs-original difference; return both as data."""
    apply, params, tokens = build()
    report = flashport.find_attention(apply)(params, tokens)
    Console(highlight=False, width=None if sys.stdout.isatty() else 120).print(compact_table(report))
    fused = jax.jit(flashport.fuse_attention(apply))
    expected = jax.jit(apply)(params, tokens)
    got = fused(params, tokens)
    diff = float(jnp.max(jnp.abs(np.asarray(got) - np.asarray(expected))))
    print(
        f"{len(report.matches)} fused, {len(report.near_misses)} near-miss; max |fused - original| = {diff:.2e}"
    )
    return {"matches": len(report.matches), "near_misses": len(report.near_misses), "max_abs_diff": diff}


if __name__ == "__main__":
    main()
