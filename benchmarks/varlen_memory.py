"""Peak scratch memory of ``flashport.varlen_attention``: the O(total) layout vs a dense mask.

32 packed sequences of 1025 tokens (T = 32 * 1025), causal, H = 4, D = 64, float32, compiled on
this host's platform (``backend="auto"``) and read from XLA's ``memory_analysis`` (temp bytes;
nothing runs). Rows:

- ``dense mask``: what varlen did before: the packed layout plus a [T, T] per-sequence mask
  (``flashport.kernels.contract.varlen.varlen_layout``) passed as ``mask=``;
- ``segment ids, same cu_seqlens``: queries and keys share ``cu_seqlens`` (packed layout as is);
- ``virtual layout, cu_q != cu_k``: per-sequence q/k lengths may differ (bottom-right per sequence),
  so the sequences are gathered into a 2T-row layout with one global alignment.

    python benchmarks/varlen_memory.py            # forward and forward+backward (about 2 minutes)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import flashport
from flashport.kernels.contract.varlen import varlen_layout

SEQS, LEN, H, D = 32, 1025, 4, 64
T = SEQS * LEN


def dense(q, k, v, cu_q, cu_k):
    q_ids, kv_ids, mask = varlen_layout(cu_q, cu_k, T, T, causal=True)
    out = flashport.attention(
        q[None],
        k[None],
        v[None],
        mask=mask[None, None],
        q_segment_ids=q_ids[None],
        kv_segment_ids=kv_ids[None],
    )
    return out[0]


def same_cu(q, k, v, cu_q, cu_k):
    return flashport.varlen_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_q, causal=True)


def virtual(q, k, v, cu_q, cu_k):
    return flashport.varlen_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)


def temp_bytes(fn, grad: bool) -> int:
    x = jax.ShapeDtypeStruct((T, H, D), jnp.float32)
    cu = jax.ShapeDtypeStruct((SEQS + 1,), jnp.int32)

    def loss(q, k, v, cu_q, cu_k):
        return fn(q, k, v, cu_q, cu_k).sum()

    f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)) if grad else fn)
    return f.trace(x, x, x, cu, cu).lower().compile().memory_analysis().temp_size_in_bytes


def main() -> None:
    print(
        f"jax {jax.__version__} on {jax.default_backend()}: T = {SEQS} x {LEN} = {T}, H={H}, D={D}, f32, causal"
    )
    print(f"{'layout':<32} {'pass':<8} {'temp MiB':>10} {'vs dense':>9}")
    rows = {
        "dense mask": dense,
        "segment ids, same cu_seqlens": same_cu,
        "virtual layout, cu_q != cu_k": virtual,
    }
    for grad in (False, True):
        base = None
        for name, fn in rows.items():
            mib = temp_bytes(fn, grad) / 2**20
            base = base or mib
            print(f"{name:<32} {'fwd+bwd' if grad else 'forward':<8} {mib:>10.1f} {mib / base:>8.3f}x")
    print(
        f"(a [T, T] bool mask alone is {T * T / 2**20:.0f} MiB; q, k, v are {3 * T * H * D * 4 / 2**20:.0f} MiB)"
    )


if __name__ == "__main__":
    main()
