"""Fuzzer: random attention-like programs never crash the pass and keep their values and gradients.

Programs are drawn (fixed seeds) from einsum spellings with every dimension order for q, k, v, the
scores and the output; softmax over any scores axis (only the key axis is attention) written as
``jax.nn.softmax``, ``exp / sum``, ``exp(log_softmax)`` or normalized after the P·V product; scale on
the scores (multiply/divide) or on q; masks as ``where`` (causal or padding), additive bias or
multiply-add; K/V heads repeated with ``jnp.repeat`` (foldable to GQA) or ``jnp.tile`` (not); an
optional transpose of the probabilities; and the whole site nested in ``jit``, ``scan``, ``cond``,
``checkpoint`` or ``custom_vjp``; optional attention-weight dropout (fused only with
``dropout="contract"``, whose fused programs are traced too). Whatever is or is not fused:

* the pass itself (``fuse_attention`` traced, also under ``grad``, and ``find_attention``) never
  raises, on :data:`PASS_PROGRAMS` programs;
* ``fuse_attention(f)(*x)`` equals ``f(*x)`` and so do the gradients w.r.t. q, k and v, on
  :data:`VALUE_PROGRAMS` programs, compiled :data:`BATCH` programs per ``jax.jit`` to keep compile
  time down.

The default run uses a fixed-seed budget that fits in well under a minute on two shared cores
(:data:`REGRESSIONS` first); ``pytest -m slow`` runs :data:`SLOW_PASS_PROGRAMS` and
:data:`SLOW_VALUE_PROGRAMS` more programs with other seeds. A failure names the program's spec;
every failure found becomes a case in :data:`REGRESSIONS`.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashport

SIZES = {"b": 2, "t": 3, "s": 4, "n": 2, "d": 4}
HKV = 1  # kv heads when K/V are repeated
# Budgets. The default run (CI) is fixed: PASS_PROGRAMS and VALUE_PROGRAMS (one compiled batch).
# The slow run adds SLOW_* programs with other seeds (FLASHPORT_FUZZ_SCALE multiplies them, e.g. 10
# for a nightly sweep). Measured on the shared 2-core machine at load ~12: the default run of this
# file takes ~25 s (the value batch ~17 s, the pass-level programs ~0.45 s each, the reach check
# ~3 s), the default hypothesis test ~23 s; the cost is trace- and compile-bound.
_SCALE = max(1, int(os.environ.get("FLASHPORT_FUZZ_SCALE", "1")))
PASS_PROGRAMS = 16
BATCH = 8
VALUE_PROGRAMS = BATCH
SLOW_PASS_PROGRAMS = 100 * _SCALE
SLOW_VALUE_PROGRAMS = 3 * BATCH * _SCALE
REACH_PROGRAMS = 40
SEED = 20261201
BACKEND = "xla"  # the pass is under test, not the kernel: the plain backend traces and compiles fastest

# Specs that once failed (or exercise a past defect); always run first.
REGRESSIONS = [
    # the unnormalized exp's P·V product divided after an einsum transpose (output layout != dot's)
    {
        "q": "btnd",
        "k": "bsnd",
        "v": "bsnd",
        "scores": "bnts",
        "out": "btnd",
        "axis": "s",
        "form": "deferred",
        "mask": "padding",
        "scale": "scores_div",
        "gqa": "none",
        "p_transpose": False,
        "nest": "none",
        "seed": 1,
    },
    # K scaled after a head repeat in BHSD, matmul-like spelling
    {
        "q": "bntd",
        "k": "bnsd",
        "v": "bnsd",
        "scores": "bnts",
        "out": "bntd",
        "axis": "s",
        "form": "nn",
        "mask": "none",
        "scale": "q",
        "gqa": "repeat",
        "p_transpose": False,
        "nest": "remat",
        "seed": 2,
    },
]


def _perm(rng, letters):
    return "".join(rng.permutation(list(letters)))


def random_spec(seed: int) -> dict:
    """A random program spec (deterministic in ``seed``)."""
    rng = np.random.default_rng(seed)
    choice = lambda xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
    spec = {
        "q": _perm(rng, "btnd"),
        "k": _perm(rng, "bsnd"),
        "v": _perm(rng, "bsnd"),
        "scores": _perm(rng, "bnts"),
        "out": _perm(rng, "btnd"),
        "axis": "s" if rng.random() < 0.75 else choice("bnt"),
        "form": choice(["nn", "expsum", "logsoftmax", "deferred"]),
        "mask": choice(["none", "causal", "padding", "bias", "muladd"]),
        "scale": choice(["scores_mul", "scores_div", "q"]),
        "gqa": choice(["none", "none", "repeat", "tile"]),
        "p_transpose": bool(rng.random() < 0.2),
        "nest": choice(["none", "jit", "scan", "cond", "remat", "custom_vjp"]),
        "seed": int(rng.integers(2**16)),
    }
    spec["dropout"] = bool(rng.random() < 0.15)  # drawn last: the earlier fields keep their seeds
    if spec["form"] == "deferred":
        spec["p_transpose"] = False
        spec["dropout"] = False
    return spec


def _to(x, src, dst):
    return jnp.einsum(f"{src}->{dst}", x)


def _site(spec):
    """The attention site of ``spec`` as a function of (q, k, v, pad) in spec layouts."""
    sc, ax = spec["scores"], spec["scores"].index(spec["axis"])

    def site(q, k, v, pad):
        if spec["gqa"] != "none":  # k, v arrive with HKV heads in "bsnd"; repeat to n heads
            g = SIZES["n"] // HKV
            rep = (
                (lambda x: jnp.repeat(x, g, axis=2))
                if spec["gqa"] == "repeat"
                else (lambda x: jnp.tile(x, (1, 1, g, 1)))
            )
            k, v = _to(rep(k), "bsnd", spec["k"]), _to(rep(v), "bsnd", spec["v"])
        if spec["scale"] == "q":
            q = q * 0.5
        s = jnp.einsum(f"{spec['q']},{spec['k']}->{sc}", q, k)
        s = s * 0.5 if spec["scale"] == "scores_mul" else s / 2.0 if spec["scale"] == "scores_div" else s
        s = _mask(spec, s, sc, pad)
        if spec["form"] == "deferred":
            e = jnp.exp(s - jnp.max(s, ax, keepdims=True))
            num = jnp.einsum(f"{sc},{spec['v']}->{spec['out']}", e, v)
            den = jnp.sum(e, ax)
            if spec["axis"] == "s":
                den = _to(den, sc.replace("s", ""), spec["out"].replace("d", ""))
            if spec["axis"] != "s":  # not attention: the sum has a key axis; any valid program will do
                return num / jnp.sum(e)
            return num / jnp.expand_dims(den, spec["out"].index("d"))
        if spec["form"] == "nn":
            p = jax.nn.softmax(s, axis=ax)
        elif spec["form"] == "expsum":
            e = jnp.exp(s - jnp.max(s, ax, keepdims=True))
            p = e / jnp.sum(e, ax, keepdims=True)
        else:
            p = jnp.exp(jax.nn.log_softmax(s, axis=ax))
        p_spec = sc
        if spec.get("dropout"):  # Flax/Equinox-style attention-weight dropout with a fixed key
            keep = jax.random.bernoulli(jax.random.key(spec["seed"]), 0.8, p.shape)
            p = jnp.where(keep, p / 0.8, 0.0)
        if spec["p_transpose"]:
            p, p_spec = jnp.swapaxes(p, 0, -1), sc[-1] + sc[1:-1] + sc[0]
        return jnp.einsum(f"{p_spec},{spec['v']}->{spec['out']}", p, v)

    return site


def _mask(spec, s, sc, pad):
    kind = spec["mask"]
    if kind == "none":
        return s
    if kind == "causal":
        m, dims = jnp.tril(jnp.ones((SIZES["t"], SIZES["s"]), bool)), "ts"
    else:
        m, dims = pad, "bs"
    order = sorted(dims, key=sc.index)
    m = jnp.transpose(m, [dims.index(c) for c in order]).reshape([SIZES[c] if c in dims else 1 for c in sc])
    if kind in ("causal", "padding"):
        return jnp.where(m, s, jnp.finfo(s.dtype).min)
    mf = m.astype(s.dtype)
    if kind == "bias":
        return s + (1.0 - mf) * -1e9
    return s * mf + (1.0 - mf) * -1e9


def build(spec):
    """``(f, args)``: the program of ``spec`` (the site nested as asked) and its inputs."""
    site = _site(spec)
    nest = spec["nest"]

    def f(q, k, v, pad):
        if nest == "jit":
            return jax.jit(site)(q, k, v, pad)
        if nest == "remat":
            return jax.checkpoint(site)(q, k, v, pad)
        if nest == "scan":
            return jax.lax.scan(lambda c, x: (c, site(x, k, v, pad)), 0.0, jnp.stack([q, -q]))[1].sum(0)
        if nest == "cond":
            return jax.lax.cond(q.sum() > 0, lambda a: site(a, k, v, pad), lambda a: site(-a, k, v, pad), q)
        if nest == "custom_vjp":
            return _custom_vjp(site)(q, k, v, pad)
        return site(q, k, v, pad)

    rng = np.random.default_rng(spec["seed"])
    kv_heads = HKV if spec["gqa"] != "none" else SIZES["n"]
    kv_spec = "bsnd" if spec["gqa"] != "none" else None
    sizes_kv = dict(SIZES, n=kv_heads)

    def arr(layout, sizes):
        return jnp.asarray(rng.normal(size=[sizes[c] for c in layout]), jnp.float32)

    args = [
        arr(spec["q"], SIZES),
        arr(kv_spec or spec["k"], sizes_kv),
        arr(kv_spec or spec["v"], sizes_kv),
        jnp.asarray(rng.random((SIZES["b"], SIZES["s"])) < 0.6).at[:, 0].set(True),
    ]
    return f, args


def _custom_vjp(site):
    @jax.custom_vjp
    def g(q, k, v, pad):
        return site(q, k, v, pad)

    def fwd(q, k, v, pad):
        return site(q, k, v, pad), (q, k, v, pad)

    def bwd(res, ct):
        q, k, v, pad = res
        _, vjp = jax.vjp(lambda a, b, c: site(a, b, c, pad), q, k, v)
        return (*vjp(ct), None)

    g.defvjp(fwd, bwd)
    return g


def _loss(f, w):
    return lambda q, k, v, pad: jnp.sum(f(q, k, v, pad) * w)


def _specs(n, offset):
    """``n`` programs: the regression cases first, then random ones from ``SEED + offset``."""
    return [*REGRESSIONS, *(random_spec(SEED + offset + i) for i in range(n))][: max(n, len(REGRESSIONS))]


def _check_pass(specs):
    """Tracing the fused program (and its gradient) and reporting never raise; avals are unchanged."""
    for spec in specs:
        f, args = build(spec)
        modes = (None, "contract") if spec.get("dropout") else (None,)
        for mode in modes:
            fused = flashport.fuse_attention(f, backend=BACKEND, dropout=mode)

            def fwd_bwd(q, k, v, pad, fused=fused):  # one trace of the fused program, forward and backward
                out, vjp = jax.vjp(lambda a, b, c: fused(a, b, c, pad), q, k, v)
                return out, vjp(out)

            try:
                want = jax.eval_shape(f, *args)
                got = jax.eval_shape(fwd_bwd, *args)[0]
                flashport.find_attention(f, dropout=mode)(*args)
            except Exception as err:
                raise AssertionError(f"pass failed on {spec} (dropout={mode})") from err
            assert (got.shape, got.dtype) == (want.shape, want.dtype), spec


def _check_values(specs):
    """Outputs and q/k/v gradients of ``fuse_attention(f)`` equal ``f``'s, all ``specs`` in one jit."""
    built = [build(spec) for spec in specs]

    def all_programs(*flat):
        res = []
        for i, (f, _) in enumerate(built):
            args = flat[4 * i : 4 * i + 4]
            fused = flashport.fuse_attention(f, backend=BACKEND)
            out_shape = jax.eval_shape(f, *args).shape
            w = jnp.cos(jnp.arange(np.prod(out_shape))).reshape(out_shape)
            res.append(
                (
                    f(*args),
                    fused(*args),
                    jax.grad(_loss(f, w), argnums=(0, 1, 2))(*args),
                    jax.grad(_loss(fused, w), argnums=(0, 1, 2))(*args),
                )
            )
        return res

    flat = [a for _, args in built for a in args]
    results = jax.jit(all_programs)(*flat)
    for spec, (want, got, gwant, ggot) in zip(specs, results, strict=True):
        try:
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
            for a, b in zip(ggot, gwant, strict=True):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-4, rtol=2e-4)
        except AssertionError as err:
            raise AssertionError(f"mismatch on {spec}") from err


