"""Sequence-parallel (ring) attention: ``flashport.ring_attention``.

The sequence dim of query/key/value is sharded over one mesh axis of ``n`` devices. Inside a
``shard_map`` each shard keeps its queries while the K/V chunks (with their kv segment ids) travel
around the ring with ``ppermute``: at step ``t`` shard ``r`` holds the K/V of shard ``(r − t) mod n``
(the next chunk's send is issued before the step's compute; the last step sends nothing). Each step
folds the visiting keys into the shard's running softmax state, which is exactly softmax attention
over the union of the key chunks. No device ever holds more than two K/V chunks (the one it
computes on and the one arriving), so per-device memory is O(S / n).

The per-step work is an *engine* (:func:`engine_for`):

* ``backend="blockwise"``: :mod:`flashport.kernels.parallel.ring_blockwise` runs the online softmax tile by
  tile on the user's layout and carries the running ``(out, lse)`` through the tiles in place (no
  per-step output, no merge pass, no layout transposes);
* any other backend (and ``auto``): :mod:`flashport.kernels.parallel.ring_backend` calls the backend once per
  step with ``return_lse=True`` and merges the partial results through the log-sum-exp.

Positions: a shard's queries and keys are pieces of the global sequence (one piece per shard in the
``"contiguous"`` layout, two in ``"zigzag"``, see :mod:`flashport.kernels.semantics.seq_layout`). For a query
piece starting at global position ``q0`` and a key piece at ``k0``, the contract's condition
``j_glob <= i_glob + offset (+ window)`` is the same condition on local positions with
``offset' = offset + q0 − k0``; causal, windows, bottom-right alignment (``offset = Sk − Sq`` of the
*global* lengths) and segment ids keep their meaning. Because ``q0 − k0`` depends on the traced shard
index, every (shard, piece, visiting shard, piece) combination is classified ahead of time from
:func:`flashport.kernels.semantics.block_ranges.key_range` as *empty* (nothing visible: out 0, lse −inf, no compute), *full*
(every key visible: no positional masking) or *partial* (its own offset): the :class:`Plan`, whose
static table the engines index with the traced shard indices.

Gradients: a ``custom_vjp`` runs the ring backward from the forward's residuals (its ``out`` and
``lse``), with no forward recomputed: a flash backward given the *global* lse computes the global
probabilities restricted to the visiting keys, so each step's dQ/dK/dV contributions are exact.
dQ stays local; dK/dV (f32) travel around the ring with their K/V and take one last hop home.
Training memory stays O(S / n) per device too.

``score_mod`` / ``mask_mod`` (and a ``block_mask``'s mask_mod) see global indices: every step's
backend call gets the mods shifted by its pieces' global starts (and, with ``batch_axis`` /
``head_axis``, the shard's first batch / query head), so ALiBi, relative-bias tables and document
masks keep their meaning in both layouts. Such calls always take the backend-call engine (the
blockwise backend then runs per step). A ``mask_mod`` is also classified at the pieces once per
call (:func:`piece_classes`): a step whose (query piece, key piece) pair it leaves empty for all of
the shard's batches and heads takes the empty branch (no backend call, forward or backward), so a
document mask skips whole ring steps as well as tiles inside them. The gradients of the arrays a
score_mod closes over are summed over the steps and, by the ``shard_map`` (they enter replicated),
over the shards.

Not supported (clear errors): ``bias`` and ``mask`` arrays (they span the key sequence; express
document masking with segment ids), and dropout (the contract's dropout hash takes positions in the
arrays a backend receives, and backends take no global position offset yet).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from flashport.kernels.contract import registry
from flashport.kernels.contract.call import PLATFORMS
from flashport.kernels.contract.keywords import SPEC_KEYWORDS, pick, takes_contract_keywords
from flashport.kernels.contract.spec import AttentionSpec, make_spec
from flashport.kernels.contract.validate import prepare, trace_mods
from flashport.kernels.parallel.ring_backend import BackendRing
from flashport.kernels.parallel.ring_blockwise import BlockwiseRing
from flashport.kernels.semantics import block_mask as block_mask_lib
from flashport.kernels.semantics import seq_layout as layouts
from flashport.kernels.semantics.block_ranges import key_range


@takes_contract_keywords()
def ring_attention(
    query,
    key,
    value,
    *,
    mesh,
    axis_name,
    seq_layout: str = "contiguous",
    batch_axis=None,
    head_axis=None,
    backend="auto",
    return_lse=False,
    dropout_rate=0.0,
    dropout_rng=None,
    score_mod=None,
    mask_mod=None,
    block_mask=None,
    **contract,
):
    """``flashport.attention`` with the sequence dim sharded over mesh axis ``axis_name`` (ring attention).

    Takes the *global* arrays (usually already sharded; they are resharded to the ring's layout if
    not) and returns the global output, sharded the same way. All contract keywords keep their
    meaning for the global sequence (see :func:`flashport.attention`).

    Args:
      query, key, value: as in :func:`flashport.attention` (``layout`` BSHD or BHSD). Sq and Sk must
        be multiples of ``n`` (the size of ``axis_name``), or of ``2n`` for ``seq_layout="zigzag"``.
      mesh: a ``jax.sharding.Mesh`` (or ``AbstractMesh``, e.g. for ``jax.export``). Inside a
        ``shard_map`` over ``axis_name`` (with ``check_vma=False``) the arrays are the shard's pieces
        and the ring runs on them directly (the global lengths are ``n`` times theirs).
      axis_name: the mesh axis that shards the sequence; K/V rotate around it.
      seq_layout: ``"contiguous"`` (shard r holds positions [r·S/n, (r+1)·S/n)) or ``"zigzag"``
        (the arrays are stored in :func:`flashport.seq_layout.to_zigzag` order; balances causal work).
        The output (and lse) come back in the same order as the inputs.
      batch_axis, head_axis: optional mesh axes (a name or tuple of names) that also shard the batch
        dim and the head dim (Hq and Hkv must both split evenly); attention is independent across
        them, so they need no communication.
      backend: the backend each ring step runs (``"auto"``, a name, or ``registry.use(...)``); it must
        support ``return_lse`` (every shipped one does). ``"blockwise"`` (with its ``block_q`` /
        ``block_k`` options, rounded down to divisors of the per-shard pieces) runs the ring's own
        tile loop with the running state carried in place, the leanest in memory.
      return_lse: also return the global log-sum-exp, float32 [B, Hq, Sq] (in the layout's order).
      score_mod, mask_mod, block_mask: as in :func:`flashport.attention`, over the global indices
        (natural positions whatever ``seq_layout``; the global batch and query head). Inside a
        ``shard_map`` that also shards the batch or head dim, name it as ``batch_axis`` /
        ``head_axis`` so the mods see global batch / head indices.

    Raises:
      ValueError naming the argument for ``bias``/``mask`` arrays or dropout (not supported by the
      ring), a sequence length that does not split over the axis, an unknown mesh axis, and whatever
      :func:`flashport.attention` raises for the call itself.
    """
    for name in ("bias", "mask"):
        if contract[name] is not None:
            raise ValueError(
                f"ring_attention does not take {name}=: a {name} array spans the key sequence, which the "
                f"ring shards; express document masking with q_segment_ids/kv_segment_ids, or call "
                f"flashport.attention (which gathers the sequence on every shard)"
            )
    if dropout_rate:
        raise ValueError(
            "ring_attention does not support dropout_rate > 0: the contract's dropout mask hashes "
            "global positions and the backends take no position offset yet; use dropout_rate=0.0, or "
            "flashport.attention on gathered arrays"
        )
    (q, k, v, _, _, q_seg, kv_seg, _), call = prepare(query, key, value, return_lse=return_lse, **contract)
    seq_layout_ = seq_layout_check(seq_layout)
    n = _axis_size(mesh, axis_name, "axis_name")
    inside = _inside_shard_map(axis_name)
    if inside:  # the arrays are this shard's pieces: the spec is the global sequence's
        (b, hq, sq, d), (_, hkv, sk, _) = call.q_shape, call.kv_shape
        spec = make_spec((b, hq, n * sq, d), (b, hkv, n * sk, d), **pick(contract, SPEC_KEYWORDS))
        call = dataclasses.replace(call, spec=spec)
    mods = _global_mods(call, score_mod, mask_mod, block_mask, inside, batch_axis, head_axis, mesh)
    if mods is not None:
        call = dataclasses.replace(call, features=call.features | mods.features)
    _axis_size(mesh, batch_axis, "batch_axis")
    hsize = _axis_size(mesh, head_axis, "head_axis")
    for name, length in (("query", call.spec.seq_q), ("key", call.spec.seq_k)):
        parts = n * layouts.pieces(seq_layout_)
        if length % parts or length == 0:
            raise ValueError(
                f"ring_attention: {name}'s sequence length {length} must be a positive multiple of "
                f"{parts} ({n} shards of mesh axis {axis_name!r}"
                f"{' x 2 zigzag pieces' if parts != n else ''}); pad it (e.g. with a padding segment id)"
            )
    if head_axis is not None and not inside and (call.q_shape[1] % hsize or call.kv_shape[1] % hsize):
        raise ValueError(
            f"ring_attention: head_axis {head_axis!r} has size {hsize}, which must divide both the query "
            f"heads ({call.q_shape[1]}) and the kv heads ({call.kv_shape[1]}); use head_axis=None"
        )
    plan = Plan.make(call.spec, n, seq_layout_)
    layout = contract["layout"]
    engine = engine_for(plan, call, backend, layout, mesh, mods=mods, mod_axes=(batch_axis, head_axis))
    run = functools.partial(_ring_shard, engine=engine, axis_name=axis_name)
    consts = () if mods is None else (mods.score_consts, mods.mask_consts)
    if mods is not None and mods.mask is not None:  # which piece pairs the mask_mod leaves empty
        consts = (
            *consts,
            piece_classes(mods, block_mask, _global_shape(call, inside, mesh, batch_axis, head_axis), plan),
        )
    if inside:
        if layout == "BSHD":
            q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
        out, lse = run(q, k, v, q_seg, kv_seg, consts)
        return (out, lse) if return_lse else out
    # The shard_map takes the user's layout: the blockwise engine reads it directly, the others
    # transpose each shard once (the transposes of `prepare` and back cancel in XLA).
    if layout == "BSHD":
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
        x_spec = P(batch_axis, axis_name, head_axis, None)
    else:
        x_spec = P(batch_axis, head_axis, axis_name, None)
    seg_spec = P(batch_axis, axis_name)
    fn = jax.shard_map(
        run,
        mesh=mesh,
        # The mods' arrays are whole on every shard (their gradients are summed over the shards).
        in_specs=(x_spec, x_spec, x_spec, seg_spec, seg_spec, jax.tree.map(lambda _: P(), consts)),
        out_specs=(x_spec, P(batch_axis, head_axis, axis_name)),
        check_vma=False,
    )
    if _has_explicit_axes(mesh):  # explicit-sharding mode: shard_map wants inputs already laid out
        q, k, v = (_reshard(x, mesh, x_spec) for x in (q, k, v))
        q_seg, kv_seg = (_reshard(x, mesh, seg_spec) for x in (q_seg, kv_seg))
    out, lse = fn(q, k, v, q_seg, kv_seg, consts)
    return (out, lse) if return_lse else out


def _global_mods(call, score_mod, mask_mod, blocks, inside, batch_axis, head_axis, mesh):
    """The call's :class:`~flashport.kernels.semantics.mods.Mods` over the global arrays, or None without
    mods. A ``block_mask`` gives its ``mask_mod``; its classes only feed :func:`piece_classes` (each
    step's backend runs the shifted mods without a block mask)."""
    shape = _global_shape(call, inside, mesh, batch_axis, head_axis)
    return trace_mods(score_mod, mask_mod, blocks, shape, build_blocks=False)


def _global_shape(call, inside, mesh, batch_axis, head_axis):
    """``(B, Hq, Sq, Sk)`` of the global call (inside a ``shard_map``, from the axes that shard it)."""
    (b, hq, _, _), spec = call.q_shape, call.spec
    if inside:
        b *= _axis_size(mesh, batch_axis, "batch_axis")
        hq *= _axis_size(mesh, head_axis, "head_axis")
    return (b, hq, spec.seq_q, spec.seq_k)


def piece_classes(mods, blocks, shape, plan: Plan):
    """The mask_mod's block classes at the ring's pieces: int8 ``[B|1, H|1, Sq / pq, Sk / pk]``
    (:mod:`flashport.kernels.semantics.block_mask`; every piece of either layout is one block, since
    pieces start at multiples of their size). Regrouped from a given ``block_mask`` whose blocks
    divide the pieces, else evaluated from the mask_mod (once per call, before the ring). A ring
    step whose pair is empty for all of its shard's batches and heads computes nothing."""
    if blocks is not None and not (plan.pq % blocks.block_size[0] or plan.pk % blocks.block_size[1]):
        return block_mask_lib.tile_classes(blocks, plan.pq, plan.pk)
    b, h, sq, sk = shape
    return block_mask_lib.build(mods.mask, mods.mask_consts, b, h, sq, sk, (plan.pq, plan.pk)).classes


def _inside_shard_map(axis_name) -> bool:
    """True inside a ``shard_map`` over ``axis_name`` (the arrays are then the shard's pieces)."""
    manual = getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ())
    return axis_name in manual


def seq_layout_check(name):
    """Validate ``seq_layout`` (see :mod:`flashport.kernels.semantics.seq_layout`)."""
    return layouts.check_layout(name)


def _has_explicit_axes(mesh) -> bool:
    return any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def _reshard(x, mesh, spec):
    if x is None:
        return None
    return jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, spec))


