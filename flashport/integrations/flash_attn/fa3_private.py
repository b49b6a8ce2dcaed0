"""Drop-ins for FlashAttention-3's private kernels (``hopper/flash_attn_interface.py``), per build.

FA3's ``_flash_attn_forward`` is the one kernel behind its public functions: dense, varlen
(``cu_seqlens_q``/``cu_seqlens_k``) and KV-cache attention (``k_new``/``v_new`` appended in place,
``seqused_k`` = the cache lengths, ``page_table``, ``kv_batch_idx``, ``leftpad_k``, rotary). It
returns ``(out, softmax_lse, out_accum, softmax_lse_accum)`` (the split-KV accumulators: empty
tensors here, as in FA3 when it does not split). ``_flash_attn_backward`` writes dq, dk, dv **into
the given buffers** from the ``out`` and ``softmax_lse`` it is given, and returns ``softmax_d``
(``(dq, dk, dv, softmax_d)`` before 2025-07-24).

Their parameter lists changed between FA3 builds (FA3 is versioned by commit date): ``qv`` was
inserted on 2025-02-07, ``sink_token_length`` removed on 2025-03-01, ``scheduler_metadata`` added
on 2025-03-15, ``seqlens_rotary`` inserted on 2025-03-21, ``attention_chunk`` on 2025-04-10,
``window_size=(l, r)`` split into ``window_size_left``/``window_size_right`` on 2025-07-16 (and
the backward's ``causal`` renamed ``is_causal``), every parameter after ``v`` got a default on
2025-08-06 and the forward's ``out`` became ``out_`` on 2025-11-21. The latest build's functions
keep their names here; each older build's has the suffix of the date its signature appeared
(``_flash_attn_forward_v2025_03_21``). The codemod picks the build whose signature the call fits.

The forward runs FA3's public drop-ins the way FA3's public functions call this kernel: with
``cu_seqlens_k``, :func:`.fa3.flash_attn_varlen_func` (``seqused_*`` raise NotImplementedError);
without, :func:`.fa3.flash_attn_with_kvcache` (``seqused_k`` as ``cache_seqlens``). The backward
runs FA2's private backward drop-ins (:mod:`.private`; FA3's semantics are FA2's without dropout
and ALiBi). FP8 descales, ``attention_chunk``, ``sink_token_length`` and ``sequed_*`` (sic, FA3's
spelling) raise NotImplementedError; the tuning arguments are ignored.
"""

from __future__ import annotations

from flashport.integrations.flash_attn import fa3, fa3_kvcache, private
from flashport.integrations.flash_attn.core import with_signature

__all__ = [
    "_flash_attn_backward",
    "_flash_attn_backward_v2025_01_07",
    "_flash_attn_backward_v2025_03_01",
    "_flash_attn_backward_v2025_07_16",
    "_flash_attn_backward_v2025_07_24",
    "_flash_attn_forward",
    "_flash_attn_forward_v2025_01_07",
    "_flash_attn_forward_v2025_02_07",
    "_flash_attn_forward_v2025_03_01",
    "_flash_attn_forward_v2025_03_15",
    "_flash_attn_forward_v2025_03_21",
    "_flash_attn_forward_v2025_04_10",
    "_flash_attn_forward_v2025_07_16",
    "_flash_attn_forward_v2025_08_06",
]

_DEFAULTS = {
    **{
        name: None
        for name in (
            "k_new v_new qv out out_ cu_seqlens_q cu_seqlens_k cu_seqlens_k_new seqused_q seqused_k "
            "sequed_q sequed_k max_seqlen_q max_seqlen_k page_table kv_batch_idx leftpad_k rotary_cos "
            "rotary_sin seqlens_rotary q_descale k_descale v_descale softmax_scale scheduler_metadata "
            "pack_gqa dq dk dv"
        ).split()
    },
    "causal": False,
    "is_causal": False,
    "window_size": (-1, -1),
    "window_size_left": -1,
    "window_size_right": -1,
    "sink_token_length": 0,
    "attention_chunk": 0,
    "softcap": 0.0,
    "rotary_interleaved": True,
    "num_splits": 1,
    "sm_margin": 0,
    "deterministic": False,
}


