"""Helpers shared by several rule families: value references, where a node sits, signatures, literals and
call building."""
