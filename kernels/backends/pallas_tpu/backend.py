"""The backend functions around the kernels: padding, the custom_vjp, dropout seeds, registration.

See the package docstring (:mod:`flashport.kernels.backends.pallas_tpu`) for what this adds around the
kernels and for the options.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from flashport.kernels.backends.pallas_platform import tpu_only
from flashport.kernels.backends.pallas_tpu.backward import dkv_call, dq_call
from flashport.kernels.backends.pallas_tpu.blocks import (
    FORWARD_VMEM_BUDGET,
    GENERATION_DEFAULTS,
    GENERATION_DEVICE_KINDS,
    LANES,
    MULTI_HEAD_VMEM,
    BlockSizes,
    backward_vmem_bytes,
    fit_backward_blocks,
    fit_band,
    fit_forward_block_q,
    fit_head_block,
    forward_vmem_bytes,
    resolve_blocks,
    tile_operand_bytes,
)
from flashport.kernels.backends.pallas_tpu.classify import with_full_ranges, with_step_codes
from flashport.kernels.backends.pallas_tpu.forward import forward_call
from flashport.kernels.backends.pallas_tpu.layout import token_major_pays
from flashport.kernels.backends.pallas_tpu.sharding import partitioned
from flashport.kernels.backends.pallas_tpu.specs import Operands
from flashport.kernels.backends.pallas_tpu.tiling import (
    Geometry,
    Tables,
    block_tables,
    head_seed_table,
    mod_class_table,
    pad_lanes,
    prepare_operands,
    round_up,
)
from flashport.kernels.contract import registry
from flashport.kernels.contract.spec import FEATURES, AttentionSpec
from flashport.kernels.semantics.padding import pad_to


@dataclasses.dataclass(frozen=True)
class Config:
    """Static configuration of one call (hashable: it is a nondiff argument of the custom_vjp)."""

    spec: AttentionSpec
    blocks: BlockSizes
    interpret: bool
    generation: str = "v6e"  # the chip Mosaic lowers for when the computation names none
    # BSHD calls whose head dims are multiples of 128 (:func:`reads_bshd`) read/write the caller's
    # arrays directly (token-major, no transposes around the kernels): by default (None) unless the
    # HBM byte model finds their smaller all-head blocks re-stream more than the transposes move
    # (:func:`~flashport.kernels.backends.pallas_tpu.layout.token_major_pays`); option ``read_bshd=True``
    # always, ``False`` never.
    read_bshd: bool | None = None
    # The user mods the kernels run (``Geometry.mods``: score TracedMod, its array count, mask
    # TracedMod, block mask given) or None; their arrays and tile classes travel in the tables.
    mods: Any = None

    def geometry(self, kind: str, q, k, v, *, token_major: bool = False, bias=None, mask=None) -> Geometry:
        """The tiling of kernel ``kind`` (``"fwd"``, ``"dkv"`` or ``"dq"``).

        From the canonical operands ``q, k, v``: the blocks are shrunk until the heads of one step
        (the G heads of a GQA group in the forward and dQ; every head when ``token_major``) fit VMEM
        together (:func:`~flashport.kernels.backends.pallas_tpu.blocks.fit_forward_block_q`,
        :func:`~flashport.kernels.backends.pallas_tpu.blocks.fit_backward_blocks`); default blocks are first
        fitted to a causal or sliding-window band (:func:`~flashport.kernels.backends.pallas_tpu.blocks.fit_band`).
        The heads-major forward and dQ kernels then take as many kv heads per step as the larger VMEM
        budget holds
        (``Geometry.head_block``, :func:`~flashport.kernels.backends.pallas_tpu.blocks.fit_head_block`).
        """
        b = self.blocks
        bq, bk = {
            "fwd": (b.block_q, b.block_k),
            "dkv": (b.block_q_dkv, b.block_k_dkv),
            "dq": (b.block_q_dq, b.block_k_dq),
        }[kind]
        if b == GENERATION_DEFAULTS[self.generation]:  # the user's own blocks are kept as given
            spec = self.spec
            seq = max(spec.seq_q, spec.seq_k)
            bq, bk = fit_band(
                self.generation, kind, bq, bk, causal=spec.causal, left=spec.window_left, seq=seq
            )
        hq, hkv, itemsize = q.shape[1], k.shape[1], jnp.dtype(q.dtype).itemsize
        dp, dvp = round_up(q.shape[3], LANES), round_up(v.shape[3], LANES)
        kv_heads = hkv if token_major else 1
        budget = self.vmem(token_major)[0]
        head_block = 1
        if kind == "fwd":
            heads = hq if token_major else hq // hkv
            tiles = tile_operand_bytes(kind, heads, bias, mask)
            bq = fit_forward_block_q(
                bq,
                bk,
                heads,
                dp,
                dvp,
                itemsize,
                kv_heads=kv_heads,
                budget=budget,
                staged=token_major,
                tile_bytes=tiles,
            )
        else:
            heads = hq if token_major else (hq // hkv if kind == "dq" else 1)
            tiles = tile_operand_bytes(kind, heads, bias, mask)
            clipped = Geometry.make(self.spec, bq, bk)  # fit the blocks the sequences actually use
            bq, bk = fit_backward_blocks(
                kind,
                clipped.bq,
                clipped.bk,
                heads,
                kv_heads,
                dp,
                dvp,
                itemsize,
                budget,
                staged=token_major,
                tile_bytes=tiles,
            )
        if not token_major:  # several kv heads per step where the larger budget holds them
            group, wide = hq // hkv, self.vmem(True)[0]

            def step_bytes(hb: int) -> tuple[int, int]:
                tiles = tile_operand_bytes(kind, hb * group, bias, mask)
                if kind == "fwd":
                    need = forward_vmem_bytes(bq, bk, hb * group, dp, dvp, itemsize, hb, tile_bytes=tiles)
                else:
                    need = backward_vmem_bytes(
                        kind, bq, bk, hb * group, hb, dp, dvp, itemsize, tile_bytes=tiles
                    )
                return need, wide

            head_block = fit_head_block(hkv, step_bytes)
        return dataclasses.replace(Geometry.make(self.spec, bq, bk), mods=self.mods, head_block=head_block)

    def vmem(self, multi_head: bool) -> tuple[int, int | None]:
        """``(budget, vmem_limit_bytes)`` of the kernels: steps holding several kv heads' blocks
        (token-major, or the heads-major forward's head blocks) get the chip's larger budget
        (:data:`~flashport.kernels.backends.pallas_tpu.blocks.MULTI_HEAD_VMEM`), others the default
        scoped VMEM."""
        return MULTI_HEAD_VMEM[self.generation] if multi_head else (FORWARD_VMEM_BUDGET, None)

    def operands(self, q, k, v, kinds) -> Operands:
        """The operand layout of kernels ``kinds`` for canonical ``q, k, v``: token-major when
        :func:`reads_bshd` and the ``read_bshd`` option (default: the byte model) allow it."""
        token_major = reads_bshd(self.spec, q, v) and self.read_bshd is not False
        if token_major and self.read_bshd is None:
            token_major = token_major_pays(
                lambda kind, tm: self.geometry(kind, q, k, v, token_major=tm), kinds, q, k, v
            )
        return Operands(
            token_major=token_major,
            kv_group=q.shape[1] // k.shape[1],
        )

    @property
    def interpret_mode(self):
        """The ``interpret=`` argument for ``pallas_call``.

        The TPU interpreter (``InterpretParams``) simulates memory spaces and DMAs through ordered
        host callbacks, which cannot be lowered inside a ``custom_partitioning`` call; in a
        multi-device process the kernels therefore run in the plain discharge interpreter
        (``interpret=True``, same kernel body, no memory-space model).
        """
        if not self.interpret:
            return False
        return pltpu.InterpretParams() if jax.device_count() == 1 else True


def _pad_qkv(g: Geometry, q, k, v):
    return (pad_lanes(pad_to(q, 2, g.sqp)), pad_lanes(pad_to(k, 2, g.skp)), pad_lanes(pad_to(v, 2, g.skp)))


def _launch(cfg: Config, call_fn, g: Geometry, operands, tables: Tables, **kwargs):
    """Run a kernel builder ``call_fn(g, *operands, tables, interpret=...)``.

    Operands (``None`` where absent) and the tables travel as one flat list of arrays; for real TPU
    lowering the call is routed through :func:`tpu_only`.
    """
    present = [x is not None for x in operands]
    table_leaves, table_tree = jax.tree_util.tree_flatten(tables)
    flat = [x for x in operands if x is not None] + table_leaves
    n = len(flat) - len(table_leaves)

    def make(interpret):
        def run(*flat):
            it = iter(flat[:n])
            ops = [next(it) if p else None for p in present]
            tabs = jax.tree_util.tree_unflatten(table_tree, flat[n:])
            kw = dict(kwargs, ops=kwargs["ops"].for_interpret(interpret))
            return tuple(call_fn(g, *ops, tabs, interpret=interpret, **kw))

        return run

    if cfg.interpret:
        return _map_under_vmap(make(cfg.interpret_mode), *flat)
    return tpu_only(make, *flat, device_kind=GENERATION_DEVICE_KINDS[cfg.generation])


def _map_under_vmap(fn, *flat):
    """Call ``fn``; under ``vmap`` loop over the batch with ``lax.map`` instead of batching the kernel.

    The TPU interpreter rejects a vmapped ``pallas_call`` (the batching rule adds a grid dimension but
    not its dimension semantics), so the interpreter backends map sequentially instead.
    """

    @jax.custom_batching.custom_vmap
    def call(*xs):
        return fn(*xs)

    @call.def_vmap
    def _rule(axis_size, in_batched, *xs):
        batched = [x for x, b in zip(xs, in_batched, strict=False) if b]

        def one(slices):
            it = iter(slices)
            return call(*[next(it) if b else x for x, b in zip(xs, in_batched, strict=False)])

        outs = tuple(jax.lax.map(one, batched))
        return outs, tuple(True for _ in outs)

    return call(*flat)


def _rows(x, g: Geometry):
    """[B, H, S] f32 -> the kernels' compact lse/di rows [B, H, nq, 1, bq] (padded rows are 0)."""
    return pad_to(x, 2, g.sqp).reshape(*x.shape[:2], g.nq, 1, g.bq)


def reads_bshd(spec: AttentionSpec, q, v) -> bool:
    """Whether the forward reads the caller's BSHD arrays directly (token-major operands).

    Only when the caller's layout is BSHD (the spec's hint) and both head dims are whole 128-lane
    multiples: other head dims are padded to 128 lanes, which needs a copy anyway, so they take the
    heads-major (transposed) path.
    """
    return spec.layout == "BSHD" and q.shape[3] % LANES == 0 and v.shape[3] % LANES == 0


def _loadable(x):
    """float16 -> float32: Mosaic cannot load float16 vectors on any TPU generation ("Invalid vector
    type for load"), so float16 operands enter the kernels as float32 (accumulation is f32 anyway)."""
    return x.astype(jnp.float32) if x is not None and x.dtype == jnp.float16 else x


def _tables(
    g: Geometry, q_seg, kv_seg, head_seeds, *, by_rows: bool, has_mask: bool, mod_consts=None, mod_blocks=None
) -> Tables:
    """A kernel's scalar-prefetch tables: block ranges and full-tile ranges, plus the dropout head
    seeds, the arrays of the user mods and the tile classes of their block mask when given."""
    tables = with_full_ranges(g, block_tables(g, q_seg, kv_seg, by_rows=by_rows), has_mask=has_mask)
    tables = with_step_codes(g, tables, by_rows=by_rows, has_mask=has_mask)
    if mod_consts is not None:
        tables = tables._replace(mod_consts=tuple(mod_consts))
    if g.mask_mod_classified:
        tables = tables._replace(mod_classes=mod_class_table(g, mod_blocks))
    return tables if head_seeds is None else tables._replace(head_seeds=head_seeds.reshape(-1))


def _forward_local(
    cfg: Config,
    q,
    k,
    v,
    bias,
    mask,
    q_seg,
    kv_seg,
    head_seeds=None,
    mod_consts=None,
    mod_blocks=None,
    *,
    write_lse=True,
    count_tiles=False,
    classify=True,
):
    """Forward on unpadded canonical arrays of one shard; returns ``(out, lse[, full, partial])``.

    ``head_seeds`` (uint32 [B, Hq] of this shard, or None) are the dropout seeds ``t_bh`` of the
    shard's global batch rows and query heads. ``write_lse=False`` (inference without lse): the
    kernel writes none and the returned lse is NaN (never read). When :func:`reads_bshd`, the kernel
    runs on ``swapaxes(q, 1, 2)`` etc.: under ``jit`` XLA cancels these against the API's BSHD ->
    BHSD transposes, so no copy is made. ``count_tiles``/``classify``: see
    :func:`~flashport.kernels.backends.pallas_tpu.forward.forward_call` (instrumentation).
    """
    out_dtype = q.dtype
    q, k, v, bias = map(_loadable, (q, k, v, bias))
    b, hq, sq, _ = q.shape
    dv = v.shape[3]
    ops = cfg.operands(q, k, v, ("fwd",))
    g = cfg.geometry("fwd", q, k, v, token_major=ops.token_major, bias=bias, mask=mask)
    if ops.token_major:
        qp, kp, vp = (pad_to(jnp.swapaxes(x, 1, 2), 1, n) for x, n in ((q, g.sqp), (k, g.skp), (v, g.skp)))
    else:
        qp, kp, vp = _pad_qkv(g, q, k, v)
    bias, mask, qs, ks = prepare_operands(g, bias, mask, q_seg, kv_seg)
    tables = _tables(
        g,
        q_seg,
        kv_seg,
        head_seeds,
        by_rows=True,
        has_mask=mask is not None,
        mod_consts=mod_consts,
        mod_blocks=mod_blocks,
    )
    res = _launch(
        cfg,
        forward_call,
        g,
        [qp, kp, vp, bias, mask, qs, ks],
        tables,
        ops=ops,
        vmem_limit=cfg.vmem(ops.token_major or g.head_block > 1)[1],
        write_lse=write_lse,
        count_tiles=count_tiles,
        classify=classify,
    )
    out = jnp.swapaxes(res[0], 1, 2) if ops.token_major else res[0]
    out = out[:, :, :sq, :dv].astype(out_dtype)
    if write_lse:
        lse, counts = res[1].reshape(b, hq, g.sqp)[:, :, :sq], res[2:]
    else:
        lse, counts = jnp.full((b, hq, sq), jnp.nan, jnp.float32), res[1:]
    if count_tiles:
        full, partial = (c[:, :, ::8, 0] for c in counts)
        if g.head_block > 1:  # a step counts the tiles of its head block's hb * G heads: G per kv head
            full, partial = (jnp.repeat(c // g.head_block, g.head_block, axis=1) for c in (full, partial))
        return out, lse, full, partial
    return out, lse


def _backward_local(
    cfg: Config,
    q,
    k,
    v,
    bias,
    mask,
    q_seg,
    kv_seg,
    out,
    lse,
    d_out,
    d_lse,
    head_seeds,
    mod_consts=None,
    mod_blocks=None,
):
    """dQ, dK, dV (and the bias gradient, or None) for one shard (canonical arrays; like the forward,
    the kernels read token-major ``swapaxes`` views when :func:`reads_bshd`)."""
    dtypes = (q.dtype, k.dtype, v.dtype)
    q, k, v, bias_in, d_out = map(_loadable, (q, k, v, bias, d_out))
    sq, sk, d, dv = q.shape[2], k.shape[2], q.shape[3], v.shape[3]
    # dL/dlogits = P * (dP - di) with di = rowsum(dO*O) - dlse: the lse cotangent folds into di.
    di = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - d_lse
    ops = cfg.operands(q, k, v, ("dkv", "dq"))

    def operands(g: Geometry):
        if ops.token_major:
            pairs = ((q, g.sqp), (k, g.skp), (v, g.skp), (d_out, g.sqp))
            return [pad_to(jnp.swapaxes(x, 1, 2), 1, n) for x, n in pairs]
        return [*_pad_qkv(g, q, k, v), pad_lanes(pad_to(d_out, 2, g.sqp))]

    def canonical(x, s, width):
        return (jnp.swapaxes(x, 1, 2) if ops.token_major else x)[:, :, :s, :width]

    results = {}
    for kind in ("dkv", "dq"):
        g = cfg.geometry(kind, q, k, v, token_major=ops.token_major, bias=bias_in, mask=mask)
        b_, m_, qs, ks = prepare_operands(g, bias_in, mask, q_seg, kv_seg)
        tables = _tables(
            g,
            q_seg,
            kv_seg,
            head_seeds,
            by_rows=(kind == "dq"),
            has_mask=mask is not None,
            mod_consts=mod_consts,
            mod_blocks=mod_blocks,
        )
        call = dkv_call if kind == "dkv" else dq_call
        arrays = [*operands(g), _rows(lse, g), _rows(di, g), b_, m_, qs, ks]
        limit = cfg.vmem(ops.token_major or g.head_block > 1)[1]
        results[kind] = (g, _launch(cfg, call, g, arrays, tables, ops=ops, vmem_limit=limit))
    _, (dk, dv_) = results["dkv"]
    g, dq_out = results["dq"]
    dq, dk, dv_ = (
        canonical(dq_out[0], sq, d).astype(dtypes[0]),
        canonical(dk, sk, d).astype(dtypes[1]),
        canonical(dv_, sk, dv).astype(dtypes[2]),
    )
    dbias = None
    if bias is not None:
        dbias = _reduce_dbias(g, dq_out[1], bias.shape, sq, sk).astype(bias.dtype)
    return dq, dk, dv_, dbias


def _reduce_dbias(g: Geometry, tiles, bias_shape, sq, sk):
    """[B, Hq, nq, nk, rq, rk] per-tile bias gradients -> the bias's own (broadcast) shape."""
    bb, hb, sqb, skb = bias_shape
    if bb == 1:
        tiles = jnp.sum(tiles, axis=0, keepdims=True)
    if hb == 1:
        tiles = jnp.sum(tiles, axis=1, keepdims=True)
    b_, h_, nq, nk, rq, rk = tiles.shape
    x = jnp.swapaxes(tiles, 3, 4).reshape(b_, h_, nq * rq, nk * rk)
    x = jnp.sum(x, axis=2, keepdims=True) if sqb == 1 else x[:, :, :sq]
    x = jnp.sum(x, axis=3, keepdims=True) if skb == 1 else x[:, :, :, :sk]
    return x


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg: Config, q, k, v, bias, mask, q_seg, kv_seg, head_seeds):
    # Without a gradient (this primal) the lse is written only when the caller keeps it.
    forward = functools.partial(_forward_local, cfg, write_lse=cfg.spec.lse_used)
    return partitioned(forward, "fwd")(q, k, v, bias, mask, q_seg, kv_seg, head_seeds)


def _attention_fwd(cfg, q, k, v, bias, mask, q_seg, kv_seg, head_seeds):
    # The forward of a gradient always writes the lse: the backward recomputes P from it.
    out, lse = partitioned(functools.partial(_forward_local, cfg), "fwd")(
        q, k, v, bias, mask, q_seg, kv_seg, head_seeds
    )
    return (out, lse), (q, k, v, bias, mask, q_seg, kv_seg, out, lse, head_seeds)


def _attention_bwd(cfg, residuals, cotangents):
    q, k, v, bias, mask, q_seg, kv_seg, out, lse, head_seeds = residuals
    d_out, d_lse = cotangents
    dq, dk, dv, dbias = partitioned(functools.partial(_backward_local, cfg), "bwd")(
        q, k, v, bias, mask, q_seg, kv_seg, out, lse, d_out, d_lse, head_seeds
    )
    return dq, dk, dv, dbias, None, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention_mods(cfg: Config, q, k, v, bias, mask, q_seg, kv_seg, seed, head_seeds, mods):
    """``_attention`` with user mods (one device: their arrays are not partitioned). The gradients of
    the score_mod's arrays come from the blockwise backend's pass over the tiles
    (:func:`flashport.kernels.backends.blockwise.mods_cotangent`); XLA drops it when they are not needed."""
    return _attention_mods_fwd(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, head_seeds, mods)[0]


def _attention_mods_fwd(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, head_seeds, mods):
    consts = (*mods.score_consts, *mods.mask_consts)
    out, lse = _forward_local(cfg, q, k, v, bias, mask, q_seg, kv_seg, head_seeds, consts, mods.blocks)
    return (out, lse), (q, k, v, bias, mask, q_seg, kv_seg, seed, out, lse, head_seeds, mods)


def _attention_mods_bwd(cfg, residuals, cotangents):
    from flashport.kernels.backends.blockwise import mods_cotangent

    q, k, v, bias, mask, q_seg, kv_seg, seed, out, lse, head_seeds, mods = residuals
    d_out, d_lse = cotangents
    consts = (*mods.score_consts, *mods.mask_consts)
    dq, dk, dv, dbias = _backward_local(
        cfg, q, k, v, bias, mask, q_seg, kv_seg, out, lse, d_out, d_lse, head_seeds, consts, mods.blocks
    )
    arrays = (q, k, v, bias, mask, q_seg, kv_seg, seed, out, lse)
    d_mods = mods_cotangent(*arrays, d_out, d_lse, spec=cfg.spec, mods=mods)
    return dq, dk, dv, dbias, None, None, None, None, None, d_mods


_attention_mods.defvjp(_attention_mods_fwd, _attention_mods_bwd)


def _mods_config(cfg: Config, mods) -> Config:
    """``cfg`` with the static part of ``mods`` (see ``Config.mods``)."""
    return dataclasses.replace(
        cfg, mods=(mods.score, len(mods.score_consts), mods.mask, mods.blocks is not None)
    )


def _make_backend_fns(name: str, interpret: bool) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The backend's forward ``fn`` and its residual ``backward`` (:class:`registry.BackendInfo`)."""

    def config(spec: AttentionSpec, options, q) -> Config:
        options = dict(options)
        read_bshd = options.pop("read_bshd", None)
        if read_bshd is not None and not isinstance(read_bshd, bool):
            raise ValueError(
                f"backend {name!r} option read_bshd={read_bshd!r} must be True, False or None (the default)"
            )
        generation, blocks = resolve_blocks(options, name, q)
        return Config(spec, blocks, interpret, generation, read_bshd)

    def fn(q, k, v, bias, mask, q_seg, kv_seg, seed, *, spec: AttentionSpec, options, mods=None):
        # Dropout seeds of every (batch, query head), computed before sharding so that each shard's
        # kernels hash global batch and head indices (positions are global: sequences are never split).
        head_seeds = head_seed_table(seed, q.shape[0], q.shape[1]) if spec.dropout_rate > 0 else None
        if mods is not None:
            cfg = _mods_config(config(spec, options, q), mods)
            return _attention_mods(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, head_seeds, mods)
        return _attention(config(spec, options, q), q, k, v, bias, mask, q_seg, kv_seg, head_seeds)

    def backward(
        q,
        k,
        v,
        bias,
        mask,
        q_seg,
        kv_seg,
        seed,
        out,
        lse,
        d_out,
        d_lse,
        *,
        spec: AttentionSpec,
        options,
        mods=None,
    ):
        cfg = config(spec, options, q)
        head_seeds = head_seed_table(seed, q.shape[0], q.shape[1]) if spec.dropout_rate > 0 else None
        cotangents = (d_out.astype(q.dtype), d_lse)
        if mods is not None:
            saved = (q, k, v, bias, mask, q_seg, kv_seg, seed, out.astype(q.dtype), lse, head_seeds, mods)
            return _attention_mods_bwd(_mods_config(cfg, mods), saved, cotangents)[:4]
        residuals = (q, k, v, bias, mask, q_seg, kv_seg, out.astype(q.dtype), lse, head_seeds)
        return _attention_bwd(cfg, residuals, cotangents)[:4]

    fn.__name__ = f"{name}_attention"
    fn.__doc__ = (
        f"The ``{name}`` backend over the canonical arrays; returns ``(out, lse)``. Options are "
        "validated (with the fix named in the error) before anything is lowered."
    )
    backward.__name__ = f"{name}_attention_backward"
    backward.__doc__ = (
        f"The ``{name}`` residual backward (the dK/dV and dQ kernels of its ``custom_vjp``) from the "
        "forward's ``out`` and ``lse``; returns ``(dq, dk, dv, dbias)``."
    )
    return fn, backward


pallas_tpu_attention, pallas_tpu_backward = _make_backend_fns("pallas_tpu", interpret=False)
pallas_tpu_interpret_attention, pallas_tpu_interpret_backward = _make_backend_fns(
    "pallas_tpu_interpret", interpret=True
)


def count_visited_tiles(
    q, k, v, *, spec: AttentionSpec, options=None, bias=None, mask=None, q_seg=None, kv_seg=None
):
    """Run the forward kernel in the TPU interpreter with visit counters (single device, no sharding).

    Returns ``(out, lse, visits)`` where ``visits`` [B, Hkv, nq] counts the head tiles (key block x
    query head of the kv head's group) whose compute actually ran for each query block. For tests and
    for checking block skipping on new masks; :func:`count_tiles_by_class` splits it by tile class.
    """
    out, lse, full, partial = count_tiles_by_class(
        q, k, v, spec=spec, options=options, bias=bias, mask=mask, q_seg=q_seg, kv_seg=kv_seg
    )
    return out, lse, full + partial


def count_tiles_by_class(
    q,
    k,
    v,
    *,
    spec: AttentionSpec,
    options=None,
    bias=None,
    mask=None,
    q_seg=None,
    kv_seg=None,
    classify=True,
    mods=None,
):
    """Like :func:`count_visited_tiles`, split by tile class: returns ``(out, lse, full, partial)``.

    ``full`` [B, Hkv, nq] counts head tiles computed through the mask-free body, ``partial`` those
    computed through the masked body (see :mod:`flashport.kernels.backends.pallas_tpu.classify`);
    ``classify=False`` masks every tile, as the kernel did before tiles were classified. ``mods``: a
    :class:`~flashport.kernels.semantics.mods.Mods` (``contract.validate.prepare_mods``) the tiles run.
    """
    _, blocks = resolve_blocks(dict(options or {}), "pallas_tpu_interpret")
    cfg = Config(spec, blocks, interpret=True)
    consts, blocks_of_mods = None, None
    if mods is not None:
        cfg = _mods_config(cfg, mods)
        consts, blocks_of_mods = (*mods.score_consts, *mods.mask_consts), mods.blocks
    return _forward_local(
        cfg,
        q,
        k,
        v,
        bias,
        mask,
        q_seg,
        kv_seg,
        None,
        consts,
        blocks_of_mods,
        count_tiles=True,
        classify=classify,
    )


# Deliberately parallel registrations (here and in kernels/backends/pallas_gpu/backend.py): each backend declares
# the same BackendInfo fields; the values are what differ.
registry.register(
    registry.BackendInfo(
        name="pallas_tpu",
        description="flashport's Pallas TPU flash attention (forward + dK/dV and dQ kernels, block "
        "skipping in compute and DMA, GQA via index maps); TPU only.",
        platforms=("tpu",),
        features=frozenset(FEATURES),
        fn=pallas_tpu_attention,
        backward=pallas_tpu_backward,
        interpret=registry.InterpretTwin(
            description="The pallas_tpu kernels run in the TPU interpreter on CPU (slow; for tests and "
            "debugging, never chosen by auto).",
            fn=pallas_tpu_interpret_attention,
            backward=pallas_tpu_interpret_backward,
        ),
    )
)
