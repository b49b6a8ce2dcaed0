"""Run-wide facts stay inside their project: a run-time patch of a source API found in one
project of a run (a monorepo's package, one of several checkouts scanned together) changes how the
sites of that project are ported, and nothing in the others."""

from __future__ import annotations

import json

from flashport.rewriter.app import cli
from flashport.rewriter.engine import run_context

PATCH_SDPA = "import torch.nn.functional as F\n\n\ndef install(wrapper):\n    F.scaled_dot_product_attention = wrapper\n"
PATCH_FA = "import flash_attn\n\n\ndef install(wrapper):\n    flash_attn.flash_attn_func = wrapper\n"
SDPA_CALLER = (
    "import torch.nn.functional as F\n\n\ndef attend(q, k, v):\n"
    "    return F.scaled_dot_product_attention(q, k, v, is_causal=True)\n"
)
FA_CALLER = (
    "from flash_attn import flash_attn_func\n\n\ndef attend(q, k, v):\n"
    "    return flash_attn_func(q, k, v, causal=True)\n"
)
DROP_IN = "flashport.integrations.sdpa_compat.scaled_dot_product_attention"


def _write(root, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _run(capsys, *paths) -> dict:
    code = cli.main(["rewrite", *map(str, paths), "--format", "json", "--isolated", "--jobs", "1"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    return report


def _call(report: dict, suffix: str) -> dict:
    (site,) = [s for s in report["sites"] if s["kind"] == "call" and s["path"].endswith(suffix)]
    return site


def _diff(report: dict, suffix: str) -> str:
    (entry,) = [f for f in report["files"] if f["path"].endswith(suffix)]
    return entry["diff"] or ""


def test_two_checkouts_scanned_together_keep_their_patches_apart(tmp_path, capsys):
    _write(
        tmp_path / "a",
        {
            "pyproject.toml": "",
            "a/patch.py": PATCH_SDPA + PATCH_FA,
            "a/model.py": SDPA_CALLER,
            "a/fa.py": FA_CALLER,
        },
    )
    _write(tmp_path / "b", {"setup.py": "", "b/model.py": SDPA_CALLER, "b/fa.py": FA_CALLER})
    report = _run(capsys, tmp_path / "a", tmp_path / "b")
    # project a: its SDPA calls go to the patch-aware drop-in, its flash-attn sites are kept
    assert _call(report, "a/a/model.py")["status"] == "rewrite"
    assert DROP_IN in _diff(report, "a/a/model.py")
    kept = _call(report, "a/a/fa.py")
    assert kept["status"] == "refused" and "patch.py" in kept["reason"]
    # project b: ported exactly as a run of b alone ports it
    for name in ("b/b/model.py", "b/b/fa.py"):
        assert _call(report, name)["status"] == "rewrite"
    alone = _run(capsys, tmp_path / "b")
    assert _diff(report, "b/b/model.py") == _diff(alone, "b/b/model.py")
    assert _diff(report, "b/b/fa.py") == _diff(alone, "b/b/fa.py")
    assert DROP_IN not in _diff(report, "b/b/model.py") and "flashport.torch.attention" in _diff(
        report, "b/b/fa.py"
    )


def test_in_a_monorepo_the_nearest_project_wins(tmp_path, capsys):
    (tmp_path / ".git").mkdir()
    _write(
        tmp_path,
        {
            "libs/patcher/pyproject.toml": "",
            "libs/patcher/src/patch.py": PATCH_FA,
            "libs/patcher/src/deep/fa.py": FA_CALLER,  # same project, another folder
            "libs/other/setup.cfg": "",
            "libs/other/fa.py": FA_CALLER,
            "tools/fa.py": FA_CALLER,  # the monorepo's own project (.git)
        },
    )
    report = _run(capsys, tmp_path)
    assert _call(report, "patcher/src/deep/fa.py")["status"] == "refused"
    assert _call(report, "libs/other/fa.py")["status"] == "rewrite"
    assert _call(report, "tools/fa.py")["status"] == "rewrite"


def test_project_root_is_the_nearest_marked_folder(tmp_path):
    _write(tmp_path, {"p/pyproject.toml": "", "p/pkg/sub/m.py": "", "q/setup.cfg": "", "q/m.py": ""})
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / ".git").write_text("gitdir: elsewhere\n")  # a worktree's .git is a file
    (tmp_path / "r" / "m.py").write_text("")
    assert run_context.project_root(str(tmp_path / "p/pkg/sub/m.py")) == str(tmp_path / "p")
    assert run_context.project_root(str(tmp_path / "q/m.py")) == str(tmp_path / "q")
    assert run_context.project_root(str(tmp_path / "r/m.py")) == str(tmp_path / "r")
