"""The data model of the source-API catalogue: :class:`Api` (qualified names, signature per release,
return and lse conventions), :class:`DropIn` (flashport's replacement), :class:`Param`, the
compact signature builders :func:`params` and :func:`keyword_only`, and :func:`one_release` for an
API recorded at one release with a drop-in of its own name."""

from __future__ import annotations

import dataclasses
import inspect

REQUIRED = inspect.Parameter.empty  # a parameter without a default
POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD
KEYWORD_ONLY = inspect.Parameter.KEYWORD_ONLY
VAR_KEYWORD = inspect.Parameter.VAR_KEYWORD

Version = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter: its name, default (:data:`REQUIRED` for none) and kind."""

    name: str
    default: object = REQUIRED
    kind: inspect._ParameterKind = POSITIONAL


Params = tuple[Param, ...]


def params(*required: str, **defaults: object) -> Params:
    """``required`` positional parameters, then ``defaults`` (in order): the usual shape of a Python
    signature, written compactly."""
    return tuple(Param(n) for n in required) + tuple(Param(n, d) for n, d in defaults.items())


def keyword_only(**defaults: object) -> Params:
    """Keyword-only parameters with ``defaults`` (in order)."""
    return tuple(Param(n, d, KEYWORD_ONLY) for n, d in defaults.items())


@dataclasses.dataclass(frozen=True)
class DropIn:
    """flashport's replacement of an API.

    Attributes:
      module: the ``flashport.integrations`` module that defines or exports it.
      name: its attribute there (``Class.method`` for a method or classmethod).
      releases: the upstream releases whose signature it replicates (the test checks each).
      exact: whether it replicates every use of a value of the API (same signature, defaults and
        return convention), so a reference to the API may be pointed at it.
      deviation: why its signature differs from upstream's, when it deliberately does; then
        ``signature`` is the one it has instead.
      signature: the drop-in's own parameters when ``deviation`` is set.
    """

    module: str
    name: str
    releases: tuple[Version, ...]
    exact: bool = True
    deviation: str = ""
    signature: Params | None = None


@dataclasses.dataclass(frozen=True)
class Api:
    """One source API.

    Attributes:
      names: its qualified import paths (the first is canonical).
      signatures: ``(first release, parameters)`` in release order; a release has the parameters of
        the latest entry at or before it.
      returns: what a call returns (``"out"``, ``"(out, lse)"``, ...).
      lse: the layout of a returned log-sum-exp, if any.
      drop_ins: flashport's replacements (one per release range where the signature changed).
    """

    names: tuple[str, ...]
    signatures: tuple[tuple[Version, Params], ...]
    returns: str = "out"
    lse: str = ""
    drop_ins: tuple[DropIn, ...] = ()

    def signature_at(self, release: Version) -> Params | None:
        """The parameters at ``release`` (None before the first known release)."""
        found = None
        for since, parameters in self.signatures:
            if pad(release) >= pad(since):
                found = parameters
        return found


def one_release(
    names: tuple[str, ...],
    release: Version,
    parameters: Params,
    drop_in_module: str,
    *,
    returns: str = "out",
    lse: str = "",
    exact: bool = True,
    drop_in_name: str = "",
) -> Api:
    """An API recorded at one ``release`` whose drop-in, in ``drop_in_module``, replicates that release
    under the API's own name (its last component, unless ``drop_in_name`` says otherwise)."""
    name = drop_in_name or names[0].rsplit(".", 1)[-1]
    return Api(
        names=names,
        signatures=((release, parameters),),
        returns=returns,
        lse=lse,
        drop_ins=(DropIn(drop_in_module, name, (release,), exact=exact),),
    )


def pad(version: Version) -> Version:
    """``(2, 7)`` as ``(2, 7, 0)``: versions compare by release, whatever their length."""
    return tuple(version) + (0,) * (3 - len(version))
