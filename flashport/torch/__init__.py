"""``flashport.torch``: the flashport attention contract for PyTorch tensors.

``flashport.torch.attention`` takes the keywords of :func:`flashport.attention` and dispatches on
where the tensors live (``backend="auto"``):

============  ===============================================================================
tensors       path
============  ===============================================================================
CPU           torch SDPA (its CPU flash kernel) when it computes the call exactly (no window,
              segment ids, softcap, dropout, lse or bottom-right causal with Sq != Sk: see
              ``_native.cpu_sdpa_unsupported``), else flashport's JAX implementation through
              DLPack (zero-copy), backward = JAX VJP; the pure-torch math path when jax is not
              importable
torch_xla     ``torch_xla.core.xla_builder.call_jax`` -> flashport's JAX implementation (the
              Pallas kernel on TPU); backward = JAX VJP staged through the same bridge
torchax       ``torchax.interop.call_jax`` -> flashport's JAX implementation
CUDA          flash-attn 2 (``flash_attn_func``; ``flash_attn_varlen_func`` for packed segment
              ids) when installed and the call fits, else torch SDPA's fused kernels (top-left
              causal, bias), else FlexAttention compiled once per call signature (softcap,
              windows, segment ids, bottom-right causal, masks, lse), else the exact math path
              (dropout, head_dim < 16 with softcap or lse): ``_routing.choose_route``
other         torch SDPA (with explicit masks where needed), else the exact math path
============  ===============================================================================

Explicit ``backend=`` values: ``"torch"`` (pure-torch math on any device), ``"sdpa"``,
``"flash_attn"``, ``"flex"`` (FlexAttention: compiled on CUDA; elsewhere eager, forward only, as
torch has no CPU flex backward), or any JAX backend name / ``flashport.kernels.contract.registry.use(...)`` choice, which
runs the JAX implementation with that backend. Importing this module imports torch, never jax.

Dropout (``dropout_p``, ``generator``) draws the contract's keep-mask, a position hash of two seed
words (:mod:`flashport.kernels.semantics.dropout`), on the math path and on every JAX path alike; SDPA and
flash-attn draw their own masks, so ``auto`` routes dropout calls on CUDA and other devices to the
exact math path, and ``backend="sdpa"`` / ``"flash_attn"`` / ``"flex"`` refuse ``dropout_p > 0``.

:func:`varlen_attention` is flash-attn's packed variable-length convention on torch tensors.
:func:`flex_attention` / :func:`create_block_mask` are torch's FlexAttention API on every device
(``score_mod`` / ``mask_mod`` traced into JAX on the TPU routes; ``docs/flex.md``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
from typing import Any

import torch

from flashport.kernels.contract.keywords import (
    TENSOR_KEYWORDS,
    VARLEN_KEYWORDS,
    pick,
    takes_contract_keywords,
)
from flashport.kernels.contract.varlen import run_varlen
from flashport.torch import _checks, _dropout, _flex, _jax, _native, _routing
from flashport.torch._checks import check
from flashport.torch._flex_api import create_block_mask, flex_attention

__all__ = ["NATIVE_BACKENDS", "attention", "create_block_mask", "flex_attention", "varlen_attention"]

# Backends implemented in torch itself; every other backend name belongs to the JAX implementation.
NATIVE_BACKENDS = ("torch", "sdpa", "flash_attn", "flex")

_Options = dict[str, Any]  # scale, causal, window, align, softcap, layout as the user gave them
_Tensors = dict[str, Any]  # bias, mask, q_segment_ids, kv_segment_ids as the user gave them
_Dropout = tuple[float, "torch.Generator | None"]  # (dropout_p, generator), both checked
_Result = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class _Request:
    """One call of :func:`attention` as the user gave it, its keywords sorted and dropout checked."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    options: _Options
    tensors: _Tensors
    return_lse: bool
    dropout: _Dropout

    def validated(self, **extra: Any) -> _checks.CanonicalCall:
        """The call checked against the contract (:func:`check`; ``extra``: its other keywords)."""
        return check(
            self.query,
            self.key,
            self.value,
            **self.options,
            **self.tensors,
            return_lse=self.return_lse,
            **extra,
        )


