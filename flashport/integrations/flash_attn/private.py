"""Drop-ins for flash-attn 2.7+'s private kernel entry points, on flashport's JAX implementation.

Ring / context-parallel attention and custom autograd functions call flash-attn's private kernels
directly: ``_flash_attn_forward`` / ``_flash_attn_varlen_forward`` return
``(out, softmax_lse, S_dmask, rng_state)`` and ``_flash_attn_backward`` /
``_flash_attn_varlen_backward`` write dq, dk, dv **into the buffers they are given** and return
``softmax_d``. The functions here have flash-attn 2.8.3's signatures (``window_size_left`` /
``window_size_right`` as ints since 2.7; before 2.7 the forward took ``window_size=(l, r)`` and
returned 8 values: ``_flash_attn_forward_v2_4`` / ``_v2_6`` and ``_flash_attn_backward_v2_4`` / ``_v2_6``
have those signatures and return conventions, as do the varlen ones of 2.4-2.5 / 2.6, and the ``_v2_0``
ones those of 2.0.2-2.2, which had no window, softcap or ALiBi) and the same conventions:

* q [B, Sq, H, D], k/v [B, Sk, Hk, D] (varlen: [total, H, D] with int ``cu_seqlens``); causal and
  window aligned bottom-right (per sequence for varlen); ``softcap`` 0 = off; contiguous GQA;
  ``alibi_slopes`` as flash-attn's kernel adds them (dense only);
* ``softmax_lse`` float32 [B, H, Sq] (varlen: [H, total_q]), natural log of the sum of
  ``exp(softmax_scale * q·k)`` over the visible keys; +inf for a row that sees no key;
* the backward uses the ``out`` and ``softmax_lse`` it is given (not a recomputed forward), as
  flash-attn's does, so merged partial results (ring attention, two-branch attention) get the
  gradients flash-attn gives them; it runs :func:`flashport.attention_backward`;
* ``dropout_p > 0``: the forward draws the contract's keep-mask from two seed words taken from torch's
  default generator and returns them as ``rng_state``; the backward regenerates the same mask from
  that ``rng_state`` (and refuses ``dropout_p > 0`` without it, where flash-attn would silently draw
  a different mask);
* ``S_dmask`` is None (``return_softmax=True`` raises: flash-attn's dropout-encoded probabilities
  are for its tests only); ``softmax_d`` is ``rowsum(dout * out)`` float32 [B, H, Sq] (varlen:
  [H, total_q]) without flash-attn's padding rows; ``deterministic`` and ``zero_tensors`` are
  accepted and ignored; ``max_seqlen_*`` only size flash-attn's launch.

They run on CPU tensors through DLPack and on torch_xla / torchax tensors through their JAX bridges,
without autograd (they are kernels: the caller's ``torch.autograd.Function`` owns the graph).
"""

from __future__ import annotations

from flashport.integrations.flash_attn.core import (
    alibi_bias,
    flash_attn_window,
    lse_from_flash_attn,
    lse_like_flash_attn,
    with_signature,
)
from flashport.kernels.contract.varlen import varlen_layout, varlen_plan

__all__ = [
    "_flash_attn_backward",
    "_flash_attn_backward_v2_0",
    "_flash_attn_backward_v2_4",
    "_flash_attn_backward_v2_6",
    "_flash_attn_forward",
    "_flash_attn_forward_v2_0",
    "_flash_attn_forward_v2_4",
    "_flash_attn_forward_v2_6",
    "_flash_attn_varlen_backward",
    "_flash_attn_varlen_backward_v2_0",
    "_flash_attn_varlen_backward_v2_4",
    "_flash_attn_varlen_backward_v2_6",
    "_flash_attn_varlen_forward",
    "_flash_attn_varlen_forward_v2_0",
    "_flash_attn_varlen_forward_v2_4",
    "_flash_attn_varlen_forward_v2_6",
]


