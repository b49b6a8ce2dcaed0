"""Engine speed-ups that must not change results: ast chunk pruning, on-demand qualified names,
the persistent result cache, and the deterministic choice among several qualified names."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from flashport import rules as registry
from flashport.rewriter.app import cache as result_cache
from flashport.rewriter.app import runner
from flashport.rewriter.engine import pipeline as engine
from flashport.rewriter.engine import prune
from flashport.rewriter.engine.pipeline import transform_source
from flashport.rules.base import RuleOptions

RULES = registry.all_rules()


def _data(source: str) -> bytes:
    return textwrap.dedent(source).encode()


def _unpruned(monkeypatch, data: bytes):
    monkeypatch.setattr(engine.prune, "keep", lambda chunks, tree, watch: [True] * len(chunks))
    try:
        return transform_source(data, "m.py", RULES, RuleOptions())
    finally:
        monkeypatch.undo()


def _same(a, b) -> None:
    assert (a.status, a.sites, a.new, a.error) == (b.status, b.sites, b.new, b.error)


def _kept(source: str) -> list[bool]:
    tree = ast.parse(textwrap.dedent(source))
    return prune.keep([[stmt] for stmt in tree.body], tree, prune.watch_of(RULES))


def test_chunks_mentioning_triggers_only_in_unrelated_names_are_pruned():
    kept = _kept("""
        def uses(q, k, v):
            return F.scaled_dot_product_attention(q, k, v)
        def mentions(self):
            return self._flash_attn_uses_top_left_mask or is_flash_attn_2_available()
        def config(c):
            return c.attn_implementation == "flash_attention_2"
    """)
    assert kept == [True, False, True]


def test_binding_the_root_of_a_candidate_keeps_the_chunk():
    kept = _kept("""
        class flash_attn:
            pass
        def uses(q, k, v):
            return flash_attn.flash_attn_func(q, k, v)
        def other():
            global flash_attn
        def unrelated(self):
            return self._flash_attn_uses_top_left_mask
    """)
    assert kept == [True, True, True, False]


def test_a_candidate_outside_functions_keeps_every_chunk():
    kept = _kept("""
        CLASSES = {"flash_attention_2": object}
        def unrelated(self):
            return self._flash_attn_uses_top_left_mask
    """)
    assert kept == [True, True]


def test_import_aliases_are_candidates():
    kept = _kept("""
        def f(q, k, v):
            from flash_attn import flash_attn_func as fa
            return fa(q, k, v)
        def g(q, k, v):
            return fa(q, k, v)
    """)
    assert kept == [True, True]


SOURCE = """\
import torch
import torch.nn.functional as F
from flash_attn import flash_attn_func, flash_attn_with_kvcache

CLASSES = {"eager": 1, "flash_attention_2": 2}


class Attn:
    _supports_flash_attn_2 = True

    def forward(self, q, k, v):
        if self._flash_attn_uses_top_left_mask:
            pass
        out = flash_attn_func(q, k, v, causal=True)
        return out[0]

    def sdpa(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def probe(self):
        return is_flash_attn_2_available()


def cache(q, k_cache, v_cache, k, v, lens):
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lens)
    return out


def flash_attn_func_like(x):
    return x.flash_attn_helper()
