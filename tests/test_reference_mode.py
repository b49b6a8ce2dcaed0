"""The reference mode (:func:`flashport.rewriter.engine.pipeline.transform_source` with ``reference=True``,
or ``FLASHPORT_REFERENCE=1``) runs with every speed layer off; the fast mode must give the same
bytes and the same per-site results on every golden fixture, every example and (slow tier) the
real-repository corpus. A difference is a bug in a speed layer."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import sys
import textwrap
from typing import ClassVar

import libcst as cst
import pytest
import test_codemod_fuzz as fuzz
from hypothesis import given, settings

from flashport import rules as registry
from flashport.rewriter.engine import pipeline as engine
from flashport.rewriter.engine import run_context, transform
from flashport.rewriter.engine.results import FileResult
from flashport.rules.base import Rewrite, Rule, RuleContext, RuleOptions

RULES = registry.all_rules()
ROOT = pathlib.Path(__file__).parent
INPUTS = sorted((ROOT / "fixtures").glob("*/*/*.py")) + sorted((ROOT.parent / "examples").glob("*.py"))


def outcome(result: FileResult) -> dict:
    """Everything a run reports about one file: bytes, status, sites and import edits."""
    return {
        "status": result.status,
        "error": result.error,
        "new": result.new,
        "sites": [dataclasses.astuple(site) for site in result.sites],
        "imports_added": list(result.imports_added),
        "imports_removed": result.imports_removed,
        "imports_kept": result.imports_kept,
    }


def both_modes(data: bytes, path: str, rules=RULES, options: RuleOptions | None = None) -> tuple[dict, dict]:
    """The outcomes of the fast and the reference mode on ``data``."""
    fast = engine.transform_source(data, path, rules, options, reference=False)
    reference = engine.transform_source(data, path, rules, options, reference=True)
    return outcome(fast), outcome(reference)


def variants(data: bytes) -> list[tuple[str, bytes]]:
    """``data`` as written, and with CRLF line endings (a different newline for every layer)."""
    crlf = data.replace(b"\r\n", b"\n").replace(b"\n", b"\r\n")
    return [("lf", data), ("crlf", crlf)]


@pytest.mark.parametrize("case", INPUTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_fixtures_and_examples_same_in_both_modes(case: pathlib.Path):
    for name, data in variants(case.read_bytes()):
        fast, reference = both_modes(data, case.name)
        assert fast == reference, name
    assert fast["sites"] or case.stem.startswith("no_change") or case.parent.name == "examples"


@given(fuzz.fixture_variants())
@settings(**fuzz.QUICK)
def test_fuzzed_call_sites_same_in_both_modes(source):
    fast, reference = both_modes(source.encode(), "case.py")
    assert fast == reference


@pytest.mark.slow
@given(fuzz.fixture_variants())
@settings(**fuzz.THOROUGH)
def test_fuzzed_call_sites_same_in_both_modes_thorough(source):
    fast, reference = both_modes(source.encode(), "case.py")
    assert fast == reference


def test_reference_mode_uses_no_speed_layer(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a speed layer ran in the reference mode")

    for owner, name in [
        (engine.prune, "keep"),
        (engine, "_thin_pass"),
        (engine, "_relevant_pattern"),
        (engine, "_spliced"),
        (engine.mini_parse, "parse"),
        (engine.semantic.SemanticModel, "header_names"),
        (engine, "StatementSpans"),
        (transform, "line_positions"),
    ]:
        monkeypatch.setattr(owner, name, forbidden)
    data = (ROOT.parent / "examples" / "torch_flash_attn_model.py").read_bytes()
    result = engine.transform_source(data, "model.py", RULES, reference=True)
    assert result.status == "changed" and result.sites, result.error


# Files whose names the semantic model answers alone: a function-level import (before the read,
# or only after it: the module's import then answers a plain name), a guarded import in a chunk
# (with a None fallback too, read at module level and in a function), a value use through a header
# import, a value use in a function whose import shadows the module's, a function-local alias read
# in its function, a decorator, a nested function and a comprehension; a source name a function
# also binds by a ``for``/``with``/``except`` target, a nested def or class, ``+=`` or an annotated
# assignment (a read before those resolves to the module's import, one after to the local).
_MODEL_ANSWERS = {
    "function_import.py": """
        import torch

        def attend(q, k, v):
            from flash_attn import flash_attn_func
            return flash_attn_func(q, k, v, causal=True)

        def attend_attr(q, k, v):
            import flash_attn
            return flash_attn.flash_attn_func(q, k, v, causal=True)
        """,
    "import_after_read.py": """
        from flash_attn import flash_attn_func

        def attend(q, k, v):
            out = flash_attn_func(q, k, v, causal=True)
            from flash_attn import flash_attn_varlen_func as flash_attn_func
            return out
        """,
    "guarded_import.py": """
        try:
            from flash_attn import flash_attn_func
        except ImportError:
            from flash_attn_interface import flash_attn_func

        def attend(q, k, v):
            return flash_attn_func(q, k, v, causal=True)
        """,
    "none_fallback.py": """
        try:
            from flash_attn import flash_attn_func
        except ImportError:
            flash_attn_func = None

        KERNELS = {"flash": flash_attn_func}

        def attend(q, k, v):
            return flash_attn_func(q, k, v, causal=True)
        """,
    "local_alias.py": """
        import functools
        from flash_attn import flash_attn_func

        def attend(q, k, v, chunks):
            fn = flash_attn_func

            @functools.wraps(fn)
            def inner(q):
                return fn(q, k, v, causal=True)

            return [fn(c, k, v) for c in chunks], inner(q)
        """,
    "for_target.py": """
        from flash_attn import flash_attn_func

        def attend(q, k, v, kernels):
            out = flash_attn_func(q, k, v, causal=True)
            for flash_attn_func in kernels:
                out = out + flash_attn_func(q, k, v)
            return out
        """,
    "with_except_targets.py": """
        import flash_attn
        from flash_attn import flash_attn_func

        def attend(q, k, v, opened):
            out = flash_attn_func(q, k, v, causal=True)
            with opened() as (flash_attn, other):
                out = flash_attn.flash_attn_func(out, k, v) + other
            return out

        def guarded(q, k, v):
            try:
                out = flash_attn.flash_attn_func(q, k, v, causal=True)
            except RuntimeError as flash_attn_func:
                out = flash_attn_func
            return out
        """,
    "nested_definitions.py": """
        from flash_attn import flash_attn_func, flash_attn_varlen_func

        def attend(q, k, v):
            out = flash_attn_func(q, k, v, causal=True)

            def flash_attn_func(*args):
                return args

            class flash_attn_varlen_func:
                pass

            return flash_attn_func(out), flash_attn_varlen_func(q)

        def counted(q, k, v, extra):
            out = flash_attn_varlen_func(q, k, v, 1, 1, 1, 1)
            flash_attn_varlen_func += extra
            flash_attn_func: object = extra
            return out + flash_attn_func(q, k, v) + flash_attn_varlen_func
        """,
    "value_use.py": """
        import functools
        from flash_attn import flash_attn_func

        ATTEND = functools.partial(flash_attn_func, causal=True)

        class Block:
            def forward(self, q, k, v):
                from flash_attn import flash_attn_func as attend
                return run(attend, q, k, v) + attend(q, k, v, causal=False)
        """,
}


@pytest.mark.parametrize("name", sorted(_MODEL_ANSWERS))
def test_fast_mode_names_come_from_the_semantic_model(monkeypatch, name):
    """Where the semantic model answers every name question, libcst's ``ScopeProvider`` never runs
    in the fast mode; the reference mode (libcst alone) gives the same outcome."""
    data = textwrap.dedent(_MODEL_ANSWERS[name]).encode()
    reference = outcome(engine.transform_source(data, name, RULES, reference=True))
    resolve = transform.MetadataWrapper.resolve

    def no_scopes(wrapper, provider):
        assert provider is not transform.ScopeProvider, "the fast mode ran libcst's scope analysis"
        return resolve(wrapper, provider)

    monkeypatch.setattr(transform.MetadataWrapper, "resolve", no_scopes)
    fast = outcome(engine.transform_source(data, name, RULES, reference=False))
    assert fast["error"] is None
    assert fast == reference
    assert fast["sites"]


def test_environment_variable_selects_the_reference_mode(monkeypatch):
    monkeypatch.setenv("FLASHPORT_REFERENCE", "1")
    assert engine.reference_mode()
    monkeypatch.setenv("FLASHPORT_REFERENCE", "0")
    assert not engine.reference_mode()
    monkeypatch.delenv("FLASHPORT_REFERENCE")
    assert not engine.reference_mode()


# A function long enough for the thin pass (its setup statements mention nothing relevant): a rule
# reading the enclosing function sees placeholders there unless the engine gives that pass up.
_LONG_FUNCTION = textwrap.dedent("""\
    from flash_attn import flash_attn_func

    def forward(q, k, v):
        a = torch.randn(2, 3)
        b = torch.randn(2, 3)
        c = torch.randn(2, 3)
        d = torch.randn(2, 3)
        e = torch.randn(2, 3)
        marker_statement_the_rule_looks_for = 1
        f = torch.randn(2, 3)
        g = torch.randn(2, 3)
        h = torch.randn(2, 3)
        return flash_attn_func(q, k, v)
