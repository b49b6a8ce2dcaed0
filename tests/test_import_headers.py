"""The file header survives a port: nothing goes above a shebang, an encoding cookie, the module
docstring, ``from __future__`` imports or the leading comment block, and ``import flashport``
lands where isort puts it (ruff's isort rule, run on the output, is the independent judge)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flashport import rules as registry
from flashport.rewriter.engine.pipeline import transform_source
from flashport.rules.base import RuleOptions

SHEBANG = "#!/usr/bin/env python\n"
COOKIE = "# -*- coding: latin-1 -*-\n"
LICENCE = "# Copyright 2024 The Caf\xe9 Authors.\n# Licensed under the Apache License, Version 2.0.\n"
DOCSTRING = '"""A model."""\n'
FUTURE = "from __future__ import annotations\n"
CALL = "\n\ndef f(q, k, v):\n    return flash_attn_func(q, k, v, causal=True)\n"

# Import regions, each already sorted the way isort/ruff want (checked below).
REGIONS = {
    "plain": "import torch\nfrom flash_attn import flash_attn_func\n",
    "stdlib_and_third": "import os\n\nimport torch\nfrom flash_attn import flash_attn_func\n",
    "only_gpu": "from flash_attn import flash_attn_func\n",
    "local_after": "from flash_attn import flash_attn_func\n\nfrom . import layers\n",
    "type_checking": (
        "from typing import TYPE_CHECKING\n\nfrom flash_attn import flash_attn_func\n\n"
        "if TYPE_CHECKING:\n    import torch\n"
    ),
    "try_except": (
        "import torch\n\ntry:\n    from flash_attn import flash_attn_func\nexcept ImportError:\n"
        "    flash_attn_func = None\n"
    ),
    "late_import": "x = 1\nfrom flash_attn import flash_attn_func  # noqa: E402\n",
}

HEADERS = {
    "none": [],
    "shebang": [SHEBANG],
    "cookie": [COOKIE],
    "shebang_cookie": [SHEBANG, COOKIE],
    "shebang_cookie_licence": [SHEBANG, COOKIE, LICENCE],
    "shebang_cookie_licence_gap": [SHEBANG, COOKIE, LICENCE, "\n"],
    "licence": [LICENCE],
    "docstring": [DOCSTRING],
    "cookie_docstring_licence": [COOKIE, DOCSTRING, LICENCE],
    "cookie_licence_docstring": [COOKIE, LICENCE, DOCSTRING, "\n"],
    "future": [FUTURE, "\n"],
    "shebang_cookie_licence_docstring_future": [SHEBANG, COOKIE, LICENCE, DOCSTRING, "\n", FUTURE, "\n"],
}


def _encoding(text: str) -> str:
    return "latin-1" if COOKIE in text else "utf-8"


def _cases():
    for header, parts in HEADERS.items():
        for region in REGIONS:
            if region == "late_import" and FUTURE in parts:
                continue  # `x = 1` above a __future__ import does not compile
            yield pytest.param(header, region, id=f"{header}-{region}")


def _ruff_isort(paths: list[str], cwd: str) -> dict[str, list[str]]:
    """Per path, ruff's isort findings (``I001``) with the fix it wants (run in ``cwd``, away from
    this repository, where ruff would take ``flashport`` for a first-party module)."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--isolated",
            "--select",
            "I",
            "--output-format",
            "json",
            *paths,
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode in (0, 1), out.stderr
    found: dict[str, list[str]] = {}
    for item in json.loads(out.stdout or "[]"):
        fix = (item.get("fix") or {}).get("edits") or [{}]
        found.setdefault(item["filename"], []).append(f"{item['code']}: wants {fix[0].get('content')!r}")
    return found


def _source(header: str, region: str) -> str:
    parts = HEADERS[header]
    body = REGIONS[region]
    if region == "late_import" and (not parts or parts[-1] != "\n"):
        body = "\n" + body if parts and DOCSTRING in parts[-1] else body
    return "".join(parts) + body + CALL


@pytest.mark.parametrize("header, region", list(_cases()))
def test_header_stays_above_and_flashport_goes_where_isort_puts_it(header, region, tmp_path):
    source = _source(header, region)
    encoding = _encoding(source)
    data = source.encode(encoding)
    before = tmp_path / "before.py"
    before.write_bytes(data)
    result = transform_source(data, "m.py", registry.all_rules(), RuleOptions())
    assert result.status == "changed", (result.error, result.sites)
    new = result.new.decode(encoding)
    compile(result.new, "m.py", "exec", dont_inherit=True)  # bytes: the cookie is honoured
    new_lines = new.splitlines(keepends=True)
    # every header line keeps its place at the top, in order, and nothing is put before it
    head = [line for part in HEADERS[header] for line in part.splitlines(keepends=True) if line.strip()]
    assert [line for line in new_lines if line.strip()][: len(head)] == head, new[:300]
    if COOKIE in source:
        assert COOKIE in new_lines[:2]
    if LICENCE in source:
        assert "Caf\xe9".encode(encoding) in result.new
    if SHEBANG in source:
        assert new_lines[0] == SHEBANG
    assert new.count("import flashport\n") == 1
    # isort's placement: ruff's isort rule finds nothing to sort in the output where it found
    # nothing in the input (the late import is its own block for both)
    after = tmp_path / "after.py"
    after.write_bytes(result.new)
    found = _ruff_isort([str(before), str(after)], str(tmp_path))
    assert str(before) not in found, f"the input must be isort-clean: {found}"
    assert str(after) not in found, f"{found[str(after)]}\n{new}"


@pytest.mark.parametrize(
    "source",
    [
        "# just a comment on flash_attn_func\n# and another\n",
        "#!/usr/bin/env python\n# -*- coding: latin-1 -*-\n# Copyright\n# flash_attn_func(q, k, v)\n",
        '"""Only a docstring: flash_attn_func."""\n',
    ],
)
def test_files_without_code_are_left_alone(source):
    result = transform_source(source.encode("latin-1"), "m.py", registry.all_rules(), RuleOptions())
    assert result.parsed and result.status == "unchanged" and result.new is None and not result.sites