# torch code holds both layouts (SDPA's [B, H, S, D], flash-attn's [B, S, H, D]) and a wrong guess is a
# silently wrong answer, so this entry point has no default layout.
LAYOUT_REQUIRED = (
    "flashport.torch.attention needs layout=: 'BHSD' for [batch, heads, seq, head_dim] tensors (torch "
    "SDPA's layout) or 'BSHD' for [batch, seq, heads, head_dim] (flash-attn's); it has no default "
    "because guessing wrong would give a wrong answer without an error"
)


@takes_contract_keywords(layout=None)
def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    backend: Any = "auto",
    return_lse: bool = False,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    **contract: Any,
) -> _Result:
    """Scaled dot-product attention on torch tensors with the contract of :func:`flashport.attention`.

    Args:
      query, key, value, scale, causal, window, align, softcap, bias, mask, q_segment_ids,
        kv_segment_ids, return_lse: as for :func:`flashport.attention`, with torch tensors
        (bias, mask and segment ids too) on one device.
      layout: required: ``"BHSD"`` ([batch, heads, seq, head_dim], torch SDPA's layout) or
        ``"BSHD"`` ([batch, seq, heads, head_dim], flash-attn's). Unlike :func:`flashport.attention`
        there is no default: torch code uses both layouts, and a wrong guess is a wrong answer.
      backend: ``"auto"`` (by device, see the module docstring), ``"torch"``, ``"sdpa"``,
        ``"flash_attn"``, ``"flex"``, or a JAX backend name or ``registry.use(...)`` choice.
      dropout_p: probability of zeroing each entry of the normalized attention probabilities; kept
        entries are scaled by ``1 / (1 - dropout_p)`` (flash-attn / SDPA semantics; pass 0.0 in
        eval mode, as callers of those do). The lse is that of the scores, unaffected.
      generator: the ``torch.Generator`` each call draws two uint32 seed words from (``None`` =
        torch's default CPU generator, seeded by ``torch.manual_seed``); only when ``dropout_p > 0``.
        The keep-mask is the contract's hash of the words (module docstring), the same on every
        path; the backward reuses the words. Under ``torch.utils.checkpoint`` keep ``None``
        (checkpoint restores the default generator for the recomputed forward).

    Returns:
      The output in ``query``'s layout and dtype, or ``(out, lse)`` with lse float32 [B, Hq, Sq];
      both differentiable (with ``backend="flash_attn"`` a backward through lse raises, as
      flash-attn's own backward ignores it; ``auto`` then runs the exact math path instead). Gradients flow to query, key, value and bias. A query row that sees no
      key returns 0 (lse = -inf) with zero gradients.

    Raises:
      TypeError without ``layout`` (naming both choices); TypeError / ValueError naming the argument
      for inputs that do not fit the contract, and
      ValueError when an explicit backend cannot serve the call (naming the reason), e.g.
      ``backend="sdpa"``, ``"flash_attn"`` or ``"flex"`` with ``dropout_p > 0``.
    """
    if contract["layout"] is None:
        raise TypeError(LAYOUT_REQUIRED)
    dropout = (_dropout.check_p(dropout_p), _dropout.check_generator(generator))
    options = {n: x for n, x in contract.items() if n not in TENSOR_KEYWORDS}
    tensors = pick(contract, TENSOR_KEYWORDS)
    if not isinstance(query, torch.Tensor):
        raise TypeError(f"query must be a torch.Tensor, got {type(query).__name__}")
    return _dispatch(backend, _Request(query, key, value, options, tensors, return_lse, dropout))


_default_attention = attention  # varlen_attention's default: its `attention` parameter shadows the name


def _dispatch(backend: Any, request: _Request) -> _Result:
    """Route a call to the torch-native paths or the JAX implementation (module docstring's table)."""
    kind = device_kind(request.query)
    if isinstance(backend, str) and backend in NATIVE_BACKENDS:
        return _run_native(backend, request)
    if backend == "auto" and kind not in ("cpu", "xla", "torchax"):
        call = _native_call(request)
        out, lse = _routing.cuda_attention(
            call, request.return_lse, flash="import" if kind == "cuda" else None
        )
        return (out, lse) if request.return_lse else out
    validated = False  # the torch-side checks of the JAX path already ran (in `check`)
    if backend == "auto" and kind == "cpu" and request.dropout[0] == 0:
        out, validated = _cpu_sdpa(request)
        if out is not None:
            return out
    if backend == "auto" and kind == "cpu" and not jax_available():
        return _run_native("torch", request)
    if not jax_available():
        raise ValueError(
            f"backend={backend!r} runs flashport's JAX implementation, but jax is not importable here; "
            f"use backend='auto' or one of {', '.join(map(repr, NATIVE_BACKENDS))}"
        )
    return _run_jax(kind, backend, request, validated=validated)