def _axis_size(mesh, axes, arg):
    if axes is None:
        return 1
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    size = 1
    for name in names:
        if name not in mesh.shape:
            raise ValueError(
                f"ring_attention: {arg}={name!r} is not an axis of the mesh (axes: {tuple(mesh.shape)})"
            )
        size *= mesh.shape[name]
    return size


# ------------------------------------------------------------------------------------ the plan


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static schedule of one ring call: piece geometry and the branch of every piece pair.

    Attributes:
      n: ring size; m: pieces per shard (1 contiguous, 2 zigzag).
      pq, pk: query / key positions per piece.
      specs: the distinct local specs (``None`` for the empty branch), one ``lax.switch`` branch each.
      table: int ``[n, m, n, m]`` (nested tuples): branch of (query shard, query piece, key shard,
        key piece).
      q_starts, k_starts: int ``[n, m]`` (nested tuples): the global position of each piece's first
        query / key (:func:`flashport.kernels.semantics.seq_layout.piece_starts`).
    """

    n: int
    m: int
    pq: int
    pk: int
    specs: tuple[AttentionSpec | None, ...]
    table: tuple
    q_starts: tuple = ()
    k_starts: tuple = ()

    @staticmethod
    def make(spec: AttentionSpec, n: int, layout: str) -> Plan:
        """Classify every (query piece, key piece) pair of the ring for global ``spec``."""
        m = layouts.pieces(layout)
        pq, pk = spec.seq_q // (n * m), spec.seq_k // (n * m)
        q_starts = layouts.piece_starts(layout, n, spec.seq_q)
        k_starts = layouts.piece_starts(layout, n, spec.seq_k)
        specs: list[AttentionSpec | None] = []
        table = np.zeros((n, m, n, m), np.int32)
        for r, a, s, b in np.ndindex(n, m, n, m):
            local = local_spec(spec, pq, pk, int(q_starts[r, a]) - int(k_starts[s, b]))
            if local not in specs:
                specs.append(local)
            table[r, a, s, b] = specs.index(local)
        starts = tuple(tuple(tuple(int(x) for x in row) for row in st) for st in (q_starts, k_starts))
        return Plan(n, m, pq, pk, tuple(specs), tuple(map(tuple, table.reshape(n * m, n * m))), *starts)

    def branches_of(self, a: int, b: int) -> set[int]:
        """The branch ids query piece ``a`` x key piece ``b`` can take over all shard pairs."""
        table = np.asarray(self.table).reshape(self.n, self.m, self.n, self.m)
        return set(np.unique(table[:, a, :, b]).tolist())

    def starts(self, r, a, s, b):
        """Traced global positions of the first query of shard ``r``'s piece ``a`` and of the first
        key of shard ``s``'s piece ``b``."""
        q0 = jnp.asarray(np.asarray(self.q_starts, np.int32))[r, a]
        return q0, jnp.asarray(np.asarray(self.k_starts, np.int32))[s, b]

    def index(self, r, a, s, b):
        """Traced branch id for query shard ``r`` piece ``a``, key shard ``s`` piece ``b``."""
        table = jnp.asarray(np.asarray(self.table, np.int32).reshape(self.n, self.m, self.n, self.m))
        return table[r, a, s, b]

    @property
    def pairs(self) -> list[tuple[int, int]]:
        """The (query piece, key piece) pairs some shard pair computes (the others are never run)."""
        return [
            (a, b)
            for a in range(self.m)
            for b in range(self.m)
            if any(self.specs[i] is not None for i in self.branches_of(a, b))
        ]

    @property
    def computed_pairs(self) -> int:
        """How many (query piece, key piece) pairs over the whole ring run a kernel (not empty)."""
        table = np.asarray(self.table)
        return int(sum(np.sum(table == i) for i, sp in enumerate(self.specs) if sp is not None))


