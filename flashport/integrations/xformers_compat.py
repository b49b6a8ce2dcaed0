"""xformers' ``memory_efficient_attention`` and its ``attn_bias`` classes on the flashport contract.

Rewritten code calls :func:`memory_efficient_attention` (same signature as
``xformers.ops.memory_efficient_attention``) and builds biases with the classes below, which mirror
xformers' constructors (``LowerTriangularMask()``, ``BlockDiagonalMask.from_seqlens(...)``,
``.make_causal()``, ...) but only record what the bias means. Semantics (xformers 0.0.35,
``xformers/ops/fmha/attn_bias.py``):

===========================================  ===============================================
bias                                         contract keywords
===========================================  ===============================================
``LowerTriangularMask``                      ``causal=True, align="top_left"``
``LowerTriangularMaskWithTensorBias(b)``     top-left causal + ``bias=b``
``LowerTriangularFromBottomRightMask``       ``causal=True, align="bottom_right"``
``...FromBottomRightLocalAttentionMask(w)``  bottom-right causal, ``window=(w - 1, 0)``
``LocalAttentionFromBottomRightMask(l, r)``  ``window=(l, r), align="bottom_right"`` (= FA2)
``BlockDiagonalMask.from_seqlens(q, kv)``    B = 1, sequences concatenated: segment ids
``BlockDiagonalCausalMask``                  + causal per block, top-left
``BlockDiagonalCausalFromBottomRightMask``   + causal per block, bottom-right
``BlockDiagonalCausalLocalAttentionMask(w)`` + keys in ``(i - w, i]`` per block (``left = w - 1``)
``torch.Tensor``                             additive ``bias`` broadcast to [B, H, Mq, Mk]
===========================================  ===============================================

Inputs may be 3-D ``[B, M, K]`` (one head), 4-D ``[B, M, H, K]`` or 5-D ``[B, M, G, H, K]`` (GQA with
K/V expanded by the caller); the output has the query's rank. Real xformers bias objects of the
classes above are accepted too (read through their attributes). Every bias object has xformers'
``materialize(shape, dtype=torch.float32, device="cpu")``: the dense additive tensor (0 visible,
``-inf`` masked).
"""

from __future__ import annotations

import dataclasses
import itertools

from flashport.kernels.contract.varlen import is_torch_tensor

__all__ = [
    "AttentionBias",
    "AttentionMask",
    "BlockDiagonalCausalFromBottomRightMask",
    "BlockDiagonalCausalLocalAttentionFromBottomRightMask",
    "BlockDiagonalCausalLocalAttentionMask",
    "BlockDiagonalCausalMask",
    "BlockDiagonalMask",
    "LocalAttentionFromBottomRightMask",
    "LowerTriangularFromBottomRightLocalAttentionMask",
    "LowerTriangularFromBottomRightMask",
    "LowerTriangularMask",
    "LowerTriangularMaskWithTensorBias",
    "contract_kwargs",
    "memory_efficient_attention",
]


class _BiasType(type):
    """The bias classes' metaclass: ``isinstance(b, <class>)`` also holds for a real xformers bias of
    the class of that name or a subclass of it, so code whose checks and annotations were ported
    keeps its meaning for biases still built by xformers elsewhere (``memory_efficient_attention``
    here takes both)."""

    def __instancecheck__(cls, instance):
        if type.__instancecheck__(cls, instance):
            return True
        names = {cls.__name__} | ({"AttentionMask"} if cls.__name__ == "AttentionBias" else set())
        return any(
            c.__module__.startswith("xformers.") and c.__name__ in names for c in type(instance).__mro__
        )


