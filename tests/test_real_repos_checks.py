"""The checks of benchmarks/real_repos.py (fast, no download): a stray change is flagged, the
changes a port makes (sites, imports, dead guards) are not, and test code is told apart."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

from flashport import rules as registry
from flashport.rewriter.engine.pipeline import transform_source
from flashport.rules.base import RuleOptions

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "flashport_real_repos", ROOT / "benchmarks" / "real_repos.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["flashport_real_repos"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


GPU = ("flash_attn", "xformers")
OLD = textwrap.dedent("""\
    import torch

    try:
        from flash_attn import flash_attn_func
    except ImportError:
        flash_attn_func = None


    def f(q, k, v):
        x = 1
        return flash_attn_func(q, k, v,
                               causal=True)
""").encode()


def test_a_port_has_no_stray_changes_and_a_hand_edit_outside_sites_is_flagged():
    bench = _bench()
    result = transform_source(OLD, "m.py", registry.all_rules(), RuleOptions())
    assert bench.check_changes("m.py", OLD, result.new, result.sites, GPU) == []
    edited = result.new.replace(b"x = 1", b"x = 2")
    assert bench.check_changes("m.py", OLD, edited, result.sites, GPU) == ["m.py:10"]
    assert bench.gpu_imports(result.new, GPU) == [] and bench.gpu_imports(OLD, GPU) == [
        "flash_attn (guarded)"
    ]


def test_test_code_is_told_apart_by_path():
    bench = _bench()
    assert (
        bench.is_test("pkg/tests/x.py")
        and bench.is_test("pkg/test_x.py")
        and bench.is_test("benchmarks/b.py")
    )
    assert not bench.is_test("pkg/models/attention.py") and not bench.is_test("pkg/testing_utils.py")


def test_a_gpu_import_the_port_left_unread_is_counted_dead():
    bench = _bench()
    old = b"from flash_attn import flash_attn_func, flash_attn_varlen_func\nimport xformers.ops as xops\n"
    old += b"y = flash_attn_func(q, k, v)\nz = xops\n"
    new = b"from flash_attn import flash_attn_func, flash_attn_varlen_func\nimport xformers.ops as xops\n"
    new += b"y = flashport_call(q, k, v)\nz = xops\n"
    # flash_attn_func was read and no longer is; flash_attn_varlen_func was never read (not the
    # port's doing); xops is still read.
    assert bench.dead_gpu_imports(old, new, GPU) == ["flash_attn: flash_attn_func (line 1)"]
    assert bench.dead_gpu_imports(old, old, GPU) == []
    exported = new + b"__all__ = ['flash_attn_func']\n"
    assert bench.dead_gpu_imports(old, exported, GPU) == []


def test_the_import_check_tells_an_availability_probe_from_an_import_and_says_where(tmp_path):
    import json
    import subprocess

    bench = _bench()
    (tmp_path / "probe.py").write_text(
        "import importlib.util\n\nHAS_FA3 = importlib.util.find_spec('flash_attn_3') is not None\n"
    )
    (tmp_path / "needs.py").write_text("import os\n\nif os.sep:\n    import flash_attn\n")
    done = subprocess.run(
        [sys.executable, "-c", bench._IMPORT_CHECK, str(tmp_path), ",".join(bench.BLOCKED), "probe", "needs"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    outcomes = json.loads(done.stdout.strip().splitlines()[-1])
    # a probe is answered "not installed", as on a host without the GPU libraries; an import is caught
    assert outcomes == {"probe": "ok", "needs": "gpu needs.py:4"}, done.stderr


def test_probe_lines_are_the_kept_imports_whose_reason_is_a_probe_of_the_library():
    bench = _bench()
    kept = [
        "flash_attn_3.flash_attn_interface._flash_attn_forward (line 64): `_flash_attn_forward` is still "
        "read (5x): a use left as it was (refused, suppressed or not covered)",
        "flash_attn_3.flash_attn_interface.flash_attn_with_kvcache (line 65): an availability probe: "
        "`f3` is read nowhere, the try answers whether the library is installed",
        "flash_attn (line 9): reads `fa` itself (fa.__file__): it inspects the installed library, which "
        "has no flashport counterpart",
    ]
    assert bench.probe_lines(kept) == {65, 9}
    assert bench.probe_lines([]) == set()


def test_a_fa3_private_kernel_keeps_its_file_from_counting_as_ported():
    source = textwrap.dedent("""\
        try:
            from flash_attn_3.flash_attn_interface import _flash_attn_forward
            HAVE_FA3 = True
        except ImportError:
            HAVE_FA3 = False

        def f(*args):
            return _flash_attn_forward(*args)
    """).encode()
    result = transform_source(source, "m.py", registry.all_rules(), RuleOptions())
    [site] = result.sites
    # positional splats stay refused: FA3 builds inserted parameters, so which ones it fills is unknown
    assert site.status == "refused" and "FA3 builds" in site.reason and result.new is None


def test_a_line_the_diff_realigns_next_to_a_rewritten_call_is_not_stray():
    bench = _bench()
    old = textwrap.dedent("""\
        import torch.nn.functional as F
        from flash_attn import flash_attn_varlen_func


        def f(mode, q, k, v, cu, m):
            if mode == "torch":
                x = F.scaled_dot_product_attention(
                    q, k, v, is_causal=True
                )
            elif mode == "flash":
                x = flash_attn_varlen_func(
                    q,
                    k,
                    v,
                    cu,
                    cu,
                    m,
                    m,
                )
            return x
    """).encode()
    result = transform_source(old, "m.py", registry.all_rules(), RuleOptions())
    assert result.status == "changed"
    assert bench.check_changes("m.py", old, result.new, result.sites, GPU) == []
    edited = result.new.replace(b'elif mode == "flash"', b'elif mode == "fast"')
    assert bench.check_changes("m.py", old, edited, result.sites, GPU) == ["m.py:10"]