def local_spec(spec: AttentionSpec, pq: int, pk: int, delta: int) -> AttentionSpec | None:
    """The spec a [pq queries] x [pk keys] piece pair runs with, or ``None`` when nothing is visible.

    ``delta`` = global start of the query piece − global start of the key piece. The local offset is
    ``spec.offset + delta``; when every key is visible to every query the positional mask is dropped
    (so all such pairs share one branch).
    """
    local = dataclasses.replace(spec, seq_q=pq, seq_k=pk, offset=spec.offset + delta)
    if not spec.has_positional_mask:
        return dataclasses.replace(local, offset=0)
    lo, hi = key_range(local, 0, pq)
    if hi <= lo:
        return None
    if key_range(local, pq - 1, pq)[0] <= 0 and key_range(local, 0, 1)[1] >= pk:
        return dataclasses.replace(local, causal=False, window_left=None, window_right=None, offset=0)
    return local


# ------------------------------------------------------------------------------- the ring loops


def engine_for(plan: Plan, call, backend, layout: str, mesh=None, *, mods=None, mod_axes=(None, None)):
    """The per-step engine of a ring: the blockwise ring steps for ``backend="blockwise"`` (running
    state carried through the tiles, :mod:`flashport.kernels.parallel.ring_blockwise`), backend calls
    merged through the lse for every other backend (:mod:`flashport.kernels.parallel.ring_backend`),
    and for every backend when the call has ``mods`` (each step's backend runs them at the pieces'
    global positions; ``mod_axes``: the call's ``(batch_axis, head_axis)``, whose shard index gives
    the global batch and head offsets).

    ``backend="auto"`` on a mesh whose devices are all of one known platform takes that platform's
    pick now; when the pick is ``blockwise`` the ring runs the blockwise steps (no per-step output
    or merge pass: the leanest in memory). Otherwise ``auto`` is decided per step when lowering.
    """
    choice = backend if isinstance(backend, registry.BackendChoice) else None
    if backend == "auto":
        platform = mesh_platform(mesh)
        if platform is not None and mods is not None:  # one backend traced, not every platform's
            backend = registry.BackendChoice(registry.choose(platform, call)[0])
        elif platform is not None and registry.choose(platform, call)[0] == "blockwise":
            backend = "blockwise"
    if mods is not None:
        return BackendRing(plan, backend, call.features, layout, mods=mods, mod_axes=mod_axes)
    if backend == "blockwise" or (choice is not None and choice.name == "blockwise"):
        options = {} if choice is None else choice.options_dict
        return BlockwiseRing(plan, call.spec, options, layout)
    return BackendRing(plan, backend, call.features, layout)


