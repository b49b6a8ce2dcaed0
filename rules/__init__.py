"""flashport.rules: one rule module per GPU attention source API, plus the registry.

``RULE_MODULES`` lists the rule modules in catalogue order; importing them fills
:data:`flashport.rules.base.REGISTRY`. Rule modules import only libcst (never jax or torch), so the CLI
stays fast.
"""

from __future__ import annotations

import importlib

from flashport.rules.base import REGISTRY, Rule

RULE_MODULES = (
    "fpa001_flash_attn_func",
    "fpa002_flash_attn_qkvpacked_func",
    "fpa003_flash_attn_kvpacked_func",
    "fpa004_flash_attn_varlen_func",
    "fpa005_flash_attn_varlen_qkvpacked_func",
    "fpa006_flash_attn_varlen_kvpacked_func",
    "fpa007_flash_attn_with_kvcache",
    "fpa008_flash_attn_internal",
    "fpa009_flash_attn_bert_padding",
    "fpa010_fa3_flash_attn_func",
    "fpa011_fa3_flash_attn_varlen_func",
    "fpa012_fa3_flash_attn_with_kvcache",
    "fpa013_fa4_flash_attn_func",
    "fpa014_fa4_flash_attn_varlen_func",
    "fpa015_flash_attn_rotary",
    "fpa101_torch_sdpa",
    "fpa102_sdpa_backend_selector",
    "fpa110_xformers_memory_efficient_attention",
    "fpa111_xformers_attn_bias",
    "fpa201_jax_nn_dpa_cudnn",
    "fpa202_cudnn_fused_attention",
    "fpa203_pallas_gpu_mha",
    "fpa204_pallas_gpu_decode",
    "fpa205_flash_attn_jax_mha",
    "fpa206_flash_attn_jax_varlen",
    "fpa207_keras_dpa",
    "fpa208_te_jax_dpa",
    "fpa209_te_jax_fused_attn",
    "fpa901_attn_implementation_config",
    "fpa902_use_flash_attention_2",
    "fpa903_maxtext_attention_config",
    "fpa904_nvte_fused_attn_env",
    "fpa905_transformers_attn_implementation",
)

_loaded = False


def all_rules() -> list[type[Rule]]:
    """Every registered rule class, sorted by code."""
    global _loaded
    if not _loaded:
        for name in RULE_MODULES:
            importlib.import_module(f"flashport.rules.{name}")
        _loaded = True
    return [REGISTRY[code] for code in sorted(REGISTRY)]


def get(code: str) -> type[Rule]:
    """The rule with this code or kebab name (case-insensitive).

    Raises:
      KeyError: naming the known codes when nothing matches.
    """
    wanted = code.strip().upper()
    for rule in all_rules():
        if rule.CODE == wanted or rule.NAME.upper() == wanted:
            return rule
    raise KeyError(f"unknown rule {code!r}; known: {', '.join(r.CODE for r in all_rules())}")


def select(select: list[str] | None = None, ignore: list[str] | None = None) -> list[type[Rule]]:
    """Rules chosen by code prefixes (``FPA0`` = every flash-attn rule; ``ALL``), minus ``ignore``.

    Raises:
      ValueError: for a selector that matches no rule (likely a typo).
    """
    rules = all_rules()

    def matches(rule, selector):
        selector = selector.strip().upper()
        return selector == "ALL" or rule.CODE.startswith(selector) or rule.NAME.upper() == selector

    for selector in (select or []) + (ignore or []):
        if not any(matches(rule, selector) for rule in rules):
            raise ValueError(
                f"rule selector {selector!r} matches no rule; known: {', '.join(r.CODE for r in rules)}"
            )
    chosen = [r for r in rules if not select or any(matches(r, s) for s in select)]
    return [r for r in chosen if not any(matches(r, s) for s in (ignore or []))]
