"""Import management after a rewrite (:mod:`flashport.rewriter.imports.edits`): dead GPU imports go,
everything still used stays, ``import flashport`` lands where isort would put it."""

from __future__ import annotations

import textwrap

import pytest

from flashport import rules as registry
from flashport.rewriter.engine.pipeline import transform_source
from flashport.rewriter.imports import edits as imports
from flashport.rules.base import RuleOptions


def port(source: str) -> str:
    """The rewritten text of ``source`` (dedented); fails when nothing changed."""
    result = transform_source(textwrap.dedent(source).encode(), "m.py", registry.all_rules(), RuleOptions())
    assert result.status == "changed", (result.status, result.error, result.sites)
    return result.new.decode()


# ------------------------------------------------------------------ parenthesized multi-line imports


@pytest.mark.parametrize(
    "stmt, drop, want",
    [
        # the stray, indented ")" of issue 10: the closing parenthesis keeps its own line and column
        ("from m import (\n    a,\n    b,\n    c,\n)\n", {"b", "c"}, "from m import (\n    a,\n)\n"),
        ("from m import (a, b,\n    c)\n", {"c"}, "from m import (a, b)\n"),
        ("from m import (a,\n    b, c\n)\n", {"c"}, "from m import (a,\n    b\n)\n"),
        # a line comment stays with the alias it was written after
        (
            "from m import (  # x\n    a,  # keep a\n    b,  # drop b\n)\n",
            {"b"},
            "from m import (  # x\n    a,  # keep a\n)\n",
        ),
        (
            "    from m import (\n        a,\n        b,\n    )\n",
            {"b"},
            "    from m import (\n        a,\n    )\n",
        ),
        ("from m import a, b, c\n", {"a", "c"}, "from m import b\n"),
    ],
)
def test_dropping_aliases_keeps_the_closing_parenthesis_in_place(stmt, drop, want):
    assert imports._drop_aliases(stmt, drop) == want


def test_multi_line_import_of_fa1_names_loses_only_the_ported_names():
    text = port("""
        from flash_attn.flash_attn_interface import (
            flash_attn_unpadded_func,
            flash_attn_unpadded_kvpacked_func,
        )


        def f(q, k, v, kv, cu, m):
            a = flash_attn_unpadded_kvpacked_func(q, kv, cu, cu, m, m, 0.0, causal=True)
            return a, flash_attn_unpadded_func(q, k, v, cu, cu, m, m, 0.0, None, True, True)
    """)
    assert "from flash_attn.flash_attn_interface import (\n    flash_attn_unpadded_func,\n)\n" in text
    compile(text, "m.py", "exec")


# ------------------------------------------------------------------------------ dead GPU imports


def test_dead_guarded_imports_and_their_fallbacks_go_at_every_scope():
    text = port("""
        import torch

        try:
            from flash_attn import flash_attn_func
        except ImportError:
            flash_attn_func = None
            warnings.warn("flash-attn is not installed")

        try:
            import xformers.ops as xops
            _HAS_XFORMERS = True
        except (ImportError, OSError):
            xops = None
            _HAS_XFORMERS = False

        if is_flash_attn_2_available():
            from flash_attn import flash_attn_kvpacked_func
        else:
            flash_attn_kvpacked_func = None


        def f(q, k, v, kv):
            from flash_attn import flash_attn_qkvpacked_func
            a = flash_attn_func(q, k, v, causal=True)
            b = xops.memory_efficient_attention(q, k, v)
            c = flash_attn_kvpacked_func(q, kv)
            return a, b, c, flash_attn_qkvpacked_func(torch.stack([q, k, v], 2))
    """)
    for gone in (
        "flash_attn",
        "import xformers",
        "xops =",
        "_HAS_XFORMERS",
        "is_flash_attn_2_available",
        "try:",
        "warnings",
    ):
        assert gone not in text, gone
    assert text.startswith(
        "\nimport flashport\nimport flashport.integrations.xformers_compat\nimport torch\n\n\ndef f("
    )