def _static(softmax_scale, causal, window_size_left, window_size_right, softcap, dropout_p):
    """The contract's static keywords for a dense call (bottom-right alignment, BSHD)."""
    from flashport.torch import kernel_calls

    static = dict(
        scale=softmax_scale,
        causal=bool(causal),
        window=flash_attn_window((window_size_left, window_size_right)),
        align="bottom_right",
        softcap=softcap or None,
        layout="BSHD",
        backend="auto",
    )
    if kernel_calls.check_dropout_p(dropout_p) > 0:
        static["dropout_rate"] = float(dropout_p)
    return static


def _seed(dropout_p, rng_state, like, step):
    """The dropout seed tensor: drawn (forward) or the forward's ``rng_state`` (backward); None
    without dropout."""
    from flashport.torch import kernel_calls

    if not dropout_p:
        return None
    if step == "forward":
        return kernel_calls.dropout_seed(like)
    if rng_state is None:
        raise ValueError(
            "dropout_p > 0 in the backward needs rng_state: pass the rng_state the forward returned "
            "(without it the keep-mask cannot be regenerated)"
        )
    return rng_state


def _no_softmax(return_softmax):
    """Refuse ``return_softmax=True`` (flash-attn's dropout-encoded probabilities)."""
    if return_softmax:
        raise ValueError(
            "return_softmax=True: flash-attn's dropout-encoded probabilities (for its tests only) are "
            "not produced by flashport's drop-in; pass return_softmax=False"
        )


def _write(buffers, grads):
    """Copy each gradient into its caller-given buffer (flash-attn writes in place); None is skipped."""
    for buffer, grad in zip(buffers, grads, strict=False):
        if buffer is not None:
            buffer.copy_(grad.to(buffer.dtype))


# Each kernel states flash-attn's signature once (``with_signature``; flash-attn 2.8.3's for the 2.7+
# kernels) and receives its arguments by name.
_DEFAULTS = {
    "window_size": (-1, -1),
    "window_size_left": -1,
    "window_size_right": -1,
    "softcap": 0.0,
    "alibi_slopes": None,
    "return_softmax": False,
    "block_table": None,
    "leftpad_k": None,
    "seqused_k": None,
    "rng_state": None,
    "zero_tensors": False,
}
_VARLEN = "cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k"
_GRADS = "dout q k v out softmax_lse dq dk dv"
_HEAD = "dropout_p softmax_scale causal"
_BAND = "window_size_left window_size_right softcap alibi_slopes"


def _dense_call(q, k, step, *, dropout_p, alibi_slopes, rng_state=None, deterministic=False, **band):
    """``(static, seed, bias)`` of a dense kernel call (``step``: ``"forward"`` or ``"backward"``);
    ``band``: softmax_scale, causal, window_size_left, window_size_right, softcap."""
    static = _static(dropout_p=dropout_p, **band)
    seed = _seed(dropout_p, rng_state, q, step)
    causal = band["causal"]
    bias = (
        None if alibi_slopes is None else alibi_bias(alibi_slopes, q.shape[1], k.shape[1], causal, q.device)
    )
    return static, seed, bias


@with_signature(f"q k v {_HEAD} {_BAND} return_softmax", _DEFAULTS)
def _flash_attn_forward(q, k, v, return_softmax, **options):
    """flash-attn 2.7+ ``_flash_attn_forward``: ``(out [B, Sq, H, D], softmax_lse [B, H, Sq], None,
    rng_state)`` (``rng_state`` None without dropout)."""
    from flashport.torch import kernel_calls

    _no_softmax(return_softmax)
    static, seed, bias = _dense_call(q, k, "forward", **options)
    out, lse = kernel_calls.forward((q, k, v, bias, None, None, None, seed), static)
    return out, lse_like_flash_attn(lse), None, seed


