"""The manifest facts a rule leaves to :func:`flashport.rules.base.register` and to the API
catalogue: what is derived matches what a rule would have had to write out (upstream's names and
signatures, written here by hand from flash-attn's ``flash_attn_interface.py``)."""

from __future__ import annotations

import pytest

from flashport.rules import get
from flashport.rules.base import Rule, _derive_manifest


def _rule(module: str, **attributes) -> type[Rule]:
    """A rule class as if defined in ``module`` (not registered)."""
    return type("Probe", (Rule,), {"__module__": module, **attributes})


def test_a_flash_attn_rule_gets_api_framework_triggers_and_gpu_modules():
    rule = _rule(
        "flashport.rules.flash_attn.fpa099_probe",
        SOURCES=("flash_attn.ops.thing", "flash_attn.thing", "hopper.other.thing_2"),
    )
    _derive_manifest(rule)
    assert rule.API == "flash_attn.ops.thing"
    assert rule.FRAMEWORK == "torch"
    assert rule.TRIGGERS == (b"thing", b"thing_2")
    assert rule.GPU_MODULES == ("flash_attn", "hopper")


def test_a_jax_rule_keeps_its_gpu_modules_its_own():
    rule = _rule("flashport.rules.jax.fpa299_probe", SOURCES=("jax.nn.thing",))
    _derive_manifest(rule)
    assert (rule.FRAMEWORK, rule.GPU_MODULES, rule.TRIGGERS) == ("jax", (), (b"thing",))


def test_strings_are_triggers_and_config_rules_name_their_framework():
    rule = _rule("flashport.rules.config.fpa999_probe", STRINGS=("flash_attention_2",))
    _derive_manifest(rule)
    assert (rule.FRAMEWORK, rule.TRIGGERS, rule.API) == ("", (b"flash_attention_2",), "")


def test_what_a_rule_sets_is_kept():
    rule = _rule(
        "flashport.rules.xformers.fpa199_probe",
        API="xformers.ops.thing (all forms)",
        FRAMEWORK="jax",
        SOURCES=("xformers.ops.thing",),
        TRIGGERS=(b"xformers",),
        GPU_MODULES=("xformers.ops",),
    )
    _derive_manifest(rule)
    assert (rule.API, rule.FRAMEWORK, rule.TRIGGERS, rule.GPU_MODULES) == (
        "xformers.ops.thing (all forms)",
        "jax",
        (b"xformers",),
        ("xformers.ops",),
    )


@pytest.mark.parametrize(
    ("code", "leading", "required", "fa1"),
    [
        ("FPA001", ("q", "k", "v"), None, None),
        ("FPA002", ("qkv",), None, None),
        ("FPA003", ("q", "kv"), None, None),
        (
            "FPA004",
            ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"),
            5,
            "flash_attn_unpadded_func",
        ),
        ("FPA005", ("qkv", "cu_seqlens", "max_seqlen"), 2, "flash_attn_unpadded_qkvpacked_func"),
        (
            "FPA006",
            ("q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"),
            4,
            "flash_attn_unpadded_kvpacked_func",
        ),
    ],
)
def test_dense_and_varlen_rules_take_flash_attns_leading_parameters(code, leading, required, fa1):
    rule = get(code)
    function = rule.API.rsplit(".", 1)[-1]
    expected = (f"flash_attn.{function}", f"flash_attn.flash_attn_interface.{function}")
    if fa1:
        expected += (f"flash_attn.flash_attn_interface.{fa1}",)
    assert rule.SOURCES == expected
    assert rule.LEADING == leading
    assert getattr(rule, "REQUIRED", None) == required


def test_kvcache_rules_take_the_keywords_after_the_caches():
    fa2 = (
        "rotary_cos rotary_sin cache_seqlens cache_batch_idx cache_leftpad block_table softmax_scale causal "
        "window_size softcap rotary_interleaved alibi_slopes num_splits return_softmax_lse"
    )
    fa3 = (
        "qv rotary_cos rotary_sin cache_seqlens cache_batch_idx cache_leftpad page_table cu_seqlens_q "
        "cu_seqlens_k_new max_seqlen_q rotary_seqlens q_descale k_descale v_descale softmax_scale causal "
        "window_size attention_chunk softcap rotary_interleaved scheduler_metadata num_splits pack_gqa "
        "sm_margin return_softmax_lse"
    )
    assert get("FPA007").KEYWORDS == tuple(fa2.split())
    assert get("FPA012").KEYWORDS == tuple(fa3.split())
