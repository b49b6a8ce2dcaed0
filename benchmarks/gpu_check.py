"""Check flashport.attention on a CUDA machine against the float64 reference, and time it.

1. Correctness: runs every backend that can run there (``cudnn``, ``pallas_gpu``, ``blockwise``,
   ``xla``, ``auto``) on configurations inside and outside cuDNN's feature set, prints max errors vs
   tests/reference.py and which backend ``auto`` picked, and checks the compiled ``pallas_gpu``
   kernels' gradients (and dropout) against the float64 reference.
2. The issue's table (:mod:`gpu_table`): bf16 B=2 H=16 D=128 S=8192, causal / + window 1024 / GQA
   32q:8kv / + softcap 30 / + 4 packed documents / chunked prefill, flashport auto and pallas_gpu next
   to jax.nn cuDNN, jax.nn XLA and JAX's Pallas GPU ``mha``: forward and forward+backward medians,
   compiled scratch memory, ratios to the best anchor, the goals' pass/fail and memory at two S.

Everything printed is also written to ``--out`` (default ``benchmarks/results/<gpu>_gpu_check.txt``,
e.g. ``h200_gpu_check.txt``). The exit status is 1 when a correctness check fails (including a
table column whose output differs from flashport auto's); the goals are reported (``GOALS MET`` /
``GOALS NOT MET``), not enforced.

    python benchmarks/gpu_check.py                 # on the GPU, about 5 minutes on an H200
    python benchmarks/gpu_check.py --smoke --out /tmp/smoke.txt
        # the table's code path on CPU at tiny shapes: pallas_gpu_interpret, mha interpreted,
        # jax.nn cuDNN skipped with a note (no correctness section; tests/test_gpu_check_smoke.py)
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))
import gpu_table
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


def check(emit=print) -> bool:
    """Compare every backend with the reference; return True when all are within tolerance."""
    ok = True
    picks = _Picks()
    log = logging.getLogger("flashport")
    log.setLevel(logging.DEBUG)
    log.addHandler(picks)
    emit(f"jax {jax.__version__}, devices {jax.devices()}")
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
                emit(f"{name:28s} {backend:9s} refused: {str(err)[:110]}")
                continue
            err = float(np.max(np.abs(np.asarray(out, np.float64) - want)))
            picked = next((l.split("cuda->")[1].split(" ")[0] for l in picks.lines if "cuda->" in l), "")
            good = err < 5e-2
            ok &= good
            emit(
                f"{name:28s} {backend:9s} max err {err:.2e} {'ok' if good else 'FAIL'} {('auto picked ' + picked) if picked else ''}"
            )
    return ok


GRAD_CASES = [
    ("causal bottom_right gqa", dict(causal=True, hkv=2)),
    ("window softcap bias", dict(window=(32, 0), softcap=5.0, bias=(1, 8, 128, 256))),
    ("key-padding bias + segments", dict(bias=(2, 1, 1, 256), segments=True)),
    ("dropout causal", dict(causal=True, dropout_rate=0.2)),
]


def check_grads(
    backend="pallas_gpu", dtype=jnp.bfloat16, sq=128, sk=256, d=64, tol=6e-2, cases=None, emit=print
) -> bool:
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
        emit(
            f"{name:28s} {backend:9s} grads "
            + " ".join(f"{l} {e:.1e}" for l, e in zip(labels, errs, strict=True))
            + f" {'ok' if good else 'FAIL'}"
        )
    return ok


def default_out() -> str:
    """``benchmarks/results/<gpu>_gpu_check.txt`` from the device kind ("NVIDIA H200" -> "h200")."""
    kind = jax.devices()[0].device_kind.lower().replace("nvidia", "").strip()
    slug = re.sub(r"[^a-z0-9]+", "_", kind).strip("_") or "unknown"
    return os.path.join(os.path.dirname(__file__), "results", f"{slug}_gpu_check.txt")


def main(argv=None) -> int:
    """Run the checks and the table; print everything and write it to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU with interpreter backends")
    parser.add_argument("--out", help="file for the output (default: benchmarks/results/<gpu>_gpu_check.txt)")
    parser.add_argument(
        "--rows", default="", help="comma-separated words: only the table rows naming one (plus causal)"
    )
    args = parser.parse_args(argv)
    lines: list[str] = []

    def emit(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    good = True
    if not args.smoke:  # both sections run, whatever the first finds
        good = check(emit)
        good &= check_grads(emit=emit)
    only = tuple(w.strip() for w in args.rows.split(",") if w.strip())
    goals, agree = gpu_table.run_table(gpu_table.Shape.make(args.smoke), emit, only)
    good &= agree
    emit(f"correctness {'ALL OK' if good else 'SOME CHECKS FAILED'}; goals {'met' if goals else 'not met'}")
    out = args.out or (None if args.smoke else default_out())
    if out:
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