""")


class _Swallowing(Rule):
    """Reads the whole enclosing function (beyond the site's statement) inside a broad
    ``except Exception`` that logs what it swallowed (``SWALLOWED``: a side effect outside the
    rule, like a warning), and counts its calls on the instance: its notes say what it saw."""

    SWALLOWED: ClassVar[list[str]] = []

    CODE = "FPA990"
    SOURCES = ("flash_attn.flash_attn_func",)
    TRIGGERS = (b"flash_attn_func",)

    def __init__(self):
        self.calls = 0

    def check_call(self, node, ctx: RuleContext):
        """A rewrite noting whether the marker statement was seen, and the counts."""
        self.calls += 1
        try:
            seen = any("marker_statement" in ctx.module.code_for_node(a) for a in ctx.ancestors)
        except Exception as err:  # noqa: BLE001 - the point of the test: a rule that swallows everything
            self.SWALLOWED.append(repr(err))
            seen = False
        notes = (f"seen: {seen}", f"calls: {self.calls}")
        return Rewrite(node.with_changes(func=cst.Name("ported")), imports=(), notes=notes)


def test_thin_pass_is_safe_against_rules_catching_exception():
    data = _LONG_FUNCTION.encode()
    thinned = []
    real = engine._thin_pass

    def thin_pass(*args):
        thinned.append(real(*args))
        return thinned[-1]

    with pytest.MonkeyPatch.context() as patch:  # the thin pass is tried here, and given up
        patch.setattr(engine, "_thin_pass", thin_pass)
        fast, reference = both_modes(data, "m.py", [_Swallowing])
    assert thinned == [None]
    assert _Swallowing.SWALLOWED == []  # nothing was raised through the rule
    notes = [site[-1] for site in fast["sites"]]
    assert notes == [("seen: True", "calls: 1")], notes  # a fresh rule for the whole chunks
    assert fast == reference


_TWO_FUNCTIONS = textwrap.dedent("""\
    from flash_attn import flash_attn_func

    def forward(q, k, v):
        return flash_attn_func(q, k, v)

    def helper():
        return is_flash_attn_available()
""")


class _ModuleReader(Rule):
    """Reads the whole module (the chunk of ``helper`` holds no site, so pruning leaves it out)."""

    CODE = "FPA991"
    SOURCES = ("flash_attn.flash_attn_func",)
    TRIGGERS = (b"flash_attn",)

    def check_call(self, node, ctx: RuleContext):
        """A rewrite noting whether the module holds ``helper``."""
        seen = "def helper" in ctx.module.code
        return Rewrite(node.with_changes(func=cst.Name("ported")), imports=(), notes=(f"helper: {seen}",))


def test_a_rule_reading_the_module_sees_the_chunks_pruning_leaves_out():
    data = _TWO_FUNCTIONS.encode()
    fast, reference = both_modes(data, "m.py", [_ModuleReader])
    assert [site[-1] for site in fast["sites"]] == [("helper: True",)]
    assert fast == reference


def _real_repos():
    """benchmarks/real_repos.py, loaded as a module (its pinned packages and fetcher)."""
    sys.path.insert(0, str(ROOT.parent / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "flashport_real_repos", ROOT.parent / "benchmarks" / "real_repos.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["flashport_real_repos"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def package_differences(root: str) -> list[str]:
    """The files under ``root`` whose outcome differs between the modes, with the run-level
    context the CLI builds (run-time patches found in the package)."""
    paths = sorted(str(p) for p in pathlib.Path(root).rglob("*.py"))
    options = run_context.for_paths(paths, RuleOptions())
    pattern = engine.trigger_pattern(RULES)
    differ = []
    for path in paths:
        data = pathlib.Path(path).read_bytes()
        if pattern.search(data):
            fast, reference = both_modes(data, path, RULES, options)
            if fast != reference:
                differ.append(path)
    return differ


@pytest.mark.slow
@pytest.mark.parametrize("package", [f"{n}=={v}" for n, v in _real_repos().PACKAGES])
def test_real_repository_corpus_same_in_both_modes(package: str):
    bench = _real_repos()
    name, version = package.split("==")
    cache = os.path.join(os.path.dirname(bench.corpus.cache_dir()), "real_repos")
    root = bench.corpus.fetch(name, version, cache)  # no network and no cache: an error, not a skip
    assert package_differences(root) == []