def test_a_guard_whose_flag_is_still_read_collapses_to_its_success_path():
    block = textwrap.dedent("""\
        try:
            from flash_attn import flash_attn_func
            HAS_FLASH_ATTN = True
        except ImportError:
            flash_attn_func = None
            HAS_FLASH_ATTN = False
    """)
    text = port(
        block
        + textwrap.dedent("""

        def f(q, k, v):
            if HAS_FLASH_ATTN:
                return flash_attn_func(q, k, v)
            return None
    """)
    )
    # flashport now supplies what the import supplied, so it cannot fail: the ported branch is taken
    # (as it was where flash-attn was installed), not the fallback a host without it would take
    assert text.startswith("import flashport\n\nHAS_FLASH_ATTN = True\n\n\ndef f(") and "try:" not in text
    assert "flashport.torch.attention(" in text


def test_an_else_flag_and_a_handler_only_flag_collapse_too():
    text = port("""
        try:
            from flash_attn import flash_attn_func
        except ImportError:
            _has_flash_attn_2 = False
        else:
            _has_flash_attn_2 = True

        def f(q, k, v, decode):
            if decode:
                try:
                    from flash_attn import flash_attn_func as fa
                except Exception:
                    decode = False
            if _has_flash_attn_2 and decode:
                return fa(q, k, v)
            return flash_attn_func(q, k, v)
    """)
    assert "\n_has_flash_attn_2 = True\n" in text and "_has_flash_attn_2 = False" not in text
    assert (
        "    if decode:\n        pass\n" in text
        and "decode = False" not in text
        and "from flash_attn" not in text
    )


def test_a_dead_import_leaves_a_try_whose_other_code_stays():
    block = textwrap.dedent("""\
        try:
            from flash_attn import flash_attn_func
            HAS_FLASH_ATTN = check_gpu()
        except ImportError:
            HAS_FLASH_ATTN = False
    """)
    text = port(
        block + "\n\ndef f(q, k, v):\n    return flash_attn_func(q, k, v) if HAS_FLASH_ATTN else None\n"
    )
    # flashport stands in for the import, so it can no longer fail: the rest of the try computes what
    # it computed where flash-attn was installed (check_gpu() still decides)
    assert "try:\n    HAS_FLASH_ATTN = check_gpu()\nexcept ImportError:\n    HAS_FLASH_ATTN = False\n" in text
    assert "flash_attn_func" not in text


def test_a_dead_import_stays_in_a_try_whose_handler_alone_binds_a_name_read_elsewhere():
    block = textwrap.dedent("""\
        try:
            from flash_attn import flash_attn_func
            ok = check_gpu()
        except ImportError:
            reason = "no flash-attn"
    """)
    text = port(block + "\n\ndef f(q, k, v):\n    print(reason)\n    return flash_attn_func(q, k, v)\n")
    assert block in text  # without the failing import, `reason` would never be bound


def test_an_unread_public_flag_may_be_imported_elsewhere_so_it_stays_true():
    text = port("""
        try:
            from flash_attn import flash_attn_func
            HAS_FLASH_ATTN = True
        except ImportError:
            HAS_FLASH_ATTN = False

        def f(q, k, v):
            return flash_attn_func(q, k, v)
    """)
    assert "\nHAS_FLASH_ATTN = True\n" in text and "flash_attn_func" not in text and "try:" not in text


def test_a_guarded_import_with_a_live_name_loses_only_the_dead_one_and_its_fallback():
    text = port("""
        try:
            from flash_attn import flash_attn_func, flash_attn_with_kvcache
        except ImportError:
            flash_attn_func = None
            flash_attn_with_kvcache = None

        def f(q, k, v, run):
            run(callable(flash_attn_with_kvcache))
            return flash_attn_func(q, k, v)
    """)
    assert (
        "    from flash_attn import flash_attn_with_kvcache\nexcept ImportError:\n    flash_attn_with_kvcache = None\n"
        in text
    )
    assert "flash_attn_func" not in text


