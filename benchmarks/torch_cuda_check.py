"""flashport.torch.attention on CUDA: its paths checked against the float64 reference, then timed.

Run on a CUDA machine from the repository root (torch with CUDA; flash-attn optional):

    python benchmarks/torch_cuda_check.py            # checks, then the timing table
    python benchmarks/torch_cuda_check.py --smoke    # tiny table on CPU (tests/test_torch_cuda_check.py)

Checks (``--device cpu`` runs them on CPU): for each case and dtype it prints which path ran
(flash-attn, torch SDPA, FlexAttention or the math path, from the adapter's debug log), the max abs
error of the output and lse against tests/reference.py (float64 numpy), and of dq/dk/dv/dbias
against the pure-torch math path run on CPU in float32 (that path is checked against the float64
reference by tests/test_torch_adapter.py). Errors are relative to max(1, max |reference|). Without
flash-attn, the softcap, window, mask, segment and bias+causal cases run FlexAttention (compiled per
signature, so this section pays one compilation per case and dtype). Exits 1 on any failure.

Table (``benchmarks/torch_cuda_table.py``): the comparison's rows (bf16, B=2, H=16, D=128, S=8192: causal,
window 1024, GQA 32q/8kv, softcap 30, 4 packed documents, chunked prefill Sq=2048 Sk=8192
bottom-right), flashport auto next to SDPA's flash / efficient / math kernels and FlexAttention:
forward and forward+backward medians, peak memory, ratio to the best anchor.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from reference import reference_attention
from torch_cuda_table import PathLog, run_table

import flashport.torch as ft

TOLERANCE = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 4e-2}  # fp32 allows TF32 matmuls


def cases():
    """(name, q_shape BSHD, kv_shape BSHD, options, extras) covering each feature of the contract."""
    b, hq, hkv, d = 2, 8, 2, 64
    ids = torch.tensor([[0] * 100 + [1] * 80 + [2] * 76, [3] * 256])
    return [
        ("self causal GQA", (b, 256, hq, d), (b, 256, hkv, d), dict(causal=True), {}),
        ("decode Sq<Sk causal bottom-right", (b, 4, hq, d), (b, 300, hkv, d), dict(causal=True), {}),
        ("Sq>Sk causal bottom-right (empty rows)", (b, 300, hq, d), (b, 200, hkv, d), dict(causal=True), {}),
        ("Sq<Sk causal top-left", (b, 64, hq, d), (b, 300, hkv, d), dict(causal=True, align="top_left"), {}),
        ("sliding window", (b, 256, hq, d), (b, 256, hkv, d), dict(causal=True, window=(63, 0)), {}),
        (
            "window top-left Sq>Sk",
            (b, 200, hq, d),
            (b, 120, hkv, d),
            dict(window=(16, 8), align="top_left"),
            {},
        ),
        ("softcap", (b, 256, hq, d), (b, 256, hkv, d), dict(causal=True, softcap=20.0, scale=0.3), {}),
        ("bias", (b, 128, hq, d), (b, 160, hkv, d), dict(causal=True), dict(bias=(1, hq, 128, 160))),
        ("mask", (b, 128, hq, d), (b, 160, hkv, d), {}, dict(mask=(b, 1, 128, 160))),
        (
            "packed segments (varlen)",
            (b, 256, hq, d),
            (b, 256, hkv, d),
            dict(causal=True),
            dict(segments=ids),
        ),
        ("BHSD layout", (b, 128, hq, d), (b, 128, hkv, d), dict(causal=True, layout="BHSD"), {}),
    ]


def check(name, q_shape, kv_shape, options, extras, dtype, device, log, rng):
    """Run one case on ``device``, print its errors, return whether all are within tolerance."""
    layout = options.get("layout", "BSHD")

    def tensor(shape, scale=1.0):
        x = torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * scale).to(dtype)
        return x.transpose(1, 2).contiguous() if layout == "BHSD" else x

    q, k, v = tensor(q_shape, 2.0), tensor(kv_shape), tensor(kv_shape)
    kw = dict(options, layout=layout)
    if "bias" in extras:
        kw["bias"] = torch.from_numpy(rng.standard_normal(extras["bias"]).astype(np.float32))
    if "mask" in extras:
        kw["mask"] = torch.from_numpy(rng.random(extras["mask"]) < 0.6)
    if "segments" in extras:
        kw["q_segment_ids"] = kw["kv_segment_ids"] = extras["segments"]
    cpu = {n: x for n, x in dict(query=q, key=k, value=v, **kw).items()}
    dev = {n: x.to(device, copy=True) if isinstance(x, torch.Tensor) else x for n, x in cpu.items()}
    grads = ("query", "key", "value") + (("bias",) if "bias" in kw else ())
    for n in grads:
        dev[n].requires_grad_(True)
    log.path = "jax"  # the native paths log which one ran; the JAX path (CPU, XLA) does not
    out, lse = ft.attention(**dev, return_lse=True)
    path_lse = log.path
    out = ft.attention(**dev)  # without lse: flash-attn or SDPA where they fit
    path = log.path
    g = torch.from_numpy(rng.standard_normal(tuple(out.shape)).astype(np.float32))
    out.backward(g.to(device=device, dtype=out.dtype))

    ref_in = {
        n: (x.double().numpy() if n in grads else x.numpy()) if isinstance(x, torch.Tensor) else x
        for n, x in cpu.items()
    }
    ref_out, ref_lse = reference_attention(
        ref_in.pop("query"), ref_in.pop("key"), ref_in.pop("value"), **ref_in
    )
    math_in = {n: (x.float().requires_grad_(True) if n in grads else x) for n, x in cpu.items()}
    ft.attention(**math_in, backend="torch").backward(g)

    def err(got, want):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        both_inf = np.isinf(got) & np.isinf(want) & (np.sign(got) == np.sign(want))
        with np.errstate(invalid="ignore"):
            diff = np.where(both_inf, 0.0, np.abs(got - want))
        return float(np.nan_to_num(diff, nan=np.inf).max()) / max(
            1.0, float(np.abs(want[np.isfinite(want)]).max())
        )

    errors = {"out": err(out.detach().float().cpu(), ref_out), "lse": err(lse.detach().cpu(), ref_lse)}
    for n in grads:
        errors["d" + ("bias" if n == "bias" else n[0])] = err(dev[n].grad.float().cpu(), math_in[n].grad)
    ok = all(e <= TOLERANCE[dtype] for e in errors.values())
    shown = "  ".join(f"{n}={e:.1e}" for n, e in errors.items())
    print(
        f"{'ok  ' if ok else 'FAIL'} {name:40s} {str(dtype)[6:]:9s} {path:13s} (lse: {path_lse:13s}) {shown}"
    )
    return ok


def run_checks(device, log, dtypes):
    """Every check case for every dtype, one line each; returns whether all passed."""
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    results = [check(*case, dtype, device, log, rng) for dtype in dtypes for case in cases()]
    print(f"{sum(results)}/{len(results)} passed ({time.perf_counter() - start:.0f} s, compilation included)")
    return all(results)


def main():
    """Run the checks, then the timing table; exit 1 on any failed check."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny table on CPU, no checks (a test runs it)")
    parser.add_argument("--no-checks", action="store_true", help="only the timing table")
    parser.add_argument("--no-table", action="store_true", help="only the checks")
    parser.add_argument(
        "--dtypes",
        default="bfloat16,float16,float32",
        help="checked dtypes, comma-separated (each FlexAttention case compiles once per dtype)",
    )
    parser.add_argument(
        "--reps", type=int, default=10, help="timed runs per median (after up to two warm-ups)"
    )
    args = parser.parse_args()
    device = "cpu" if args.smoke else args.device
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device visible to torch (use --device cpu to dry-run, or --smoke)")
    log = PathLog()
    logging.getLogger("flashport").addHandler(log)
    logging.getLogger("flashport").setLevel(logging.DEBUG)
    flash = ft._native.import_flash_attn()
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(
        f"torch {torch.__version__}, device {device} ({name}), flash-attn "
        f"{getattr(flash, '__version__', 'installed') if flash else 'not installed'}"
    )
    ok = True
    if not (args.smoke or args.no_checks):
        ok = run_checks(device, log, [getattr(torch, name) for name in args.dtypes.split(",")])
    if not args.no_table:
        print("\ntiming (bf16, B=2, D=128, causal; fwd / fwd+bwd medians in ms, peak MB of fwd+bwd):")
        start = time.perf_counter()
        run_table(device, args.smoke, 1 if args.smoke else args.reps, log)
        print(f"table: {time.perf_counter() - start:.0f} s, compilation included")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