def device_kind(t: torch.Tensor) -> str:
    """Where ``t`` lives for dispatch: ``"xla"``, ``"torchax"``, or its device type (``"cpu"``, ``"cuda"``...)."""
    if t.device.type == "jax" or type(t).__module__.startswith("torchax"):
        return "torchax"
    return t.device.type


@takes_contract_keywords(VARLEN_KEYWORDS, layout="THD")
def varlen_attention(
    query: Any,
    key: Any,
    value: Any,
    *,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    backend: Any = "auto",
    dropout_p: float = 0.0,
    generator: Any = None,
    attention: Any = None,
    **contract: Any,
) -> Any:
    """Attention over packed variable-length torch tensors (torchax / torch_xla tensors included),
    flash-attn varlen semantics, through :func:`flashport.torch.attention`.

    Args:
      query: [total_q, Hq, D]; key, value: [total_k, Hkv, D] (``layout="THD"``).
      cu_seqlens_q, cu_seqlens_k: int (B+1,) cumulative sequence starts (flash-attn's convention).
      scale, softcap, backend: as :func:`flashport.torch.attention`.
      causal, window: applied per sequence with ``align`` (``"bottom_right"``: offset
        ``len_k[b] - len_q[b]``, flash-attn >= 2.1; ``"top_left"``: offset 0).
      layout: must be ``"THD"``.
      dropout_p, generator: as :func:`flashport.torch.attention`; the sequences are packed into one
        batch row, so the keep-mask is drawn at batch 0 and the packed token positions.
      attention: the contract implementation to call (default: :func:`flashport.torch.attention`);
        tests pass a reference. Dropout keywords reach a custom one only when ``dropout_p`` is
        non-zero or a generator is given.

    Returns:
      [total_q, Hq, D]; rows of tokens past ``cu_seqlens_q[-1]`` are 0.
    """
    if attention is None:
        attention = _default_attention
    extra = dict(dropout_p=dropout_p, generator=generator) if dropout_p or generator is not None else {}
    cu = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    return run_varlen(attention, query, key, value, **cu, backend=backend, contract=contract, extra=extra)


@functools.cache
def jax_available() -> bool:
    """Whether jax can be imported here (imports it on first call)."""
    try:
        importlib.import_module("jax")
    except ImportError:
        return False
    return True


def _cpu_sdpa(request: _Request) -> tuple[torch.Tensor | None, bool]:
    """``auto`` on CPU tensors: ``(torch SDPA's output, True)`` when it computes the call exactly,
    else ``(None, validated)``. Keywords that alone rule SDPA out are read before any validation
    (``validated`` False: the JAX path validates the call, once); otherwise the call is validated
    here to decide, and ``validated`` True spares the JAX path the same torch-side checks."""
    options, tensors, return_lse = request.options, request.tensors, request.return_lse
    segments = (tensors["q_segment_ids"], tensors["kv_segment_ids"])
    reason = _native.cpu_sdpa_excluded(options["window"], options["softcap"], segments, return_lse)
    validated = reason is None
    if validated:
        call = request.validated()
        reason = _native.cpu_sdpa_unsupported(call, return_lse)
    if reason is not None:
        _native.log.debug("flashport.torch: SDPA passed over on CPU (%s)", reason)
        return None, validated
    _native.log.debug("flashport.torch: torch SDPA runs this CPU call")
    with _cpu_sdpa_kernels():
        return _native.sdpa_attention(call)[0], True


