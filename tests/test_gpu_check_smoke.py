"""``benchmarks/gpu_check.py --smoke``: the device table's code path on CPU at tiny shapes.

The default run takes the plain causal row and the chunked-prefill row (anchors with an explicit
bottom-right mask, an ``mha`` refusal, the cuDNN skip); the slow run takes every row. Each column's
forward output must agree with flashport auto's (the script's own check, which catches an anchor
configured with other semantics), and the printed table must be what the file holds.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_smoke(tmp_path, capsys, rows):
    out = tmp_path / "smoke.txt"
    assert load_gpu_check().main(["--smoke", "--out", str(out), "--rows", rows]) == 0
    text = out.read_text()
    assert capsys.readouterr().out == text  # what it prints is what it writes
    return text


def check_table(text, row_names):
    lines = text.splitlines()
    for name in ("causal", *row_names):
        head = next(i for i, line in enumerate(lines) if line.startswith(f"{name}  (auto picked "))
        # on CPU auto runs a CPU backend; the CUDA branch's choice is shown next to it
        assert "(cuda: pallas_gpu)" in lines[head]
        cells = {line[2:17].strip(): line for line in lines[head + 1 : head + 6]}
        assert set(cells) == {"flashport auto", "pallas_gpu", "jax.nn cudnn", "jax.nn xla", "pallas mha"}
        assert re.search(
            r"  (skipped: needs CUDA \(cuDNN\)|n/a: jax.nn has no softcap)$", cells["jax.nn cudnn"]
        )
        for column in ("flashport auto", "pallas_gpu"):
            assert re.match(r"\s+[\w. ]+\s+\d+\.\d{3}\s+\d+\.\d{3}\s", cells[column]), cells[column]
            diff = float(re.search(r"(\d\.\de[+-]\d\d)", cells[column]).group(1))
            assert diff <= 6e-2, cells[column]
    assert re.search(r"^  causal: (PASS|FAIL) \(", text, re.M)
    assert re.search(r"compiled fwd\+bwd scratch, plain causal, S=16 -> S=32", text)
    assert re.search(r"^  flashport auto .* MiB  \d+\.\d\dx (linear|superlinear)$", text, re.M)
    assert "columns agree with flashport auto" in text


def test_smoke_runs_the_table_on_cpu(tmp_path, capsys):
    text = run_smoke(tmp_path, capsys, "chunked")
    check_table(text, ["chunked prefill Sq=S/4 bottom-right"])
    assert "n/a: mha has no window, softcap or bottom-right causal" in text
    assert "causal + softcap" not in text  # --rows keeps only the named rows (and causal)


@pytest.mark.slow
def test_smoke_every_row(tmp_path, capsys):
    text = run_smoke(tmp_path, capsys, "")
    check_table(
        text,
        [
            "causal + window 8",
            "causal GQA 4q/1kv",
            "causal + softcap 30",
            "causal + 4 documents",
            "chunked prefill Sq=S/4 bottom-right",
        ],
    )
    assert "n/a: jax.nn has no softcap" in text
