"""``flashport.torch.flex_attention`` / ``create_block_mask``: torch's FlexAttention API on every device.

Same signatures as ``torch.nn.attention.flex_attention.flex_attention`` and ``create_block_mask``
(what the codemod points FlexAttention calls at). Where the tensors live decides the route
(``backend="auto"``):

* CPU and CUDA tensors: torch's own FlexAttention (compiled once per input signature on CUDA, eager
  on CPU), with the arguments as given, except CPU calls that need gradients (torch has no CPU
  FlexAttention backward), which take the JAX route when jax is installed;
* torch_xla / torchax tensors (TPU), or an explicit JAX ``backend=`` on any device:
  :func:`flashport.attention` with the torch mods traced into JAX
  (:mod:`flashport.torch._torch_mods` says what a mod may contain there); the block mask's
  ``mask_mod`` is re-traced and flashport builds its own block sparsity.

``create_block_mask`` returns torch's ``BlockMask`` (every field users read: ``kv_num_blocks``,
``kv_indices``, ``full_kv_num_blocks``, ``BLOCK_SIZE``, ``shape``, ``mask_mod``, ``sparsity()``...),
built on the CPU when the requested device is CUDA without a GPU, or an XLA / JAX device.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from flashport.torch import _torch_mods

# Devices torch's FlexAttention runs on (the others take the JAX route).
TORCH_DEVICES = ("cpu", "cuda")


def _flex_module() -> Any:
    from flashport.torch._flex import import_flex

    module = import_flex()
    if module is None:
        raise ImportError(f"torch {torch.__version__} has no torch.nn.attention.flex_attention")
    return module


def create_block_mask(
    mask_mod: Any,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device: Any = "cuda",
    BLOCK_SIZE: int | tuple[int, int] = 128,
    _compile: bool = False,
) -> Any:
    """torch's ``create_block_mask``, built on the CPU where ``device`` has no FlexAttention
    (CUDA without a GPU, XLA or JAX devices); ``flex_attention`` reads its ``mask_mod`` there."""
    kind = torch.device(device).type if isinstance(device, (str, torch.device)) else "cpu"
    if kind not in TORCH_DEVICES or (kind == "cuda" and not torch.cuda.is_available()):
        device = "cpu"
    with _plain_torch_on_cpu(device):
        return _flex_module().create_block_mask(
            mask_mod, B, H, Q_LEN, KV_LEN, device=device, BLOCK_SIZE=BLOCK_SIZE, _compile=_compile
        )


@contextlib.contextmanager
def _plain_torch_on_cpu(device: Any) -> Iterator[None]:
    """Inside torchax's environment (its torch function and dispatch modes), building a block mask
    on the CPU runs with those modes set aside: torch's ``create_block_mask`` vmaps the mask_mod
    with functorch, whose batched CPU tensors torchax's modes would otherwise take for its own."""
    modes = torch.overrides._get_current_function_mode_stack()
    torchax_env = any(type(m).__module__.split(".")[0] == "torchax" for m in modes)
    if str(device) != "cpu" or not torchax_env:
        yield
        return
    from torch.utils._python_dispatch import _disable_current_modes

    with contextlib.ExitStack() as stack:
        for _ in modes:
            stack.enter_context(torch.overrides._pop_mode_temporarily())
        stack.enter_context(_disable_current_modes())
        try:
            yield
        except AssertionError as err:  # torchax's "can only do math within the torchax environment"
            if "torchax" not in str(err):
                raise
            raise TypeError(
                "create_block_mask builds the block mask on the CPU for torchax tensors, so its mask_mod "
                "may close over CPU tensors only; it reads a tensor on the torchax device: close over "
                "its .cpu() copy (flex_attention traces the mask_mod into JAX either way)"
            ) from err


