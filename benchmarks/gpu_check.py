"""Check flashport.attention on a CUDA machine against the float64 reference, and time it.

Runs every backend that can run there (``cudnn``, ``blockwise``, ``xla``, ``auto``) on configurations
inside and outside cuDNN's feature set, prints max errors vs tests/reference.py and which backend
``auto`` picked, then times the forward pass of auto vs jax.nn's cuDNN and XLA paths.

    python benchmarks/gpu_check.py
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import flashport  # noqa: E402
from reference import reference_attention  # noqa: E402

CASES = [
    ("plain", dict()),
    ("causal top_left", dict(causal=True, align="top_left")),
    ("causal square", dict(causal=True, sq=256)),
    ("causal bottom_right Sq<Sk", dict(causal=True)),
    ("left window top_left", dict(window=(32, 0), align="top_left")),
    ("bias + gqa", dict(bias=True, hkv=2)),
    ("softcap", dict(softcap=5.0)),
    ("segments", dict(segments=True)),
]


class _Picks(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _inputs(seed, sq=128, sk=256, hq=8, hkv=8, d=64, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((2, sq, hq, d)), dtype)
    k = jnp.asarray(rng.standard_normal((2, sk, hkv, d)), dtype)
    v = jnp.asarray(rng.standard_normal((2, sk, hkv, d)), dtype)
    return q, k, v


def check() -> bool:
    """Compare every backend with the reference; return True when all are within tolerance."""
    ok = True
    picks = _Picks()
    log = logging.getLogger("flashport")
    log.setLevel(logging.DEBUG)
    log.addHandler(picks)
    print(f"jax {jax.__version__}, devices {jax.devices()}")
    for name, case in CASES:
        case = dict(case)
        shape = {k: case.pop(k) for k in ("sq", "hkv") if k in case}
        if "sq" in shape:
            shape["sk"] = shape["sq"]
        q, k, v = _inputs(0, **shape)
        rng = np.random.default_rng(1)
        if case.pop("bias", False):
            case["bias"] = jnp.asarray(rng.standard_normal((1, 8, q.shape[1], k.shape[1])), jnp.float32)
        if case.pop("segments", False):
            seg_q = jnp.asarray(np.sort(rng.integers(0, 3, (2, q.shape[1])), axis=1), jnp.int32)
            seg_k = jnp.asarray(np.sort(rng.integers(0, 3, (2, k.shape[1])), axis=1), jnp.int32)
            case.update(q_segment_ids=seg_q, kv_segment_ids=seg_k)
        want, _ = reference_attention(np.float32(q), np.float32(k), np.float32(v), **case)
        for backend in ("cudnn", "blockwise", "xla", "auto"):
            picks.lines.clear()
            try:
                out = jax.jit(lambda q, k, v: flashport.attention(q, k, v, backend=backend, **case))(q, k, v)
            except ValueError as err:
                print(f"{name:28s} {backend:9s} refused: {str(err)[:110]}")
                continue
            err = float(np.max(np.abs(np.asarray(out, np.float64) - want)))
            picked = next((l.split("cuda->")[1].split(" ")[0] for l in picks.lines if "cuda->" in l), "")
            good = err < 5e-2
            ok &= good
            print(f"{name:28s} {backend:9s} max err {err:.2e} {'ok' if good else 'FAIL'} {('auto picked ' + picked) if picked else ''}")
    return ok


def _time(fn, *args, repeats=20):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench() -> None:
    """Median forward time: flashport auto vs jax.nn cuDNN and XLA, causal, bf16."""
    print(f"{'S':>6} {'flashport auto ms':>18} {'jax.nn cudnn ms':>16} {'jax.nn xla ms':>14}")
    for seq in (1024, 4096, 8192):
        q, k, v = _inputs(0, sq=seq, sk=seq, hq=16, hkv=16, d=128)
        ours = jax.jit(lambda q, k, v: flashport.attention(q, k, v, causal=True))
        cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
        xla = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"))
        row = [_time(f, q, k, v) * 1e3 for f in (ours, cudnn, xla)]
        print(f"{seq:>6} {row[0]:>18.3f} {row[1]:>16.3f} {row[2]:>14.3f}")


if __name__ == "__main__":
    good = check()
    bench()
    print("ALL OK" if good else "SOME CHECKS FAILED")
    sys.exit(0 if good else 1)
