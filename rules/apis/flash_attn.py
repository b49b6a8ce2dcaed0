"""flash-attn's APIs: FA1/FA2 public functions and private kernels, ``bert_padding``, FA3, FA4.

Sources: flash-attn's ``flash_attn/flash_attn_interface.py`` at every ``v2.*`` tag (FA2), tag
v1.0.9 (FA1), ``hopper/flash_attn_interface.py`` after 2025-08-29 (FA3, versioned by commit date),
``flash_attn/cute/interface.py`` (FA4).
"""

from __future__ import annotations

from typing import Any

from flashport.rules.apis.model import (
    VAR_KEYWORD,
    Api,
    DropIn,
    Param,
    Params,
    Version,
    keyword_only,
    one_release,
    pad,
    params,
)

COMPAT = "flashport.integrations.flash_attn_compat"
PRIVATE = "flashport.integrations.flash_attn_private"
BERT_PADDING = "flashport.integrations.bert_padding"
FA3 = "flashport.integrations.flash_attn3_compat"
FA4 = "flashport.integrations.flash_attn4_compat"
ROTARY = "flashport.integrations.rotary"
CROSS_ENTROPY = "flashport.integrations.cross_entropy"
DISTRIBUTED = "flashport.integrations.distributed"

MODULES = ("flash_attn.", "flash_attn.flash_attn_interface.")  # FA2's public import paths
FA2_RELEASES: tuple[Version, ...] = ((2, 6, 0), (2, 7, 0), (2, 8, 3))  # the drop-ins' (2.8.3's) signature
FA1_RELEASE: Version = (1, 0, 9)

# The parameters after the tensors (and cu_seqlens/max_seqlen) of FA2's public functions, by the
# release that last changed them: window_size 2.3, alibi_slopes and deterministic 2.4, softcap 2.6
# (inserted before alibi_slopes).
FA2_TAILS: tuple[tuple[Version, tuple[str, ...]], ...] = (
    ((2, 0), ("dropout_p", "softmax_scale", "causal", "return_attn_probs")),
    ((2, 3), ("dropout_p", "softmax_scale", "causal", "window_size", "return_attn_probs")),
    (
        (2, 4),
        (
            "dropout_p",
            "softmax_scale",
            "causal",
            "window_size",
            "alibi_slopes",
            "deterministic",
            "return_attn_probs",
        ),
    ),
    (
        (2, 6),
        (
            "dropout_p",
            "softmax_scale",
            "causal",
            "window_size",
            "softcap",
            "alibi_slopes",
            "deterministic",
            "return_attn_probs",
        ),
    ),
)
FA2_DEFAULTS = {
    "dropout_p": 0.0,
    "softmax_scale": None,
    "causal": False,
    "window_size": (-1, -1),
    "softcap": 0.0,
    "alibi_slopes": None,
    "deterministic": False,
    "return_attn_probs": False,
}
BLOCK_TABLE: Version = (2, 5, 7)  # flash_attn_varlen_func's block_table=None
FA2_LEADING = {
    "flash_attn_func": ("q", "k", "v"),
    "flash_attn_qkvpacked_func": ("qkv",),
    "flash_attn_kvpacked_func": ("q", "kv"),
    "flash_attn_varlen_func": ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"),
    "flash_attn_varlen_qkvpacked_func": ("qkv", "cu_seqlens", "max_seqlen"),
    "flash_attn_varlen_kvpacked_func": (
        "q",
        "kv",
        "cu_seqlens_q",
        "cu_seqlens_k",
        "max_seqlen_q",
        "max_seqlen_k",
    ),
}
# FA1 (<= 1.0.9) names of the varlen functions (renamed flash_attn_varlen_* in 2.0): dropout_p is
# required and deterministic comes after return_attn_probs.
FA1_NAMES = {
    "flash_attn_varlen_func": "flash_attn_unpadded_func",
    "flash_attn_varlen_qkvpacked_func": "flash_attn_unpadded_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func": "flash_attn_unpadded_kvpacked_func",
}
FA1_LEADING = {fa1: FA2_LEADING[fa2] for fa2, fa1 in FA1_NAMES.items()}
FA2_RETURNS = "out; (out, softmax_lse, S_dmask) with return_attn_probs=True"


def fa2_tail(version: Version) -> tuple[str, ...]:
    """The parameters after the tensors (and cu_seqlens) of FA2's public functions at ``version``."""
    found = FA2_TAILS[0][1]
    for since, tail in FA2_TAILS:
        if pad(version) >= pad(since):
            found = tail
    return found