def mesh_platform(mesh) -> str | None:
    """The platform of ``mesh``'s devices (``"cpu"``, ``"cuda"``, ``"tpu"``...), ``None`` if unknown or mixed."""
    if mesh is None:
        return None
    if isinstance(mesh, jax.sharding.AbstractMesh):
        platforms = {getattr(mesh.abstract_device, "platform", None)}
    else:
        platforms = {d.platform for d in np.asarray(mesh.devices).flat}
    platform = platforms.pop() if len(platforms) == 1 else None
    return platform if platform in PLATFORMS else None  # a "gpu" device does not say cuda or rocm


def _ring_shard(q, k, v, q_seg, kv_seg, consts, *, engine, axis_name):
    """Body of the shard_map: this shard's queries against every shard's K/V (user layout in and
    out). ``consts``: ``(score_mod arrays, mask_mod arrays[, piece classes])`` of the engine's mods
    (the classes with a mask_mod, :func:`piece_classes`), or ``()``."""

    @jax.custom_vjp
    def core(q, k, v, q_seg, kv_seg, consts):
        return _forward(engine, axis_name, q, k, v, q_seg, kv_seg, consts)

    def core_fwd(q, k, v, q_seg, kv_seg, consts):
        out, lse = _forward(engine, axis_name, q, k, v, q_seg, kv_seg, consts)
        return (out, lse), (q, k, v, q_seg, kv_seg, consts, out, lse)

    def core_bwd(res, cotangents):
        dq, dk, dv, d_consts = _backward(engine, axis_name, *res, *cotangents)
        return dq, dk, dv, None, None, d_consts

    core.defvjp(core_fwd, core_bwd)
    return core(q, k, v, q_seg, kv_seg, consts)