@with_signature(f"{_GRADS} {_HEAD} {_BAND} deterministic | rng_state", _DEFAULTS)
def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, **options):
    """flash-attn 2.7+ ``_flash_attn_backward``: writes dq, dk, dv into the given buffers from the
    given ``out`` / ``softmax_lse``; returns ``softmax_d`` [B, H, Sq]."""
    import torch

    from flashport.torch import kernel_calls

    static, seed, bias = _dense_call(q, k, "backward", **options)
    d_lse = torch.zeros(softmax_lse.shape, dtype=torch.float32, device=q.device)
    args = (q, k, v, bias, None, None, None, seed, out, lse_from_flash_attn(softmax_lse), dout, d_lse)
    grads = kernel_calls.backward(args, static)
    _write((dq, dk, dv), grads[:3])
    return (dout.float() * out.float()).sum(-1).transpose(1, 2)


class _Varlen:
    """One private varlen call on the contract in O(total) memory: the layout of
    :func:`flashport.kernels.contract.varlen.varlen_plan` (packed rows as they are, or each sequence's queries
    and keys gathered into a virtual layout under one top-left band), or, for dropout where the
    virtual layout would move the keep-mask's packed positions, the packed rows and a dense mask."""

    def __init__(self, q, k, cu_seqlens_q, cu_seqlens_k, causal, window_size_left, window_size_right):
        import torch

        self.band = dict(causal=bool(causal), window=flash_attn_window((window_size_left, window_size_right)))
        self.plan = varlen_plan(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
        self.mask = None
        self.q_ids, self.kv_ids = (
            self.plan.q_ids.to(torch.int32)[None],
            self.plan.kv_ids.to(torch.int32)[None],
        )
        self.dense = False

        self._dense_layout = lambda: varlen_layout(
            cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], **self.band
        )

    def static(self, softmax_scale, softcap, dropout_p):
        """The contract's static keywords: the band top-left on the plan's rows, or none (dense mask)."""
        import torch

        if self.plan.q_rows is not None and dropout_p:
            q_ids, kv_ids, mask = self._dense_layout()
            self.q_ids, self.kv_ids, self.mask = (
                q_ids.to(torch.int32)[None],
                kv_ids.to(torch.int32)[None],
                mask[None, None],
            )
            self.dense = True
        if self.dense:
            return _static(softmax_scale, False, -1, -1, softcap, dropout_p)
        return dict(_static(softmax_scale, False, -1, -1, softcap, dropout_p), **self.band, align="top_left")

    def rows(self, x, which):
        """``x`` [total, ...] on the call's rows (``which``: ``"q"`` or ``"kv"``), batch dim added."""
        index = None if self.dense else getattr(self.plan, f"{which}_rows")
        return (x if index is None else x.index_select(0, index))[None]

    def back(self, x, dim=0):
        """The call's per-query ``x`` (batch dim dropped) on the packed query rows along ``dim``."""
        index = None if self.dense else self.plan.out_rows
        return x if index is None else x.index_select(dim, index)

    def grads_back(self, grad, which, like):
        """A gradient on the call's rows summed back onto the packed rows of ``like``."""
        index = None if self.dense else getattr(self.plan, f"{which}_rows")
        if index is None:
            return grad
        return like.new_zeros(like.shape, dtype=grad.dtype).index_add_(0, index, grad)


def _varlen_call(q, k, cu_seqlens_q, cu_seqlens_k, step, *, function, dropout_p, rng_state=None, **options):
    """``(call, static, seed)`` of a varlen kernel call: the :class:`_Varlen` layout, the contract's
    static keywords and the dropout seed. Raises NotImplementedError naming ``function`` for the
    arguments the drop-in does not support (ALiBi, paged keys, left padding, ``seqused_k``)."""
    for name in ("alibi_slopes", "block_table", "leftpad_k", "seqused_k"):
        if options.get(name) is not None:
            raise NotImplementedError(f"{function}: {name} is not supported by flashport's drop-in")
    band = (options["causal"], options["window_size_left"], options["window_size_right"])
    call = _Varlen(q, k, cu_seqlens_q, cu_seqlens_k, *band)
    static = call.static(options["softmax_scale"], options["softcap"], dropout_p)
    return call, static, _seed(dropout_p, rng_state, q, step)