def _fa2(name: str) -> Api:
    leading = FA2_LEADING[name]
    block_table = name == "flash_attn_varlen_func"
    releases = sorted({since for since, _ in FA2_TAILS} | ({BLOCK_TABLE} if block_table else set()), key=pad)
    signatures = []
    for release in releases:
        defaults = {n: FA2_DEFAULTS[n] for n in fa2_tail(release)}
        if block_table and pad(release) >= BLOCK_TABLE:
            defaults["block_table"] = None
        signatures.append((release, params(*leading, **defaults)))
    return Api(
        names=tuple(m + name for m in MODULES),
        signatures=tuple(signatures),
        returns=FA2_RETURNS,
        lse="[H, total_q] fp32" if "varlen" in name else "[B, H, Sq] fp32",
        drop_ins=(DropIn(COMPAT, name, FA2_RELEASES),),
    )


def _fa1(name: str) -> Api:
    parameters = params(
        *FA1_LEADING[name],
        "dropout_p",
        softmax_scale=None,
        causal=False,
        return_attn_probs=False,
        deterministic=False,
    )
    return Api(
        names=(f"flash_attn.flash_attn_interface.{name}",),
        signatures=((FA1_RELEASE, parameters),),
        returns=FA2_RETURNS,
        lse="[H, total_q] fp32",
        drop_ins=(DropIn(COMPAT, name, (FA1_RELEASE,)),),
    )


# flash_attn_with_kvcache: 2.8.3's order (cache_leftpad, the last addition, came in 2.6.1).
KVCACHE = Api(
    names=tuple(m + "flash_attn_with_kvcache" for m in MODULES),
    signatures=(
        (
            (2, 6, 1),
            params(
                "q",
                "k_cache",
                "v_cache",
                k=None,
                v=None,
                rotary_cos=None,
                rotary_sin=None,
                cache_seqlens=None,
                cache_batch_idx=None,
                cache_leftpad=None,
                block_table=None,
                softmax_scale=None,
                causal=False,
                window_size=(-1, -1),
                softcap=0.0,
                rotary_interleaved=True,
                alibi_slopes=None,
                num_splits=0,
                return_softmax_lse=False,
            ),
        ),
    ),
    returns="out; (out, softmax_lse) with return_softmax_lse=True",
    lse="[B, H, Sq] fp32",
    drop_ins=(DropIn(COMPAT, "flash_attn_with_kvcache", ((2, 6, 1), (2, 7, 0), (2, 8, 3))),),
)

# --- private kernels (flash_attn.flash_attn_interface._flash_attn_*) -------------------------------
_VARLEN = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
_BACKWARD = ("dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv")
_HEAD = ("dropout_p", "softmax_scale", "causal")
_LATEST = ("window_size_left", "window_size_right", "softcap", "alibi_slopes")

