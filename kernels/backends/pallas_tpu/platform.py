"""Lower a Mosaic kernel for TPU only, so multi-platform exports (``platforms=["cpu", "tpu"]``) work.

``flashport.attention(backend="auto")`` dispatches with ``lax.platform_dependent``. When one module
is lowered for several platforms, JAX lowers every kept branch for *all* of the module's platforms,
and ``pallas_call``'s CPU rule raises ("Only interpret mode is supported on CPU backend") even though
the TPU branch can never run on CPU. :func:`tpu_only` binds a small primitive whose lowering is
registered per platform: on TPU it inlines the Mosaic kernel; elsewhere it inlines the same kernel
in the discharge interpreter (``interpret=True``), which is correct (if slow) should it ever run.
That fallback is only for modules lowered for several platforms (the TPU branch of ``auto`` beside
the others): lowered for one platform that is not a TPU, the kernel would really run in the
interpreter (a TPU host whose TPU failed to start would crawl without a word), so the lowering
raises, naming the platform and the interpret backend (:func:`refuse_single_platform`).
``mlir.lower_per_platform`` narrows the module's platforms inside each rule, so the Mosaic lowering
only ever sees ``tpu``.

Mosaic's lowering asks for the TPU chip it lowers for (some rules depend on the generation). It
reads the abstract mesh's device or else the default device, which is a CPU on a build host. The TPU
rule therefore names a chip itself, in this order: the abstract mesh's device (the user picked one),
the devices the computation is being compiled for (e.g. ``get_topology_desc`` devices), a real TPU
on this host, and last the ``device_kind`` the backend passes (its ``generation`` option, or the
documented default generation).
"""

from __future__ import annotations

import jax
from jax._src import core
from jax._src.interpreters import batching, mlir
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

tpu_only_p = core.Primitive("flashport_tpu_only")
tpu_only_p.multiple_results = True


def tpu_only(make, *args, device_kind: str):
    """Call ``make(interpret)(*args)`` with ``interpret=False`` on TPU and ``True`` on other platforms.

    ``make`` maps the ``interpret`` argument of ``pallas_call`` to a function of ``args`` (a flat list
    of arrays) returning a tuple of arrays. ``device_kind`` (e.g. ``"TPU v6 lite"``) is the chip the
    Mosaic lowering assumes when nothing else names one (see the module docstring).
    """
    tpu = jax.make_jaxpr(make(False))(*args)
    other = jax.make_jaxpr(make(True))(*args)
    return tuple(tpu_only_p.bind(*args, tpu=tpu, other=other, make=make, device_kind=device_kind))


@tpu_only_p.def_abstract_eval
def _abstract_eval(*args, tpu, other, make, device_kind):
    return [v.aval for v in tpu.jaxpr.outvars]


def _impl(*args, **params):
    return jax.jit(lambda *a: tpu_only_p.bind(*a, **params))(*args)


tpu_only_p.def_impl(_impl)


def _target_tpu(ctx):
    """The first TPU device this module is compiled for, if the context names one (else ``None``)."""
    if jax.sharding.get_abstract_mesh().abstract_device is not None:
        return None  # Mosaic reads the abstract mesh itself
    devices = getattr(ctx.module_context.axis_context, "device_assignment", None) or ()
    mesh = getattr(ctx.module_context.axis_context, "mesh", None)
    if not devices and mesh is not None and hasattr(mesh, "devices"):
        devices = tuple(mesh.devices.flat)
    for d in devices:
        if getattr(d, "platform", None) == "tpu":
            return d
    return None


def _has_real_tpu() -> bool:
    try:
        return bool(jax.devices("tpu"))
    except RuntimeError:
        return False


def refuse_single_platform(ctx, backend: str, native: str) -> None:
    """Raise when a module is lowered for exactly one platform and it is not ``native``.

    The interpreter fallback of :func:`tpu_only` (and its CUDA twin) exists for the branches of a
    multi-platform module that never run there; alone on a platform it would be what runs.
    """
    platforms = tuple(ctx.module_context.platforms)
    if len(platforms) == 1 and platforms[0] != native:
        raise ValueError(
            f"backend={backend!r} runs natively only on {native}, and this computation is lowered for "
            f"{platforms[0]} (no {native} device here, or it failed to start); use "
            f"backend='{backend}_interpret' to run the same kernels in the Pallas interpreter (slow, "
            f"for tests), or backend='auto'"
        )


def _lowering(which):
    def rule(ctx, *args, tpu, other, make, device_kind):
        if which != "tpu":
            refuse_single_platform(ctx, "pallas_tpu", "tpu")
        jaxpr = tpu if which == "tpu" else other
        lower = mlir.lower_fun(core.jaxpr_as_fun(jaxpr), multiple_results=True)
        if which != "tpu" or jax.sharding.get_abstract_mesh().abstract_device is not None:
            return lower(ctx, *args)
        target = _target_tpu(ctx)
        if target is None and _has_real_tpu():
            return lower(ctx, *args)
        # A one-chip abstract mesh only tells Mosaic which chip it lowers for (the surrounding
        # module's shardings are already fixed). Each equation re-enters the abstract mesh it was
        # traced under, so the kernel is traced again inside this one.
        chip = AbstractDevice(
            device_kind=target.device_kind if target else device_kind,
            num_cores=getattr(target, "num_cores", 1) or 1,
            platform="tpu",
        )
        with jax.sharding.use_abstract_mesh(
            AbstractMesh((1,), ("_flashport_chip",), (AxisType.Auto,), abstract_device=chip)
        ):
            structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in ctx.avals_in]
            traced = jax.make_jaxpr(make(False))(*structs)
            return mlir.lower_fun(core.jaxpr_as_fun(traced), multiple_results=True)(ctx, *args)

    return rule


mlir.register_lowering(tpu_only_p, _lowering("other"))
mlir.register_lowering(tpu_only_p, _lowering("tpu"), platform="tpu")


def _batch(args, dims, *, tpu, other, make, device_kind):
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    axes = tuple(dims)  # None = not mapped

    def vmapped(jaxpr):
        return jax.make_jaxpr(jax.vmap(core.jaxpr_as_fun(jaxpr), in_axes=axes))(*structs)

    def vmapped_make(interpret):
        return jax.vmap(make(interpret), in_axes=axes)

    out = tpu_only_p.bind(
        *args, tpu=vmapped(tpu), other=vmapped(other), make=vmapped_make, device_kind=device_kind
    )
    return out, [0] * len(out)


batching.primitive_batchers[tpu_only_p] = _batch
