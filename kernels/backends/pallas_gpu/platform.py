"""Lower a Pallas Triton kernel for CUDA only, so multi-platform exports (``platforms=["cpu", "cuda"]``)
of ``backend="auto"`` keep working.

``flashport.attention(backend="auto")`` dispatches with ``lax.platform_dependent``. When one module is
lowered for several platforms, JAX lowers every kept branch for *all* of the module's platforms, and
``pallas_call``'s CPU rule raises ("Only interpret mode is supported on CPU backend") even though the
CUDA branch can never run on CPU. :func:`cuda_only` binds a small primitive whose lowering is
registered per platform: on CUDA it inlines the Triton kernel; elsewhere the same kernel in the Pallas
interpreter (``interpret=True``), which is correct (if slow) should it ever run; lowered for one
platform that is not CUDA, it raises instead (:func:`~flashport.kernels.backends.pallas_tpu.platform.refuse_single_platform`).
``mlir.lower_per_platform`` narrows the module's platforms inside each rule, so the Triton lowering
only ever sees ``cuda``. (The same device as :mod:`flashport.kernels.pallas_tpu_platform`, without
the TPU chip selection.)
"""

from __future__ import annotations

import jax
from jax._src import core
from jax._src.interpreters import batching, mlir

from flashport.kernels.backends.pallas_tpu.platform import refuse_single_platform

cuda_only_p = core.Primitive("flashport_cuda_only")
cuda_only_p.multiple_results = True


def cuda_only(make, *args):
    """Call ``make(interpret)(*args)`` with ``interpret=False`` on CUDA and ``True`` on other platforms.

    ``make`` maps the ``interpret`` argument of ``pallas_call`` to a function of ``args`` (a flat list
    of arrays) returning a tuple of arrays.
    """
    cuda = jax.make_jaxpr(make(False))(*args)
    other = jax.make_jaxpr(make(True))(*args)
    return tuple(cuda_only_p.bind(*args, cuda=cuda, other=other))


@cuda_only_p.def_abstract_eval
def _abstract_eval(*args, cuda, other):
    return [v.aval for v in cuda.jaxpr.outvars]


def _impl(*args, **params):
    return jax.jit(lambda *a: cuda_only_p.bind(*a, **params))(*args)


cuda_only_p.def_impl(_impl)


def _lowering(which):
    def rule(ctx, *args, cuda, other):
        if which != "cuda":
            refuse_single_platform(ctx, "pallas_gpu", "cuda")
        jaxpr = cuda if which == "cuda" else other
        return mlir.lower_fun(core.jaxpr_as_fun(jaxpr), multiple_results=True)(ctx, *args)

    return rule


mlir.register_lowering(cuda_only_p, _lowering("other"))
mlir.register_lowering(cuda_only_p, _lowering("cuda"), platform="cuda")


def _batch(args, dims, *, cuda, other):
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]

    def vmapped(jaxpr):
        return jax.make_jaxpr(jax.vmap(core.jaxpr_as_fun(jaxpr), in_axes=tuple(dims)))(*structs)

    out = cuda_only_p.bind(*args, cuda=vmapped(cuda), other=vmapped(other))
    return out, [0] * len(out)


batching.primitive_batchers[cuda_only_p] = _batch
