"""Lower a Pallas kernel natively on one platform only, so multi-platform exports of ``auto`` work.

``flashport.attention(backend="auto")`` dispatches with ``lax.platform_dependent``. When one module
is lowered for several platforms (``platforms=["cpu", "tpu"]``, ``["cpu", "cuda"]``), JAX lowers
every kept branch for *all* of the module's platforms, and ``pallas_call``'s CPU rule raises ("Only
interpret mode is supported on CPU backend") even though the native branch can never run on CPU. A
:class:`NativeOnly` primitive has its lowering registered per platform: on its native platform it
inlines the compiled kernel (Mosaic on TPU, Triton on CUDA); elsewhere it inlines the same kernel in
the Pallas interpreter (``interpret=True``), which is correct (if slow) should it ever run. That
fallback is only for modules lowered for several platforms (the native branch of ``auto`` beside the
others): lowered for one platform that is not the native one, the kernel would really run in the
interpreter (a TPU host whose TPU failed to start would crawl without a word), so the lowering
raises, naming the platform and the interpret backend (:func:`refuse_single_platform`).
``mlir.lower_per_platform`` narrows the module's platforms inside each rule, so the native lowering
only ever sees its platform.

Mosaic's lowering asks for the TPU chip it lowers for (some rules depend on the generation). It
reads the abstract mesh's device or else the default device, which is a CPU on a build host. The TPU
rule of :data:`tpu_only` therefore names a chip itself, in this order: the abstract mesh's device
(the user picked one), the devices the computation is being compiled for (e.g.
``get_topology_desc`` devices), a real TPU on this host, and last the ``device_kind`` the backend
passes (its ``generation`` option, or the documented default generation).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax._src import core
from jax._src.interpreters import batching, mlir
from jax.sharding import AbstractDevice, AbstractMesh, AxisType


class NativeOnly:
    """A primitive running a Pallas kernel natively on ``native`` and in the interpreter elsewhere.

    Call it as ``prim(make, *args, **static)``: ``make`` maps the ``interpret`` argument of
    ``pallas_call`` to a function of ``args`` (a flat list of arrays) returning a tuple of arrays;
    ``static`` (hashable keyword values) reaches ``lower_native``, the optional native lowering
    ``lower_native(ctx, args, jaxpr, make, **static)`` used instead of inlining the traced kernel.
    """

    def __init__(self, name: str, native: str, backend: str, lower_native: Callable[..., Any] | None = None):
        self.native, self.backend, self.lower_native = native, backend, lower_native
        self.p = core.Primitive(name)
        self.p.multiple_results = True
        self.p.def_abstract_eval(lambda *args, compiled, **_: [v.aval for v in compiled.jaxpr.outvars])
        self.p.def_impl(lambda *args, **params: jax.jit(lambda *a: self.p.bind(*a, **params))(*args))
        mlir.register_lowering(self.p, self._lowering(native=False))
        mlir.register_lowering(self.p, self._lowering(native=True), platform=native)
        batching.primitive_batchers[self.p] = self._batch

    def __call__(self, make: Callable[[bool], Callable[..., tuple]], *args: Any, **static: Any) -> tuple:
        """Call ``make(interpret)(*args)`` with ``interpret=False`` natively and ``True`` elsewhere."""
        compiled = jax.make_jaxpr(make(False))(*args)
        other = jax.make_jaxpr(make(True))(*args)
        params = dict(compiled=compiled, other=other, make=make, static=tuple(sorted(static.items())))
        return tuple(self.p.bind(*args, **params))

    def _lowering(self, native: bool) -> Callable[..., Any]:
        def rule(ctx, *args, compiled, other, make, static):
            if not native:
                refuse_single_platform(ctx, self.backend, self.native)
            elif self.lower_native is not None:
                return self.lower_native(ctx, args, compiled, make, **dict(static))
            jaxpr = compiled if native else other
            return mlir.lower_fun(core.jaxpr_as_fun(jaxpr), multiple_results=True)(ctx, *args)

        return rule

    def _batch(self, args, dims, *, compiled, other, make, static):
        structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
        axes = tuple(dims)  # None = not mapped

        def vmapped(jaxpr):
            return jax.make_jaxpr(jax.vmap(core.jaxpr_as_fun(jaxpr), in_axes=axes))(*structs)

        def vmapped_make(interpret):
            return jax.vmap(make(interpret), in_axes=axes)

        out = self.p.bind(
            *args, compiled=vmapped(compiled), other=vmapped(other), make=vmapped_make, static=static
        )
        return out, [0] * len(out)


def refuse_single_platform(ctx, backend: str, native: str) -> None:
    """Raise when a module is lowered for exactly one platform and it is not ``native``.

    The interpreter fallback of a :class:`NativeOnly` primitive exists for the branches of a
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


def _lower_on_tpu(ctx, args, jaxpr, make, *, device_kind: str):
    """The Mosaic lowering, with the chip named when the context names none (module docstring)."""
    lower = mlir.lower_fun(core.jaxpr_as_fun(jaxpr), multiple_results=True)
    if jax.sharding.get_abstract_mesh().abstract_device is not None:
        return lower(ctx, *args)
    target = _target_tpu(ctx)
    if target is None and _has_real_tpu():
        return lower(ctx, *args)
    # A one-chip abstract mesh only tells Mosaic which chip it lowers for (the surrounding module's
    # shardings are already fixed). Each equation re-enters the abstract mesh it was traced under,
    # so the kernel is traced again inside this one.
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


# ``tpu_only(make, *args, device_kind=...)``: ``device_kind`` (e.g. ``"TPU v6 lite"``) is the chip
# Mosaic assumes when nothing else names one.
tpu_only = NativeOnly("flashport_tpu_only", "tpu", "pallas_tpu", lower_native=_lower_on_tpu)
# ``cuda_only(make, *args)``: the Triton kernel on CUDA.
cuda_only = NativeOnly("flashport_cuda_only", "cuda", "pallas_gpu")