"""


@pytest.mark.parametrize(
    "source", [SOURCE, SOURCE.replace('CLASSES = {"eager": 1, "flash_attention_2": 2}', "")]
)
def test_pruned_results_equal_unpruned_results(monkeypatch, source):
    data = source.encode()
    pruned = transform_source(data, "m.py", RULES, RuleOptions())
    assert pruned.sites
    _same(pruned, _unpruned(monkeypatch, data))


def test_pruning_skips_libcst_when_no_chunk_can_hold_a_site(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("libcst parse")

    monkeypatch.setattr(engine.cst, "parse_module", boom)
    result = transform_source(
        _data("""
        def probe(self):
            return self._flash_attn_uses_top_left_mask and is_flash_attn_2_available()
    """),
        "m.py",
        RULES,
        RuleOptions(),
    )
    assert result.parsed and result.status == "unchanged" and not result.sites


def test_several_matching_qualified_names_answer_the_canonical_source_whatever_the_hash_seed():
    code = textwrap.dedent("""
        import sys
        from flashport import rules as registry
        from flashport.rewriter.engine.pipeline import transform_source
        from flashport.rules.base import RuleOptions
        src = b'''try:
            from jax.experimental.pallas.ops.gpu.attention import mha
        except ImportError:
            from jax.experimental.pallas.ops.attention import mha

        def f(q, k, v, segment_ids):
            return mha(q, k, v, segment_ids)
        '''
        r = transform_source(src, "m.py", registry.all_rules(), RuleOptions())
        print(sorted({s.api for s in r.sites}))
    """)
    outputs = set()
    for seed in ("1", "2", "3", "4"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outputs.add(
            subprocess.run(
                [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
            ).stdout
        )
    assert outputs == {"['jax.experimental.pallas.ops.gpu.attention.mha']\n"}


# ------------------------------------------------------------------------------------ the cache


def _write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_cache_reuses_results_and_invalidates_on_content_change(tmp_path, monkeypatch):
    path = _write(tmp_path, "m.py", SOURCE)
    store = str(tmp_path / "cache")
    options = RuleOptions()
    first = list(
        runner.run(
            [path], RULES, options, jobs=1, cache=result_cache.ResultCache.for_run(RULES, options, store)
        )
    )

    def boom(*args, **kwargs):
        raise AssertionError("recomputed")

    monkeypatch.setattr(runner, "transform_source", boom)
    warm = result_cache.ResultCache.for_run(RULES, options, store)
    second = list(runner.run([path], RULES, options, jobs=1, cache=warm))
    assert warm.hits == 1 and [r.sites for r in second] == [r.sites for r in first]
    assert second[0].new == first[0].new and second[0].status == first[0].status == "changed"

    _write(tmp_path, "m.py", SOURCE.replace("causal=True", "causal=False"))
    with pytest.raises(AssertionError, match="recomputed"):
        list(
            runner.run(
                [path], RULES, options, jobs=1, cache=result_cache.ResultCache.for_run(RULES, options, store)
            )
        )


def test_cache_key_covers_rule_set_and_options():
    options = RuleOptions()
    base = result_cache.fingerprint(RULES, options)
    assert result_cache.fingerprint(RULES[:-1], options) != base
    assert result_cache.fingerprint(RULES, RuleOptions(inference=True)) != base
    assert result_cache.fingerprint(RULES, options) == base


@pytest.mark.parametrize(
    "source",
    [
        "rule",  # a rule module
        "rewriter/engine/run_context.py",  # an engine module a hand-kept list once missed
        "rewriter/source/semantic.py",  # a module in another subpackage
        "rules/common/values.py",  # a rule helper
        "kernels/contract/keywords.py",  # the contract's defaults, which rules/common/calls.py reads
        "flashport/integrations/flash_attn/core.py",  # a drop-in module
    ],
)
def test_cache_key_covers_every_package_source(source, monkeypatch):
    """Editing any module of the engine or rule packages changes the key, imported or not."""
    options = RuleOptions()
    base = result_cache.fingerprint(RULES, options)
    real_open = open
    root = pathlib.Path(__file__).resolve().parents[1]
    rule_file = sys.modules[RULES[0].__module__].__file__ if source == "rule" else str(root / source)

    def edited_open(path, mode="r", *args, **kwargs):
        handle = real_open(path, mode, *args, **kwargs)
        if path == rule_file and "b" in mode:
            data = handle.read() + b"\n# edited\n"
            handle.close()
            import io

            return io.BytesIO(data)
        return handle

    monkeypatch.setattr("builtins.open", edited_open)
    assert result_cache.fingerprint(RULES, options) != base


def test_corrupt_cache_file_is_ignored_and_rewritten(tmp_path):
    path = _write(tmp_path, "m.py", SOURCE)
    options = RuleOptions()
    store = result_cache.ResultCache.for_run(RULES, options, str(tmp_path / "cache"))
    os.makedirs(os.path.dirname(store.path))
    with open(store.path, "wb") as handle:
        handle.write(b"not a pickle")
    results = list(
        runner.run(
            [path],
            RULES,
            options,
            jobs=1,
            cache=result_cache.ResultCache.for_run(RULES, options, str(tmp_path / "cache")),
        )
    )
    assert results[0].sites
    assert result_cache.ResultCache(store.path).entries


def test_cache_is_off_unless_asked(tmp_path, monkeypatch):
    monkeypatch.delenv("FLASHPORT_CACHE", raising=False)
    assert result_cache.from_environment(RULES, RuleOptions()) is None
    monkeypatch.setenv("FLASHPORT_CACHE", str(tmp_path))
    assert result_cache.from_environment(RULES, RuleOptions()).path.startswith(str(tmp_path))


def test_cli_cache_flag_turns_the_cache_on_and_off(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.py").write_text(
        "from flash_attn import flash_attn_func\n\ndef f(q, k, v):\n    return flash_attn_func(q, k, v, causal=True)\n"
    )
    env = dict(os.environ, HOME=str(tmp_path / "home"), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    env.pop("FLASHPORT_CACHE", None)

    def scan(*flags):
        cmd = [sys.executable, "-m", "flashport", "scan", str(src), "--format", "json", *flags]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, check=True).stdout

    def cache_files():
        return [p for p in tmp_path.rglob("results-*.pickle")]

    scan("--no-cache")
    assert cache_files() == []
    first = scan("--cache")
    assert len(cache_files()) == 1
    assert scan("--cache") == first  # served from the cache, same report
