"""Validation for the torch-native paths (math, SDPA, flash-attn), without importing jax.

The JAX path validates inside ``flashport.attention``; the torch-native paths use :func:`check`.
Both share the framework-free checks of :mod:`flashport.kernels.contract.checks` and build the same
framework-free :class:`flashport.kernels.contract.spec.AttentionSpec` (:func:`~flashport.kernels.contract.spec.make_spec`),
so users see the same errors on every device and every path runs one normalized spec.
"""

from __future__ import annotations

import dataclasses

import torch

from flashport.kernels.contract import checks
from flashport.kernels.contract.checks import LAYOUTS
from flashport.kernels.contract.keywords import SPEC_KEYWORDS, pick, takes_contract_keywords
from flashport.kernels.contract.spec import AttentionSpec, make_spec

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class CanonicalCall:
    """One validated torch call in canonical form: the framework-free :class:`AttentionSpec` plus
    q/k/v as [B, H, S, D] views and bias/mask at rank 4 (unbroadcast).

    ``layout`` is the user's (outputs go back to it). ``spec.dropout_rate`` > 0 comes with ``seed``,
    the two uint32 seed words of the contract's keep-mask (:mod:`flashport.torch._dropout`).
    """

    spec: AttentionSpec
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    bias: torch.Tensor | None
    mask: torch.Tensor | None
    q_seg: torch.Tensor | None
    kv_seg: torch.Tensor | None
    layout: str
    seed: tuple[int, int] | None = None

    @property
    def dropout_p(self) -> float:
        """The dropout probability (``spec.dropout_rate``, under torch's name)."""
        return self.spec.dropout_rate


@takes_contract_keywords()
def check(query, key, value, *, return_lse=False, dropout_p=0.0, seed=None, **contract):
    """Validate the contract's arguments for torch tensors and return the :class:`CanonicalCall`.

    ``contract`` holds :func:`flashport.attention`'s keywords (:mod:`flashport.kernels.contract.keywords`).
    ``dropout_p`` is validated by the caller
    (:func:`flashport.torch._dropout.check_p`); ``seed`` (the drawn words) is required when it is > 0.

    Raises:
      TypeError / ValueError naming the offending argument and what was expected.
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        check_tensor(name, x)
    layout = checks.check_choice("layout", contract["layout"], LAYOUTS)
    checks.check_bool("return_lse", return_lse)
    q, k, v = (x.transpose(1, 2) if layout == "BSHD" else x for x in (query, key, value))
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"query, key and value must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"query, key and value must be on one device, got {q.device}, {k.device}, {v.device}"
        )
    checks.check_head_shapes(q.shape, k.shape, v.shape, layout)
    spec = make_spec(q.shape, k.shape, dropout_rate=dropout_p, **pick(contract, SPEC_KEYWORDS))
    batch, hq, sq, sk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    full, device = (batch, hq, sq, sk), query.device
    q_seg, kv_seg = _check_segments(contract["q_segment_ids"], contract["kv_segment_ids"], full, device)
    return CanonicalCall(
        spec=spec,
        q=q,
        k=k,
        v=v,
        bias=_check_broadcast("bias", contract["bias"], full, device, floating=True),
        mask=_check_broadcast("mask", contract["mask"], full, device, floating=False),
        q_seg=q_seg,
        kv_seg=kv_seg,
        layout=layout,
        seed=seed if dropout_p > 0 else None,
    )


def check_tensor(name, x):
    """Raise unless ``x`` is a rank-4 float32/bfloat16/float16 torch tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim != 4:
        raise ValueError(
            f"{name} must have rank 4 ([batch, seq, heads, head_dim] for BSHD), got shape {tuple(x.shape)}"
        )
    if x.dtype not in DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")


def _check_broadcast(name, x, full, device, *, floating):
    """Left-pad ``x`` to rank 4 and check each dim is 1 or the full size; dims stay unbroadcast."""
    if x is None:
        return None
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if floating and not x.is_floating_point():
        raise TypeError(checks.BIAS_DTYPE_ERROR.format(name=name, dtype=x.dtype))
    if not floating and x.dtype != torch.bool:
        raise TypeError(checks.MASK_DTYPE_ERROR.format(name=name, dtype=x.dtype))
    if x.device != device:
        raise ValueError(f"{name} must be on query's device {device}, got {x.device}")
    return x.reshape(checks.broadcast_shape(name, x.shape, full))


def _check_segments(q_seg, kv_seg, full, device):
    batch, _, sq, sk = full
    if not checks.check_segments_given(q_seg, kv_seg):
        return None, None
    for name, ids, seq in (("q_segment_ids", q_seg, sq), ("kv_segment_ids", kv_seg, sk)):
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(ids).__name__}")
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer array, got {ids.dtype}")
        checks.check_segment_shape(name, ids.shape, batch, seq)
        if ids.device != device:
            raise ValueError(f"{name} must be on query's device {device}, got {ids.device}")
    return q_seg, kv_seg
