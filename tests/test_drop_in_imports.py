"""GPU imports that a port points at flashport's drop-ins, and flash-attn version reads it pins
(:mod:`flashport.rewriter.imports.drop_in_imports`): a fully ported file no longer imports the GPU library,
and a probe or re-export whose answer could change stays as it was."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from flashport import rules as registry
from flashport.rewriter.engine.pipeline import transform_source
from flashport.rules.base import RuleOptions

sys.path.insert(0, os.path.dirname(__file__))
from reference import reference_attention


def port(source: str, version: tuple[int, ...] = (2, 8, 3)) -> str:
    """The rewritten text of ``source`` (dedented) for flash-attn ``version``."""
    options = RuleOptions(flash_attn_version=version)
    result = transform_source(textwrap.dedent(source).encode(), "m.py", registry.all_rules(), options)
    assert result.status == "changed", (result.status, result.error, result.sites)
    return result.new.decode()


# FPDT-style ring code: the branch is chosen by the installed flash-attn's version, and a probe of
# the private kernel refuses to run without it
_VERSIONED = """\
from packaging import version

try:
    import flash_attn
    from flash_attn.flash_attn_interface import _flash_attn_forward
    flash_attn_version = version.parse(flash_attn.__version__)
except ImportError:
    _flash_attn_forward = None


def attend(q, k, v):
    if _flash_attn_forward is None:
        raise ImportError("this needs flash-attn")
    if flash_attn_version >= version.parse("2.7.0"):
        out, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, 0.5, True, -1, -1, 0.0, None, False)
    else:
        out, _, _, _, _, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, 0.5, True, (-1, -1), 0.0, None, False)
    return out, lse
"""

_RUN = """\
import importlib.abc, sys
import numpy as np
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("flash_attn", "xformers"):
            raise ImportError(f"{name} is blocked (no GPU libraries here)")
        return None
sys.meta_path.insert(0, Blocker())
sys.path.insert(0, sys.argv[1])
import torch
import model
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(2, 6, 3, 8, generator=g, dtype=torch.float64) for _ in range(3))
out, lse = model.attend(q, k, v)
np.savez(sys.argv[2], q=q.numpy(), k=k.numpy(), v=v.numpy(), out=out.numpy(), lse=lse.numpy())
"""


@pytest.mark.parametrize("version", [(2, 8, 3), (2, 6, 3)])
def test_a_version_read_is_pinned_and_the_ported_branch_runs_without_flash_attn(tmp_path, version):
    pytest.importorskip("torch")
    pytest.importorskip("packaging")
    text = port(_VERSIONED, version)
    pinned = ".".join(map(str, version))
    assert f'    flash_attn_version = version.parse("{pinned}")\n' in text
    # the probe now finds the function the port calls; nothing imports flash_attn any more
    assert "    from flashport.integrations.flash_attn_compat import _flash_attn_forward\n" in text
    assert "flash_attn." not in text.replace("flashport.integrations.flash_attn_compat", "")
    assert "import flash_attn\n" not in text
    (tmp_path / "model.py").write_text(text)
    (tmp_path / "run.py").write_text(_RUN)
    done = subprocess.run(
        [sys.executable, str(tmp_path / "run.py"), str(tmp_path), str(tmp_path / "out.npz")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = np.load(tmp_path / "out.npz")
    want, want_lse = reference_attention(got["q"], got["k"], got["v"], scale=0.5, causal=True)
    np.testing.assert_allclose(got["out"], want, atol=1e-6)
    np.testing.assert_allclose(got["lse"], want_lse, atol=1e-6)


def test_the_version_stays_read_when_another_gpu_import_stays():
    # the fused dense layer has no port: the host's real flash-attn version may still matter to it
    text = port(
        _VERSIONED
        + textwrap.dedent("""

        def project(x, weight):
            from flash_attn.ops.fused_dense import fused_dense_func
            return fused_dense_func(x, weight)
    """)
    )
    assert "version.parse(flash_attn.__version__)" in text and "    import flash_attn\n" in text


_SDPA = "\n\ndef f(q, k, v):\n    return torch.nn.functional.scaled_dot_product_attention(q, k, v)\n"


def test_a_probe_of_a_name_the_file_never_called_keeps_asking_about_the_library():
    block = textwrap.dedent("""\
        try:
            from flash_attn import flash_attn_func
        except ImportError:
            flash_attn_func = None
        HAS_FA = flash_attn_func is not None
    """)
    text = port("import torch\n\n" + block + _SDPA)
    assert block in text  # nothing was ported for it: the probe is about the real library


def test_an_import_that_is_the_probe_stays_in_its_try():
    block = textwrap.dedent("""\
        try:
            from flash_attn import flash_attn_func  # noqa: F401
            HAS_FA = True
        except ImportError:
            HAS_FA = False
    """)
    text = port("import torch\n\n" + block + _SDPA)
    assert block in text  # "is flash-attn installed?": pointing it at flashport would change the answer


@pytest.mark.parametrize(
    "version, moved",
    [((2, 8, 3), True), ((2, 6, 3), False)],  # unpad_input returns five values only from 2.7 on
)
def test_a_re_export_moves_only_where_the_drop_in_replicates_the_release(version, moved):
    text = port(
        """
        from flash_attn import flash_attn_func
        from flash_attn.bert_padding import pad_input, unpad_input

        def f(q, k, v):
            return flash_attn_func(q, k, v)
        """,
        version,
    )
    moved_line = "from flashport.integrations.bert_padding import pad_input, unpad_input\n"
    assert (moved_line in text) is moved
    assert ("from flash_attn.bert_padding import pad_input, unpad_input\n" in text) is not moved


def test_a_never_read_private_kernel_is_not_re_exported_as_the_drop_in():
    text = port("""
        from flash_attn import flash_attn_func
        from flash_attn.flash_attn_interface import _flash_attn_forward

        def f(q, k, v):
            return flash_attn_func(q, k, v)
    """)
    # its convention changed between releases: the drop-in may not be what an importer expects
    assert "from flash_attn.flash_attn_interface import _flash_attn_forward\n" in text


def test_an_unread_import_under_a_flag_moves_and_lets_the_guard_below_collapse():
    text = port("""
        if HAS_SOFTCAP:
            from flash_attn import flash_attn_func  # noqa: F401

        if USE_DECODE:
            try:
                from flash_attn import flash_attn_with_kvcache
            except Exception:
                USE_DECODE = False

        def decode(q, k_cache, v_cache, lengths):
            return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths)
    """)
    assert (
        "if HAS_SOFTCAP:\n    from flashport.integrations.flash_attn_compat import flash_attn_func  # noqa: F401\n"
        in text
    )
    assert "if USE_DECODE:\n    pass\n" in text and "from flash_attn" not in text


def test_every_gpu_import_left_in_place_comes_with_its_reason():
    source = textwrap.dedent("""\
        import torch

        def fingerprint():
            try:
                import flash_attn as fa
                return fa.__file__
            except ImportError:
                return None

        def installed():
            try:
                import flash_attn.cute.interface  # noqa: F401
            except ImportError:
                return False
            return True

        def f(q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)
    """)
    result = transform_source(source.encode(), "m.py", registry.all_rules(), RuleOptions())
    assert result.status == "changed"
    kept = result.imports_kept
    assert len(kept) == 2, kept
    assert kept[0].startswith("flash_attn (line 6): reads `fa` itself (fa.__file__)"), kept
    assert kept[1].startswith("flash_attn.cute.interface (line 13): an availability probe"), kept


# verl-style dispatch: the NPU helpers in one branch, flash-attn's bert_padding in the other
_BRANCHES = """\
def get_functions(npu):
    if npu:
        from npu_utils import index_first_axis, pad_input, rearrange, unpad_input
    else:
        from flash_attn.bert_padding import index_first_axis, pad_input, rearrange, unpad_input
    found = index_first_axis, pad_input, rearrange, unpad_input
    return found
