"""The backend registry: the seam where kernels plug into ``flashport.attention``.

A backend is a function ``fn(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, seed, *, spec, options)``
over the canonical arrays described in :mod:`flashport.kernels.contract.spec`, returning ``(out, lse)``. It is
registered with :func:`register` together with the features it supports, the platforms it runs on
and an optional ``check`` for limits that features alone cannot express (head_dim, dtype pairs...).

``flashport.attention`` asks :func:`missing_features` before calling an explicit backend, and
:func:`choose` picks one per platform for ``backend="auto"``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from collections.abc import Callable
from typing import Any

import jax

from flashport.kernels.contract.call import Call
from flashport.kernels.contract.spec import FEATURES

log = logging.getLogger("flashport")

# Modules that register backends on import. Missing optional modules are skipped.
BACKEND_MODULES = (
    "flashport.kernels.backends.xla",
    "flashport.kernels.backends.blockwise",
    "flashport.kernels.backends.cpu_native.backend",
    "flashport.kernels.backends.cudnn",
    "flashport.kernels.backends.pallas_tpu",
    "flashport.kernels.backends.pallas_gpu",
    "flashport.kernels.backends.splash",
)

# For backend="auto": the order of preference per platform (first available and capable wins).
AUTO_PREFERENCE = {
    "tpu": ("pallas_tpu", "blockwise", "xla"),
    "cuda": ("cudnn", "pallas_gpu", "blockwise", "xla"),
    "rocm": ("blockwise", "xla"),
    "cpu": ("cpu_native", "blockwise", "xla"),
}


@dataclasses.dataclass(frozen=True)
class InterpretTwin:
    """A backend's kernels run by the Pallas interpreter on CPU, declared on its :class:`BackendInfo`.

    :func:`register` registers it as ``<name>_interpret``: CPU only, never chosen by ``auto``, with
    the backend's features, ``check`` and ``deferrable``.

    Attributes:
      description: one line for ``flashport.backends()`` and the porting guide.
      fn: the interpreted forward (same signature as ``BackendInfo.fn``).
      backward: optional interpreted residual backward (see ``BackendInfo.backward``).
    """

    description: str
    fn: Callable[..., Any]
    backward: Callable[..., Any] | None = None


@dataclasses.dataclass(frozen=True)
class BackendInfo:
    """What one backend is, where it runs and what it supports.

    Attributes:
      name: registry key, e.g. ``"blockwise"``.
      description: one line for ``flashport.backends()`` and the porting guide.
      platforms: XLA platforms it can lower for (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``).
      features: the subset of :data:`flashport.kernels.contract.spec.FEATURES` it implements.
      fn: the implementation (see module docstring).
      check: optional ``check(call) -> str | None`` giving a reason it cannot take this call.
      is_available: optional ``() -> bool``; whether it can run on this machine right now.
      prefer: optional ``prefer(call) -> str | None``; for ``auto`` only: a reason to pass this
        backend over for a call it could run (e.g. the blockwise path is slower for short sequences).
      backward: optional residual backward ``backward(q, k, v, bias, mask, q_segment_ids,
        kv_segment_ids, seed, out, lse, d_out, d_lse, *, spec, options) -> (dq, dk, dv, dbias)``
        over canonical arrays: the gradients from the forward's ``out`` and ``lse`` without running
        the forward again (:func:`flashport.kernels.contract.backward.attention_backward`; without one, that
        recomputes the forward under ``jax.vjp``).
      deferrable: whether ``auto`` may leave it untraced until a module is lowered for its platform
        (:mod:`flashport.kernels.contract.deferred`); False for one whose lowering cannot run nested inside
        another equation's (cuDNN's ``custom_partitioning`` needs the module's device assignment).
      interpret: optional :class:`InterpretTwin`, registered with it as ``<name>_interpret``.
    """

    name: str
    description: str
    platforms: tuple[str, ...]
    features: frozenset[str]
    fn: Callable[..., Any]
    check: Callable[[Call], str | None] | None = None
    is_available: Callable[[], bool] | None = None
    prefer: Callable[[Call], str | None] | None = None
    backward: Callable[..., Any] | None = None
    deferrable: bool = True
    interpret: InterpretTwin | None = None

    @property
    def available(self) -> bool:
        """Whether this backend can run on this machine now."""
        return True if self.is_available is None else bool(self.is_available())

    def as_row(self) -> dict[str, Any]:
        """A plain-data view for reports and the porting guide."""
        return {
            "name": self.name,
            "available": self.available,
            "platforms": list(self.platforms),
            "features": {f: f in self.features for f in FEATURES},
            "description": self.description,
        }


@dataclasses.dataclass(frozen=True)
class BackendChoice:
    """A backend name plus options, e.g. ``BackendChoice("pallas_tpu", (("block_q", 512),))``.

    Pass one as ``backend=`` to ``flashport.attention`` to give a backend its options; build it with
    :func:`use`. Hashable, so it can be a static jit argument.
    """

    name: str
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def options_dict(self) -> dict[str, Any]:
        """The options as a dict."""
        return dict(self.options)


def use(name: str, **options: Any) -> BackendChoice:
    """Return a backend choice with options, e.g. ``use("pallas_tpu", block_q=512)``."""
    return BackendChoice(name, tuple(sorted(options.items())))


_REGISTRY: dict[str, BackendInfo] = {}
_loaded = False


@functools.lru_cache(maxsize=1)
def cuda_present() -> bool:
    """Whether this process has a CUDA device (an ``is_available`` probe; cached: device discovery
    is not free)."""
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def register(info: BackendInfo) -> BackendInfo:
    """Add (or replace) a backend in the registry, and its interpret twin if it declares one; return it."""
    unknown = set(info.features) - set(FEATURES)
    if unknown:
        raise ValueError(f"backend {info.name!r} declares unknown features {sorted(unknown)}")
    _REGISTRY[info.name] = info
    if info.interpret is not None:
        twin = interpret_twin(info)
        _REGISTRY[twin.name] = twin
    return info


def interpret_twin(info: BackendInfo) -> BackendInfo:
    """The ``<name>_interpret`` backend of ``info``'s :class:`InterpretTwin`: the same kernels in the
    Pallas interpreter on CPU, with ``info``'s features and limits."""
    if info.interpret is None:
        raise ValueError(f"backend {info.name!r} declares no interpret twin")
    return BackendInfo(
        name=f"{info.name}_interpret",
        description=info.interpret.description,
        platforms=("cpu",),
        features=info.features,
        fn=info.interpret.fn,
        check=info.check,
        backward=info.interpret.backward,
        deferrable=info.deferrable,
    )