def test_a_block_left_empty_gets_pass_and_a_condition_with_effects_stays():
    text = port("""
        def f(q, k, v):
            if load_kernels(q):
                from flash_attn import flash_attn_func
            return flash_attn_func(q, k, v)
    """)
    assert "    if load_kernels(q):\n        pass\n    return flashport.torch.attention(" in text


def test_names_read_before_the_port_only_by_other_code_keep_their_imports():
    text = port("""
        from flash_attn import flash_attn_func, flash_attn_varlen_func
        from flash_attn.bert_padding import pad_input

        __all__ = ["pad_input"]

        def f(q, k, v):
            return flash_attn_func(q, k, v)
    """)
    # flash_attn_varlen_func was never read here and pad_input only exported: re-exports for other
    # modules (out of sight), which now hand out flashport's drop-ins of the same API
    assert "from flashport.integrations.flash_attn_compat import flash_attn_varlen_func\n" in text
    assert "from flashport.integrations.bert_padding import pad_input\n" in text
    assert "from flash_attn" not in text


# ------------------------------------------------------------------------- where flashport goes


@pytest.mark.parametrize(
    "before, after",
    [
        # isort default: plain imports first, sorted; flashport joins the third-party group
        (
            '"""d"""\nfrom __future__ import annotations\n\nimport os\n\nimport torch\nfrom einops import rearrange\n\nfrom .x import y\n',
            '"""d"""\nfrom __future__ import annotations\n\nimport os\n\nimport flashport\nimport torch\nfrom einops import rearrange\n\nfrom .x import y\n',
        ),
        ("import numpy as np\nimport torch\n", "import flashport\nimport numpy as np\nimport torch\n"),
        (
            "import apex\nimport einops\nfrom torch import nn\n",
            "import apex\nimport einops\nimport flashport\nfrom torch import nn\n",
        ),
        # force_sort_within_sections style: by module name among all
        (
            "from einops import rearrange\nimport torch\n",
            "from einops import rearrange\nimport flashport\nimport torch\n",
        ),
        # no third-party group: its own, after the stdlib one / before the local one
        ("import os\n\nfrom .x import y\n", "import os\n\nimport flashport\n\nfrom .x import y\n"),
        ("from .x import y\n", "import flashport\n\nfrom .x import y\n"),
        # comments above a statement stay with it
        (
            "import apex\n# the fast path\nimport torch\n",
            "import apex\nimport flashport\n# the fast path\nimport torch\n",
        ),
        # a guarded import block between the groups (timm) is part of the import region, not its end
        (
            "import math\ntry:\n    from typing import Literal\nexcept ImportError:\n    from typing_extensions import Literal\n\nimport torch\n",
            "import math\ntry:\n    from typing import Literal\nexcept ImportError:\n    from typing_extensions import Literal\n\nimport flashport\nimport torch\n",
        ),
        # a new group after the stdlib one is kept apart from the code below it by a blank line
        ("import os\ndef f():\n    pass\n", "import os\n\nimport flashport\n\ndef f():\n    pass\n"),
        # no imports left (the GPU one was removed): at the top, PEP 8 spacing; a header comment stays above
        ("\n\ndef f():\n    pass\n", "import flashport\n\n\ndef f():\n    pass\n"),
        ("# header\n\nx = 1\n", "# header\n\nimport flashport\n\nx = 1\n"),
    ],
)
def test_flashport_import_goes_where_isort_puts_it(before, after):
    assert imports.ensure_import(before, "flashport", "\n") == (after, True)


def test_flashport_submodule_import_sorts_after_flashport():
    text, added = imports.ensure_import("import flashport\nimport torch\n", "flashport.torch", "\n")
    assert added and text == "import flashport\nimport flashport.torch\nimport torch\n"