def _rotate(tree, axis_name, n):
    """Send ``tree`` to the next shard of the ring (``ppermute`` r -> r + 1 mod n).

    16-bit floats travel bit-cast to uint16: XLA:CPU otherwise widens a bf16 collective-permute to
    f32 (a converted copy of each K/V chunk on both sides, twice the bytes).
    """

    def send(x):
        if x is None or jnp.dtype(x.dtype).itemsize != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
            return jax.lax.ppermute(x, axis_name, perm)
        bits = jax.lax.ppermute(jax.lax.bitcast_convert_type(x, jnp.uint16), axis_name, perm)
        return jax.lax.bitcast_convert_type(bits, x.dtype)

    perm = [(i, (i + 1) % n) for i in range(n)]
    return jax.tree.map(send, tree)


def _forward(engine, axis_name, q, k, v, q_seg, kv_seg, consts=()):
    """The ring forward: at step t this shard holds the K/V of shard (r − t) mod n; the next chunk's
    ``ppermute`` is issued before the step's compute so the two overlap. The last step sends
    nothing (n − 1 rotations)."""
    plan, n = engine.plan, engine.plan.n
    r = jax.lax.axis_index(axis_name)
    q, k, v = engine.enter(q), engine.enter(k), engine.enter(v)
    extra = () if not consts else (consts,)  # only engines with mods take their arrays

    def step(state, kv, t):
        s = (r - t) % n
        for a, b in plan.pairs:
            state = engine.forward_pair(state, a, b, r, s, q, q_seg, *kv, *extra)
        return state

    def body(carry, t):
        state, kv = carry
        kv_next = _rotate(kv, axis_name, n)
        return (step(state, kv, t), kv_next), None

    (state, kv), _ = jax.lax.scan(body, (engine.init_forward(q, v), (k, v, kv_seg)), jnp.arange(n - 1))
    out, lse = engine.finish_forward(step(state, kv, n - 1), q.dtype)
    return engine.leave(out), lse


