"""Run-level context: a run whose files patch ``torch.nn.functional.scaled_dot_product_attention``
(or a flash-attn function) at run time. SDPA calls then go to the patch-aware drop-in with their
arguments verbatim (the patch still runs once ported), calls through names bound earlier and
patched flash-attn sites are kept with a reason naming the patch, and runs without a patch are
unchanged."""

from __future__ import annotations

import json
import textwrap

import pytest

from flashport import rules as registry
from flashport.rewriter.app import cli
from flashport.rewriter.engine import run_context
from flashport.rewriter.engine.pipeline import transform_source
from flashport.rules.base import RuleOptions

SDPA = "torch.nn.functional.scaled_dot_product_attention"
DROP_IN = "flashport.integrations.sdpa_compat.scaled_dot_product_attention"

CALLER = """\
import torch.nn.functional as F


def attend(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)
"""

PATCHER = """\
import torch.nn.functional as F

_original = F.scaled_dot_product_attention


def install(wrapper):
    F.scaled_dot_product_attention = wrapper
"""


def patches(source: str) -> list[tuple[str, int]]:
    return [(p.api, p.line) for p in run_context.find_patches(textwrap.dedent(source).encode(), "x.py")]


@pytest.mark.parametrize(
    "source",
    [
        "import torch.nn.functional as F\nF.scaled_dot_product_attention = w\n",
        "import torch\ntorch.nn.functional.scaled_dot_product_attention = w\n",
        "import torch.nn.functional as nnf\nnnf.scaled_dot_product_attention = w\n",
        "from torch.nn import functional\nfunctional.scaled_dot_product_attention = w\n",
        'import torch.nn.functional as F\nsetattr(F, "scaled_dot_product_attention", w)\n',
        'import torch.nn.functional as F\nmonkeypatch.setattr(F, "scaled_dot_product_attention", w)\n',
        'import os\nmonkeypatch.setattr("torch.nn.functional.scaled_dot_product_attention", w)\n',
        'from unittest import mock\nmock.patch("torch.nn.functional.scaled_dot_product_attention", w)\n',
        'import torch.nn.functional as F\nmock.patch.object(F, "scaled_dot_product_attention", w)\n',
        "import torch.nn.functional as F\nF.scaled_dot_product_attention, x = w, 1\n",
    ],
)
def test_every_alias_and_form_of_an_sdpa_patch_is_found(source):
    assert patches(source) == [(SDPA, 2)]


def test_torch_context_parallel_counts_as_an_sdpa_patch():
    source = "from torch.distributed.tensor.experimental import context_parallel\n"
    assert patches(source) == [(SDPA, 1)]


@pytest.mark.parametrize(
    "source",
    [
        "import torch.nn.functional as F\nsdpa = F.scaled_dot_product_attention\n",  # a read
        "from flash_attn import flash_attn_func\nflash_attn_func = None\n",  # rebinds a name
        "import torch.nn.functional as F\nF.relu = w\n",
        "F.scaled_dot_product_attention = w\n",  # F is not torch.nn.functional here
    ],
)
def test_reads_and_other_assignments_are_not_patches(source):
    assert patches(source) == []


def test_flash_attn_patches_are_found():
    source = (
        "import flash_attn\nimport flash_attn_interface as fa3\n"
        "flash_attn.flash_attn_func = w\nfa3.flash_attn_varlen_func = w\n"
    )
    assert patches(source) == [
        ("flash_attn.flash_attn_func", 3),
        ("flash_attn_interface.flash_attn_varlen_func", 4),
    ]


def port(source: str, path: str = "case.py", options: RuleOptions | None = None):
    return transform_source(textwrap.dedent(source).encode(), path, registry.all_rules(), options)