class AttentionBias(metaclass=_BiasType):
    """Base class of the bias objects (``xformers.ops.AttentionBias``)."""

    def _contract(self, total_q, total_k, device):
        raise NotImplementedError(f"{type(self).__name__} has no flashport equivalent")

    def _visible(self, mq, mk, device):
        raise NotImplementedError(f"{type(self).__name__} cannot be materialized")

    def materialize(self, shape, dtype=None, device="cpu"):
        """The bias as a dense additive tensor of ``shape`` (``[..., Mq, Mk]``), like xformers':
        0 where a query may see a key, ``-inf`` where it is masked (default dtype float32)."""
        import torch

        shape = tuple(shape)
        if len(shape) < 2:
            raise ValueError(f"{type(self).__name__}.materialize: shape must end with (Mq, Mk), got {shape}")
        visible = self._visible(shape[-2], shape[-1], device)
        zero = torch.zeros((), dtype=dtype or torch.float32, device=device)
        out = torch.where(visible, zero, torch.full((), float("-inf"), dtype=zero.dtype, device=device))
        return out.expand(shape).clone()


def _band(mq, mk, device, causal, align, window):
    """Boolean [mq, mk]: query ``i`` sees key ``j`` (``d = j - i - s``, ``s = mk - mq`` bottom-right
    else 0; causal: ``d <= 0``; window ``(l, r)``: ``-l <= d <= r``)."""
    import torch

    shift = mk - mq if align == "bottom_right" else 0
    d = torch.arange(mk, device=device)[None, :] - torch.arange(mq, device=device)[:, None] - shift
    ok = torch.ones((mq, mk), dtype=torch.bool, device=device)
    if causal:
        ok &= d <= 0
    if window is not None:
        ok &= (d >= -window[0]) & (d <= window[1])
    return ok


@dataclasses.dataclass
class _Dense(AttentionBias):
    """A bias given by causal/window/alignment flags (no sequence structure)."""

    causal = False
    align = "top_left"

    def window(self):
        """The contract's ``window`` (None = unbounded)."""
        return None

    def _visible(self, mq, mk, device):
        return _band(mq, mk, device, self.causal, self.align, self.window())

    def _contract(self, total_q, total_k, device):
        out = {"causal": self.causal, "align": self.align}
        if self.window() is not None:
            out["window"] = self.window()
        return out


class LowerTriangularMask(_Dense):
    """Causal, **top-left** aligned (query ``i`` sees keys ``j <= i``)."""

    causal = True

    def __init__(self, device=None):
        """``device`` is accepted and unused, as in xformers (kept there for backward compatibility)."""

    def add_bias(self, bias):
        """Causal plus an additive tensor bias."""
        return LowerTriangularMaskWithTensorBias(bias)


@dataclasses.dataclass(init=False)
class LowerTriangularMaskWithTensorBias(LowerTriangularMask):
    """Top-left causal plus an additive bias tensor."""

    _bias: object = None

    def __init__(self, bias):
        self._bias = bias

    def _contract(self, total_q, total_k, device):
        return {**super()._contract(total_q, total_k, device), "bias": self._bias}

    def materialize(self, shape, dtype=None, device="cpu"):
        """The causal mask plus the bias tensor (xformers: ``super().materialize(...) + bias``)."""
        return super().materialize(shape, dtype=dtype, device=device) + self._bias


class LowerTriangularFromBottomRightMask(_Dense):
    """Causal, **bottom-right** aligned (query ``i`` sees keys ``j <= i + Mk - Mq``)."""

    causal = True
    align = "bottom_right"

    def make_local_attention(self, window_size):
        """Bottom-right causal limited to the last ``window_size`` keys."""
        return LowerTriangularFromBottomRightLocalAttentionMask(window_size)


@dataclasses.dataclass
class LowerTriangularFromBottomRightLocalAttentionMask(LowerTriangularFromBottomRightMask):
    """Bottom-right causal; query ``i`` sees keys in ``(i + s - w, i + s]`` (FA2 window ``(w - 1, 0)``)."""

    _window_size: int

    def window(self):
        """``(w - 1, 0)``."""
        return (int(self._window_size) - 1, 0)


@dataclasses.dataclass
class LocalAttentionFromBottomRightMask(_Dense):
    """``q - window_left <= k + s <= q + window_right`` with ``s = Mq - Mk``: FA2's ``window_size=(l, r)``."""

    window_left: int
    window_right: int
    align = "bottom_right"

    def window(self):
        """``(window_left, window_right)``."""
        return (int(self.window_left), int(self.window_right))


