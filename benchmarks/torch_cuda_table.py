"""The torch side of the CUDA comparison table: flashport.torch.attention next to SDPA and FlexAttention.

Used by ``benchmarks/torch_cuda_check.py`` (its second section; ``--smoke`` runs tiny shapes on
CPU). Each row is causal, bf16, B=2, D=128; on CUDA S=8192 with 16 heads:

- causal; causal + window (1024, 0); causal GQA 32q/8kv; causal + softcap 30; causal + 4 packed
  documents (segment ids); chunked prefill Sq=2048, Sk=8192, bottom-right causal.

Contenders, all on BHSD tensors:

- ``flashport``: ``flashport.torch.attention(..., layout="BHSD")`` with ``backend="auto"``; the
  ``path`` column is the path its DEBUG log names (flash-attn, torch SDPA, FlexAttention, math; on
  CPU the JAX path when SDPA passes);
- anchors: SDPA pinned to each of its flash / efficient / math kernels (``sdpa_kernel``), with
  ``is_causal`` where that is the row's mask and an explicit boolean [Sq, Sk] / [B, 1, S, S] mask
  otherwise (not applicable: softcap; the flash kernel takes no mask); and FlexAttention written as
  a user would (``torch.compile(flex_attention)``, ``create_block_mask`` built once outside the
  timed region, a tanh ``score_mod`` for softcap). On CPU flex runs eagerly, forward only (torch
  2.13 has no CPU flex backward).

Times are medians of ``reps`` runs after warm-up (two runs, one when ``reps`` is 1) (forward without grad; forward+backward with
grads of q, k, v), peak memory is the CUDA allocator's peak above the inputs during forward+backward,
and ``ratio`` is flashport's time over the best anchor's (per column; goal <= 1.25).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashport.torch as ft

BATCH, HEAD_DIM = 2, 128
SDPA_KERNELS = {
    "SDPA flash": SDPBackend.FLASH_ATTENTION,
    "SDPA efficient": SDPBackend.EFFICIENT_ATTENTION,
    "SDPA math": SDPBackend.MATH,
}
ANCHORS = (*SDPA_KERNELS, "FlexAttention")


@dataclasses.dataclass(frozen=True)
class Row:
    """One case of the table (always causal; Sq != Sk means bottom-right alignment)."""

    name: str
    sq: int
    sk: int
    hq: int
    hkv: int
    window: int | None = None  # left reach of a causal sliding window
    softcap: float | None = None
    docs: int = 0  # packed documents of equal length (segment ids)


def rows(smoke: bool) -> list[Row]:
    """The table's rows: the comparison's shapes, or tiny ones for ``--smoke``."""
    s, h, gqa, w, chunk = (64, 2, (4, 2), 16, 32) if smoke else (8192, 16, (32, 8), 1024, 2048)
    return [
        Row("causal", s, s, h, h),
        Row(f"causal + window {w}", s, s, h, h, window=w),
        Row(f"causal GQA {gqa[0]}q/{gqa[1]}kv", s, s, *gqa),
        Row("causal + softcap 30", s, s, h, h, softcap=30.0),
        Row("causal + 4 packed documents", s, s, h, h, docs=4),
        Row(f"prefill Sq={chunk} Sk={s} bottom-right", chunk, s, h, h),
    ]


class PathLog(logging.Handler):
    """Remembers the path named by flashport.torch's last 'X runs this call' DEBUG line."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.path = ""

    def emit(self, record: logging.LogRecord) -> None:
        """Keep the path named by a 'runs this' line."""
        found = re.match(r"flashport\.torch: (?:exact )?(.+?) runs this", record.getMessage())
        if found:
            self.path = found.group(1)


# ------------------------------------------------------------------------------------ contenders