# Per release range [start, end): the drop-ins' name suffix (None: flashport has none), the
# parameters after the tensors (and cu_seqlens/max_seqlen) per function, and how many values the
# forwards return. 2.3 added window_size, 2.4 alibi_slopes (and deterministic in the backward), 2.6
# softcap before alibi_slopes, 2.7 split window_size into left/right and cut the forward's return
# from 8 values to 4 (2.8.3's lists for the last range).
PRIVATE_RELEASES: tuple[tuple[Version, Version | None, str | None, dict[str, tuple[str, ...]], int], ...] = (
    (
        (2, 0, 2),
        (2, 3, 0),
        "_v2_0",
        {
            # flash-attn 2.0.2 - 2.2.5 (2.0.0 / 2.0.1, no rng_state and a 7-value forward, are not listed)
            "_flash_attn_forward": (*_HEAD, "return_softmax"),
            "_flash_attn_backward": (*_HEAD, "rng_state"),
            "_flash_attn_varlen_forward": (*_HEAD, "return_softmax"),
            "_flash_attn_varlen_backward": (*_HEAD, "rng_state"),
        },
        8,
    ),
    (
        (2, 3, 0),
        (2, 4, 0),
        None,
        {
            "_flash_attn_forward": (*_HEAD, "window_size", "return_softmax"),
            "_flash_attn_backward": (*_HEAD, "window_size", "rng_state"),
            "_flash_attn_varlen_forward": (*_HEAD, "window_size", "return_softmax"),
            "_flash_attn_varlen_backward": (*_HEAD, "window_size", "rng_state"),
        },
        8,
    ),
    (
        (2, 4, 0),
        (2, 6, 0),
        "_v2_4",
        {
            "_flash_attn_forward": (*_HEAD, "window_size", "alibi_slopes", "return_softmax"),
            "_flash_attn_backward": (*_HEAD, "window_size", "alibi_slopes", "deterministic", "rng_state"),
            # flash-attn 2.4.2 / 2.5.9 (block_table from 2.5.7)
            "_flash_attn_varlen_forward": (
                *_HEAD,
                "window_size",
                "alibi_slopes",
                "return_softmax",
                "block_table",
            ),
            "_flash_attn_varlen_backward": (
                *_HEAD,
                "window_size",
                "alibi_slopes",
                "deterministic",
                "rng_state",
            ),
        },
        8,
    ),
    (
        (2, 6, 0),
        (2, 7, 0),
        "_v2_6",
        {
            "_flash_attn_forward": (*_HEAD, "window_size", "softcap", "alibi_slopes", "return_softmax"),
            "_flash_attn_backward": (
                *_HEAD,
                "window_size",
                "softcap",
                "alibi_slopes",
                "deterministic",
                "rng_state",
            ),
            # flash-attn 2.6.3's lists; 2.6.0 had no leftpad_k/seqused_k and no defaults
            "_flash_attn_varlen_forward": (
                *_HEAD,
                "window_size",
                "softcap",
                "alibi_slopes",
                "return_softmax",
                "block_table",
                "leftpad_k",
                "seqused_k",
            ),
            "_flash_attn_varlen_backward": (
                *_HEAD,
                "window_size",
                "softcap",
                "alibi_slopes",
                "deterministic",
                "rng_state",
            ),
        },
        8,
    ),
    (
        (2, 7, 0),
        None,
        "",
        {
            "_flash_attn_forward": (*_HEAD, *_LATEST, "return_softmax"),
            "_flash_attn_varlen_forward": (*_HEAD, *_LATEST, "return_softmax")
            + ("block_table", "leftpad_k", "seqused_k", "zero_tensors"),
            "_flash_attn_backward": (*_HEAD, *_LATEST, "deterministic", "rng_state"),
            "_flash_attn_varlen_backward": (*_HEAD, *_LATEST, "deterministic", "rng_state", "zero_tensors"),
        },
        4,
    ),
)
# Private-kernel parameters with a default (every other one is required in these releases), and the
# defaults themselves.
PRIVATE_OPTIONAL = {"rng_state", "zero_tensors", "block_table", "leftpad_k", "seqused_k"}
PRIVATE_OPTIONAL_VARLEN_FORWARD = {
    "window_size",
    "window_size_left",
    "window_size_right",
    "softcap",
    "alibi_slopes",
    "return_softmax",
}
_PRIVATE_DEFAULTS = {
    "rng_state": None,
    "zero_tensors": False,
    "block_table": None,
    "leftpad_k": None,
    "seqused_k": None,
    "window_size": (-1, -1),
    "window_size_left": -1,
    "window_size_right": -1,
    "softcap": 0.0,
    "alibi_slopes": None,
    "return_softmax": False,
}


def private_leading(function: str) -> tuple[str, ...]:
    """The tensors (and ``cu_seqlens``/``max_seqlen``) a private kernel takes before its tail."""
    return (_BACKWARD if function.endswith("_backward") else ("q", "k", "v")) + (
        _VARLEN if "varlen" in function else ()
    )


def _private(function: str) -> Api:
    signatures, drop_ins = [], []
    for start, _end, suffix, tails, _returns in PRIVATE_RELEASES:
        if function not in tails:
            continue
        varlen_defaults = function == "_flash_attn_varlen_forward" and start >= (2, 6, 0)  # 2.6.3 on
        optional = PRIVATE_OPTIONAL | (PRIVATE_OPTIONAL_VARLEN_FORWARD if varlen_defaults else set())
        names = private_leading(function) + tails[function]
        signatures.append(
            (start, tuple(Param(n, _PRIVATE_DEFAULTS[n]) if n in optional else Param(n) for n in names))
        )
        if suffix is not None:
            release = start if suffix else (2, 8, 3)
            drop_ins.append(DropIn(PRIVATE, function + suffix, (release,), exact=False))
    return Api(
        names=(f"flash_attn.flash_attn_interface.{function}",),
        signatures=tuple(signatures),
        returns="forward: 8 values before 2.7, (out, softmax_lse, S_dmask, rng_state) from 2.7",
        lse="[B, H, Sq] fp32 ([H, total_q] for varlen)",
        drop_ins=tuple(drop_ins),
    )