# --------------------------------------------------------------- a ported file runs without GPU libs

_MODEL = '''\
"""A model file that uses flash-attn and xformers when they are there."""
import math

import torch

try:
    from flash_attn import flash_attn_func
except ImportError:
    flash_attn_func = None

try:
    import xformers.ops as xops
except ImportError:
    xops = None


def attend(q, k, v):
    from flash_attn import flash_attn_kvpacked_func
    a = flash_attn_func(q, k, v, causal=True, softmax_scale=1 / math.sqrt(q.shape[-1]))
    b = xops.memory_efficient_attention(q, k, v)
    c = flash_attn_kvpacked_func(q, torch.stack([k, v], 2))
    return a, b, c
'''

_RUN = """\
import importlib.abc, sys
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("flash_attn", "xformers"):
            raise ImportError(f"{name} is blocked (no GPU libraries here)")
        return None
sys.meta_path.insert(0, Blocker())
sys.path.insert(0, sys.argv[1])
import torch
import torch.nn.functional as F
import model
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(2, 5, 3, 8, generator=g) for _ in range(3))
a, b, c = model.attend(q, k, v)
t = lambda x: x.transpose(1, 2)
causal = t(F.scaled_dot_product_attention(t(q), t(k), t(v), is_causal=True))
full = t(F.scaled_dot_product_attention(t(q), t(k), t(v)))
errors = [(a - causal).abs().max().item(), (b - full).abs().max().item(), (c - full).abs().max().item()]
assert max(errors) < 1e-5, errors
assert not any(m.split(".")[0] in ("flash_attn", "xformers") for m in sys.modules)
print("ok")
"""


def _run_model(tmp_path, source: str):
    import subprocess
    import sys

    (tmp_path / "model.py").write_text(source)
    (tmp_path / "run.py").write_text(_RUN)
    return subprocess.run(
        [sys.executable, str(tmp_path / "run.py"), str(tmp_path)], capture_output=True, text=True, timeout=600
    )


def test_a_ported_file_imports_and_runs_where_flash_attn_and_xformers_cannot_be_imported(tmp_path):
    pytest.importorskip("torch")
    original = _run_model(tmp_path, _MODEL)
    assert original.returncode != 0  # the original needs the GPU libraries
    ported = port(_MODEL)
    assert "flash_attn" not in ported and "import xformers" not in ported
    done = _run_model(tmp_path, ported)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


_FLAG_MODEL = """\
import torch

try:
    from flash_attn import flash_attn_func
    HAS_FLASH_ATTN = True
except ImportError:
    print("flash-attn not found: attention unavailable")
    HAS_FLASH_ATTN = False


def attend(q, k, v):
    if not HAS_FLASH_ATTN:
        raise RuntimeError("this model needs flash-attn")
    full = flash_attn_func(q, k, v)
    return flash_attn_func(q, k, v, causal=True), full, full
"""


def test_a_ported_availability_flag_runs_the_ported_path_without_flash_attn(tmp_path):
    pytest.importorskip("torch")
    assert _run_model(tmp_path, _FLAG_MODEL).returncode != 0  # the original falls back to raising
    ported = port(_FLAG_MODEL)
    assert "flash_attn" not in ported and "HAS_FLASH_ATTN = True" in ported
    done = _run_model(tmp_path, ported)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_a_guard_that_only_logs_the_missing_library_goes_with_it():
    text = port("""
        try:
            import xformers.ops
        except ImportError:
            LOG.error("xformers not found! Please install it before trying to use it.")

        def f(q, k, v):
            return xformers.ops.memory_efficient_attention(q, k, v)
    """)
    assert "try:" not in text and "LOG.error" not in text and "import xformers" not in text