"""

_RUN_BRANCHES = """\
import importlib.abc, sys
import numpy as np
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "flash_attn":
            raise ImportError(f"{name} is blocked (no GPU libraries here)")
        return None
sys.meta_path.insert(0, Blocker())
sys.path.insert(0, sys.argv[1])
import torch
import model
index_first_axis, pad_input, rearrange, unpad_input = model.get_functions(False)
g = torch.Generator().manual_seed(0)
x = torch.randn(2, 5, 3, 4, generator=g, dtype=torch.float64)
mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
flat = x.reshape(2, 5, 12)
hidden, indices, cu_seqlens, max_seqlen, _ = unpad_input(flat, mask)
assert callable(rearrange)  # einops' function, called through the drop-in (einops may be absent here)
np.savez(sys.argv[2], x=x.numpy(), mask=mask.numpy(), hidden=hidden.numpy(),
         cu=cu_seqlens.numpy(), max_seqlen=max_seqlen, padded=pad_input(hidden, indices, 2, 5).numpy(),
         rows=index_first_axis(flat.reshape(10, 12), indices).numpy())
"""


def test_a_name_bound_per_branch_gets_the_drop_in_in_the_flash_attn_branch_and_runs_without_it(tmp_path):
    pytest.importorskip("torch")
    text = port(_BRANCHES)
    assert "        from npu_utils import index_first_axis, pad_input, rearrange, unpad_input\n" in text
    assert (
        "        from flashport.integrations.bert_padding import index_first_axis, pad_input, rearrange, unpad_input\n"
        in text
    )
    assert "flash_attn" not in text
    (tmp_path / "model.py").write_text(text)
    (tmp_path / "run.py").write_text(_RUN_BRANCHES)
    done = subprocess.run(
        [sys.executable, str(tmp_path / "run.py"), str(tmp_path), str(tmp_path / "out.npz")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = np.load(tmp_path / "out.npz")
    flat = got["x"].reshape(2, 5, 12)  # numpy's own reshape and boolean indexing as the reference
    mask = got["mask"]
    np.testing.assert_array_equal(got["hidden"], flat[mask])
    np.testing.assert_array_equal(got["cu"], [0, 3, 8])
    assert int(got["max_seqlen"]) == 5
    np.testing.assert_array_equal(got["padded"], flat * mask[..., None])
    np.testing.assert_array_equal(got["rows"], flat.reshape(10, 12)[mask.reshape(-1)])