def test_two_file_repository_through_the_cli(tmp_path, capsys):
    (tmp_path / "patcher.py").write_text(PATCHER)
    (tmp_path / "model.py").write_text(CALLER)
    code = cli.main(["rewrite", str(tmp_path), "--format", "json", "--isolated", "--jobs", "1"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    (site,) = [s for s in report["sites"] if s["kind"] == "call" and s["path"].endswith("model.py")]
    assert site["status"] == "rewrite"
    assert f"{tmp_path / 'patcher.py'}:7" in site["notes"][0]  # the notice names the patch
    (changed,) = [f for f in report["files"] if f["status"] == "changed"]
    assert changed["path"].endswith("model.py") and DROP_IN in changed["diff"]
    options = run_context.for_paths([str(tmp_path / "patcher.py")], RuleOptions())
    ported = port(CALLER, str(tmp_path / "model.py"), options)
    assert f"return {DROP_IN}(q, k, v, attn_mask=mask, is_causal=False)" in ported.new.decode()
    monkeypatch_stays = port(PATCHER, options=run_context.for_paths([], RuleOptions()))
    assert monkeypatch_stays.new is None  # the patch statement itself is kept


def test_a_file_that_patches_and_calls_gets_the_drop_in_without_a_pre_pass():
    source = (
        PATCHER
        + "\n\ndef attend(q, k, v):\n    return F.scaled_dot_product_attention(q, k, v, None, 0.0, True)\n"
    )
    result = port(source)
    assert f"return {DROP_IN}(q, k, v, None, 0.0, True)" in result.new.decode()
    (call,) = [s for s in result.sites if s.kind == "call"]
    assert "case.py:7" in call.notes[0]


def test_calls_through_a_name_bound_earlier_are_kept_with_the_patch_named():
    source = (
        "from torch.nn.functional import scaled_dot_product_attention as sdpa\n"
        "import torch.nn.functional as F\n\n"
        "F.scaled_dot_product_attention = lambda *a, **k: sdpa(*a, **k)\n\n"
        "def attend(q, k, v):\n    return sdpa(q, k, v)\n"
    )
    result = port(source)
    calls = [s for s in result.sites if s.kind == "call"]
    assert calls and all(s.status == "refused" for s in calls)
    assert all("case.py:4" in s.reason and "order" in s.reason for s in calls)


def test_patched_flash_attn_sites_are_kept_with_the_patch_named():
    source = (
        "import flash_attn\nfrom flash_attn import flash_attn_func\n\n"
        "flash_attn.flash_attn_func = lambda *a, **k: None\n\n"
        "def attend(q, k, v):\n    return flash_attn_func(q, k, v, causal=True)\n"
    )
    result = port(source)
    (call,) = [s for s in result.sites if s.kind == "call"]
    assert call.status == "refused" and "case.py:4" in call.reason
    assert result.new is None


def test_without_an_sdpa_patch_the_output_is_unchanged(tmp_path):
    """A run that patches something else ports SDPA calls exactly as a run without patches (the
    golden fixtures, unchanged, cover the rest)."""
    (tmp_path / "other.py").write_text("import flash_attn\nflash_attn.flash_attn_func = w\n")
    options = run_context.for_paths([str(tmp_path / "other.py")], RuleOptions())
    assert [p.api for p in options.patches] == ["flash_attn.flash_attn_func"]
    plain = port(CALLER)
    assert port(CALLER, options=options).new == plain.new
    assert "flashport.torch.attention(q, k, v" in plain.new.decode()


def test_ported_caller_still_runs_the_patch(tmp_path):
    """Executed: the two-file repository ported, with a patch installed, returns the patch's result
    (float64 check against torch's own SDPA), and flashport's SDPA once the patch is removed."""
    torch = pytest.importorskip("torch")
    (tmp_path / "patcher.py").write_text(PATCHER)
    options = run_context.for_paths([str(tmp_path / "patcher.py")], RuleOptions())
    namespace: dict = {}
    exec(
        compile(port(CALLER, str(tmp_path / "model.py"), options).new.decode(), "model.py", "exec"), namespace
    )
    original = torch.nn.functional.scaled_dot_product_attention
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=gen) for _ in range(3))
    mask = torch.randn(5, 5, generator=gen)
    expected = original(q.double(), k.double(), v.double(), attn_mask=mask.double())  # float64 reference
    try:
        torch.nn.functional.scaled_dot_product_attention = lambda *a, **kw: -original(*a, **kw)
        patched = namespace["attend"](q, k, v, mask)
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
    assert torch.allclose(patched.double(), -expected, atol=2e-5)
    assert torch.allclose(namespace["attend"](q, k, v, mask).double(), expected, atol=2e-5)
