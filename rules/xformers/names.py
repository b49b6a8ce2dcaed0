"""Names shared by the xformers rules (FPA110, FPA111), so that neither rule imports the other."""

ATTENTION_PREFIX = "memory_efficient_attention"

UNSUPPORTED = (
    "BlockDiagonalPaddedKeysMask",
    "BlockDiagonalCausalWithOffsetPaddedKeysMask",
    "BlockDiagonalGappyKeysMask",
    "BlockDiagonalCausalWithOffsetGappyKeysMask",
    "PagedBlockDiagonalPaddedKeysMask",
    "PagedBlockDiagonalCausalWithOffsetPaddedKeysMask",
    "PagedBlockDiagonalGappyKeysMask",
    "PagedBlockDiagonalCausalWithOffsetGappyKeysMask",
)
"""Padded, paged and gappy block masks: layouts flashport cannot represent."""