@dataclasses.dataclass
class BlockDiagonalMask(AttentionBias):
    """Packed sequences (B = 1, concatenated along M); each query block sees only its key block."""

    q_seqlen: list = dataclasses.field(default_factory=list)
    kv_seqlen: list = dataclasses.field(default_factory=list)
    _batch_sizes: list | None = None
    causal = False
    align = "top_left"
    _window_size: int = 0

    @classmethod
    def from_seqlens(cls, q_seqlen, kv_seqlen=None, *, device=None):
        """Blocks of ``q_seqlen[i]`` queries and ``kv_seqlen[i]`` keys (default: the same lengths).
        ``device`` is accepted and unused: the mask is built on the query's device when it runs."""
        q = [int(n) for n in q_seqlen]
        kv = q if kv_seqlen is None else [int(n) for n in kv_seqlen]
        if len(q) != len(kv):
            raise ValueError(f"q_seqlen has {len(q)} sequences but kv_seqlen has {len(kv)}")
        return cls(q_seqlen=q, kv_seqlen=kv)

    @classmethod
    def from_tensor_list(cls, tensors):
        """``(bias, tensors concatenated along M)`` for tensors ``[B_i, M_i, ...]`` (like xformers)."""
        import torch

        lengths = [x.shape[1] for x in tensors for _ in range(x.shape[0])]
        bias = cls.from_seqlens(lengths)
        bias._batch_sizes = [x.shape[0] for x in tensors]
        return bias, torch.cat([x.reshape(1, -1, *x.shape[2:]) for x in tensors], dim=1)

    def split(self, tensor):
        """Inverse of :meth:`from_tensor_list`: ``[1, sum M_i, ...]`` back to the list of tensors."""
        sizes = self._batch_sizes or [1] * len(self.q_seqlen)
        chunks, start, out = [], 0, []
        for size in sizes:
            chunks.append(sum(self.q_seqlen[start : start + size]))
            start += size
        for size, part in zip(sizes, tensor.split(chunks, dim=1), strict=False):
            out.append(part.reshape(size, -1, *part.shape[2:]))
        return out

    def _derive(self, cls, **extra):
        return cls(q_seqlen=self.q_seqlen, kv_seqlen=self.kv_seqlen, _batch_sizes=self._batch_sizes, **extra)

    def make_causal(self):
        """Causal blocks, top-left aligned."""
        return self._derive(BlockDiagonalCausalMask)

    def make_causal_from_bottomright(self):
        """Causal blocks, bottom-right aligned."""
        return self._derive(BlockDiagonalCausalFromBottomRightMask)

    def window(self):
        """The per-block window, or None."""
        return (int(self._window_size) - 1, 0) if self._window_size else None

    def _visible(self, mq, mk, device):
        import torch

        if sum(self.q_seqlen) != mq or sum(self.kv_seqlen) != mk:
            raise ValueError(
                f"{type(self).__name__}.materialize: shape must end with ({sum(self.q_seqlen)}, "
                f"{sum(self.kv_seqlen)}) (the blocks' total queries and keys), got ({mq}, {mk})"
            )
        ok = torch.zeros((mq, mk), dtype=torch.bool, device=device)
        q0 = k0 = 0
        for nq, nk in zip(self.q_seqlen, self.kv_seqlen, strict=False):
            ok[q0 : q0 + nq, k0 : k0 + nk] = _band(nq, nk, device, self.causal, self.align, self.window())
            q0, k0 = q0 + nq, k0 + nk
        return ok

    def _contract(self, total_q, total_k, device):
        import torch

        def cumulative(lengths):
            return torch.tensor([0] + lengths, device=device).cumsum(0)

        if sum(self.q_seqlen) != total_q or sum(self.kv_seqlen) != total_k:
            raise ValueError(
                f"{type(self).__name__}: the blocks cover {sum(self.q_seqlen)} queries and "
                f"{sum(self.kv_seqlen)} keys, the tensors have {total_q} and {total_k}"
            )
        # Packed sequences: memory_efficient_attention runs them in O(total) memory (kernels/contract/varlen.py).
        return {
            "cu_seqlens": (cumulative(self.q_seqlen), cumulative(self.kv_seqlen)),
            "causal": self.causal,
            "window": self.window(),
            "align": self.align,
            "blocks": True,
        }