def _cpu_sdpa_kernels() -> contextlib.AbstractContextManager[Any]:
    """torch's CPU SDPA kernels (flash, math) enabled whatever the caller's SDPA backend switches
    (``torch.backends.cuda.enable_*_sdp``) and selectors (``sdpa_kernel``) say: they pick kernels for
    torch SDPA, and flashport's result does not depend on them (the backward keeps the kernel the
    forward chose)."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # torch < 2.3: no selector to undo
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])


def _native_call(request: _Request) -> _checks.CanonicalCall:
    """The validated :class:`_checks.CanonicalCall`, with seed words drawn when ``dropout_p > 0``."""
    p, generator = request.dropout
    call = request.validated(dropout_p=p)
    return dataclasses.replace(call, seed=_dropout.draw_words(generator)) if p > 0 else call


def _run_native(backend: str, request: _Request) -> _Result:
    dropout = request.dropout
    if dropout[0] > 0 and backend != "torch":
        request.validated()  # argument errors first
        why = {
            "sdpa": _native.DROPOUT_REASON.format(name="SDPA"),
            "flash_attn": _native.DROPOUT_REASON.format(name="flash-attn"),
            "flex": "FlexAttention has no dropout",
        }[backend]
        raise ValueError(
            f"backend={backend!r} cannot run dropout_p={dropout[0]}: {why}; use backend='torch' "
            f"(exact math), 'auto', or a JAX backend such as 'xla', which draw the contract's mask"
        )
    call = _native_call(request)
    lse: torch.Tensor | None
    if backend == "torch" or call.k.shape[2] == 0:  # no keys: the contract's zeros on every backend
        out, lse = _native.math_attention(call)
    else:
        out, lse = _explicit_path(backend, call, request.return_lse)
    if not request.return_lse:
        return out
    assert lse is not None, f"backend={backend!r} returned no lse although return_lse=True"
    return out, lse


def _explicit_path(
    backend: str, call: _checks.CanonicalCall, return_lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``backend="sdpa"``, ``"flash_attn"`` or ``"flex"``: run it, or raise why it cannot."""
    if backend == "sdpa":
        reason = _native.sdpa_unsupported(call, return_lse)
        if reason:
            raise ValueError(f"backend='sdpa' does not support {reason}; use backend='torch' or 'auto'")
        return _native.sdpa_attention(call)
    if backend == "flex":
        reason = _flex.explicit_unsupported(call)
        if reason:
            raise ValueError(f"backend='flex' does not support {reason}; use backend='torch' or 'auto'")
        return _flex.flex_attention(call, return_lse, compiled=call.q.device.type == "cuda")
    flash = _native.import_flash_attn()
    if flash is None:
        raise ValueError(
            "backend='flash_attn' needs the flash-attn package (pip install flash-attn); "
            "use backend='auto' to fall back to torch SDPA"
        )
    reason = _native.flash_unsupported(call)
    if reason:
        raise ValueError(f"backend='flash_attn' does not support this call: {reason}; use backend='auto'")
    return _native.flash_attention(call, flash, return_lse)


def _run_jax(kind: str, backend: Any, request: _Request, *, validated: bool = False) -> _Result:
    query, key, value, tensors, dropout = (
        request.query,
        request.key,
        request.value,
        request.tensors,
        request.dropout,
    )
    if not validated:  # `check` did these already when `validated`
        # JAX validates everything else, but DLPack would hand it float64 already cast down (no x64).
        for name, x in (("query", query), ("key", key), ("value", value)):
            _checks.check_tensor(name, x)
        for name, x in tensors.items():
            if x is not None and not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    runner: _jax.CallJaxRunner | _jax.DLPackRunner
    if kind == "xla":
        runner = _jax.torch_xla_runner()
    elif kind == "torchax":
        runner = _jax.torchax_runner()
    else:
        runner = _jax.DLPackRunner()
    q_seg, kv_seg = (
        ids.int() if ids is not None and ids.dtype == torch.int64 else ids  # JAX runs without x64
        for ids in (tensors["q_segment_ids"], tensors["kv_segment_ids"])
    )
    static = dict(request.options, backend=backend)
    seed = None
    if dropout[0] > 0:  # the words ride as a tensor (not static), so a new draw compiles nothing new
        static["dropout_rate"] = dropout[0]
        seed = _dropout.seed_tensor(_dropout.draw_words(dropout[1]), query.detach())
    bias = tensors["bias"]
    need_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (query, key, value, bias)
    )
    out, lse = _jax.JaxAttention.apply(
        runner, static, need_grad, query, key, value, bias, tensors["mask"], q_seg, kv_seg, seed
    )
    return (out, lse) if request.return_lse else out
