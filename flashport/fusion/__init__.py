"""The jaxpr attention-fusion pass: :func:`fuse_attention` and :func:`find_attention`.

Importing this subpackage does not import jax; the pass lives in :mod:`.fuse`.
"""