def _load_builtin() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module in BACKEND_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:  # an optional backend module that is not shipped yet
            if err.name != module:
                raise
            log.debug("flashport: backend module %s not present", module)


def get(name: str) -> BackendInfo:
    """Return the registered backend ``name`` or raise ``ValueError`` listing the known ones."""
    _load_builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(["auto", *sorted(_REGISTRY)])
        raise ValueError(f"backend={name!r} is not a flashport backend; use one of: {known}") from None


def all_backends() -> dict[str, BackendInfo]:
    """All registered backends by name."""
    _load_builtin()
    return dict(_REGISTRY)


def backends() -> dict[str, dict[str, Any]]:
    """Report every backend: whether it is available here, its platforms and supported features.

    Returns:
      ``{name: {"name", "available", "platforms", "features": {feature: bool}, "description"}}``.
    """
    return {name: info.as_row() for name, info in sorted(all_backends().items())}


def missing_features(info: BackendInfo, call: Call) -> list[str]:
    """Features (or limits, as reasons) that ``call`` needs and backend ``info`` lacks."""
    missing = sorted(call.features - info.features)
    if not missing and info.check is not None:
        reason = info.check(call)
        if reason:
            missing.append(reason)
    return missing


def backends_with(features: frozenset[str]) -> list[str]:
    """Names of the backends that support all of ``features``."""
    return sorted(n for n, i in all_backends().items() if features <= i.features)


def choose(platform: str, call: Call) -> tuple[str, str]:
    """Pick the backend ``auto`` uses on ``platform`` for ``call``; returns ``(name, why)``."""
    reasons: list[str] = []
    for name in AUTO_PREFERENCE.get(platform, ("blockwise", "xla")):
        info = all_backends().get(name)
        if info is None:
            reasons.append(f"{name}: not installed")
            continue
        if platform not in info.platforms:
            continue
        missing = missing_features(info, call)
        if missing:
            reasons.append(f"{name}: lacks {', '.join(missing)}")
            continue
        if info.prefer is not None:
            skip = info.prefer(call)
            if skip:
                reasons.append(f"{name}: {skip}")
                continue
        why = "; ".join(reasons) if reasons else "first preference"
        return name, why
    # xla supports every feature, so reaching here means it was unregistered.
    raise RuntimeError(f"no flashport backend can run this call on {platform}: {'; '.join(reasons)}")
