"""All the imports a file needs in one edit (:func:`flashport.rewriter.imports.edits.ensure_imports`):
the same text as adding them one by one with a fresh parse of the text each time, and the kept-import
lines of the report counted in the final text."""

from __future__ import annotations

import ast
import re
import textwrap

import pytest

from flashport import rules as registry
from flashport.rewriter.engine.pipeline import transform_source
from flashport.rewriter.imports import edits as imports
from flashport.rewriter.imports import kept_imports
from flashport.rules.base import RuleOptions

LAYOUTS = [
    '"""d"""\nfrom __future__ import annotations\n\nimport os\n\nimport torch\nfrom einops import rearrange\n\nfrom .x import y\n',
    "import numpy as np\nimport torch\n",
    "import apex\nimport einops\nfrom torch import nn\n",
    "from einops import rearrange\nimport torch\n",
    "import os\n\nfrom .x import y\n",
    "from .x import y\n",
    "import apex\n# the fast path\nimport torch\n",
    "import math\ntry:\n    from typing import Literal\nexcept ImportError:\n    from typing_extensions import Literal\n\nimport torch\n",
    "import os\ndef f():\n    pass\n",
    "import os\nimport sys\n\n\nx = 1\n",
    "\n\ndef f():\n    pass\n",
    "\n\n@decorate\n# between\n@again\ndef f():\n    pass\n",
    "# header\n\nx = 1\n",
    '"""only a docstring"""\n',
    '"""a docstring without a newline"""',
    "from __future__ import annotations\nx = 1",
    '#!/usr/bin/env python\n# -*- coding: utf-8 -*-\n"""d"""\n\nclass A:\n    pass\n',
    "",
    "# only a comment\n",
    "import os\r\n\r\nimport torch\r\n\r\nx = 1\r\n",
    "import os\r\n\r\nx = 1\r\n",
    "import os",
    "import os\nimport torch; import numpy\n",
    "import torch\nif TYPE_CHECKING:\n    import numpy\nimport zlib_ng\n\nx = 1\n",
    "from .a import b\nfrom .c import d\n\nx = 1\n",
    "import os\n\nfrom .a import b\n\nimport torch\n",
    "x = 1\nimport os\n\ny = 2\n",
    "x = 1\nimport aaa",
]

MODULES = [
    ["flashport"],
    ["flashport", "flashport.integrations.bert_padding", "flashport.integrations.flash_attn_compat"],
    ["flashport.integrations.xformers_compat", "flashport.torch"],
    ["aaa", "flashport", "zzz"],
    ["math", "flashport", "os"],
]


def _one_by_one(text: str, modules: list[str]) -> tuple[str, list[str]]:
    """The reference: :func:`imports.ensure_import` module by module, parsing each new text."""
    added = []
    for module in modules:
        text, was_added = imports.ensure_import(text, module, "\r\n" if "\r\n" in text else "\n")
        if was_added:
            added.append(module)
        ast.parse(text)  # every intermediate text is valid Python
    return text, added


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("modules", MODULES, ids="+".join)
def test_all_imports_in_one_edit_match_adding_them_one_by_one(layout, modules):
    newline = "\r\n" if "\r\n" in layout else "\n"
    text, added, shift = imports.ensure_imports(layout, modules, newline)
    assert (text, added) == _one_by_one(layout, modules)
    # the line shift takes every original statement to its line in the new text
    old, new = ast.parse(layout), ast.parse(text)
    moved = {shift(node.lineno): ast.dump(node) for node in old.body}
    assert moved == {
        node.lineno: ast.dump(node)
        for node in new.body
        if not (isinstance(node, ast.Import) and node.names[0].name in added)
    }


def test_an_import_present_already_is_not_added_again():
    text, added, shift = imports.ensure_imports(
        "import flashport\nimport torch\n", ["flashport", "flashport.torch"], "\n"
    )
    assert text == "import flashport\nimport flashport.torch\nimport torch\n"
    assert added == ["flashport.torch"] and shift(2) == 3


def test_an_import_after_a_last_line_without_newline_gets_its_own_line():
    text, added, _ = imports.ensure_imports("x = 1\nimport aaa", ["flashport"], "\n")
    assert text == "x = 1\nimport aaa\nimport flashport\n" and added == ["flashport"]


_KEPT = """\
import math

import torch

try:
    import flash_attn as fa
except ImportError:
    fa = None

from flash_attn import flash_attn_with_kvcache
from flash_attn.bert_padding import pad_input, unpad_input


def f(q, k, v, mask, cache):
    flash_attn_with_kvcache(q, cache, cache)
    x, idx, cu, m, _ = unpad_input(q, mask)
    out = flash_attn_varlen_func(x, x, x, cu, cu, m, m)
    print(fa.__file__)
    return pad_input(out, idx, q.shape[0], q.shape[1])


from flash_attn import flash_attn_varlen_func
"""


def test_kept_import_lines_are_those_of_the_final_text():
    data = textwrap.dedent(_KEPT).encode()
    result = transform_source(data, "m.py", registry.all_rules(), RuleOptions())
    assert result.status == "changed" and len(result.imports_added) >= 2, result
    new_text = result.new.decode()
    gpu = tuple(sorted({m for r in registry.all_rules() for m in r.GPU_MODULES}))
    final = ast.parse(new_text)
    original = ast.parse(data.decode())
    want = kept_imports.explain(
        final, imports.name_uses(original), imports.name_uses(final), gpu, RuleOptions().flash_attn_version
    )
    assert result.imports_kept == want and want
    lines = new_text.splitlines()
    for entry in result.imports_kept:
        module, line = re.match(r"(\S+) \(line (\d+)\)", entry).groups()
        assert module.split(".")[-1] in lines[int(line) - 1], (entry, lines[int(line) - 1])


def test_the_import_edits_parse_the_text_once_after_the_clean_up(monkeypatch):
    """Imports added and GPU imports kept: the file is parsed whole once; of the rewritten text
    and the cleaned text only the statements the edits changed are parsed again; never a text
    with an added import (it was parsed again for every import before)."""
    data = textwrap.dedent(_KEPT).encode()
    calls = []
    parse = ast.parse

    def counting(source, *args, **kwargs):
        calls.append(source)
        return parse(source, *args, **kwargs)

    monkeypatch.setattr(imports.ast, "parse", counting)
    result = transform_source(data, "m.py", registry.all_rules(), RuleOptions())
    assert result.imports_removed and len(result.imports_added) >= 2, result
    source = textwrap.dedent(_KEPT)
    assert calls[0] == source and 2 <= len(calls) <= 5, calls
    assert not any("import math" in piece for piece in calls[1:]), calls  # untouched: not parsed again
    assert not any("import flashport" in piece for piece in calls), calls
