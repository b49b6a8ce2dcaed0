"""The FlexAttention path of ``flashport.torch``: the contract as ``torch.nn.attention.flex_attention``.

``backend="auto"`` on CUDA takes this path when flash-attn is absent or cannot serve the call and
SDPA's fused kernels cannot either (softcap, windows, segment ids, bottom-right causal with
Sq != Sk, boolean masks, a bias under a causal mask, ``return_lse``): see
:func:`flashport.torch._routing.choose_route`. The mapping:

- ``scale`` -> flex's ``scale`` (flex hands ``score_mod`` the already scaled score);
- softcap, then bias -> ``score_mod``: ``softcap * tanh(s / softcap) + bias[b, h, i, j]`` (a
  broadcast bias is indexed at 0 on its broadcast dimensions, never expanded in memory);
- causal in both alignments and windows (:func:`flashport.kernels.contract.spec.positional_visible`, the
  contract's one definition of the band), boolean masks and segment ids (``q_ids[b, i] ==
  kv_ids[b, j]``, which covers packed documents and key padding) -> ``mask_mod``, and a
  ``BlockMask`` built from it so blocks no query sees are skipped (O(S) memory, no O(Sq*Sk) mask);
- GQA/MQA -> ``enable_gqa=True`` (K/V are not repeated); ``return_lse`` ->
  ``return_aux=AuxRequest(lse=True)``, differentiable;
- gradients (query, key, value and bias) run through flex's own backward.

Rows with no visible key give 0 and lse = -inf, the contract's convention and flex's own.

Not routed here (:func:`flex_unsupported`): dropout (it acts on the normalized probabilities,
which no ``score_mod`` sees), empty sequences, head dims below 16 (Triton's ``tl.dot``), and torch
builds without ``torch.nn.attention.flex_attention``.

Compilation (``compiled=True``, the CUDA route): each call signature (the spec, tensor shapes and
dtypes, ``return_lse``, device) gets its own ``torch.compile(..., fullgraph=True, dynamic=False)``
of a fresh copy of the runner's code, so it is compiled once and dynamo's per-code-object
recompile limit counts per signature instead of across all of them (at most
:data:`MAX_COMPILED` are kept). Block masks of the causal/window band depend only on the spec and
the lengths and are cached per (band, Sq, Sk, device); those of segment ids are reused while the
same id tensors come back unmodified (the last 8); boolean masks are built per call.
``compiled=False`` runs flex eagerly (its unfused math implementation: materialized scores), which
is how the path is tested on CPU: torch 2.13 compiles flex for CPU only for inference without lse,
and refuses CPU backward in eager mode.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib
import importlib.util
import types
from collections.abc import Callable
from typing import Any

import torch

from flashport.kernels.contract.spec import AttentionSpec, apply_softcap, positional_visible
from flashport.torch._checks import CanonicalCall

# Triton's tl.dot, which flex's CUDA kernels use, needs head dims of at least 16.
FLEX_MIN_HEAD_DIM = 16
# Compiled runners kept (least recently used dropped first).
MAX_COMPILED = 32

_Runner = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


@functools.cache
def import_flex() -> Any:
    """``torch.nn.attention.flex_attention`` (the module), or None where this torch has none."""
    try:
        return importlib.import_module("torch.nn.attention.flex_attention")
    except ImportError:
        return None


@functools.cache
def triton_available() -> bool:
    """Whether Triton is installed (``torch.compile`` builds flex's CUDA kernels with it)."""
    return importlib.util.find_spec("triton") is not None


def flex_unsupported(call: CanonicalCall) -> str | None:
    """Why the FlexAttention path cannot run ``call`` with the contract's semantics (None when it can)."""
    if import_flex() is None:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention"
    if call.dropout_p > 0:
        return "dropout_p > 0 (FlexAttention has no dropout: it acts on the normalized probabilities)"
    if call.spec.seq_q == 0 or call.spec.seq_k == 0:
        return "an empty sequence"
    head_dims = (call.q.shape[-1], call.v.shape[-1])
    if min(head_dims) < FLEX_MIN_HEAD_DIM:
        return f"head_dim {min(head_dims)} < {FLEX_MIN_HEAD_DIM} (flex's Triton kernels)"
    return None


def explicit_unsupported(call: CanonicalCall) -> str | None:
    """Why ``backend="flex"`` cannot run ``call``: :func:`flex_unsupported`, or a backward on a
    device where torch's flex has none (it runs eagerly there, and refuses inputs needing grad)."""
    reason = flex_unsupported(call)
    device = call.q.device.type
    if reason is None and device == "cuda" and not triton_available():
        reason = "CUDA tensors without Triton installed (torch.compile builds flex's CUDA kernels with it)"
    if reason is None and device != "cuda" and torch.is_grad_enabled():
        needs_grad = [
            n
            for n, x in (("query", call.q), ("key", call.k), ("value", call.v), ("bias", call.bias))
            if x is not None and x.requires_grad
        ]
        if needs_grad:
            reason = (
                f"gradients on {device} ({', '.join(needs_grad)} require grad; torch's FlexAttention has "
                f"no {device} backward): run under torch.no_grad()"
            )
    return reason


def flex_attention(call: CanonicalCall, return_lse: bool, *, compiled: bool) -> tuple[torch.Tensor, Any]:
    """Run ``call`` through FlexAttention; returns ``(out, lse)`` (lse None unless ``return_lse``).

    The caller has checked :func:`flex_unsupported`. ``compiled`` selects the per-signature compiled
    runner (CUDA) or flex's eager implementation (tests on CPU).
    """
    block_mask = _block_mask(call, compile_mask=compiled)
    runner = compiled_runner(signature(call, return_lse)) if compiled else _runner(call.spec, return_lse)
    out, lse = runner(call.q, call.k, call.v, call.bias, block_mask)
    return (out.transpose(1, 2) if call.layout == "BSHD" else out), lse


# ------------------------------------------------------------------------------------ score_mod


def _at(x: torch.Tensor, dim: int, index: Any) -> Any:
    """``index`` for a full dimension of ``x``, 0 for a broadcast (size-1) one."""
    return index if x.shape[dim] > 1 else 0


def score_mod(spec: AttentionSpec, bias: torch.Tensor | None) -> Callable[..., Any] | None:
    """The contract's score transform after scaling: softcap, then ``+ bias`` (None if neither)."""
    if spec.softcap is None and bias is None:
        return None

    def mod(score: Any, b: Any, h: Any, i: Any, j: Any) -> Any:
        score = apply_softcap(spec, score, torch)
        if bias is not None:
            score = score + bias[_at(bias, 0, b), _at(bias, 1, h), _at(bias, 2, i), _at(bias, 3, j)]
        return score

    return mod


# ------------------------------------------------------------------------------------ block masks


def mask_mod(
    spec: AttentionSpec,
    mask: torch.Tensor | None,
    q_seg: torch.Tensor | None,
    kv_seg: torch.Tensor | None,
) -> Callable[..., Any] | None:
    """Which keys a query sees: band (causal/window, either alignment) & mask & equal segment ids."""
    band = spec.has_positional_mask
    if not band and mask is None and q_seg is None:
        return None

    def mod(b: Any, h: Any, i: Any, j: Any) -> Any:
        keep = positional_visible(spec, i, j) if band else None
        if mask is not None:
            hit = mask[_at(mask, 0, b), _at(mask, 1, h), _at(mask, 2, i), _at(mask, 3, j)]
            keep = hit if keep is None else keep & hit
        if q_seg is not None and kv_seg is not None:
            same = q_seg[b, i] == kv_seg[b, j]
            keep = same if keep is None else keep & same
        return keep

    return mod


def _block_mask(call: CanonicalCall, *, compile_mask: bool) -> Any:
    """The call's ``BlockMask`` (None when every key is visible), from a cache where it can be."""
    spec, device = call.spec, call.q.device
    band = (spec.causal, spec.window_left, spec.window_right, spec.offset)
    if call.mask is None and call.q_seg is None:
        if not spec.has_positional_mask:
            return None
        return _band_block_mask(band, spec.seq_q, spec.seq_k, str(device), compile_mask)
    if call.mask is None:
        return _segment_block_mask(call, band, compile_mask)
    batch = call.mask.shape[0] > 1 or call.q_seg is not None
    heads = call.mask.shape[1] > 1
    return import_flex().create_block_mask(
        mask_mod(spec, call.mask, call.q_seg, call.kv_seg),
        call.q.shape[0] if batch else None,
        call.q.shape[1] if heads else None,
        spec.seq_q,
        spec.seq_k,
        device=device,
        _compile=compile_mask,
    )


@dataclasses.dataclass(frozen=True)
class _SegmentEntry:
    q_seg: torch.Tensor
    kv_seg: torch.Tensor
    versions: tuple[int, int]
    key: tuple
    block_mask: Any


# Block masks of segment ids, reused while the same id tensors come back unmodified (their
# ``_version`` counts in-place writes); the entries hold the [B, S] ids, which are small.
_SEGMENT_MASKS: collections.deque[_SegmentEntry] = collections.deque(maxlen=8)


def _segment_block_mask(call: CanonicalCall, band: tuple, compile_mask: bool) -> Any:
    """The ``BlockMask`` of segment ids (and the band), cached per id tensors, their versions and
    the band; boolean masks (O(Sq*Sk) tensors, not kept alive) are built per call instead."""
    q_seg, kv_seg = call.q_seg, call.kv_seg
    assert q_seg is not None and kv_seg is not None  # both or neither (checked)
    key = (band, call.spec.seq_q, call.spec.seq_k, str(call.q.device), compile_mask)
    versions = (q_seg._version, kv_seg._version)
    for entry in _SEGMENT_MASKS:
        if (
            entry.q_seg is q_seg
            and entry.kv_seg is kv_seg
            and entry.versions == versions
            and entry.key == key
        ):
            return entry.block_mask
    block_mask = import_flex().create_block_mask(
        mask_mod(call.spec, None, q_seg, kv_seg),
        call.q.shape[0],
        None,
        call.spec.seq_q,
        call.spec.seq_k,
        device=call.q.device,
        _compile=compile_mask,
    )
    _SEGMENT_MASKS.append(_SegmentEntry(q_seg, kv_seg, versions, key, block_mask))
    return block_mask


@functools.lru_cache(maxsize=64)
def _band_block_mask(
    band: tuple[bool, int | None, int | None, int], seq_q: int, seq_k: int, device: str, compile_mask: bool
) -> Any:
    """The ``BlockMask`` of a causal/window band (``(causal, left, right, offset)``), built once."""
    causal, left, right, offset = band
    spec = AttentionSpec(1.0, causal, left, right, offset, None, seq_q, seq_k)
    mod = mask_mod(spec, None, None, None)
    return import_flex().create_block_mask(
        mod, None, None, seq_q, seq_k, device=device, _compile=compile_mask
    )


# ------------------------------------------------------------------------------------ runners


@dataclasses.dataclass(frozen=True)
class Signature:
    """What a compiled runner is specialized to: one per distinct value, compiled once."""

    spec: AttentionSpec
    tensors: tuple[tuple[tuple[int, ...], torch.dtype] | None, ...]  # q, k, v, bias, mask, q_seg, kv_seg
    return_lse: bool
    device: str


def signature(call: CanonicalCall, return_lse: bool) -> Signature:
    """The :class:`Signature` of ``call`` (the key of the compiled-runner cache)."""
    tensors = (call.q, call.k, call.v, call.bias, call.mask, call.q_seg, call.kv_seg)
    meta = tuple(None if t is None else (tuple(t.shape), t.dtype) for t in tensors)
    return Signature(call.spec, meta, return_lse, str(call.q.device))


_COMPILED: collections.OrderedDict[Signature, _Runner] = collections.OrderedDict()


def compiled_runner(sig: Signature) -> _Runner:
    """The compiled runner for ``sig``: built and compiled on first use, then reused (LRU of
    :data:`MAX_COMPILED`). Its code object is a fresh copy, so dynamo caches it on its own."""
    runner = _COMPILED.get(sig)
    if runner is not None:
        _COMPILED.move_to_end(sig)
        return runner
    eager = _runner(sig.spec, sig.return_lse)
    fresh = types.FunctionType(
        eager.__code__.replace(), eager.__globals__, eager.__name__, None, eager.__closure__
    )
    runner = torch.compile(fresh, fullgraph=True, dynamic=False)
    _COMPILED[sig] = runner
    while len(_COMPILED) > MAX_COMPILED:
        _COMPILED.popitem(last=False)
    return runner


def _runner(spec: AttentionSpec, return_lse: bool) -> _Runner:
    """``run(q, k, v, bias, block_mask) -> (out BHSD, lse | None)``: one flex call for ``spec``."""
    flex = import_flex()
    aux = flex.AuxRequest(lse=True) if return_lse and hasattr(flex, "AuxRequest") else None

    def run(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, block_mask: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        kwargs: dict[str, Any] = {"return_aux": aux} if aux is not None else {"return_lse": return_lse}
        result = flex.flex_attention(
            q,
            k,
            v,
            score_mod=score_mod(spec, bias),
            block_mask=block_mask,
            scale=spec.scale,
            enable_gqa=q.shape[1] != k.shape[1],
            **kwargs,
        )
        if not return_lse:
            return result, None
        return result[0], (result[1].lse if aux is not None else result[1])

    return run
