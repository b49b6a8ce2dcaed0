"""Run mypy over the flashport package as it installs (``python .ci/typecheck.py [mypy args]``).

The design keeps ``rewriter/``, ``kernels/`` and ``rules/`` at the top of the repository and installs
them as ``flashport.rewriter``, ``flashport.kernels`` and ``flashport.rules`` (pyproject's
``package-dir``). mypy cannot follow that mapping (nor the editable-install import hook), so this
script lays the package out as it installs - a tree of symlinks under ``.mypy_cache/stage``, removed
afterwards (a fixed place, so mypy's incremental cache in ``.mypy_cache`` serves the next run) - runs
mypy on it with the repository's ``[tool.mypy]`` settings, and prints every finding with its path in
the repository. Exit status: mypy's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str]) -> int:
    """Stage the package, run mypy, map the paths back; returns mypy's exit status."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    cache = ROOT / ".mypy_cache"
    stage = cache / "stage"
    shutil.rmtree(stage, ignore_errors=True)  # links only: the sources stay where they are
    # fewest dots first, so flashport/ exists before flashport/rewriter is linked into it
    for package, source in sorted(mapping.items(), key=lambda item: item[0].count(".")):
        target = stage.joinpath(*package.split("."))
        if package.count(".") == 0:
            target.mkdir(parents=True)
            for entry in (ROOT / source).iterdir():
                if entry.name != "__pycache__":
                    (target / entry.name).symlink_to(entry)
        else:
            target.symlink_to(ROOT / source, target_is_directory=True)
    config = ["--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(cache)]
    command = [sys.executable, "-m", "mypy", *config, *argv, "-p", "flashport"]
    env = {**os.environ, "MYPYPATH": str(stage)}
    try:
        result = subprocess.run(command, cwd=stage, capture_output=True, text=True, env=env)
    finally:  # no second copy of the sources for tools that walk the repository
        shutil.rmtree(stage, ignore_errors=True)
    back = {
        "/".join(package.split(".")) + "/": source.rstrip("/") + "/" for package, source in mapping.items()
    }
    for line in (result.stdout + result.stderr).splitlines():
        for staged, source in sorted(back.items(), key=lambda item: -len(item[0])):
            if line.startswith(staged):
                line = source + line[len(staged) :]
                break
        print(line)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
