"""benchmarks/torch_cuda_check.py --smoke: the device script's timing table runs end to end on CPU.

Tiny shapes, one timed run per cell (about 13 CPU-seconds, most of it JAX compiling the CPU
adapter's path); the numbers are not checked, only that every row is measured for flashport, that
anchors which cannot express a row say why, and that the ratio column is filled where both sides
were timed.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMES = re.compile(r"^(\d+\.\d\d) / (\d+\.\d\d|n/a) ms")


def test_smoke_table():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "torch_cuda_check.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    table = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    header, rows = table[0], table[1:]
    assert header.split(" | ")[1:8] == [
        "flashport fwd / fwd+bwd",
        "path",
        "SDPA flash",
        "SDPA efficient",
        "SDPA math",
        "FlexAttention",
        "best anchor fwd / fwd+bwd",
    ]
    assert [row.split(" | ")[0][2:] for row in rows] == [
        "causal",
        "causal + window 16",
        "causal GQA 4q/2kv",
        "causal + softcap 30",
        "causal + 4 packed documents",
        "prefill Sq=32 Sk=64 bottom-right",
    ]
    for row in rows:
        cells = row.strip("| ").split(" | ")
        assert len(cells) == 9, row
        mine = TIMES.match(cells[1])
        assert mine and mine.group(2) != "n/a", row  # flashport serves every row, forward and backward
        assert cells[2] in ("torch SDPA", "jax"), row  # CPU: SDPA where exact, else the JAX path
        assert TIMES.match(cells[6]), row  # FlexAttention runs forward on CPU (eagerly) ...
        assert "FlexAttention does not support backward on CPU" in cells[6]  # ... and says why not backward
        assert re.fullmatch(r"\d+\.\d\d / (\d+\.\d\d|-)", cells[8]), row
    softcap = rows[3].strip("| ").split(" | ")
    assert softcap[3:6] == ["n/a (no softcap)"] * 3
    assert softcap[2] == "jax"
