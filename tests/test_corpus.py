"""The corpus run (benchmarks/corpus.py) over real third-party packages: slow, opt-in (pytest -m slow).
Also, fast: the verifier itself flags a changed line outside any site or import."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _corpus():
    spec = importlib.util.spec_from_file_location("flashport_corpus", ROOT / "benchmarks" / "corpus.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["flashport_corpus"] = module
    spec.loader.exec_module(module)
    return module


def test_verifier_flags_stray_changes(tmp_path):
    corpus = _corpus()
    path = tmp_path / "m.py"
    old = b"import torch\n\n\ndef f(q):\n    x = 1\n    return g(q)\n"
    path.write_bytes(b"import torch\nimport flashport\n\n\ndef f(q):\n    x = 2\n    return h(q)\n")
    doc = {
        "sites": [{"path": str(path), "line": 6, "end_line": 6, "status": "rewrite"}],
        "files": [{"path": str(path), "written": True}],
    }
    out = corpus.Outcome("x", "0", "torch")
    corpus._verify_changes(doc, {str(path): old}, out)
    assert out.stray_lines == ["m.py: [5]"]  # line 5 changed outside the site; the import is fine
    out = corpus.Outcome("x", "0", "torch")
    doc["sites"].append({"path": str(path), "line": 5, "end_line": 5, "status": "rewrite"})
    corpus._verify_changes(doc, {str(path): old}, out)
    assert out.ok


def test_verifier_allows_a_removed_import_guard_but_not_an_edit_inside_one(tmp_path):
    corpus = _corpus()
    path = tmp_path / "m.py"
    old = b"import torch\n\nif ok():\n    import xformers\nelse:\n    xformers = None\n\n\ndef f(q):\n    return g(q)\n"
    doc = {
        "sites": [{"path": str(path), "line": 10, "end_line": 10, "status": "rewrite"}],
        "files": [{"path": str(path), "written": True}],
    }
    path.write_bytes(b"import torch\n\nimport flashport\n\n\ndef f(q):\n    return h(q)\n")
    out = corpus.Outcome("x", "0", "torch")
    corpus._verify_changes(doc, {str(path): old}, out)
    assert out.ok, out.stray_lines
    path.write_bytes(old.replace(b"xformers = None", b"xformers = 1").replace(b"g(q)", b"h(q)"))
    out = corpus.Outcome("x", "0", "torch")
    corpus._verify_changes(doc, {str(path): old}, out)
    assert out.stray_lines == ["m.py: [6]"]


def test_verifier_allows_a_guard_collapsed_to_its_flag_but_not_a_new_value(tmp_path):
    corpus = _corpus()
    path = tmp_path / "m.py"
    old = b"try:\n    import xformers\n    HAS = True\nexcept ImportError:\n    HAS = False\n\n\ndef f(q):\n    return g(q)\n"
    doc = {
        "sites": [{"path": str(path), "line": 9, "end_line": 9, "status": "rewrite"}],
        "files": [{"path": str(path), "written": True}],
    }
    path.write_bytes(b"import flashport\n\nHAS = True\n\n\ndef f(q):\n    return h(q)\n")
    out = corpus.Outcome("x", "0", "torch")
    corpus._verify_changes(doc, {str(path): old}, out)
    assert out.ok, out.stray_lines
    path.write_bytes(b"import flashport\n\nHAS = 2\n\n\ndef f(q):\n    return h(q)\n")
    out = corpus.Outcome("x", "0", "torch")
    corpus._verify_changes(doc, {str(path): old}, out)
    assert not out.ok


@pytest.mark.slow
def test_corpus_run_keeps_every_guarantee(tmp_path):
    corpus = _corpus()
    outcomes = []
    for name, version, framework, folders in corpus.PACKAGES:
        try:
            corpus.fetch(name, version, corpus.cache_dir())
        except RuntimeError as err:  # no network and no cache: nothing to test against
            pytest.skip(str(err))
        outcomes.append(corpus.run_package(name, version, framework, folders, None, corpus.cache_dir()))
    corpus.print_report(outcomes)
    for o in outcomes:
        assert not o.crashes, (o.name, o.crashes)
        assert not o.not_compiling, (o.name, o.not_compiling)
        assert o.second_run_changes == 0, o.name
        assert not o.stray_lines, (o.name, o.stray_lines)
    assert sum(o.rewritten for o in outcomes) > 0 and len(outcomes) >= 5
    assert {o.framework.split("/")[0] for o in outcomes} >= {"torch", "jax"}
