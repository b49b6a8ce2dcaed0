"""The ``pallas_tpu`` and ``pallas_tpu_interpret`` backends: flashport's own Pallas TPU flash attention.

Both run the same kernels (:mod:`~flashport.kernels.backends.pallas_tpu.forward`,
:mod:`~flashport.kernels.backends.pallas_tpu.backward`); ``pallas_tpu_interpret`` runs them in the TPU interpreter
(``interpret=pltpu.InterpretParams()``) on CPU for tests and debugging and is never picked by
``auto``.

What the package adds around the kernels:

* padding: sequences to whole blocks (padded keys are hidden by a position test inside the kernel,
  never by an O(S²) bias) and head dims to 128 lanes;
* a ``custom_vjp``: forward saves ``out`` and ``lse`` (O(S)); backward runs the dK/dV and dQ kernels;
* dropout: the per-(batch, query head) seeds ``t_bh`` of :mod:`~flashport.kernels.semantics.dropout` as a
  scalar-prefetch table; the kernels hash positions into the keep-mask tile by tile (never stored);
* sharding: a ``pallas_call`` cannot be partitioned by GSPMD/Shardy, so each kernel call is wrapped in
  ``custom_partitioning`` that runs it per shard over the batch and head dims (sequence and head_dim
  are gathered). Users pass sharded arrays and never write a ``shard_map``.

Options (``registry.use("pallas_tpu", block_q=512, ...)``): ``generation``, ``read_bshd`` (BSHD
callers: ``True`` always / ``False`` never read the caller's arrays directly; default: the byte model
of :mod:`~flashport.kernels.backends.pallas_tpu.layout`) and the fields of
:class:`~flashport.kernels.backends.pallas_tpu.blocks.BlockSizes`; see ``kernels/README.md``.

Modules: ``backend`` (padding, ``custom_vjp``, registration), ``forward`` and ``backward`` (the
kernels), ``specs`` (their BlockSpecs: one builder per grid order), ``tiling`` (geometry, the
scalar-prefetch ``Tables``, in-tile masks and dropout), ``classify`` (per-tile classes: fully visible
tiles skip the mask), ``counting`` (instrumentation: tiles per class, mask ops, K/V fetches),
``blocks`` (block sizes per generation), ``layout`` (token-major or heads-major operands by default),
``sharding`` (per-shard ``custom_partitioning``), ``platform`` (TPU-only lowering for multi-platform
export).
"""

from flashport.kernels.backends.pallas_tpu.backend import (
    Config,
    count_visited_tiles,
    pallas_tpu_attention,
    pallas_tpu_interpret_attention,
)

__all__ = ["Config", "count_visited_tiles", "pallas_tpu_attention", "pallas_tpu_interpret_attention"]
