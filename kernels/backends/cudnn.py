"""The ``cudnn`` backend: NVIDIA's fused attention through ``jax.nn.dot_product_attention``.

Used only where the call provably means the same thing under cuDNN's rules, which
:func:`check_call` spells out (each refusal names the reason, and ``auto`` then falls back to
``pallas_gpu``):

* float16/bfloat16 only; head_dim a multiple of 8 and at most 128; value head_dim = query head_dim;
* causal and windows only when the diagonal sits at offset 0 (top-left alignment, or Sq == Sk),
  because cuDNN's plain causal mode is top-left; windows only on the left (``(left, 0)`` or
  ``(left, None)`` with causal), which jax.nn maps to cuDNN's sliding window;
* a bias must span both sequence axes ([B or 1, H or 1, Sq, Sk]): jax.nn's cuDNN path raises "Bias
  must have same seq length as QKV" for a bias broadcast over queries or keys (the common key-padding
  bias [B, 1, 1, Sk]);
* Sq and Sk even: jax's cuDNN path requires that whenever the call is differentiated
  (``check_is_flash_attention`` with ``is_training``, which counts every call as biased: "Unsupported
  sequence length"), and a forward call cannot know yet whether it will be;
* no window that leaves query rows without a key (Sq > Sk + left with top-left alignment): the
  contract gives those rows 0, which jax.nn's cuDNN path does not promise;
* no softcap, boolean mask, segment ids or lse output: jax.nn's cuDNN path either lacks them or
  gives fully-masked rows a different value than the contract's 0.
* the cuDNN custom call is traced only when a GPU backend is present in this process (jax.nn
  checks the cuDNN version while tracing), so exports for CUDA from a CPU-only machine use the
  ``pallas_gpu`` kernel instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flashport.kernels.contract import registry
from flashport.kernels.contract.registry import cuda_present

FEATURES = frozenset({"causal", "window", "bias", "gqa", "bfloat16", "float16"})
MAX_HEAD_DIM = 128


def check_call(call) -> str | None:
    """Return why cuDNN cannot serve ``call`` with the contract's semantics, or None.

    Mirrors the checks ``jax.nn.dot_product_attention(implementation="cudnn")`` runs while tracing
    (``jax._src.cudnn.fused_attention_stablehlo``: ``check_layout``, ``check_is_flash_attention``
    for the forward and the training forward), at their strictest (pre-Hopper head dims), so a call
    this accepts never raises there; ``tests/test_auto_cuda_choice.py`` runs those checks as the oracle.
    """
    if not cuda_present():
        return "needs a CUDA device in this process (cuDNN is traced only where a GPU is present)"
    return _shape_reason(call) or _bias_reason(call) or _positional_reason(call.spec)


def _shape_reason(call) -> str | None:
    dim = call.q_shape[3]
    if dim % 8 or dim > MAX_HEAD_DIM:
        return f"head_dim={dim} (cuDNN needs a multiple of 8, at most {MAX_HEAD_DIM})"
    if call.v_head_dim != dim:
        return "value head_dim differs from query head_dim"
    sq, sk = call.q_shape[2], call.kv_shape[2]
    if sq % 2 or sk % 2:
        return f"odd sequence length (Sq={sq}, Sk={sk}; cuDNN's training forward needs even ones)"
    return None


def _bias_reason(call) -> str | None:
    if call.bias_shape is None:
        return None
    sq, sk = call.q_shape[2], call.kv_shape[2]
    if tuple(call.bias_shape[2:]) != (sq, sk):
        return (
            f"bias of shape {list(call.bias_shape)} broadcast over the query or key axis (cuDNN "
            f"needs the full [.., .., Sq={sq}, Sk={sk}]; batch and head may be 1)"
        )
    return None


def _positional_reason(spec) -> str | None:
    if spec.has_positional_mask and spec.offset != 0:
        return "causal/window with bottom-right alignment when Sq != Sk"
    has_window = spec.window_left is not None or spec.window_right is not None
    if has_window and not spec.causal and spec.window_right != 0:
        return "a window that reaches right (cuDNN windows reach left only, unless causal)"
    if spec.window_left is not None and spec.seq_q > spec.seq_k + spec.window_left:
        return (
            f"window left={spec.window_left} leaves the last {spec.seq_q - spec.seq_k - spec.window_left} "
            "query rows without a key (the contract gives them 0; jax.nn's cuDNN path does not promise that)"
        )
    return None


def cudnn_attention(q, k, v, bias, mask, q_seg, kv_seg, seed, *, spec, options):
    """Run jax.nn's cuDNN attention on canonical BHSD arrays; returns ``(out, lse)`` with lse unset."""
    if options:
        raise ValueError(f"backend 'cudnn' takes no options, got {sorted(options)}")
    # check_call guarantees any window here ends at the diagonal: causal or right == 0.
    causal = spec.causal or spec.window_right == 0
    window = None if spec.window_left is None else (spec.window_left, 0)
    out = jax.nn.dot_product_attention(
        jnp.swapaxes(q, 1, 2),
        jnp.swapaxes(k, 1, 2),
        jnp.swapaxes(v, 1, 2),
        bias=None if bias is None else bias.astype(q.dtype),
        scale=spec.scale,
        is_causal=causal,
        local_window_size=window,
        implementation="cudnn",
    )
    b, h, sq, _ = q.shape
    # The contract's lse is only returned on request, and "return_lse" is not a cuDNN feature, so
    # this placeholder never reaches a user.
    return jnp.swapaxes(out, 1, 2), jnp.zeros((b, h, sq), jnp.float32)


registry.register(
    registry.BackendInfo(
        name="cudnn",
        description="cuDNN fused attention via jax.nn.dot_product_attention(implementation='cudnn'); "
        "GPU only, fp16/bf16, top-left causal, left windows, bias.",
        platforms=("cuda",),
        # No dropout: cuDNN draws its mask from its own Philox stream, which cannot reproduce the
        # contract's position hash, so auto falls back to a backend that can.
        features=frozenset(FEATURES) - {"dropout"},
        fn=cudnn_attention,
        check=check_call,
        is_available=cuda_present,
        deferrable=False,  # its custom_partitioning lowers only at the top of a module
    )
)