def _backward(engine, axis_name, q, k, v, q_seg, kv_seg, consts, out, lse, d_out, d_lse):
    """The ring backward from the forward's residuals: dQ stays local; dK/dV (f32) travel with their
    K/V (n − 1 rotations) and take one more hop home after the last step. With mods, the gradients
    of their arrays stay local too (the engine keeps them beside dQ); the ``shard_map``'s transpose
    sums them over the shards, since the arrays enter it replicated. Returns
    ``(dq, dk, dv, d_consts)``."""
    plan, n = engine.plan, engine.plan.n
    r = jax.lax.axis_index(axis_name)
    q, k, v, out, d_out = (engine.enter(x) for x in (q, k, v, out, d_out))
    context, dq, dk, dv = engine.init_backward(
        q, k, v, out, lse, d_out, d_lse, *((consts,) if consts else ())
    )
    extra = () if not consts else (consts,)

    def step(dq, kv, t):
        k_, v_, ks_, dk_, dv_ = kv
        s = (r - t) % n
        for a, b in plan.pairs:
            dq, dk_, dv_ = engine.backward_pair(
                (dq, dk_, dv_), context, a, b, r, s, q, q_seg, k_, v_, ks_, *extra
            )
        return dq, (k_, v_, ks_, dk_, dv_)

    def body(carry, t):
        dq, kv = step(*carry, t)
        return (dq, _rotate(kv, axis_name, n)), None

    (dq, kv), _ = jax.lax.scan(body, (dq, (k, v, kv_seg, dk, dv)), jnp.arange(n - 1))
    dq, kv = step(dq, kv, n - 1)
    dk, dv = _rotate(kv[3:], axis_name, n)
    d_consts = engine.mods_gradients(dq, consts) if consts else ()
    dq = engine.finish_backward(dq, q.dtype)
    return engine.leave(dq), engine.leave(dk.astype(k.dtype)), engine.leave(dv.astype(v.dtype)), d_consts