# --- bert_padding ----------------------------------------------------------------------------------
# Unchanged from 2.0.0 to 2.8.3 but for unpad_input; index_first_axis / index_put_first_axis are
# autograd Functions' ``apply``, recorded with their ``forward``'s parameters (less ``ctx``).
PADDING_RELEASES: tuple[Version, ...] = ((2, 0, 0), (2, 8, 3))
BERT_PADDING_APIS = (
    Api(
        names=("flash_attn.bert_padding.index_first_axis",),
        signatures=(((2, 0, 0), params("input", "indices")),),
        drop_ins=(DropIn(BERT_PADDING, "index_first_axis", PADDING_RELEASES),),
    ),
    Api(
        names=("flash_attn.bert_padding.index_put_first_axis",),
        signatures=(((2, 0, 0), params("values", "indices", "first_axis_dim")),),
        drop_ins=(DropIn(BERT_PADDING, "index_put_first_axis", PADDING_RELEASES),),
    ),
    Api(
        names=("flash_attn.bert_padding.pad_input",),
        signatures=(((2, 0, 0), params("hidden_states", "indices", "batch", "seqlen")),),
        drop_ins=(DropIn(BERT_PADDING, "pad_input", PADDING_RELEASES),),
    ),
    Api(  # 2.7 added unused_mask and a fifth return value (seqused)
        names=("flash_attn.bert_padding.unpad_input",),
        signatures=(
            ((2, 0, 0), params("hidden_states", "attention_mask")),
            ((2, 7, 0), params("hidden_states", "attention_mask", unused_mask=None)),
        ),
        returns="(hidden_states, indices, cu_seqlens, max_seqlen_in_batch, seqused) from 2.7 (4 values before)",
        drop_ins=(DropIn(BERT_PADDING, "unpad_input", ((2, 7, 0), (2, 8, 3))),),
    ),
    Api(  # einops' function, which flash_attn.bert_padding imports (and so re-exports)
        names=("flash_attn.bert_padding.rearrange", "einops.rearrange"),
        signatures=(((2, 0, 0), params("tensor", "pattern") + (Param("axes_lengths", kind=VAR_KEYWORD),)),),
        drop_ins=(DropIn(BERT_PADDING, "rearrange", PADDING_RELEASES),),
    ),
)

# flash_attn.layers.rotary (2.8.3)
ROTARY_APIS = (
    Api(
        names=("flash_attn.layers.rotary.apply_rotary_emb", "flash_attn.layers.rotary.apply_rotary_emb_func"),
        signatures=(
            (
                (2, 8, 3),
                params(
                    "x",
                    "cos",
                    "sin",
                    interleaved=False,
                    inplace=False,
                    seqlen_offsets=0,
                    cu_seqlens=None,
                    max_seqlen=None,
                ),
            ),
        ),
        drop_ins=(
            DropIn(ROTARY, "apply_rotary_emb", ((2, 8, 3),)),
            DropIn(ROTARY, "apply_rotary_emb_func", ((2, 8, 3),)),
        ),
    ),
    one_release(  # rotates q and k of a packed qkv in place; returns qkv
        ("flash_attn.layers.rotary.apply_rotary_emb_qkv_",),
        (2, 8, 3),
        params(
            "qkv", "cos", "sin", cos_k=None, sin_k=None, interleaved=False, seqlen_offsets=0, num_heads_q=None
        ),
        ROTARY,
        returns="qkv",
    ),
    one_release(  # rotates kv[:, :, 0] in place; returns kv
        ("flash_attn.layers.rotary.apply_rotary_emb_kv_",),
        (2, 8, 3),
        params("kv", "cos", "sin", interleaved=False, seqlen_offsets=0),
        ROTARY,
        returns="kv",
    ),
    one_release(  # an nn.Module: the constructor's parameters
        ("flash_attn.layers.rotary.RotaryEmbedding",),
        (2, 8, 3),
        params("dim", base=10000.0, interleaved=False, scale_base=None, pos_idx_in_fp32=True, device=None),
        ROTARY,
        returns="the module",
    ),
    one_release(
        ("flash_attn.layers.rotary.RotaryEmbedding.forward",),
        (2, 8, 3),
        params("self", "qkv", kv=None, seqlen_offset=0, max_seqlen=None, num_heads_q=None),
        ROTARY,
        returns="qkv, or (q, kv) when kv is given (rotated in place)",
        drop_in_name="RotaryEmbedding.forward",
    ),
)

# flash_attn.ops.triton.cross_entropy (2.8.3): (losses, z_losses); precomputed_lse is third
CROSS_ENTROPY_APIS = (
    one_release(
        ("flash_attn.ops.triton.cross_entropy.cross_entropy_loss",),
        (2, 8, 3),
        params(
            "logits",
            "labels",
            precomputed_lse=None,
            label_smoothing=0.0,
            logit_scale=1.0,
            lse_square_scale=0.0,
            ignore_index=-100,
            inplace_backward=False,
            process_group=None,
        ),
        CROSS_ENTROPY,
        returns="(losses, z_losses), both [N] fp32",
    ),
)