def test_a_function_a_handler_defines_only_for_its_fallbacks_goes_with_the_guard():
    text = port("""
        try:
            from flash_attn import flash_attn_func
        except ImportError:

            def _unsupported(*args, **kwargs):
                raise ImportError("flash-attn is not installed")

            flash_attn_func = _unsupported

        def f(q, k, v):
            return flash_attn_func(q, k, v)
    """)
    assert "try:" not in text and "_unsupported" not in text and "flash_attn_func" not in text


def test_a_guard_whose_handler_tries_another_path_goes_whole():
    """A fallback import of the same kernels from another path, nested in the handler with its own
    fallback: the whole block goes (it was left as ``try: <import> except: pass``)."""
    text = port("""
        try:
            from flash_attn import flash_attn_func
        except ImportError:
            try:
                from flash_attn.flash_attn_interface import flash_attn_func
            except ImportError:
                flash_attn_func = None

        def f(q, k, v):
            return flash_attn_func(q, k, v)
    """)
    assert "try:" not in text and "pass" not in text and "flash_attn_func" not in text, text


def test_a_try_whose_imports_all_went_goes_with_its_handlers():
    """Once its ported imports went, nothing in the ``try`` can raise: its handlers are dead code,
    whatever they do, and the block goes (it was left as ``try: pass`` with its handlers)."""
    text = port("""
        try:
            from flash_attn import flash_attn_func
        except ImportError:
            try:
                from flash_attn.flash_attn_interface import flash_attn_func
            except ImportError:
                flash_attn_func = None
                install_hint()

        def f(q, k, v):
            return flash_attn_func(q, k, v)
    """)
    assert "try:" not in text and "install_hint" not in text and "flash_attn_func" not in text, text


def test_a_handler_function_read_elsewhere_keeps_the_guard():
    text = port("""
        try:
            from flash_attn import flash_attn_func
        except ImportError:

            def _unsupported(*args, **kwargs):
                raise ImportError("flash-attn is not installed")

            flash_attn_func = _unsupported

        def f(q, k, v):
            return flash_attn_func(q, k, v)

        CHECKS = [_unsupported]
    """)
    assert "from flash_attn import flash_attn_func" in text and "def _unsupported" in text


def test_a_guard_stays_when_other_gpu_imports_remain_in_the_file():
    # The flag also gates a flash-attn import the codemod does not port (the fused dense layer): forcing
    # it to True would make a host without flash-attn import it and fail where the original took
    # its fallback; the guard stays exactly as it was.
    guard = textwrap.dedent("""\
        try:
            from flash_attn import flash_attn_func
            HAS_FLASH_ATTN = True
        except ImportError:
            flash_attn_func = None
            HAS_FLASH_ATTN = False
    """)
    text = port(
        guard
        + textwrap.dedent("""

        def f(q, k, v):
            if HAS_FLASH_ATTN:
                from flash_attn.ops.fused_dense import fused_dense_func
                q = fused_dense_func(q, q)
                return flash_attn_func(q, k, v)
            return None
    """)
    )
    assert "flashport.torch.attention(" in text
    assert guard in text and "HAS_FLASH_ATTN = True\n\n\ndef" not in text


def test_a_dead_import_in_a_try_whose_handler_only_raises_goes_even_with_other_gpu_imports():
    # `except ImportError: raise RuntimeError(...)` requires the library; kept, the dead import would
    # still raise on a host without flash-attn although the ported code no longer needs it. Another
    # GPU import elsewhere in the file (kept: its call is not ported) does not change that.
    text = port("""
        from flash_attn.ops.fused_dense import fused_dense_func

        def load():
            try:
                from flash_attn import flash_attn_func

                return lambda q, k, v: flash_attn_func(q, k, v, causal=True)
            except ImportError as e:
                raise RuntimeError("pip install flash-attn") from e

        def other(x):
            return fused_dense_func(x, x)
    """)
    assert "from flash_attn import flash_attn_func" not in text
    assert (
        "    try:\n        return lambda q, k, v: flashport.torch.attention(" in text
    )  # no blank line leads the block
    assert "from flash_attn.ops.fused_dense import fused_dense_func" in text


