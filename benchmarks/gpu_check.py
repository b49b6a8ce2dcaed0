"""Check flashport.attention on a CUDA machine against the float64 reference, and time it.

Runs every backend that can run there (``cudnn``, ``pallas_gpu``, ``blockwise``, ``xla``, ``auto``) on
configurations inside and outside cuDNN's feature set, prints max errors vs tests/reference.py and
which backend ``auto`` picked, checks the compiled ``pallas_gpu`` kernels' gradients (and dropout)
against the float64 reference, then times the forward pass of auto and pallas_gpu vs jax.nn's cuDNN
and XLA paths.

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
from reference import reduce_to_shape, reference_attention, reference_attention_vjp

import flashport

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
        for backend in ("cudnn", "pallas_gpu", "blockwise", "xla", "auto"):
            picks.lines.clear()
            try:
                out = jax.jit(
                    lambda q, k, v, backend=backend, case=case: flashport.attention(
                        q, k, v, backend=backend, **case
                    )
                )(q, k, v)
            except ValueError as err:
                print(f"{name:28s} {backend:9s} refused: {str(err)[:110]}")
                continue
            err = float(np.max(np.abs(np.asarray(out, np.float64) - want)))
            picked = next((l.split("cuda->")[1].split(" ")[0] for l in picks.lines if "cuda->" in l), "")
            good = err < 5e-2
            ok &= good
            print(
                f"{name:28s} {backend:9s} max err {err:.2e} {'ok' if good else 'FAIL'} {('auto picked ' + picked) if picked else ''}"
            )
    return ok


GRAD_CASES = [
    ("causal bottom_right gqa", dict(causal=True, hkv=2)),
    ("window softcap bias", dict(window=(32, 0), softcap=5.0, bias=(1, 8, 128, 256))),
    ("key-padding bias + segments", dict(bias=(2, 1, 1, 256), segments=True)),
    ("dropout causal", dict(causal=True, dropout_rate=0.2)),
]


def check_grads(backend="pallas_gpu", dtype=jnp.bfloat16, sq=128, sk=256, d=64, tol=6e-2, cases=None) -> bool:
    """Forward and gradients (q, k, v, bias) of ``backend`` against the float64 reference.

    On the GPU this checks the compiled Triton kernels; on CPU it runs with
    ``backend="pallas_gpu_interpret"`` (small shapes) as a smoke test of the script itself.
    """
    ok = True
    for name, case in GRAD_CASES if cases is None else cases:
        case = dict(case)
        q, k, v = _inputs(0, sq=sq, sk=sk, hkv=case.pop("hkv", 8), d=d, dtype=dtype)
        rng = np.random.default_rng(2)
        d_out = jnp.asarray(rng.standard_normal(q.shape), dtype)
        bias_shape = case.pop("bias", None)
        bias = None
        if bias_shape is not None:
            bias_shape = tuple(sk if n == 256 else sq if n == 128 else n for n in bias_shape)
            bias = jnp.asarray(rng.standard_normal(bias_shape), jnp.float32)
        if case.pop("segments", False):
            case["q_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (2, sq)), axis=1), jnp.int32)
            case["kv_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (2, sk)), axis=1), jnp.int32)
        ref_case = dict(case, bias=bias)
        if case.get("dropout_rate"):
            case["dropout_rng"] = jax.random.key(5)
            ref_case["dropout_seed"] = (0, 5)

        def run(q, k, v, bias, case=case):
            return flashport.attention(q, k, v, bias=bias, backend=backend, **case)

        out, vjp = jax.vjp(jax.jit(run), q, k, v, bias)
        got = vjp(d_out)
        f64 = [np.asarray(x, np.float64) for x in (q, k, v, d_out)]
        want_out, _ = reference_attention(*f64[:3], **ref_case)
        want = reference_attention_vjp(*f64, **ref_case)
        if bias is not None:
            want = (*want[:3], reduce_to_shape(want[3], bias.shape))
        errs = [float(np.max(np.abs(np.asarray(out, np.float64) - want_out)))]
        for g, w in zip(got[: 3 + (bias is not None)], want, strict=True):
            errs.append(
                float(np.max(np.abs(np.asarray(g, np.float64) - w))) / max(1.0, float(np.max(np.abs(w))))
            )
        good = max(errs) < tol
        ok &= good
        labels = "out dq dk dv dbias".split()
        print(
            f"{name:28s} {backend:9s} grads "
            + " ".join(f"{l} {e:.1e}" for l, e in zip(labels, errs, strict=True))
            + f" {'ok' if good else 'FAIL'}"
        )
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
    """Median forward time: flashport auto and pallas_gpu vs jax.nn cuDNN and XLA, causal, bf16."""
    print(
        f"{'S':>6} {'flashport auto ms':>18} {'pallas_gpu ms':>14} {'jax.nn cudnn ms':>16} {'jax.nn xla ms':>14}"
    )
    for seq in (1024, 4096, 8192):
        q, k, v = _inputs(0, sq=seq, sk=seq, hq=16, hkv=16, d=128)
        ours = jax.jit(lambda q, k, v: flashport.attention(q, k, v, causal=True))
        pallas = jax.jit(lambda q, k, v: flashport.attention(q, k, v, causal=True, backend="pallas_gpu"))
        cudnn = jax.jit(
            lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        )
        xla = jax.jit(
            lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
        )
        row = [_time(f, q, k, v) * 1e3 for f in (ours, pallas, cudnn, xla)]
        print(f"{seq:>6} {row[0]:>18.3f} {row[1]:>14.3f} {row[2]:>16.3f} {row[3]:>14.3f}")


if __name__ == "__main__":
    good = check()
    good &= check_grads()
    bench()
    print("ALL OK" if good else "SOME CHECKS FAILED")
    sys.exit(0 if good else 1)