# flash_attn.utils.distributed (2.8.3): the autograd collectives are Functions' ``apply``, recorded
# with their ``forward``'s parameters (less ``ctx``)
DISTRIBUTED_APIS = tuple(
    one_release(
        (f"flash_attn.utils.distributed.{name}",), (2, 8, 3), parameters, DISTRIBUTED, returns=returns
    )
    for name, parameters, returns in (
        ("all_gather_raw", params("input_", "process_group", async_op=False), "(output, handle)"),
        ("reduce_scatter_raw", params("input_", "process_group", async_op=False), "(output, handle)"),
        ("all_reduce_raw", params("input_", "process_group", async_op=False), "(input_, handle)"),
        ("all_gather", params("input_", "process_group"), "output"),
        ("reduce_scatter", params("input_", "process_group"), "output"),
        ("all_reduce", params("input_", "process_group"), "output"),
    )
)

# --- FA3 (hopper/flash_attn_interface.py; releases are commit dates) --------------------------------
FA3_MODULES = ("flash_attn_interface.", "flash_attn_3.flash_attn_interface.", "hopper.flash_attn_interface.")
FA3_RETURN_CHANGE: Version = (2025, 7, 11)  # flash_attn_func/varlen return out, not (out, lse), from here
FA3_RELEASE: Version = (2025, 8, 29)  # return_attn_probs=False added: the drop-ins' signature
_FA3_TAIL = {
    "qv": None,
    "q_descale": None,
    "k_descale": None,
    "v_descale": None,
    "window_size": (-1, -1),
    "attention_chunk": 0,
    "softcap": 0.0,
    "num_splits": 1,
    "pack_gqa": None,
    "deterministic": False,
    "sm_margin": 0,
    "return_attn_probs": False,
}
_FA3_RETURNS = "out; (out, lse) with return_attn_probs=True ((out, lse) always before 2025-07-11)"


def _fa3(name: str, parameters: Params, **conventions: Any) -> Api:
    """FA3's ``name`` (every FA3 import path) at :data:`FA3_RELEASE`, with its drop-in."""
    return one_release(tuple(m + name for m in FA3_MODULES), FA3_RELEASE, parameters, FA3, **conventions)