@torch.compiler.disable  # wrappers like torch.compile(flex_attention) run the dispatch as it is
def flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: Any = None,
    block_mask: Any = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: dict | None = None,
    *,
    return_aux: Any = None,
    backend: Any = "auto",
) -> Any:
    """torch's ``flex_attention(query, key, value, score_mod, block_mask, scale, enable_gqa,
    return_lse, kernel_options)`` on any device: tensors [B, H, S, D]; returns ``out`` or
    ``(out, lse)`` as torch does.

    ``backend``: ``"auto"`` (module docstring) or a JAX backend name / ``registry.use(...)``
    choice, which runs :func:`flashport.attention` with the mods traced into JAX (also on CPU).

    Raises:
      TypeError naming what a mod uses that cannot be traced into JAX (JAX routes only), and
      ValueError for GQA heads without ``enable_gqa`` (torch's own rule).
    """
    from flashport.torch import device_kind, jax_available

    kind = device_kind(query)
    need_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value))
    cpu_grad = kind == "cpu" and need_grad and jax_available()
    if backend == "auto" and kind in TORCH_DEVICES and not cpu_grad:
        return _torch_flex(
            query,
            key,
            value,
            score_mod,
            block_mask,
            scale,
            enable_gqa,
            return_lse,
            kernel_options,
            return_aux,
        )
    if return_aux is not None:
        return_lse = return_lse or bool(getattr(return_aux, "lse", False))
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(
            f"query has {query.shape[1]} heads and key {key.shape[1]}: pass enable_gqa=True "
            "(FlexAttention's rule for grouped-query attention)"
        )
    return _jax_flex(kind, query, key, value, score_mod, block_mask, scale, return_lse, backend)


def _torch_flex(
    query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, kernel_options, return_aux
):
    """torch's FlexAttention (compiled on CUDA, as its docs require for speed)."""
    fn = _compiled_flex() if query.device.type == "cuda" else _flex_module().flex_attention
    kwargs: dict[str, Any] = {
        "score_mod": score_mod,
        "block_mask": block_mask,
        "scale": scale,
        "enable_gqa": enable_gqa,
    }
    if kernel_options is not None:
        kwargs["kernel_options"] = kernel_options
    if return_aux is not None:
        kwargs["return_aux"] = return_aux
    elif return_lse:
        kwargs["return_lse"] = True
    return fn(query, key, value, **kwargs)


@functools.cache
def _compiled_flex() -> Any:
    return torch.compile(_flex_module().flex_attention, dynamic=False)


def _jax_flex(kind, query, key, value, score_mod, block_mask, scale, return_lse, backend):
    """:func:`flashport.attention` with the torch mods traced into JAX (module docstring)."""
    from flashport.torch import _Request, _run_jax

    mask_mod = None
    if block_mask is not None:
        mask_mod = block_mask.mask_mod
        seq = getattr(block_mask, "seq_lengths", None)
        if seq is not None and tuple(seq) != (query.shape[2], key.shape[2]):
            raise ValueError(
                f"block_mask was built for (Q_LEN, KV_LEN) = {tuple(seq)}, but the call has "
                f"{(query.shape[2], key.shape[2])}"
            )
        if getattr(mask_mod, "__name__", "") == "_no_mask":  # torch's "everything visible" mask
            mask_mod = None
    grad = torch.is_grad_enabled()
    options = {
        "scale": scale,
        "causal": False,
        "window": None,
        "align": "bottom_right",
        "softcap": None,
        "layout": "BHSD",
        "score_mod": _torch_mods.to_jax_mod(score_mod, "score_mod", grad),
        "mask_mod": _torch_mods.to_jax_mod(mask_mod, "mask_mod", grad),
    }
    tensors = {"bias": None, "mask": None, "q_segment_ids": None, "kv_segment_ids": None}
    jax_backend = "auto" if backend == "auto" else backend
    request = _Request(query, key, value, options, tensors, return_lse, (0.0, None))
    return _run_jax(kind, jax_backend, request)