def _forward(
    q,
    k,
    v,
    k_new=None,
    v_new=None,
    qv=None,
    out=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    cu_seqlens_k_new=None,
    seqused_q=None,
    seqused_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    page_table=None,
    kv_batch_idx=None,
    leftpad_k=None,
    rotary_cos=None,
    rotary_sin=None,
    seqlens_rotary=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    rotary_interleaved=True,
    sink_token_length=0,
    **tuning,
):
    """Every build's forward, by FA3's parameter names (``tuning``: ignored)."""
    if sink_token_length:
        raise NotImplementedError(
            "FlashAttention-3 sink_token_length= is not supported by flashport's drop-in"
        )
    fp8 = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    band = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap)
    if cu_seqlens_k is not None:
        cache = dict(
            k_new=k_new, v_new=v_new, cu_seqlens_k_new=cu_seqlens_k_new, page_table=page_table,
            kv_batch_idx=kv_batch_idx, leftpad_k=leftpad_k, rotary_cos=rotary_cos,
        )  # fmt: skip
        for name, value in cache.items():
            if value is not None:
                raise NotImplementedError(
                    f"FlashAttention-3 _flash_attn_forward: {name}= with cu_seqlens_k is not supported "
                    "by flashport's drop-in"
                )
        result, lse = fa3.flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
            qv=qv, attention_chunk=attention_chunk, return_attn_probs=True, **band, **fp8,
        )  # fmt: skip
        accumulators = fa3_kvcache.returned(result, lse)[2:]
    else:
        if seqused_q is not None:
            raise NotImplementedError(
                "FlashAttention-3 _flash_attn_forward: seqused_q= without cu_seqlens_k is not supported "
                "by flashport's drop-in"
            )
        result, lse, *accumulators = fa3.flash_attn_with_kvcache(
            q, k, v, k=k_new, v=v_new, qv=qv, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
            cache_seqlens=seqused_k, cache_batch_idx=kv_batch_idx, cache_leftpad=leftpad_k,
            page_table=page_table, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k_new=cu_seqlens_k_new,
            max_seqlen_q=max_seqlen_q, rotary_seqlens=seqlens_rotary, attention_chunk=attention_chunk,
            rotary_interleaved=rotary_interleaved, return_softmax_lse=True, **band, **fp8,
        )  # fmt: skip
    if out is not None:
        out.copy_(result)
        result = out
    return (result, lse, *accumulators)


def _backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    sequed_q=None,
    sequed_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    dq=None,
    dk=None,
    dv=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    deterministic=False,
    sink_token_length=0,
    **tuning,
):
    """Every build's backward, by FA3's parameter names, on FA2's private backward drop-ins;
    returns ``softmax_d``."""
    for name, value in dict(
        sequed_q=sequed_q, sequed_k=sequed_k, sink_token_length=sink_token_length
    ).items():
        if value:
            raise NotImplementedError(f"FlashAttention-3 {name}= is not supported by flashport's drop-in")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    left, right = window_size
    tail = dict(
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        window_size_left=left,
        window_size_right=right,
        softcap=softcap,
        alibi_slopes=None,
        deterministic=deterministic,
    )
    grads = (dout, q, k, v, out, softmax_lse, dq, dk, dv)
    if cu_seqlens_k is None:
        return private._flash_attn_backward(*grads, **tail)
    varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return private._flash_attn_varlen_backward(*grads, *varlen, **tail)


def _build(kernel, name, parameters, returns_grads=False):
    """The build of FA3's ``name`` whose signature is ``parameters`` (:func:`.core.with_signature`),
    on ``kernel``: ``window_size_left``/``_right`` become ``window_size``, ``out_`` ``out`` and
    ``is_causal`` ``causal``; ``returns_grads``: the backward returns ``(dq, dk, dv, softmax_d)``."""

    def build(**given):
        if "window_size_left" in given:
            given["window_size"] = (given.pop("window_size_left"), given.pop("window_size_right"))
        if "out_" in given:
            given["out"] = given.pop("out_")
        if "is_causal" in given:
            given["causal"] = given.pop("is_causal")
        result = kernel(**given)
        return (given["dq"], given["dk"], given["dv"], result) if returns_grads else result

    date = name.rpartition("_v")[2].replace("_", "-") if "_v20" in name else "2025-11-21"
    build.__name__ = build.__qualname__ = name
    build.__doc__ = f"FlashAttention-3's ``{name.partition('_v20')[0]}`` as its build of {date} has it."
    build.__module__ = __name__
    return with_signature(parameters, _DEFAULTS)(build)


_TENSORS = "k_new v_new"
_VARLEN = "cu_seqlens_q cu_seqlens_k cu_seqlens_k_new seqused_q seqused_k max_seqlen_q max_seqlen_k"
_CACHE = "page_table kv_batch_idx leftpad_k rotary_cos rotary_sin"
_FP8 = "q_descale k_descale v_descale softmax_scale causal"
_TUNING = "softcap rotary_interleaved"