def test_a_dead_import_stays_in_a_try_whose_handler_also_falls_back():
    text = port("""
        from flash_attn.ops.fused_dense import fused_dense_func

        def load():
            try:
                from flash_attn import flash_attn_func

                return lambda q, k, v: flash_attn_func(q, k, v, causal=True)
            except ImportError:
                warn_once()
                return None

        def other(x):
            return fused_dense_func(x, x)
    """)
    assert "from flash_attn import flash_attn_func" in text


@pytest.mark.parametrize(
    ("below", "gap"),
    [
        ("x = 1\n", "\n"),  # isort leaves one blank line between the imports and code
        ("def f():\n    pass\n", "\n\n"),  # two above a definition
        ("\ndef f():\n    pass\n", "\n\n"),  # one blank line already there: one more
        ("\n\n\nx = 1\n", "\n\n\n"),  # enough blank lines already: none added
    ],
)
def test_an_import_after_the_docstring_keeps_isorts_blank_lines_below_it(below, gap):
    text, added = imports.ensure_import('"""Doc."""\n' + below, "flashport", "\n")
    assert added
    expected_below = below.lstrip("\n") if gap != "\n\n\n" else "x = 1\n"
    assert text == '"""Doc."""\nimport flashport\n' + gap + expected_below


def test_an_import_after_the_docstring_goes_below_the_comments_right_under_it():
    # where ruff's isort puts a required import: the comments below the docstring stay with it
    text, _ = imports.ensure_import('"""Doc."""\n# note\nx = 1\n', "flashport", "\n")
    assert text == '"""Doc."""\n# note\nimport flashport\n\nx = 1\n'
    text, _ = imports.ensure_import("from __future__ import annotations\nx = 1\n", "flashport", "\n")
    assert text == "from __future__ import annotations\n\nimport flashport\n\nx = 1\n"


# ------------------------------------------- guards that mix ported names with never-read ones

_FA3_GUARD_MODEL = """\
try:
    from flash_attn_interface import _flash_attn_forward as fwd
    from flash_attn_interface import flash_attn_func as fa3_func
    HAS_FA3 = True
except ImportError:
    HAS_FA3 = False


def attend(q, k, v):
    assert HAS_FA3
    out, lse, *_ = fwd(q=q, k=k, v=v, softmax_scale=0.3, causal=True, window_size_left=-1, window_size_right=-1)
    return out, out, out
"""


def test_a_guard_with_a_ported_name_and_a_never_read_one_collapses_and_keeps_a_probe_for_the_other():
    # the never-read name may be re-exported, so it keeps its own guard; the flag no longer hangs on it
    text = port(_FA3_GUARD_MODEL)
    assert text.startswith(
        "import flashport.integrations.flash_attn3_compat\n\nHAS_FA3 = True\ntry:\n"
        "    from flash_attn_interface import flash_attn_func as fa3_func\nexcept ImportError:\n    pass\n\n\n"
    )
    assert "_flash_attn_forward as fwd" not in text


_FA3_RUN = """\
import importlib.abc, sys
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("flash_attn", "flash_attn_interface", "xformers"):
            raise ImportError(f"{name} is blocked (no GPU libraries here)")
        return None
sys.meta_path.insert(0, Blocker())
sys.path.insert(0, sys.argv[1])
import torch
import torch.nn.functional as F
import model
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(2, 5, 3, 8, generator=g) for _ in range(3))
out = model.attend(q, k, v)[0]
t = lambda x: x.transpose(1, 2)
want = t(F.scaled_dot_product_attention(t(q), t(k), t(v), is_causal=True, scale=0.3))
assert (out - want).abs().max().item() < 1e-5, (out - want).abs().max().item()
print("ok", model.HAS_FA3, hasattr(model, "fa3_func"))
"""