FA3_APIS = (
    _fa3(
        "flash_attn_func",
        params("q", "k", "v", softmax_scale=None, causal=False, **_FA3_TAIL),
        returns=_FA3_RETURNS,
        lse="[B, H, Sq] fp32",
        exact=False,
    ),
    _fa3(
        "flash_attn_varlen_func",
        params(
            *FA2_LEADING["flash_attn_varlen_func"],
            seqused_q=None,
            seqused_k=None,
            softmax_scale=None,
            causal=False,
            **_FA3_TAIL,
        ),
        returns=_FA3_RETURNS,
        lse="[H, total_q] fp32",
        exact=False,
    ),
    _fa3(
        "flash_attn_with_kvcache",
        params(
            "q",
            "k_cache",
            "v_cache",
            k=None,
            v=None,
            qv=None,
            rotary_cos=None,
            rotary_sin=None,
            cache_seqlens=None,
            cache_batch_idx=None,
            cache_leftpad=None,
            page_table=None,
            cu_seqlens_q=None,
            cu_seqlens_k_new=None,
            max_seqlen_q=None,
            rotary_seqlens=None,
            q_descale=None,
            k_descale=None,
            v_descale=None,
            softmax_scale=None,
            causal=False,
            window_size=(-1, -1),
            attention_chunk=0,
            softcap=0.0,
            rotary_interleaved=True,
            scheduler_metadata=None,
            num_splits=0,
            pack_gqa=None,
            sm_margin=0,
            return_softmax_lse=False,
        ),
        returns="out; (out, softmax_lse) with return_softmax_lse=True",
        lse="[B, H, Sq] fp32",
    ),
    Api(
        names=tuple(m + "get_scheduler_metadata" for m in FA3_MODULES),
        signatures=(
            (
                (2025, 4, 10),
                params(
                    "batch_size",
                    "max_seqlen_q",
                    "max_seqlen_k",
                    "num_heads_q",
                    "num_heads_kv",
                    "headdim",
                    "cache_seqlens",
                    qkv_dtype="torch.bfloat16",
                    headdim_v=None,
                    cu_seqlens_q=None,
                    cu_seqlens_k_new=None,
                    cache_leftpad=None,
                    page_size=None,
                    max_seqlen_k_new=0,
                    causal=False,
                    window_size=(-1, -1),
                    attention_chunk=0,
                    has_softcap=False,
                    num_splits=0,
                    pack_gqa=None,
                    sm_margin=0,
                ),
            ),
        ),
        returns="scheduler_metadata (the drop-in: None, FA3's 'no precomputed plan')",
        drop_ins=(
            DropIn(
                FA3,
                "get_scheduler_metadata",
                ((2025, 4, 10),),
                deviation="qkv_dtype defaults to None, not torch.bfloat16: the drop-in module imports torch "
                "only when a function runs (the value is not used)",
                signature=params(
                    "batch_size",
                    "max_seqlen_q",
                    "max_seqlen_k",
                    "num_heads_q",
                    "num_heads_kv",
                    "headdim",
                    "cache_seqlens",
                    qkv_dtype=None,
                    headdim_v=None,
                    cu_seqlens_q=None,
                    cu_seqlens_k_new=None,
                    cache_leftpad=None,
                    page_size=None,
                    max_seqlen_k_new=0,
                    causal=False,
                    window_size=(-1, -1),
                    attention_chunk=0,
                    has_softcap=False,
                    num_splits=0,
                    pack_gqa=None,
                    sm_margin=0,
                ),
            ),
        ),
    ),
    # sgl-kernel's build of FA3 as sglang 0.5.23 vendors it (vendor builds of flash_attn_interface
    # copy it): page_table after seqused_k, return_softmax_lse for return_attn_probs, sinks and an
    # out buffer. sgl_kernel.flash_attn's own releases take a subset of these names (max_seqlen_q/k
    # required, no page_table, attention_chunk or sinks), with the same return convention.
    one_release(
        ("sglang.kernels.ops.attention.flash_attention_v3.flash_attn_varlen_func",),
        (0, 5, 23),
        params(
            "q",
            "k",
            "v",
            "cu_seqlens_q",
            "cu_seqlens_k",
            max_seqlen_q=None,
            max_seqlen_k=None,
            seqused_q=None,
            seqused_k=None,
            page_table=None,
            softmax_scale=None,
            causal=False,
            qv=None,
            q_descale=None,
            k_descale=None,
            v_descale=None,
            window_size=(-1, -1),
            attention_chunk=0,
            softcap=0.0,
            num_splits=1,
            pack_gqa=None,
            only_qv=False,
            sm_margin=0,
            return_softmax_lse=False,
            sinks=None,
            out=None,
        ),
        FA3,
        returns="out; (out, softmax_lse, *rest) with return_softmax_lse=True",
        lse="[H, total_q] fp32",
        drop_in_name="sgl_flash_attn_varlen_func",
    ),
    one_release(
        ("sglang.kernels.ops.attention.flash_attention_v3.flash_attn_with_kvcache",),
        (0, 5, 23),
        params(
            "q",
            "k_cache",
            "v_cache",
            k=None,
            v=None,
            qv=None,
            rotary_cos=None,
            rotary_sin=None,
            cache_seqlens=None,
            cache_batch_idx=None,
            cache_leftpad=None,
            page_table=None,
            cu_seqlens_q=None,
            cu_seqlens_k_new=None,
            max_seqlen_q=None,
            rotary_seqlens=None,
            q_descale=None,
            k_descale=None,
            v_descale=None,
            softmax_scale=None,
            causal=False,
            window_size=(-1, -1),
            attention_chunk=None,
            softcap=0.0,
            rotary_interleaved=True,
            scheduler_metadata=None,
            num_splits=0,
            pack_gqa=None,
            only_qv=False,
            sm_margin=0,
            return_softmax_lse=False,
            sinks=None,
            out=None,
        ),
        FA3,
        returns="out; (out, softmax_lse, *rest) with return_softmax_lse=True",
        lse="[B, H, Sq] fp32",
        drop_in_name="sgl_flash_attn_with_kvcache",
    ),
)