class BlockDiagonalCausalMask(BlockDiagonalMask):
    """Block-diagonal, each block causal **top-left**."""

    causal = True

    def make_local_attention(self, window_size):
        """Each block sees keys in ``(i - window_size, i]``."""
        return self._derive(BlockDiagonalCausalLocalAttentionMask, _window_size=window_size)


class BlockDiagonalCausalFromBottomRightMask(BlockDiagonalMask):
    """Block-diagonal, each block causal **bottom-right**."""

    causal = True
    align = "bottom_right"

    def make_local_attention(self, window_size):
        """Each block sees keys in ``(i + s - window_size, i + s]``."""
        return self._derive(BlockDiagonalCausalLocalAttentionFromBottomRightMask, _window_size=window_size)


class BlockDiagonalCausalLocalAttentionMask(BlockDiagonalCausalMask):
    """Top-left causal blocks limited to the last ``window_size`` keys (FA2 ``left = window_size - 1``)."""


class BlockDiagonalCausalLocalAttentionFromBottomRightMask(BlockDiagonalCausalFromBottomRightMask):
    """Bottom-right causal blocks limited to the last ``window_size`` keys."""


AttentionMask = AttentionBias  # xformers.ops' alias


def _from_xformers(bias):
    """A real xformers bias object of a supported class as the flashport mirror (by class name)."""
    name = type(bias).__name__
    cls = globals().get(name)
    if (
        cls is None
        or not (isinstance(cls, type) and issubclass(cls, AttentionBias))
        or name in ("AttentionBias",)
    ):
        raise ValueError(f"xformers bias {name} has no flashport equivalent")
    if issubclass(cls, BlockDiagonalMask):

        def lengths(info):
            starts = getattr(info, "seqstart_py", None) or getattr(info, "cu_seqlen_py", None)
            return [b - a for a, b in itertools.pairwise(starts)]

        out = cls(q_seqlen=lengths(bias.q_seqinfo), kv_seqlen=lengths(bias.k_seqinfo))
        out._window_size = getattr(bias, "_window_size", 0) or 0
        return out
    if cls is LowerTriangularMaskWithTensorBias:
        return cls(bias._bias)
    if cls is LocalAttentionFromBottomRightMask:
        return cls(bias.window_left, bias.window_right)
    if cls is LowerTriangularFromBottomRightLocalAttentionMask:
        return cls(bias._window_size)
    return cls()


def contract_kwargs(attn_bias, total_q, total_k, device):
    """The contract keywords (``causal``, ``align``, ``window``, ``bias``, ``mask``, segment ids) for
    an ``attn_bias`` (None, a mirror/xformers bias object, or an additive tensor)."""
    if attn_bias is None:
        return {}
    if is_torch_tensor(attn_bias):  # torchax / torch_xla tensors too (torch.Tensor subclasses)
        return {"bias": attn_bias}
    if not type.__instancecheck__(AttentionBias, attn_bias):  # a real xformers bias
        attn_bias = _from_xformers(attn_bias)
    return attn_bias._contract(total_q, total_k, device)