def test_a_mixed_fa3_guard_runs_the_ported_path_without_the_gpu_library(tmp_path):
    import subprocess
    import sys

    pytest.importorskip("torch")
    (tmp_path / "run.py").write_text(_FA3_RUN)

    def run(source):
        (tmp_path / "model.py").write_text(source)
        command = [sys.executable, str(tmp_path / "run.py"), str(tmp_path)]
        return subprocess.run(command, capture_output=True, text=True, timeout=600)

    assert run(_FA3_GUARD_MODEL).returncode != 0  # the original's flag is off without FA3
    done = run(port(_FA3_GUARD_MODEL))
    # the ported path runs; the never-read name stays unbound there, as it was in the original
    assert done.returncode == 0 and done.stdout.strip() == "ok True False", done.stderr[-3000:]


@pytest.mark.parametrize(
    "guard, flags",
    [
        # FA2's never-read name has an exact drop-in: it moves there and no GPU import is left
        (
            """\
            try:
                from flash_attn import flash_attn_func, flash_attn_varlen_func as varlen
                HAS_FA = True
            except ImportError:
                flash_attn_func = varlen = None
                HAS_FA = False
            """,
            "from flashport.integrations.flash_attn_compat import flash_attn_varlen_func as varlen\n\n"
            "HAS_FA = True\n\n\n",
        ),
        # xformers: no drop-in for the module fmha, which keeps its guard and its None fallback
        (
            """\
            try:
                from xformers.ops import memory_efficient_attention as flash_attn_func, fmha
                HAS_FA = True
            except ImportError:
                HAS_FA = False
                flash_attn_func = fmha = None
            """,
            "HAS_FA = True\ntry:\n    from xformers.ops import fmha\nexcept ImportError:\n    fmha = None\n\n\n",
        ),
    ],
)
def test_mixed_guards_read_through_an_if_collapse_and_keep_their_none_fallbacks(guard, flags):
    text = port(
        textwrap.dedent(guard)
        + textwrap.dedent("""

        def f(q, k, v):
            if HAS_FA:
                return flash_attn_func(q, k, v)
            return None
    """)
    )
    assert flags in text and text.count("try:") == flags.count("try:"), text
    assert "import memory_efficient_attention" not in text and "from flash_attn import" not in text


def test_a_pure_probe_that_ports_nothing_stays_as_it_is():
    # nothing the guard imports was ported (its name is read nowhere): it asks "is FA3 installed?"
    guard = """\
        try:
            from flash_attn_interface import flash_attn_func as fa3_func
            HAS_FA3 = True
        except ImportError:
            HAS_FA3 = False
    """
    text = port(
        guard
        + """

        def f(q, k, v):
            from flash_attn import flash_attn_func

            return flash_attn_func(q, k, v), HAS_FA3
    """
    )
    assert textwrap.dedent(guard) in text


def test_a_ported_name_kept_in_a_guard_that_stays_is_not_called_read_nowhere():
    source = textwrap.dedent("""\
        import inspect

        try:
            from flash_attn_interface import _flash_attn_forward
            from flash_attn_interface import flash_attn_with_kvcache as f3
            HAVE_FA3 = True
        except ImportError:
            HAVE_FA3 = False


        def names():
            return inspect.signature(_flash_attn_forward._init_fn).parameters


        def decode(q, k_cache, v_cache):
            return f3(q, k_cache, v_cache, causal=True)
    """)
    result = transform_source(source.encode(), "m.py", registry.all_rules(), RuleOptions())
    assert "f3(" not in result.new.decode()
    [ported] = [line for line in result.imports_kept if "flash_attn_with_kvcache" in line]
    # f3 was called and ported: its import stays only because the guard does (for _flash_attn_forward)
    assert ported.startswith(
        "flash_attn_interface.flash_attn_with_kvcache (line 7): an availability probe: every use of `f3` was ported"
    )
    assert "read nowhere" not in ported
