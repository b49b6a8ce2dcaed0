"""The contract's attention dropout on the torch side: argument checks, seed words, the keep-mask.

The keep-mask is the counter-based hash of :mod:`flashport.kernels.semantics.dropout` (its docstring holds
the definition), written here in torch so that the pure-torch math path draws the mask every JAX
backend draws, without importing jax. uint32 arithmetic runs on int64 tensors holding values in
``[0, 2**32)``: additions are wrapped with ``& 0xFFFFFFFF``, multiplications by a 32-bit constant
are split into 16-bit halves so no intermediate leaves int64 (no signed overflow), and right shifts
of non-negative int64 values are logical. ``tests/test_torch_dropout.py`` checks the mask bit-equal to
``flashport.kernels.semantics.dropout`` and to the float64 reference's ``dropout_keep``.

The seed words are two uint32 values drawn from a ``torch.Generator`` per call (``None`` = torch's
default CPU generator, seeded by ``torch.manual_seed``), so seeding the generator reproduces the
mask and each call draws a fresh one. The JAX paths receive them as ``dropout_rng`` (a raw
uint32[2] key, whose words :func:`flashport.kernels.semantics.dropout.seed_words` uses as they are).
"""

from __future__ import annotations

import torch

from flashport.kernels.semantics import dropout_constants as hashing


def check_p(dropout_p) -> float:
    """Validate ``dropout_p``: a real number in [0, 1). Returns it as a float."""
    hint = "pass the probability itself (e.g. dropout_p=0.1), not a tensor"
    return hashing.check_rate("dropout_p", dropout_p, type_hint=hint, value_hint=" (e.g. in eval mode)")


def check_generator(generator):
    """Validate ``generator``: None (torch's default generator) or a ``torch.Generator``."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator or None (torch's default generator), got "
            f"{type(generator).__name__}; to seed the dropout mask pass "
            f"generator=torch.Generator().manual_seed(seed)"
        )
    return generator


def draw_words(generator) -> tuple[int, int]:
    """Two uint32 seed words drawn from ``generator`` (None = torch's default CPU generator)."""
    if generator is None:
        words = torch.randint(0, 2**32, (2,), dtype=torch.int64)
    else:
        words = torch.randint(0, 2**32, (2,), dtype=torch.int64, generator=generator, device=generator.device)
    w0, w1 = words.tolist()
    return int(w0), int(w1)


def seed_tensor(words: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
    """The seed words as an int32 [2] tensor holding their bit patterns, made like ``like`` (same
    device and tensor type: ``new_tensor`` dispatches through torchax / torch_xla tensors). JAX
    runs without x64, so int64 would not survive; the JAX side bitcasts it back to uint32."""
    signed = [w - 2**32 if w >= 2**31 else w for w in words]
    return like.new_tensor(signed, dtype=torch.int32)


def _mul(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in [0, 2**32) and a 32-bit constant, without overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & hashing.MASK32


def _fmix(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul(x, hashing.FMIX_M1)
    x = x ^ (x >> 13)
    x = _mul(x, hashing.FMIX_M2)
    return x ^ (x >> 16)


def hash_bits(words: tuple[int, int], batch: int, heads: int, seq_q: int, seq_k: int, device) -> torch.Tensor:
    """``bits`` of the definition, int64 [B, Hq, Sq, Sk] with values in [0, 2**32)."""
    k0, k1 = (int(w) & hashing.MASK32 for w in words)

    def index(n, dim):
        shape = [1, 1, 1, 1]
        shape[dim] = n
        return (torch.arange(n, dtype=torch.int64, device=device) + 1).reshape(shape)

    t_b = _fmix((_mul(index(batch, 0), hashing.BATCH_MUL) + k0) & hashing.MASK32)
    t_bh = _fmix(t_b ^ ((_mul(index(heads, 1), hashing.HEAD_MUL) + k1) & hashing.MASK32))
    row = _fmix((t_bh + _mul(index(seq_q, 2), hashing.ROW_MUL)) & hashing.MASK32)
    return _fmix(row ^ _mul(index(seq_k, 3), hashing.KEY_MUL))


def keep_mask(
    words: tuple[int, int], rate: float, batch: int, heads: int, seq_q: int, seq_k: int, device=None
) -> torch.Tensor:
    """The contract's keep-mask, bool [B, Hq, Sq, Sk] (``h`` is the query head, positions from 0)."""
    return hash_bits(words, batch, heads, seq_q, seq_k, device) >= hashing.threshold(rate)