def memory_efficient_attention(
    query,
    key,
    value,
    attn_bias=None,
    p=0.0,
    scale=None,
    *,
    op=None,
    output_dtype=None,
    backend="auto",
    generator=None,
):
    """``xformers.ops.memory_efficient_attention`` through :func:`flashport.torch.attention`.

    Args:
      query: [B, Mq, K], [B, Mq, H, K] or [B, Mq, G, H, K]; key/value the same rank with Mk.
      attn_bias: None, a bias object (module docstring) or an additive tensor broadcastable to
        [B, H, Mq, Mk] ([B, G, H, Mq, Mk] for 5-D inputs).
      p: dropout probability on the attention probabilities (``dropout_p`` of
        :func:`flashport.torch.attention`: the contract's keep-mask, kept entries scaled by
        ``1 / (1 - p)``). Positions are those of the tensors flashport sees: 5-D inputs flatten
        ``(G, H)`` to query head ``g * H + h``; block-diagonal biases keep batch 0 and the packed
        positions. Pass 0.0 in eval mode, as with xformers.
      generator: the ``torch.Generator`` the seed words are drawn from (None = torch's default).
      scale: None = ``K ** -0.5``.
      op: ignored (xformers kernel choice).
      output_dtype: cast of the output (default: the query dtype).
      backend: passed to :func:`flashport.torch.attention`.

    Returns:
      [B, Mq, (G,) (H,) Kv] like xformers.

    Raises:
      ValueError: for unsupported ranks or bias objects, blocks that do not cover the tensors, or
      ``p`` outside [0, 1) (TypeError for a non-number).
    """
    import flashport.torch

    _check_p(p)
    shape = query.shape
    query, key, value = _to_bshd(query, key, value)
    kwargs = contract_kwargs(attn_bias, query.shape[1], key.shape[1], query.device)
    if kwargs.pop("blocks", False) and query.shape[0] != 1:
        raise ValueError(
            f"memory_efficient_attention: block-diagonal biases need batch 1, got {query.shape[0]}"
        )
    if kwargs.get("bias") is not None:
        kwargs["bias"] = _bias_to_bhsd(kwargs["bias"], shape, query.shape[1], key.shape[1])
    dropout = dict(dropout_p=p, generator=generator)
    cu_seqlens = kwargs.pop("cu_seqlens", None)
    if cu_seqlens is None:
        out = flashport.torch.attention(
            query, key, value, scale=scale, layout="BSHD", backend=backend, **dropout, **kwargs
        )
    else:  # block-diagonal: packed sequences (batch 1)
        from flashport.kernels.contract.varlen import attend_varlen

        rows = (x.squeeze(0) for x in (query, key, value))
        out = attend_varlen(
            flashport.torch.attention, *rows, *cu_seqlens, scale=scale, backend=backend, **dropout, **kwargs
        ).unsqueeze(0)
    if len(shape) == 3:
        out = out.squeeze(2)
    elif len(shape) == 5:
        out = out.reshape(*shape[:4], out.shape[-1])
    return out if output_dtype is None else out.to(output_dtype)


def _check_p(p):
    """Validate xformers' ``p`` as the contract's ``dropout_p`` (errors name both)."""
    from flashport.torch import _dropout

    try:
        _dropout.check_p(p)
    except (TypeError, ValueError) as e:
        raise type(e)(f"memory_efficient_attention: p is flashport's dropout_p: {e}") from None


def _to_bshd(query, key, value):
    """3-D [B, M, K] / 5-D [B, M, G, H, K] inputs as 4-D [B, M, H', K] (5-D: head ``g * H + h``)."""
    rank = query.ndim
    if rank not in (3, 4, 5):
        raise ValueError(
            f"memory_efficient_attention: query must be 3-D, 4-D or 5-D, got shape {tuple(query.shape)}"
        )
    if rank == 3:
        return tuple(x.unsqueeze(2) for x in (query, key, value))
    if rank == 5:
        return tuple(x.reshape(x.shape[0], x.shape[1], -1, x.shape[-1]) for x in (query, key, value))
    return query, key, value


def _bias_to_bhsd(bias, shape, mq, mk):
    """An additive bias for inputs of (original) ``shape`` as the contract's [B|1, H|1, Mq, Mk] form."""
    if len(shape) == 3 and bias.ndim == 3:
        return bias.unsqueeze(1)
    if len(shape) == 5:
        full = (shape[0], shape[2], shape[3], mq, mk)
        return bias.expand(full).reshape(shape[0], shape[2] * shape[3], *full[-2:])
    return bias
