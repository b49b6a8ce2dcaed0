"""Lower a Mosaic kernel for TPU only, so multi-platform exports (``platforms=["cpu", "tpu"]``) work.

``flashport.attention(backend="auto")`` dispatches with ``lax.platform_dependent``. When one module
is lowered for several platforms, JAX lowers every kept branch for *all* of the module's platforms,
and ``pallas_call``'s CPU rule raises ("Only interpret mode is supported on CPU backend") even though
the TPU branch can never run on CPU. :func:`tpu_only` binds a small primitive whose lowering is
registered per platform: on TPU it inlines the Mosaic kernel; elsewhere it inlines the same kernel
in the discharge interpreter (``interpret=True``), which is correct (if slow) should it ever run.
``mlir.lower_per_platform`` narrows the module's platforms inside each rule, so the Mosaic lowering
only ever sees ``tpu``.
"""

from __future__ import annotations

import jax
from jax._src import core
from jax._src.interpreters import batching, mlir

tpu_only_p = core.Primitive("flashport_tpu_only")
tpu_only_p.multiple_results = True


def tpu_only(make, *args):
    """Call ``make(interpret)(*args)`` with ``interpret=False`` on TPU and ``True`` on other platforms.

    ``make`` maps the ``interpret`` argument of ``pallas_call`` to a function of ``args`` (a flat list
    of arrays) returning a tuple of arrays.
    """
    tpu = jax.make_jaxpr(make(False))(*args)
    other = jax.make_jaxpr(make(True))(*args)
    return tuple(tpu_only_p.bind(*args, tpu=tpu, other=other))


@tpu_only_p.def_abstract_eval
def _abstract_eval(*args, tpu, other):
    return [v.aval for v in tpu.jaxpr.outvars]


def _impl(*args, tpu, other):
    return jax.jit(lambda *a: tpu_only_p.bind(*a, tpu=tpu, other=other))(*args)


tpu_only_p.def_impl(_impl)


def _lowering(which):
    def rule(ctx, *args, tpu, other):
        jaxpr = tpu if which == "tpu" else other
        return mlir.lower_fun(core.jaxpr_as_fun(jaxpr), multiple_results=True)(ctx, *args)

    return rule


mlir.register_lowering(tpu_only_p, _lowering("other"))
mlir.register_lowering(tpu_only_p, _lowering("tpu"), platform="tpu")


def _batch(args, dims, *, tpu, other):
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    axes = list(dims)  # None = not mapped

    def vmapped(jaxpr):
        return jax.make_jaxpr(jax.vmap(core.jaxpr_as_fun(jaxpr), in_axes=axes))(*structs)

    out = tpu_only_p.bind(*args, tpu=vmapped(tpu), other=vmapped(other))
    return out, [0] * len(out)


batching.primitive_batchers[tpu_only_p] = _batch