_flash_attn_forward_v2025_01_07 = _build(
    _forward,
    "_flash_attn_forward_v2025_01_07",
    f"q k v {_TENSORS} out {_VARLEN} {_CACHE} {_FP8} | window_size sink_token_length {_TUNING} "
    "num_splits pack_gqa sm_margin",
)
_flash_attn_forward_v2025_02_07 = _build(
    _forward,
    "_flash_attn_forward_v2025_02_07",
    f"q k v {_TENSORS} qv out {_VARLEN} {_CACHE} {_FP8} | window_size sink_token_length {_TUNING} "
    "num_splits pack_gqa sm_margin",
)
_flash_attn_forward_v2025_03_01 = _build(
    _forward,
    "_flash_attn_forward_v2025_03_01",
    f"q k v {_TENSORS} qv out {_VARLEN} {_CACHE} {_FP8} | window_size {_TUNING} num_splits pack_gqa sm_margin",
)
_flash_attn_forward_v2025_03_15 = _build(
    _forward,
    "_flash_attn_forward_v2025_03_15",
    f"q k v {_TENSORS} qv out {_VARLEN} {_CACHE} {_FP8} | window_size {_TUNING} scheduler_metadata "
    "num_splits pack_gqa sm_margin",
)
_flash_attn_forward_v2025_03_21 = _build(
    _forward,
    "_flash_attn_forward_v2025_03_21",
    f"q k v {_TENSORS} qv out {_VARLEN} {_CACHE} seqlens_rotary {_FP8} | window_size {_TUNING} "
    "scheduler_metadata num_splits pack_gqa sm_margin",
)
_flash_attn_forward_v2025_04_10 = _build(
    _forward,
    "_flash_attn_forward_v2025_04_10",
    f"q k v {_TENSORS} qv out {_VARLEN} {_CACHE} seqlens_rotary {_FP8} | window_size attention_chunk "
    f"{_TUNING} scheduler_metadata num_splits pack_gqa sm_margin",
)
_flash_attn_forward_v2025_07_16 = _build(
    _forward,
    "_flash_attn_forward_v2025_07_16",
    f"q k v {_TENSORS} qv out {_VARLEN} {_CACHE} seqlens_rotary {_FP8} | window_size_left "
    f"window_size_right attention_chunk {_TUNING} scheduler_metadata num_splits pack_gqa sm_margin",
)
_flash_attn_forward_v2025_08_06 = _build(
    _forward,
    "_flash_attn_forward_v2025_08_06",
    f"q k v | {_TENSORS} qv out {_VARLEN} {_CACHE} seqlens_rotary {_FP8} window_size_left "
    f"window_size_right attention_chunk {_TUNING} scheduler_metadata num_splits pack_gqa sm_margin",
)
_flash_attn_forward = _build(
    _forward,
    "_flash_attn_forward",
    f"q k v | {_TENSORS} qv out_ {_VARLEN} {_CACHE} seqlens_rotary {_FP8} window_size_left "
    f"window_size_right attention_chunk {_TUNING} scheduler_metadata num_splits pack_gqa sm_margin",
)

_GRADS = "dout q k v out softmax_lse"
_BACK_VARLEN = "cu_seqlens_q cu_seqlens_k sequed_q sequed_k max_seqlen_q max_seqlen_k"
_flash_attn_backward_v2025_01_07 = _build(
    _backward,
    "_flash_attn_backward_v2025_01_07",
    f"{_GRADS} {_BACK_VARLEN} dq dk dv softmax_scale causal | window_size sink_token_length softcap "
    "deterministic sm_margin",
    returns_grads=True,
)
_flash_attn_backward_v2025_03_01 = _build(
    _backward,
    "_flash_attn_backward_v2025_03_01",
    f"{_GRADS} {_BACK_VARLEN} dq dk dv softmax_scale causal | window_size softcap deterministic sm_margin",
    returns_grads=True,
)
_flash_attn_backward_v2025_07_16 = _build(
    _backward,
    "_flash_attn_backward_v2025_07_16",
    f"{_GRADS} {_BACK_VARLEN} dq dk dv softmax_scale is_causal | window_size_left window_size_right "
    "softcap deterministic sm_margin",
    returns_grads=True,
)
_flash_attn_backward_v2025_07_24 = _build(
    _backward,
    "_flash_attn_backward_v2025_07_24",
    f"{_GRADS} {_BACK_VARLEN} dq dk dv softmax_scale is_causal | window_size_left window_size_right "
    "softcap deterministic sm_margin",
)
_flash_attn_backward = _build(
    _backward,
    "_flash_attn_backward",
    f"{_GRADS} | {_BACK_VARLEN} dq dk dv softmax_scale is_causal window_size_left window_size_right "
    "softcap deterministic sm_margin",
)
