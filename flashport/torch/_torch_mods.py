"""Torch ``score_mod`` / ``mask_mod`` functions traced into JAX, for the JAX routes of FlexAttention.

On the TPU routes (torch_xla, torchax) and with an explicit JAX backend, ``flashport.torch.flex_attention``
runs :func:`flashport.attention`, whose mods are JAX functions of scalars. :func:`to_jax_mod` wraps
a torch mod so that JAX can trace it: each scalar argument becomes a :class:`Scalar` proxy that
implements Python's operators and torch's ``__torch_function__`` protocol with ``jax.numpy``, so
``torch.where``, ``torch.tanh``, ``x.abs()``, ``slopes[h]`` (a closed-over tensor indexed by a
proxy) all become JAX operations while JAX traces.

What a mod may contain on these routes (anything else is refused with a TypeError naming it):

* arithmetic, comparisons, ``&``, ``|``, ``~`` and ``**`` between the arguments and Python numbers;
* the torch functions / tensor methods in :data:`UNARY`, :data:`BINARY`, ``where``, ``clamp``,
  ``clip`` and dtype casts (``.to(dtype)``, ``.float()``, ``.int()``, ``.long()``, ``.bool()``);
* closed-over tensors (CPU ones or the route's own), read by indexing with the arguments
  (``table[h, q_idx - kv_idx]``); the mod runs with torchax's torch modes set aside, so only the
  proxies see its torch calls. The tensors are constants of the traced function: gradients do not reach them on these routes, so a closed-over
  tensor that requires grad is refused (use ``backend="auto"`` on CPU/CUDA, where torch's own
  FlexAttention differentiates it).

Python control flow on the arguments (``if q_idx > 3:``) cannot be traced on any route of
FlexAttention either; use ``torch.where``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

UNARY = {
    "neg": "negative",
    "__neg__": "negative",
    "abs": "abs",
    "__abs__": "abs",
    "tanh": "tanh",
    "exp": "exp",
    "exp2": "exp2",
    "log": "log",
    "log2": "log2",
    "log1p": "log1p",
    "sqrt": "sqrt",
    "rsqrt": None,
    "sigmoid": None,
    "sin": "sin",
    "cos": "cos",
    "floor": "floor",
    "ceil": "ceil",
    "round": "round",
    "sign": "sign",
    "logical_not": "logical_not",
    "__invert__": "invert",
    "bitwise_not": "invert",
}
BINARY = {
    "add": "add",
    "__add__": "add",
    "__radd__": "add",
    "sub": "subtract",
    "__sub__": "subtract",
    "mul": "multiply",
    "__mul__": "multiply",
    "__rmul__": "multiply",
    "div": "true_divide",
    "true_divide": "true_divide",
    "__truediv__": "true_divide",
    "floor_divide": "floor_divide",
    "__floordiv__": "floor_divide",
    "remainder": "remainder",
    "__mod__": "remainder",
    "pow": "power",
    "__pow__": "power",
    "eq": "equal",
    "__eq__": "equal",
    "ne": "not_equal",
    "__ne__": "not_equal",
    "lt": "less",
    "__lt__": "less",
    "le": "less_equal",
    "__le__": "less_equal",
    "gt": "greater",
    "__gt__": "greater",
    "ge": "greater_equal",
    "__ge__": "greater_equal",
    "logical_and": "logical_and",
    "logical_or": "logical_or",
    "bitwise_and": "bitwise_and",
    "__and__": "bitwise_and",
    "__rand__": "bitwise_and",
    "bitwise_or": "bitwise_or",
    "__or__": "bitwise_or",
    "__ror__": "bitwise_or",
    "__xor__": "bitwise_xor",
    "minimum": "minimum",
    "maximum": "maximum",
    "atan2": "arctan2",
}
REVERSED = {
    "__rsub__": "subtract",
    "__rtruediv__": "true_divide",
    "__rfloordiv__": "floor_divide",
    "__rpow__": "power",
    "__rmod__": "remainder",
}
CASTS = {
    "float": "float32",
    "int": "int32",
    "long": "int32",
    "bool": "bool_",
    "half": "float32",
    "bfloat16": "float32",
}


def _mod_error() -> type[TypeError]:
    """The TypeError that :func:`flashport.kernels.semantics.mods.trace` passes on unchanged."""
    from flashport.kernels.semantics.mods import ModError

    return ModError


def _jnp() -> Any:
    import jax.numpy as jnp

    return jnp


def _dtype(dtype: Any) -> Any:
    """A torch dtype as the JAX dtype a mod computes in (float32 / int32 / bool: no x64)."""
    jnp = _jnp()
    if dtype == torch.bool:
        return jnp.bool_
    if dtype.is_floating_point:
        return jnp.float32
    return jnp.int32


def _value(x: Any, kind: str, grad: bool = False) -> Any:
    """``x`` as a JAX value: proxies unwrap, closed-over tensors become constants (refused when
    ``grad``, the caller's grad mode, would differentiate them)."""
    if isinstance(x, Scalar):
        return x.value
    if isinstance(x, torch.Tensor):
        if x.requires_grad and grad:
            raise _mod_error()(
                f"{kind} closes over a tensor that requires grad {tuple(x.shape)}: on the JAX routes of "
                "flashport.torch.flex_attention closed-over tensors are constants, so its gradient would "
                "be lost; detach it, or run on CPU/CUDA (torch's own FlexAttention differentiates it)"
            )
        as_jax = getattr(x, "jax", None)  # a torchax tensor holds its JAX array
        if callable(as_jax):
            return as_jax()
        array = x.detach().cpu()
        if array.dtype.is_floating_point:
            array = array.float()
        elif array.dtype != torch.bool:
            array = array.int()
        return _jnp().asarray(array.numpy())
    if isinstance(x, (tuple, list)):
        return tuple(_value(e, kind, grad) for e in x)
    if isinstance(x, torch.dtype):
        return _dtype(x)
    return x


class Scalar:
    """One argument (or intermediate) of a torch mod while JAX traces it: ``value`` is a JAX value;
    ``grad``: whether the call differentiates (closed-over tensors that require grad are refused)."""

    kind = "mod"

    def __init__(self, value: Any, kind: str, grad: bool = False):
        self.value, self.kind, self.grad = value, kind, grad

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        first = next(_scalars((args, kwargs)))  # ``table[h, i - j]`` passes them in a tuple
        return _apply(getattr(func, "__name__", str(func)), args, kwargs or {}, first)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: _apply(name, (self, *args), kwargs, self)

    def __bool__(self) -> bool:
        raise _mod_error()(
            f"{self.kind} branches on a traced value (if/and/or/not on q_idx, score...): FlexAttention "
            "mods must be branch-free; use torch.where(cond, a, b) or & / |"
        )

    __hash__ = None  # type: ignore[assignment]


def _scalars(x: Any) -> Any:
    """The :class:`Scalar` proxies in ``x`` (nested tuples, lists and dicts), in order."""
    if isinstance(x, Scalar):
        yield x
    elif isinstance(x, (tuple, list)):
        for e in x:
            yield from _scalars(e)
    elif isinstance(x, dict):
        for e in x.values():
            yield from _scalars(e)


def _operator(name: str) -> Any:
    return lambda self, *args: _apply(name, (self, *args), {}, self)


for _name in (*UNARY, *BINARY, *REVERSED, "__getitem__"):
    if _name.startswith("__"):
        setattr(Scalar, _name, _operator(_name))


def _apply(name: str, args: tuple, kwargs: dict, like: Scalar) -> Any:
    """Torch function ``name`` on proxies and constants, computed with jax.numpy; the result is a
    proxy like ``like``."""
    jnp = _jnp()
    kind = like.kind
    values = [_value(a, kind, like.grad) for a in args]
    kw = {k: _value(v, kind, like.grad) for k, v in kwargs.items()}
    result = _compute(jnp, name, values, kw)
    if result is not None:
        return Scalar(result, kind, like.grad)
    raise _mod_error()(
        f"{kind} uses torch {name}(...), which flashport cannot trace into JAX on this route; a mod may "
        "use arithmetic, comparisons, &, |, ~, torch.where, clamp, casts, indexing of closed-over "
        f"tensors and {', '.join(sorted(n for n in UNARY if not n.startswith('_')))}"
    )


def _compute(jnp: Any, name: str, values: list, kw: dict) -> Any:
    """The JAX value of torch function ``name`` on ``values`` / ``kw`` (None: not supported)."""
    if name == "__getitem__":
        table, index = values
        return jnp.asarray(table)[index]
    if name in UNARY and len(values) == 1 and not kw:
        fn = UNARY[name]
        return jax_special(name, values[0]) if fn is None else getattr(jnp, fn)(values[0])
    if name in BINARY and len(values) == 2 and not kw:
        return getattr(jnp, BINARY[name])(values[0], values[1])
    if name in REVERSED and len(values) == 2:
        return getattr(jnp, REVERSED[name])(values[1], values[0])
    if name == "where" and len(values) == 3:
        return jnp.where(*values)
    if name in ("clamp", "clip"):
        low = kw.get("min", values[1] if len(values) > 1 else None)
        high = kw.get("max", values[2] if len(values) > 2 else None)
        return jnp.clip(values[0], low, high)
    if name == "to" and len(values) == 2 and not kw:
        return jnp.asarray(values[0]).astype(values[1])
    if name in CASTS and len(values) == 1:
        return jnp.asarray(values[0]).astype(getattr(jnp, CASTS[name]))
    return None


def jax_special(name: str, x: Any) -> Any:
    """The unary functions jax.numpy lacks under torch's name."""
    import jax

    if name == "sigmoid":
        return jax.nn.sigmoid(x)
    return jax.lax.rsqrt(x)


def to_jax_mod(fn: Any, kind: str, grad: bool) -> Any:
    """The torch mod ``fn`` as a JAX function of scalars (``None`` stays ``None``); ``grad``: the
    caller differentiates (a closed-over tensor that requires grad is then refused)."""
    if fn is None:
        return None

    def traced(*scalars: Any) -> Any:
        with _without_torch_modes():
            out = fn(*(Scalar(x, kind, grad) for x in scalars))
        value = _value(out, kind, grad)
        jnp = _jnp()
        return jnp.asarray(value, jnp.bool_ if kind == "mask_mod" else jnp.float32)

    traced.__name__ = getattr(fn, "__name__", kind)
    return traced


@contextlib.contextmanager
def _without_torch_modes() -> Iterator[None]:
    """Set aside the torch function and dispatch modes (torchax's environment) while a mod runs on
    proxies: only :meth:`Scalar.__torch_function__` may see its torch calls, or torchax would take
    ``table[h]`` (a closed-over CPU tensor indexed by a proxy) for its own and index a JAX array
    with the proxy."""
    from torch.utils._python_dispatch import _disable_current_modes

    with contextlib.ExitStack() as stack:
        for _ in torch.overrides._get_current_function_mode_stack():
            stack.enter_context(torch.overrides._pop_mode_temporarily())
        stack.enter_context(_disable_current_modes())
        yield
