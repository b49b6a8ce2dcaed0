"""Every drop-in's signature against the source API catalogue (``flashport.rules.apis``).

For each drop-in and each upstream release it claims, ``inspect.signature`` of the drop-in (a
function, a class's constructor, a method or classmethod) must list the catalogue's parameters:
same names, order, kinds and defaults. A deliberate difference is recorded in the catalogue entry
(``DropIn.deviation`` and the signature the drop-in has instead). The completeness tests make a new
public drop-in, or a new public method of a drop-in class, fail until it has a catalogue entry.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import pkgutil
import subprocess
import sys

import pytest

pytest.importorskip("torch")

import flashport.integrations
from flashport.rules import apis
from flashport.rules.apis import xformers as xformers_apis
from flashport.rules.apis.model import Params

CASES = [
    pytest.param(
        api,
        drop_in,
        release,
        id=f"{drop_in.module.rsplit('.', 1)[-1]}.{drop_in.name}@{'.'.join(map(str, release))}",
    )
    for api in apis.catalogue()
    for drop_in in api.drop_ins
    for release in drop_in.releases
]


def resolve(module: str, name: str):
    """The object ``module.name`` (``name`` may be ``Class.method``)."""
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def described(obj) -> list[tuple[str, str, object]]:
    """``(name, kind, default)`` of each parameter of ``obj``; a dataclass field's default factory
    counts as the value it makes."""
    factories = {}
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj):
        factories = {
            f.name: f.default_factory()
            for f in dataclasses.fields(obj)
            if f.default_factory is not dataclasses.MISSING
        }
    return [
        (p.name, p.kind.name, factories.get(p.name, _plain(p.default)))
        for p in inspect.signature(obj).parameters.values()
        if not (p.name in FLAX_FIELDS and _is_flax_module(obj))
    ]


FLAX_FIELDS = ("parent", "name")  # every flax.linen Module's own fields, after the upstream module's


def _is_flax_module(obj) -> bool:
    """Whether ``obj`` is a ``flax.linen.Module`` class (without importing flax)."""
    return inspect.isclass(obj) and any(
        c.__module__ == "flax.linen.module" and c.__name__ == "Module" for c in obj.__mro__
    )


def _plain(default):
    """An enum member as ``"Enum.MEMBER"`` (the catalogue holds no library objects)."""
    return f"{type(default).__name__}.{default.name}" if isinstance(default, enum.Enum) else default


def expected(parameters: Params) -> list[tuple[str, str, object]]:
    return [(p.name, p.kind.name, p.default) for p in parameters]


@pytest.mark.parametrize(("api", "drop_in", "release"), CASES)
def test_drop_in_signature_matches_catalogue(api, drop_in, release):
    upstream = api.signature_at(release)
    if drop_in.deviation:
        assert drop_in.signature is not None, "a documented deviation states the drop-in's signature"
        want = drop_in.signature
    else:
        assert upstream is not None, f"{api.names[0]}: no upstream signature at {release}"
        want = upstream
    assert described(resolve(drop_in.module, drop_in.name)) == expected(want)


@pytest.mark.parametrize(("api", "drop_in", "release"), [c for c in CASES if c.values[1].deviation])
def test_deviation_differs_from_upstream(api, drop_in, release):
    """A recorded deviation is a real difference (else the entry should claim upstream's signature)."""
    upstream = api.signature_at(release)
    assert upstream is None or expected(upstream) != expected(drop_in.signature)


def integration_modules():
    """Every public module of ``flashport.integrations``."""
    package = flashport.integrations
    return [
        importlib.import_module(f"{package.__name__}.{info.name}")
        for info in pkgutil.iter_modules(package.__path__)
        if not info.name.startswith("_")
    ]


def exported(module) -> dict[str, object]:
    """The callables ``module`` exports (its ``__all__``, else the public ones it defines), less
    enum classes (values, not calls)."""
    names = getattr(module, "__all__", None)
    if names is None:
        names = [
            n
            for n, obj in vars(module).items()
            if not n.startswith("_") and callable(obj) and getattr(obj, "__module__", None) == module.__name__
        ]
    objects = {n: getattr(module, n) for n in names}
    return {
        n: obj
        for n, obj in objects.items()
        if callable(obj) and not (inspect.isclass(obj) and issubclass(obj, enum.Enum))
    }


def catalogued_objects() -> set[int]:
    return {id(resolve(drop_in.module, drop_in.name)) for api in apis.catalogue() for drop_in in api.drop_ins}


def test_every_exported_drop_in_is_catalogued():
    known, own = catalogued_objects(), apis.own_api()
    missing = [
        f"{module.__name__}.{name}"
        for module in integration_modules()
        for name, obj in exported(module).items()
        if id(obj) not in known and name not in own.get(module.__name__, ())
    ]
    assert not missing, (
        "drop-ins without a catalogue entry (add an Api with its upstream signature to "
        f"flashport.rules.apis, or list flashport's own API in OWN_API): {missing}"
    )


def test_every_public_method_of_a_drop_in_class_is_catalogued():
    entries = {(d.module, d.name) for api in apis.catalogue() for d in api.drop_ins}
    missing = []
    for module, name in sorted(entries):
        cls = resolve(module, name)
        if not inspect.isclass(cls):
            continue
        for attribute, value in vars(cls).items():
            method = inspect.isfunction(value) or isinstance(value, (classmethod, staticmethod))
            if method and not attribute.startswith("_") and attribute not in xformers_apis.OWN_METHODS:
                if (module, f"{name}.{attribute}") not in entries:
                    missing.append(f"{module}.{name}.{attribute}")
    assert not missing, f"public methods of drop-in classes without a catalogue entry: {missing}"


def test_catalogue_imports_neither_jax_nor_torch():
    """The CLI reads the catalogue; it must not pull in jax or torch."""
    code = (
        "import sys; from flashport.rules import apis; apis.catalogue(); apis.own_api(); "
        "print(sorted(m for m in ('jax', 'torch') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_drop_in_tables_point_at_catalogued_drop_ins():
    """The codemod's drop-in tables (values replaced by a drop-in, imports re-pointed to one) name
    only drop-ins whose signature the catalogue checks."""
    from flashport.rewriter.imports.drop_in_imports import DROP_INS
    from flashport.rules.common import values

    tables = [(module, name) for module, names in values.PROVIDES.items() for name in names]
    tables += [(module, name) for module, names in DROP_INS.values() for name in names]
    known = catalogued_objects()
    unchecked = sorted(f"{m}.{n}" for m, n in tables if id(resolve(m, n)) not in known)
    assert not unchecked, f"drop-in tables name drop-ins without a catalogue entry: {unchecked}"


@pytest.mark.parametrize(
    ("version", "replaced"), [((2, 6, 0), False), ((2, 6, 1), True), ((2, 5, 9), False), ((2, 8, 3), True)]
)
def test_kvcache_value_gets_the_drop_in_only_where_its_signature_matches(version, replaced):
    """flash-attn 2.6.1 inserted cache_leftpad mid-signature: a value of 2.6.0's
    flash_attn_with_kvcache keeps the original (its positional calls would bind differently)."""
    from types import SimpleNamespace

    from flashport.rules.common import values

    ctx = SimpleNamespace(options=SimpleNamespace(flash_attn_version=version))
    result = values.drop_in("flash_attn.flash_attn_with_kvcache", ctx)  # type: ignore[arg-type]
    assert (result == (values.FA2, "flash_attn_with_kvcache")) is replaced, result


@pytest.mark.parametrize(
    ("module", "name", "args", "kwargs", "message"),
    [
        (
            "flash_attn_compat",
            "flash_attn_func",
            (1, 2),
            {},
            r"flash_attn_func\(\) missing a required argument: 'v'",
        ),
        (
            "flash_attn_compat",
            "flash_attn_func",
            (1, 2, 3),
            {"bogus": 1},
            r"unexpected keyword argument 'bogus'",
        ),
        (
            "flash_attn_compat",
            "_flash_attn_forward_v2_4",
            (1,) * 10,
            {},
            r"_flash_attn_forward_v2_4\(\) too many",
        ),
        ("flash_attn3_compat", "flash_attn_func", (1, 2, 3), {"q": 1}, r"multiple values for argument 'q'"),
        (
            "flash_attn4_compat",
            "flash_attn_func",
            (1, 2, 3, 4),
            {},
            r"flash_attn_func\(\) too many positional",
        ),
    ],
)
def test_a_call_that_does_not_fit_the_signature_raises_type_error_before_running(
    module, name, args, kwargs, message
):
    """A drop-in rejects what the upstream function rejects (TypeError naming it), before any work."""
    drop_in = resolve(f"flashport.integrations.{module}", name)
    with pytest.raises(TypeError, match=message):
        drop_in(*args, **kwargs)