def segment_ids(row: Row, seq: int, device: str) -> torch.Tensor:
    """[B, seq] ids of ``row.docs`` equal documents."""
    return (torch.arange(seq, device=device) * row.docs // seq).expand(BATCH, seq).contiguous()


def dense_mask(row: Row, device: str) -> torch.Tensor | None:
    """The row's visibility as a boolean mask for SDPA (None when ``is_causal`` says it all)."""
    if row.window is None and not row.docs and row.sq == row.sk:
        return None
    i = torch.arange(row.sq, device=device)[:, None] + (row.sk - row.sq)  # bottom-right
    j = torch.arange(row.sk, device=device)[None, :]
    keep = j <= i
    if row.window is not None:
        keep = keep & (j >= i - row.window)
    if row.docs:
        q_ids, kv_ids = segment_ids(row, row.sq, device), segment_ids(row, row.sk, device)
        keep = keep & (q_ids[:, None, :, None] == kv_ids[:, None, None, :])
    return keep


def flashport_fn(row: Row, device: str) -> Callable[..., torch.Tensor]:
    """flashport.torch.attention with the row's contract keywords."""
    kw: dict = dict(causal=True, layout="BHSD", softcap=row.softcap)
    if row.window is not None:
        kw["window"] = (row.window, 0)
    if row.docs:
        kw["q_segment_ids"] = segment_ids(row, row.sq, device)
        kw["kv_segment_ids"] = segment_ids(row, row.sk, device)
    return lambda q, k, v: ft.attention(q, k, v, **kw)


def sdpa_fn(row: Row, kernel: SDPBackend, device: str) -> Callable[..., torch.Tensor] | str:
    """SDPA pinned to ``kernel``, or why it cannot express the row."""
    if row.softcap is not None:
        return "no softcap"
    mask = dense_mask(row, device)
    if mask is not None and kernel == SDPBackend.FLASH_ATTENTION:
        return "takes no mask"
    kw: dict = dict(attn_mask=mask, is_causal=mask is None, enable_gqa=row.hq != row.hkv)

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(kernel):
            return F.scaled_dot_product_attention(q, k, v, **kw)

    return run


def flex_fn(row: Row, device: str, compiled: bool) -> Callable[..., torch.Tensor]:
    """FlexAttention as a user writes it: block mask built once, a score_mod for softcap."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    offset = row.sk - row.sq
    q_ids, kv_ids = segment_ids(row, row.sq, device), segment_ids(row, row.sk, device)

    def mask_mod(b, h, i, j):
        keep = j <= i + offset
        if row.window is not None:
            keep = keep & (j >= i + offset - row.window)
        if row.docs:
            keep = keep & (q_ids[b, i] == kv_ids[b, j])
        return keep

    def softcap(score, b, h, i, j):
        return row.softcap * torch.tanh(score / row.softcap)

    batch = BATCH if row.docs else None
    block_mask = create_block_mask(mask_mod, batch, None, row.sq, row.sk, device=device, _compile=compiled)
    flex = torch.compile(flex_attention) if compiled else flex_attention
    score_mod = softcap if row.softcap is not None else None
    gqa = row.hq != row.hkv
    return lambda q, k, v: flex(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa)


# ------------------------------------------------------------------------------------ measuring


@dataclasses.dataclass
class Timing:
    """Medians in ms (None: not measured, with ``why``) and the peak memory of fwd+bwd in MB."""

    fwd: float | None = None
    fwd_bwd: float | None = None
    peak_mb: float | None = None
    why: str = ""

    def cell(self) -> str:
        """``fwd / fwd+bwd ms, peak MB`` or the reason it was not measured."""
        if self.fwd is None:
            return f"n/a ({self.why})"
        bwd = "n/a" if self.fwd_bwd is None else f"{self.fwd_bwd:.2f}"
        peak = "" if self.peak_mb is None else f", {self.peak_mb:.0f} MB"
        note = f" ({self.why})" if self.why else ""
        return f"{self.fwd:.2f} / {bwd} ms{peak}{note}"


def _median_ms(step: Callable[[], object], reps: int, sync: Callable[[], None]) -> float:
    for _ in range(min(reps, 2)):  # warm-up (compilation)
        step()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _short(error: BaseException) -> str:
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return first if len(first) <= 70 else first[:67] + "..."


def measure(fn: Callable[..., torch.Tensor], qkv: tuple, reps: int) -> Timing:
    """Forward (no grad) and forward+backward medians of ``fn(*qkv)``; failures become the reason."""
    cuda = qkv[0].device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    timing = Timing()
    try:
        with torch.no_grad():
            timing.fwd = _median_ms(lambda: fn(*qkv), reps, sync)
    except Exception as error:  # noqa: BLE001 - any refusal or OOM is a table entry, not a crash
        timing.why = _short(error)
        return timing
    leaves = [x.detach().requires_grad_(True) for x in qkv]
    grad = torch.randn(timing_shape(qkv), device=qkv[0].device, dtype=qkv[0].dtype)

    def step() -> None:
        for x in leaves:
            x.grad = None
        fn(*leaves).backward(grad)

    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        timing.fwd_bwd = _median_ms(step, reps, sync)
        if cuda:
            timing.peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
    except Exception as error:  # noqa: BLE001 - as above
        timing.why = "bwd: " + _short(error)
    finally:
        if cuda:
            torch.cuda.empty_cache()
    return timing


def timing_shape(qkv: tuple) -> tuple[int, ...]:
    """The output's shape [B, Hq, Sq, Dv] (BHSD)."""
    q, _, v = qkv
    return (*q.shape[:3], v.shape[-1])


def ratios(mine: Timing, anchors: dict[str, Timing]) -> tuple[str, str]:
    """(best anchors, flashport/best ratios) for the forward and forward+backward columns."""
    names, values = [], []
    for field in ("fwd", "fwd_bwd"):
        timed = {n: getattr(t, field) for n, t in anchors.items() if getattr(t, field) is not None}
        ours = getattr(mine, field)
        if not timed or ours is None:
            names.append("-")
            values.append("-")
            continue
        best = min(timed, key=timed.__getitem__)
        names.append(best)
        values.append(f"{ours / timed[best]:.2f}")
    return " / ".join(names), " / ".join(values)


def run_table(device: str, smoke: bool, reps: int, path_log: PathLog) -> list[str]:
    """Measure every row and return the markdown table's lines."""
    dtype = torch.bfloat16
    compiled = device == "cuda"
    # Every row compiles flex_attention and create_block_mask again (its own shapes and mods, with
    # and without grad); dynamo's default of 8 compilations per function would send the later rows'
    # FlexAttention anchor to flex's eager (unfused) implementation.
    torch._dynamo.config.recompile_limit = 64
    header = ["case", "flashport fwd / fwd+bwd", "path", *ANCHORS, "best anchor fwd / fwd+bwd", "ratio"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    print("\n".join(lines), flush=True)
    for row in rows(smoke):
        gen = torch.Generator(device="cpu").manual_seed(0)
        qkv = tuple(
            torch.randn(BATCH, heads, seq, HEAD_DIM, generator=gen).to(device=device, dtype=dtype)
            for heads, seq in ((row.hq, row.sq), (row.hkv, row.sk), (row.hkv, row.sk))
        )
        path_log.path = "jax"  # the native paths log which one ran; the JAX path (CPU) does not
        mine = measure(flashport_fn(row, device), qkv, reps)
        path = path_log.path
        anchors: dict[str, Timing] = {}
        for name, kernel in SDPA_KERNELS.items():
            fn = sdpa_fn(row, kernel, device)
            anchors[name] = Timing(why=fn) if isinstance(fn, str) else measure(fn, qkv, reps)
        anchors["FlexAttention"] = measure(flex_fn(row, device, compiled), qkv, reps)
        best, ratio = ratios(mine, anchors)
        cells = [row.name, mine.cell(), path, *(anchors[n].cell() for n in ANCHORS), best, ratio]
        lines.append("| " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    return lines
