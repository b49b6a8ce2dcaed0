"""Run rewritten source: the helper the drop-in and value-use tests share.

:func:`port_and_run` rewrites a small source file with every rule, checks that each site of one kind
was rewritten and that no GPU import is left, then executes the result and returns its namespace.
:func:`reference_torch_attention` stands in for ``flashport.torch.attention``: the contract's
float64 reference on torch tensors.
"""

from __future__ import annotations

import ast
import textwrap

import numpy as np
import torch
from reference import reference_attention

from flashport import rules as registry
from flashport.rewriter.engine.pipeline import transform_source
from flashport.rules.base import RuleOptions


def port_and_run(source: str, kind: str, **options) -> tuple[dict, str]:
    """Rewrite ``source`` (every site of ``kind``, ``"call"`` or ``"reference"``, must be rewritten and
    no ``flash_attn``/``xformers`` import may be left), exec it; returns (namespace, rewritten code)."""
    result = transform_source(
        textwrap.dedent(source).encode(), "case.py", registry.all_rules(), RuleOptions(**options)
    )
    sites = [s for s in result.sites if s.kind == kind]
    assert sites and all(s.status == "rewrite" for s in sites), [(s.status, s.reason) for s in sites]
    code = result.new.decode()
    imported = [
        alias.name if isinstance(node, ast.Import) else node.module
        for node in ast.walk(ast.parse(code))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    ]
    assert not [m for m in imported if m.split(".")[0] in ("flash_attn", "xformers")], imported
    namespace: dict = {}
    exec(compile(code, "ported.py", "exec"), namespace)
    return namespace, code


def rand(*shape, seed=0):
    """Float32 normal tensor (the contract's dtypes); references upcast to float64."""
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape)).float()


DROPOUT_SEEN: list = []  # every dropout_p the stand-in received, in call order


def reference_torch_attention(query, key, value, backend="auto", return_lse=False, dropout_p=0.0, **kwargs):
    """Stand-in for flashport.torch.attention: the contract's float64 reference on torch tensors.

    It has no dropout: it records ``dropout_p`` (so tests see what the rewrite passed) and only runs
    when it is 0 (tests/test_dropout_port_semantics.py runs p > 0 against the real contract)."""
    DROPOUT_SEEN.append(dropout_p)
    if dropout_p != 0:
        raise AssertionError(f"the float64 stand-in has no dropout, got dropout_p={dropout_p}")
    kwargs = {name: (val.numpy() if hasattr(val, "numpy") else val) for name, val in kwargs.items()}
    out, lse = reference_attention(query.numpy(), key.numpy(), value.numpy(), **kwargs)
    out = torch.from_numpy(np.asarray(out))
    return (out, torch.from_numpy(np.asarray(lse))) if return_lse else out