def test_pass_never_raises_and_keeps_signatures():
    """The default budget: the regression cases and the first random programs."""
    _check_pass(_specs(PASS_PROGRAMS, 0))


@pytest.mark.slow
def test_pass_never_raises_and_keeps_signatures_many():
    _check_pass([random_spec(SEED + 1_000 + i) for i in range(SLOW_PASS_PROGRAMS)])


def test_fused_values_and_gradients_equal_original():
    """The default budget: one compiled batch (the regression cases first)."""
    _check_values(_specs(VALUE_PROGRAMS, 10_000))


@pytest.mark.slow
@pytest.mark.parametrize("batch", range(SLOW_VALUE_PROGRAMS // BATCH))
def test_fused_values_and_gradients_equal_original_many(batch):
    _check_values([random_spec(SEED + 20_000 + batch * BATCH + i) for i in range(BATCH)])


def test_fuzzer_reaches_fused_sites():
    """The generator is not vacuous: a good share of its programs are fused (nested ones included)."""
    fused_nests = set()
    n_fused = 0
    specs = [random_spec(SEED + i) for i in range(REACH_PROGRAMS)]
    for spec in specs:
        f, args = build(spec)
        if flashport.find_attention(f)(*args).matches:
            n_fused += 1
            fused_nests.add(spec["nest"])
    assert n_fused >= 15, n_fused
    assert {"scan", "cond", "remat", "custom_vjp"} <= fused_nests, fused_nests
