"""Masking and score semantics every backend shares: visibility, block ranges, mods, dropout, padding, layouts."""
