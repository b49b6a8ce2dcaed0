"""``flashport.fuse_attention`` and ``flashport.find_attention``: the jaxpr attention-fusion pass.

``fuse_attention(f)`` traces ``f`` once per input signature, finds ``softmax(Q·Kᵀ)·V`` subgraphs
(also inside ``jit``, ``custom_jvp``/``custom_vjp``, ``checkpoint``, ``scan``, ``cond`` and ``while``
bodies), replaces each with a ``flashport.attention`` call by editing the jaxpr (no retrace of
``f``: each distinct site is traced once, alone, and spliced in) and evaluates the rewritten jaxpr
by re-binding its primitives, so it composes with ``jax.jit``, ``jax.grad``, ``jax.vmap`` and
``jax.checkpoint`` in either order. A program without matches runs exactly as before (the original
function is called).

Semantics that are preserved, not "fixed":

* **Fully masked rows.** ``flashport.attention`` returns 0 for a query row that sees no key. The
  original code may not: with a finite fill (``finfo.min`` in flax/transformers, ``-0.7·max`` in
  ``jax.nn``, ``-1e9``...) every score of such a row equals the fill, the softmax is uniform and the
  row is ``mean(V)``; with a ``-inf`` fill it is NaN; with a post-softmax zero-mask
  (``softmax(where=)``, keras) it is 0. The pass reproduces the original: when a mask can empty a
  row it asks for the log-sum-exp and selects ``mean(V)`` (or NaN) where it is ``-inf``. The cost is
  an O(S·D) mean, never the O(S²) scores, and it keeps outputs identical to the unfused program
  for padded batches, which is what users rely on. (Gradients of such rows: w.r.t. V they match the
  original ``mean``; the NaN case gives a NaN value but zero gradients.)
* **Masks** must use a fill that is at most -1e4 in the softmax dtype (``-inf`` included), otherwise
  the masked probabilities are not zero and the site is a near-miss. Masks computed from constants
  (``iota`` comparisons, ``tril``, constant arrays) are evaluated at trace time and, when they fit
  exactly, become ``causal``/``window``/``align`` (no mask array is passed).
* **Order with grad.** Use ``jax.grad(fuse_attention(f))``: the fused op brings its own backward.
  ``fuse_attention(jax.grad(f))`` sees a program whose backward reuses the probabilities, so by
  the escape rule nothing is fused and every site is reported as a near-miss (the function still
  runs, unchanged).
* **Spellings folded into the contract.** Softmax normalized after the P·V product
  (``(exp(s - max) @ v) / sum(exp(s - max))``, or ``* (1 / sum)`` / ``* reciprocal(sum)``) is fused
  like any softmax. K/V repeated over heads with ``jnp.repeat`` or ``broadcast_to`` + reshape (query
  head ``h`` reads kv head ``h // G``) reach the kernel un-repeated, as the contract's GQA;
  ``jnp.tile`` (head ``h`` reads ``h % Hkv``) is fused with the repeated K/V as written. A boolean
  key-padding mask (``mask[:, None, None, :]``) is passed as kv segment ids; an additive padding bias
  (``(1 - mask) * -1e9``) stays a bias, because on a fully padded row it means ``softmax(s - 1e9)``,
  not the contract's "no visible key".
* **Attention-weight dropout** (a ``jax.random.bernoulli`` keep-mask applied to the probabilities
  with ``1/(1-p)`` scaling, as Flax, Haiku, Equinox and Keras write it) is fused only with
  ``fuse_attention(f, dropout="contract")``: the site calls ``flashport.attention(...,
  dropout_rate=p, dropout_rng=key)`` with the program's key, so the rate and the expectation are
  the same but the kept entries are the contract's (:mod:`flashport.kernels.semantics.dropout`), not the
  original program's. By default such a site runs as written and is a near-miss naming the option.
* Nested calls whose bodies contain matches keep their params (names, shardings, ``checkpoint``
  policies, ``scan`` options) with the rewritten body; nested calls without matches are re-bound
  unchanged.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from flashport.fusion.interpreter import all_sites, analyze, checked_rewrite
from flashport.fusion.patterns import DROPOUT_MODES
from flashport.fusion.report import AttentionReport, Site, site_from


@dataclasses.dataclass
class _Entry:
    plan: object
    jaxpr: object  # the rewritten ClosedJaxpr, or None when nothing matched
    out_tree: object


def fuse_attention(fun=None, *, backend="auto", dropout=None):
    """Return ``fun`` with every recognized attention subgraph replaced by ``flashport.attention``.

    Args:
      fun: a JAX-traceable function of arrays (pytrees of arrays in and out). Non-array leaves are
        treated as static and become part of the cache key.
      backend: passed to :func:`flashport.attention` for every replaced site.
      dropout: what to do with attention-weight dropout (a Bernoulli keep-mask drawn from a PRNG key
        and applied to the softmax probabilities with ``1/(1-p)`` scaling, as Flax, Haiku, Equinox
        and Keras write it). ``None`` (default): such a site is left as written and reported as a
        near-miss. ``"contract"``: fuse it into ``flashport.attention(..., dropout_rate=p,
        dropout_rng=key)`` with the program's key; the rate and scaling are the same but the
        contract draws its own mask (:mod:`flashport.kernels.semantics.dropout`), so the kept entries differ
        from the original program's.

    Returns:
      A function with the same signature. Each new input signature (tree structure, shapes,
      dtypes, static leaves) is traced, matched and rewritten once; later calls evaluate the cached
      rewritten jaxpr. Use :func:`find_attention` to see what was (not) matched and why.
    """
    _check_dropout_mode(dropout)
    if fun is None:
        return functools.partial(fuse_attention, backend=backend, dropout=dropout)
    cache: dict = {}

    @functools.wraps(fun)
    def fused(*args, **kwargs):
        flat, treedef, dyn_pos, static = _split(args, kwargs)
        key = (treedef, static, tuple(_aval_key(flat[i]) for i in dyn_pos))
        entry = cache.get(key)
        if entry is None:
            entry, cacheable = _build(fun, flat, treedef, dyn_pos, backend, dropout)
            if cacheable:
                cache[key] = entry
        if entry.jaxpr is None:
            return fun(*args, **kwargs)
        outs = jax.core.eval_jaxpr(entry.jaxpr.jaxpr, entry.jaxpr.consts, *[flat[i] for i in dyn_pos])
        return jax.tree_util.tree_unflatten(entry.out_tree, outs)

    fused.cache_size = lambda: len(cache)
    return fused


def find_attention(fun, *, backend="auto", dropout=None):
    """Return a function that traces ``fun`` on its arguments and reports every attention site.

    ``find_attention(f)(*args)`` returns an :class:`~flashport.fusion.report.AttentionReport`:
    ``.matches`` (what :func:`fuse_attention` rewrites: source location, shapes, detected layout,
    scale, mask kind, softcap, dtypes, GQA grouping, fully-masked-row behaviour), ``.near_misses``
    (with the reason each was left alone), ``.to_dicts()`` for data and a rich table when printed.
    Each match's replacement is built (for ``backend``) as :func:`fuse_attention` would, so a site
    the pass fails on internally is reported as a near-miss naming the error, not as fused.
    ``dropout`` is :func:`fuse_attention`'s option of that name.
    """
    _check_dropout_mode(dropout)

    @functools.wraps(fun)
    def report(*args, **kwargs):
        flat, treedef, dyn_pos, _ = _split(args, kwargs)
        closed, _ = _trace(fun, flat, treedef, dyn_pos)
        try:
            plan = analyze(closed, dropout=dropout)
        except Exception as err:  # noqa: BLE001 -- the program runs unchanged; say why
            return AttentionReport((_internal_site(err),))
        checked_rewrite(plan, backend)
        sites = []
        for p, item in all_sites(plan):
            sites.append(site_from(p, item, "near-miss" if hasattr(item, "reason") else "fused"))
        sites.sort(key=lambda s: s.status != "fused")
        return AttentionReport(tuple(sites))

    return report


# ----------------------------------------------------------------------------- internals


def _is_dynamic(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.core.Tracer))


def _split(args, kwargs):
    flat, treedef = jax.tree_util.tree_flatten((args, kwargs))
    dyn_pos = tuple(i for i, x in enumerate(flat) if _is_dynamic(x))
    static = tuple((i, x) for i, x in enumerate(flat) if i not in set(dyn_pos))
    try:
        hash(static)
    except TypeError as err:
        raise TypeError("fuse_attention: non-array arguments must be hashable (they are static)") from err
    return flat, treedef, dyn_pos, static


def _aval_key(x):
    aval = jax.typeof(x)
    return (tuple(aval.shape), str(aval.dtype), bool(getattr(aval, "weak_type", False)))


def _trace(fun, flat, treedef, dyn_pos):
    out_tree = []

    def flat_fun(*dyn):
        leaves = list(flat)
        for i, x in zip(dyn_pos, dyn, strict=False):
            leaves[i] = x
        args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
        outs, tree = jax.tree_util.tree_flatten(fun(*args, **kwargs))
        out_tree.append(tree)
        return outs

    avals = [_spec(flat[i]) for i in dyn_pos]
    closed = jax.make_jaxpr(flat_fun)(*avals)
    return closed, out_tree[0]


def _spec(x):
    aval = jax.typeof(x)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))


def _internal_site(err):
    reason = f"internal error while analyzing the program (left unchanged): {type(err).__name__}: {err}"
    return Site(status="near-miss", where="<top>", location="?", reason=reason)


def _check_dropout_mode(dropout):
    if dropout not in DROPOUT_MODES:
        raise ValueError(
            f"dropout must be None (leave attention-weight dropout unfused) or 'contract' (fuse it "
            f"into flashport.attention's dropout, which draws different random bits), got {dropout!r}"
        )


def _build(fun, flat, treedef, dyn_pos, backend, dropout):
    closed, out_tree = _trace(fun, flat, treedef, dyn_pos)
    cacheable = not any(isinstance(c, jax.core.Tracer) for c in closed.consts)
    try:
        plan = analyze(closed, dropout=dropout)
    except Exception:  # noqa: BLE001 -- never break the program: run it as written
        return _Entry(plan=None, jaxpr=None, out_tree=out_tree), cacheable
    new = checked_rewrite(plan, backend)
    if new is None:
        return _Entry(plan=plan, jaxpr=None, out_tree=out_tree), cacheable
    cacheable = cacheable and not any(isinstance(c, jax.core.Tracer) for c in new.consts)
    return _Entry(plan=plan, jaxpr=new, out_tree=out_tree), cacheable