@with_signature(
    f"q k v {_VARLEN} {_HEAD} | {_BAND} return_softmax block_table leftpad_k seqused_k zero_tensors",
    _DEFAULTS,
)
def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, return_softmax, **options):
    """flash-attn 2.7+ ``_flash_attn_varlen_forward``: q [total_q, H, D], k/v [total_k, Hk, D] ->
    ``(out [total_q, H, D], softmax_lse [H, total_q], None, rng_state)``."""
    from flashport.torch import kernel_calls

    _no_softmax(return_softmax)
    function = "_flash_attn_varlen_forward"
    call, static, seed = _varlen_call(
        q, k, cu_seqlens_q, cu_seqlens_k, "forward", function=function, **options
    )
    args = (
        call.rows(q, "q"),
        call.rows(k, "kv"),
        call.rows(v, "kv"),
        None,
        call.mask,
        call.q_ids,
        call.kv_ids,
        seed,
    )
    out, lse = kernel_calls.forward(args, static)
    return call.back(out[0]), lse_like_flash_attn(call.back(lse[0], dim=1)), None, seed


@with_signature(f"{_GRADS} {_VARLEN} {_HEAD} {_BAND} deterministic | rng_state zero_tensors", _DEFAULTS)
def _flash_attn_varlen_backward(
    dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, **options
):
    """flash-attn 2.7+ ``_flash_attn_varlen_backward``: writes dq, dk, dv into the given buffers from
    the given ``out`` / ``softmax_lse`` [H, total_q]; returns ``softmax_d`` [H, total_q]."""
    import torch

    from flashport.torch import kernel_calls

    function = "_flash_attn_varlen_backward"
    call, static, seed = _varlen_call(
        q, k, cu_seqlens_q, cu_seqlens_k, "backward", function=function, **options
    )
    lse = call.rows(lse_from_flash_attn(softmax_lse).transpose(0, 1), "q")[0].transpose(0, 1)[None]
    d_lse = torch.zeros(lse.shape, dtype=torch.float32, device=q.device)
    rows = (call.rows(q, "q"), call.rows(k, "kv"), call.rows(v, "kv"))
    residuals = (call.rows(out, "q"), lse, call.rows(dout, "q"), d_lse)
    args = (*rows, None, call.mask, call.q_ids, call.kv_ids, seed, *residuals)
    grads = kernel_calls.backward(args, static)
    packed = [
        call.grads_back(g[0], w, x) for g, w, x in zip(grads[:3], ("q", "kv", "kv"), (q, k, v), strict=True)
    ]
    _write((dq, dk, dv), packed)
    return (dout.float() * out.float()).sum(-1).transpose(0, 1)


# ----------------------------------------------------------------------------------- flash-attn 2.4-2.6
# Before 2.7 the private kernels took ``window_size=(left, right)``, the forward returned 8 values
# ``(out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)`` (q, k, v and out_padded as the
# kernel saw them: head dim padded to a multiple of 8; here the inputs and ``out``, flashport needs no
# padding) and the backward returned ``(dq, dk, dv, softmax_d)``. 2.6 inserted ``softcap`` before
# ``alibi_slopes``. The codemod picks the version from the ``if flash_attn_version ...`` branch a call
# sits in. Each release's form is the 2.7+ kernel behind that release's signature and return.


