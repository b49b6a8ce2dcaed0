"""A small Flax decoder written against GPU attention kernels (the codemod's JAX example).

Two attention layers, the way GPU-first JAX code calls them:

* ``SelfAttention`` uses ``jax.nn.dot_product_attention(..., implementation="cudnn")`` with grouped
  query attention (4 query heads share 2 key/value heads) and a causal mask;
* ``PallasAttention`` calls the Pallas-GPU kernel ``mha`` from
  ``jax.experimental.pallas.ops.gpu.attention`` (note its ``sm_scale`` defaults to 1.0, not
  1/sqrt(head_dim), so the code passes it).

Both calls only run on an NVIDIA GPU. ``flashport rewrite examples/ --write`` turns them into
``flashport.attention`` calls that state layout, alignment and scale, after which::

    python examples/jax_flax_model.py

runs on CPU (and TPU) and prints the output's shape and checksum.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu.attention import mha

VOCAB, DIM, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 256, 64, 4, 2, 16, 2


class SelfAttention(nn.Module):
    """Causal GQA self-attention through cuDNN's fused kernel."""

    heads: int = HEADS
    kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM

    @nn.compact
    def __call__(self, x):
        """x: [batch, seq, DIM] -> [batch, seq, DIM]."""
        q = nn.DenseGeneral((self.heads, self.head_dim), use_bias=False, name="q")(x)
        k = nn.DenseGeneral((self.kv_heads, self.head_dim), use_bias=False, name="k")(x)
        v = nn.DenseGeneral((self.kv_heads, self.head_dim), use_bias=False, name="v")(x)
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return nn.DenseGeneral(x.shape[-1], axis=(-2, -1), use_bias=False, name="o")(out)


class PallasAttention(nn.Module):
    """Causal multi-head attention through the Pallas-GPU flash-attention kernel."""

    heads: int = HEADS
    head_dim: int = HEAD_DIM

    @nn.compact
    def __call__(self, x):
        """x: [batch, seq, DIM] -> [batch, seq, DIM]."""
        qkv = nn.DenseGeneral((3, self.heads, self.head_dim), use_bias=False, name="qkv")(x)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        out = mha(q, k, v, segment_ids=None, sm_scale=self.head_dim**-0.5, causal=True)
        return nn.DenseGeneral(x.shape[-1], axis=(-2, -1), use_bias=False, name="o")(out)


class Block(nn.Module):
    """Pre-norm residual block: attention then an MLP."""

    pallas: bool

    @nn.compact
    def __call__(self, x):
        """x: [batch, seq, DIM] -> [batch, seq, DIM]."""
        attention = PallasAttention() if self.pallas else SelfAttention()
        x = x + attention(nn.RMSNorm()(x))
        h = nn.Dense(4 * DIM)(nn.RMSNorm()(x))
        return x + nn.Dense(DIM)(jax.nn.gelu(h))


class Decoder(nn.Module):
    """Token embedding, alternating cuDNN / Pallas attention blocks, tied output head."""

    @nn.compact
    def __call__(self, tokens):
        """tokens: int [batch, seq] -> logits [batch, seq, VOCAB]."""
        embed = nn.Embed(VOCAB, DIM)
        x = embed(tokens)
        for layer in range(LAYERS):
            x = Block(pallas=layer % 2 == 1)(x)
        return embed.attend(nn.RMSNorm()(x))


def run(batch: int = 2, seq: int = 128, seed: int = 0):
    """Initialize the decoder and return ``(params, tokens, logits)`` for a random batch."""
    tokens = jax.random.randint(jax.random.PRNGKey(seed), (batch, seq), 0, VOCAB)
    model = Decoder()
    params = model.init(jax.random.PRNGKey(seed + 1), tokens)
    return params, tokens, jax.jit(model.apply)(params, tokens)


def main() -> None:
    """Run one forward pass and print the logits' shape and checksum."""
    _, _, logits = run()
    print(f"logits {logits.shape} {logits.dtype} checksum {float(jnp.abs(logits).sum()):.4f}")


if __name__ == "__main__":
    main()
