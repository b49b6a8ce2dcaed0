"""The engine's work grows linearly with the file: counted, not timed (``benchmarks/codemod_scale.py``
times it). Python-level calls (generator resumptions included) made while porting a model-like file
of 4x the lines must be at most about 4x; the text handed to ``compile`` is the file's, once."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

from flashport import rules as registry
from flashport.rewriter.engine import pipeline as engine
from flashport.rewriter.engine.pipeline import transform_source
from flashport.rules.base import RuleOptions

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "codemod_scale.py"


def _load():
    spec = importlib.util.spec_from_file_location("codemod_scale", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


codemod_scale = _load()


def _calls(data: bytes) -> int:
    """Python function calls and generator resumptions while porting ``data``."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event == "call":
            count += 1

    rules = registry.all_rules()
    sys.setprofile(profile)
    try:
        result = transform_source(data, "m.py", rules, RuleOptions())
    finally:
        sys.setprofile(None)
    assert result.status == "changed", result.error
    return count


def test_calls_grow_linearly_with_the_number_of_top_level_statements():
    transform_source(codemod_scale.model_file(100).encode(), "warm.py", registry.all_rules(), RuleOptions())
    small, large = (_calls(codemod_scale.model_file(lines).encode()) for lines in (800, 3200))
    assert large / small <= 4.3, (small, large)


def test_the_output_is_compiled_once_in_groups(monkeypatch):
    compiled: list[str] = []

    def counting(source, *args, **kwargs):
        compiled.append(source)
        return compile(source, *args, **kwargs)

    monkeypatch.setattr(engine, "compile", counting, raising=False)
    data = codemod_scale.model_file(6000).encode()
    result = transform_source(data, "m.py", registry.all_rules(), RuleOptions())
    assert result.status == "changed"
    groups = len(compiled)
    assert groups > 1 and sum(map(len, compiled)) <= len(result.new) + len("pass\n") * groups
    assert (
        "".join(text.removeprefix("pass\n") if i else text for i, text in enumerate(compiled))
        == result.new.decode()
    )