# FA3's private kernels (hopper/flash_attn_interface.py), per build: the date its signature first
# appears in FA3's history (the drop-in's suffix; the latest build's drop-in has no suffix) and its
# parameters, written as flashport.integrations.flash_attn.core.with_signature lists them (the names
# after "|" have FA3's defaults, _FA3_PRIVATE_DEFAULTS). The forwards return (out, softmax_lse,
# out_accum, softmax_lse_accum); the backwards (dq, dk, dv, softmax_d) before 2025-07-24, softmax_d
# from then on. FA3's 2024 builds (dense only, a 7-value forward) are not listed.
_FA3_FORWARD_HEAD = "q k v k_new v_new qv out"
_FA3_VARLEN = "cu_seqlens_q cu_seqlens_k cu_seqlens_k_new seqused_q seqused_k max_seqlen_q max_seqlen_k"
_FA3_CACHE = "page_table kv_batch_idx leftpad_k rotary_cos rotary_sin"
_FA3_SCALE = "q_descale k_descale v_descale softmax_scale causal"
_FA3_LATEST_TAIL = (
    "window_size_left window_size_right attention_chunk softcap rotary_interleaved scheduler_metadata "
    "num_splits pack_gqa sm_margin"
)
_FA3_BACKWARD_HEAD = "dout q k v out softmax_lse"
_FA3_BACKWARD_VARLEN = "cu_seqlens_q cu_seqlens_k sequed_q sequed_k max_seqlen_q max_seqlen_k dq dk dv"
FA3_PRIVATE_BUILDS: dict[str, tuple[tuple[Version, str], ...]] = {
    "_flash_attn_forward": (
        (
            (2025, 1, 7),
            f"q k v k_new v_new out {_FA3_VARLEN} {_FA3_CACHE} {_FA3_SCALE} | window_size "
            "sink_token_length softcap rotary_interleaved num_splits pack_gqa sm_margin",
        ),
        (
            (2025, 2, 7),
            f"{_FA3_FORWARD_HEAD} {_FA3_VARLEN} {_FA3_CACHE} {_FA3_SCALE} | window_size "
            "sink_token_length softcap rotary_interleaved num_splits pack_gqa sm_margin",
        ),
        (
            (2025, 3, 1),
            f"{_FA3_FORWARD_HEAD} {_FA3_VARLEN} {_FA3_CACHE} {_FA3_SCALE} | window_size softcap "
            "rotary_interleaved num_splits pack_gqa sm_margin",
        ),
        (
            (2025, 3, 15),
            f"{_FA3_FORWARD_HEAD} {_FA3_VARLEN} {_FA3_CACHE} {_FA3_SCALE} | window_size softcap "
            "rotary_interleaved scheduler_metadata num_splits pack_gqa sm_margin",
        ),
        (
            (2025, 3, 21),
            f"{_FA3_FORWARD_HEAD} {_FA3_VARLEN} {_FA3_CACHE} seqlens_rotary {_FA3_SCALE} | window_size "
            "softcap rotary_interleaved scheduler_metadata num_splits pack_gqa sm_margin",
        ),
        (
            (2025, 4, 10),
            f"{_FA3_FORWARD_HEAD} {_FA3_VARLEN} {_FA3_CACHE} seqlens_rotary {_FA3_SCALE} | window_size "
            "attention_chunk softcap rotary_interleaved scheduler_metadata num_splits pack_gqa sm_margin",
        ),
        (
            (2025, 7, 16),
            f"{_FA3_FORWARD_HEAD} {_FA3_VARLEN} {_FA3_CACHE} seqlens_rotary {_FA3_SCALE} | {_FA3_LATEST_TAIL}",
        ),
        (
            (2025, 8, 6),
            f"q k v | k_new v_new qv out {_FA3_VARLEN} {_FA3_CACHE} seqlens_rotary {_FA3_SCALE} "
            f"{_FA3_LATEST_TAIL}",
        ),
        (
            (2025, 11, 21),
            f"q k v | k_new v_new qv out_ {_FA3_VARLEN} {_FA3_CACHE} seqlens_rotary {_FA3_SCALE} "
            f"{_FA3_LATEST_TAIL}",
        ),
    ),
    "_flash_attn_backward": (
        (
            (2025, 1, 7),
            f"{_FA3_BACKWARD_HEAD} {_FA3_BACKWARD_VARLEN} softmax_scale causal | window_size "
            "sink_token_length softcap deterministic sm_margin",
        ),
        (
            (2025, 3, 1),
            f"{_FA3_BACKWARD_HEAD} {_FA3_BACKWARD_VARLEN} softmax_scale causal | window_size softcap "
            "deterministic sm_margin",
        ),
        (
            (2025, 7, 16),
            f"{_FA3_BACKWARD_HEAD} {_FA3_BACKWARD_VARLEN} softmax_scale is_causal | window_size_left "
            "window_size_right softcap deterministic sm_margin",
        ),
        (
            (2025, 7, 24),
            f"{_FA3_BACKWARD_HEAD} {_FA3_BACKWARD_VARLEN} softmax_scale is_causal | window_size_left "
            "window_size_right softcap deterministic sm_margin",
        ),
        (
            (2025, 8, 6),
            f"{_FA3_BACKWARD_HEAD} | {_FA3_BACKWARD_VARLEN} softmax_scale is_causal window_size_left "
            "window_size_right softcap deterministic sm_margin",
        ),
    ),
}
FA3_PRIVATE_GRADS_RETURNED: Version = (2025, 7, 24)  # the backward returns softmax_d alone from here
_FA3_PRIVATE_DEFAULTS: dict[str, Any] = {
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


def fa3_private_params(text: str) -> Params:
    """The parameters of a :data:`FA3_PRIVATE_BUILDS` list (FA3's defaults after ``|``; None
    where the table has none)."""
    head, _, tail = text.partition("|")
    return tuple(Param(n) for n in head.split()) + tuple(
        Param(n, _FA3_PRIVATE_DEFAULTS.get(n)) for n in tail.split()
    )


def fa3_private_drop_in(function: str, build: Version) -> str:
    """The drop-in's name for ``function`` of FA3's build ``build`` (the latest build's has none)."""
    if build == FA3_PRIVATE_BUILDS[function][-1][0]:
        return function
    return f"{function}_v{build[0]}_{build[1]:02d}_{build[2]:02d}"


def _fa3_private(function: str) -> Api:
    builds = FA3_PRIVATE_BUILDS[function]
    return Api(
        # flashattn_hopper: the package name of FA3's builds before 2025-01-07
        names=tuple(m + function for m in (*FA3_MODULES, "flashattn_hopper.flash_attn_interface.")),
        signatures=tuple((build, fa3_private_params(text)) for build, text in builds),
        returns=(
            "(out, softmax_lse, out_accum, softmax_lse_accum)"
            if function.endswith("forward")
            else "(dq, dk, dv, softmax_d) before 2025-07-24, softmax_d from then on"
        ),
        lse="[B, H, Sq] fp32 ([H, total_q] for varlen)",
        drop_ins=tuple(DropIn(FA3, fa3_private_drop_in(function, build), (build,)) for build, _ in builds),
    )


FA3_PRIVATE_APIS = tuple(_fa3_private(function) for function in FA3_PRIVATE_BUILDS)

# --- FA4 (flash_attn.cute; PyPI flash-attn-4 betas) -----------------------------------------------
FA4_RELEASE: Version = (4, 0, 0)
_FA4_DEVIATION = (
    "FA4's parameters moved between betas (its 4th is qv): the drop-in takes everything after v by "
    "keyword, names the ones it implements and accepts the rest through **extra (tuning keywords are "
    "ignored, any other feature passed raises NotImplementedError)"
)
_FA4_OWN = keyword_only(
    softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0, return_lse=False
)


def _fa4(name: str, signatures: tuple[tuple[Version, Params], ...], lse: str, own: Params = ()) -> Api:
    """FA4's ``name`` (both import paths) with its drop-in, which takes ``q, k, v``, then ``own``
    and the keywords it implements by name, the rest through ``**extra`` (:data:`_FA4_DEVIATION`)."""
    drop_in = DropIn(
        FA4,
        name,
        (FA4_RELEASE,),
        exact=False,
        deviation=_FA4_DEVIATION,
        signature=params("q", "k", "v") + own + _FA4_OWN + (Param("extra", kind=VAR_KEYWORD),),
    )
    return Api(
        names=(f"flash_attn.cute.{name}", f"flash_attn.cute.interface.{name}"),
        signatures=signatures,
        returns="out; (out, lse) with return_lse=True",
        lse=lse,
        drop_ins=(drop_in,),
    )


FA4_APIS = (
    _fa4(
        "flash_attn_func",
        (
            (
                FA4_RELEASE,
                params(
                    "q",
                    "k",
                    "v",
                    qv=None,
                    gather_kv_indices=None,
                    softmax_scale=None,
                    causal=False,
                    window_size=(None, None),
                    learnable_sink=None,
                    softcap=0.0,
                    num_splits=1,
                    pack_gqa=None,
                    deterministic=False,
                    score_mod=None,
                    score_mod_bwd=None,
                    mask_mod=None,
                    aux_tensors=None,
                    aux_scalars=None,
                    block_sparse_tensors=None,
                    block_sparse_tensors_bwd=None,
                    return_lse=False,
                ),
            ),
        ),
        "[B, H, Sq] fp32",
    ),
    # its upstream parameter list changed between betas and is not recorded here
    _fa4(
        "flash_attn_varlen_func", (), "[H, total_q] fp32", keyword_only(cu_seqlens_q=None, cu_seqlens_k=None)
    ),
)

PRIVATE_FUNCTIONS = (
    "_flash_attn_forward",
    "_flash_attn_varlen_forward",
    "_flash_attn_backward",
    "_flash_attn_varlen_backward",
)
APIS: tuple[Api, ...] = (
    tuple(_fa2(name) for name in FA2_LEADING)
    + (KVCACHE,)
    + tuple(_fa1(name) for name in FA1_LEADING)
    + tuple(_private(name) for name in PRIVATE_FUNCTIONS)
    + BERT_PADDING_APIS
    + ROTARY_APIS
    + CROSS_ENTROPY_APIS
    + DISTRIBUTED_APIS
    + FA3_APIS
    + FA3_PRIVATE_APIS
    + FA4_APIS
)

# flashport's own API next to the drop-ins (no flash-attn counterpart).
OWN_API = {
    COMPAT: frozenset(("kvcache_attention", "kvcache_mask")),
    FA4: frozenset(("fa4_window",)),
    # the drop-ins' shared conversions of flash-attn's conventions
    "flashport.integrations.flash_attn_core": frozenset(
        ("alibi_bias", "flash_attn_window", "kvcache_mask", "lse_like_flash_attn")
    ),
}