def _release_kernel(latest, release, parameters):
    """flash-attn ``release``'s form of the 2.7+ kernel ``latest``.

    Args:
      latest: :func:`_flash_attn_forward`, :func:`_flash_attn_backward` or their varlen forms.
      release: the releases it serves (``"2.0-2.2"``, ``"2.4-2.5"``, ``"2.6"``); the name's suffix
        (``_v2_4``).
      parameters: its signature for :func:`.core.with_signature`. ``window_size=(l, r)`` stands for
        2.7's two window ints; a release without ``window_size`` / ``softcap`` / ``alibi_slopes`` runs
        with none (full attention, off, no ALiBi).

    Returns:
      A function with exactly that signature that returns the release's values: the forward's 8,
      ``(out, q, k, v, out, softmax_lse, None, rng_state)``, or the backward's ``(dq, dk, dv,
      softmax_d)`` (dq, dk, dv: the buffers it wrote into).
    """
    forward = latest.__name__.endswith("_forward")

    def kernel(window_size=(-1, -1), softcap=0.0, alibi_slopes=None, **given):
        left, right = window_size
        if not forward:
            given.setdefault("deterministic", False)
        band = dict(
            window_size_left=left, window_size_right=right, softcap=softcap, alibi_slopes=alibi_slopes
        )
        result = latest(**band, **given)
        if forward:
            out, lse, s_dmask, rng_state = result
            return out, given["q"], given["k"], given["v"], out, lse, s_dmask, rng_state
        return given["dq"], given["dk"], given["dv"], result

    kernel.__name__ = kernel.__qualname__ = f"{latest.__name__}_v{release.split('-')[0].replace('.', '_')}"
    returns = (
        "``(out, q, k, v, out, softmax_lse, None, rng_state)``" if forward else "``(dq, dk, dv, softmax_d)``"
    )
    kernel.__doc__ = (
        f"flash-attn {release} ``{latest.__name__}`` on :func:`{latest.__name__}`: returns {returns}."
    )
    return with_signature(parameters, _DEFAULTS)(kernel)


# flash-attn 2.0.2-2.2: no window, softcap or ALiBi (2.0.0 / 2.0.1 had no rng_state, and a 7-value forward)
_flash_attn_forward_v2_0 = _release_kernel(_flash_attn_forward, "2.0-2.2", f"q k v {_HEAD} return_softmax")
_flash_attn_backward_v2_0 = _release_kernel(_flash_attn_backward, "2.0-2.2", f"{_GRADS} {_HEAD} | rng_state")
_flash_attn_varlen_forward_v2_0 = _release_kernel(
    _flash_attn_varlen_forward, "2.0-2.2", f"q k v {_VARLEN} {_HEAD} return_softmax"
)
_flash_attn_varlen_backward_v2_0 = _release_kernel(
    _flash_attn_varlen_backward, "2.0-2.2", f"{_GRADS} {_VARLEN} {_HEAD} | rng_state"
)
_flash_attn_forward_v2_4 = _release_kernel(
    _flash_attn_forward, "2.4-2.5", f"q k v {_HEAD} window_size alibi_slopes return_softmax"
)
_flash_attn_forward_v2_6 = _release_kernel(
    _flash_attn_forward, "2.6", f"q k v {_HEAD} window_size softcap alibi_slopes return_softmax"
)
_flash_attn_backward_v2_4 = _release_kernel(
    _flash_attn_backward, "2.4-2.5", f"{_GRADS} {_HEAD} window_size alibi_slopes deterministic | rng_state"
)
_flash_attn_backward_v2_6 = _release_kernel(
    _flash_attn_backward,
    "2.6",
    f"{_GRADS} {_HEAD} window_size softcap alibi_slopes deterministic | rng_state",
)
# block_table from 2.5.7
_flash_attn_varlen_forward_v2_4 = _release_kernel(
    _flash_attn_varlen_forward,
    "2.4-2.5",
    f"q k v {_VARLEN} {_HEAD} window_size alibi_slopes return_softmax | block_table",
)
# 2.6.2's defaults (2.6.0 required them)
_flash_attn_varlen_forward_v2_6 = _release_kernel(
    _flash_attn_varlen_forward,
    "2.6",
    f"q k v {_VARLEN} {_HEAD} | window_size softcap alibi_slopes return_softmax block_table leftpad_k seqused_k",
)
_flash_attn_varlen_backward_v2_4 = _release_kernel(
    _flash_attn_varlen_backward,
    "2.4-2.5",
    f"{_GRADS} {_VARLEN} {_HEAD} window_size alibi_slopes deterministic | rng_state",
)
_flash_attn_varlen_backward_v2_6 = _release_kernel(
    _flash_attn_varlen_backward,
    "2.6",
    f"{_GRADS} {_VARLEN} {_HEAD} window_size softcap alibi_slopes deterministic | rng_state",
)