# ------------------------------------------------------------------- auto-dispatch from sharding


def detect(query, key, layout: str):
    """Ring keywords (mesh, axis_name, batch_axis, head_axis) when query and key are sequence-sharded.

    Used by :func:`flashport.attention` to run the ring by itself. The sharding is read from concrete
    arrays (``x.sharding``) or, under ``jit``, from the abstract value (``jax.typeof(x).sharding``),
    which carries a spec only for mesh axes in explicit-sharding mode (``AxisType.Explicit``); with
    the default ``Auto`` axes a traced array's sharding is decided later by the partitioner, which
    :mod:`flashport.kernels.parallel.ring_partition` handles. Returns ``None`` when the sequence dims are not
    sharded over one common mesh axis of size > 1 that divides both lengths.
    """
    specs, mesh = [], None
    for x in (query, key):
        sharding = _sharding_of(x)
        if not isinstance(sharding, jax.sharding.NamedSharding) or getattr(x, "ndim", 0) != 4:
            return None
        if mesh is not None and sharding.mesh.shape != mesh.shape:
            return None
        mesh = sharding.mesh
        specs.append(tuple(sharding.spec) + (None,) * (4 - len(sharding.spec)))
    axis, batch, heads = mesh_axes(mesh, specs[0], specs[1], query.shape, key.shape, layout)
    if axis is None:
        return None
    return dict(mesh=mesh, axis_name=axis, batch_axis=batch, head_axis=heads)


def mesh_axes(mesh, q_spec, k_spec, q_shape, k_shape, layout: str):
    """``(seq_axis, batch_axes, head_axes)`` a ring over ``mesh`` keeps for query/key partition specs.

    ``seq_axis`` is the one mesh axis (size > 1, dividing both sequence lengths) sharding both
    sequence dims, else ``None``; batch and head axes are kept where query and key agree and the
    dims split evenly (else ``None``). Shapes and specs are in ``layout`` (4 entries each).
    """
    seq_dim, head_dim = (1, 2) if layout == "BSHD" else (2, 1)

    def single(axes):
        if isinstance(axes, tuple):
            return axes[0] if len(axes) == 1 else None
        return axes

    axis, k_axis = single(q_spec[seq_dim]), single(k_spec[seq_dim])
    if axis is None or axis != k_axis or mesh.shape[axis] < 2:
        axis = None
    elif q_shape[seq_dim] % mesh.shape[axis] or k_shape[seq_dim] % mesh.shape[axis]:
        axis = None
    batch = q_spec[0] if q_spec[0] == k_spec[0] else None
    heads = q_spec[head_dim] if q_spec[head_dim] == k_spec[head_dim] else None
    if heads is not None:
        size = _axis_size(mesh, heads, "head_axis")
        if q_shape[head_dim] % size or k_shape[head_dim] % size:
            heads = None
    if batch is not None and q_shape[0] % _axis_size(mesh, batch, "batch_axis"):
        batch = None
    return axis, batch, heads


def _sharding_of(x):
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        return x.sharding
    try:
        return jax.typeof(x).sharding
    except (AttributeError, TypeError):
        return None
