"""The repository stands alone: code, docs and tests never point readers to files outside it."""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUTSIDE = "shared" + "/reference"  # split so this file does not match itself
TEXT = (".py", ".md", ".toml", ".yaml", ".txt")


def test_no_references_to_files_outside_the_repository():
    found = []
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT).as_posix()
        if (
            not path.is_file()
            or path.suffix not in TEXT
            or any(
                part.startswith(".") or part in ("build", "dist") or part.endswith(".egg-info")
                for part in path.relative_to(ROOT).parts
            )
        ):
            continue
        if OUTSIDE in path.read_text(encoding="utf-8", errors="replace"):
            found.append(rel)
    assert not found, (
        f"these files point to {OUTSIDE}/ (not in the repository); state the fact instead: {found}"
    )
