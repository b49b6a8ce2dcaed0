"""Compile ``flash_cpu.cc`` on first use and load it: the ``cpu_native`` backend's build step.

The shared library is built with the system C++ compiler (``$FLASHPORT_CXX``, else ``$CXX``, else
``c++`` / ``g++`` / ``clang++`` on the PATH) against the XLA FFI headers jaxlib ships
(``jax.ffi.include_dir()``), tuned for this machine (``-march=native``). It is cached in
``$FLASHPORT_CACHE_DIR``, else ``$XDG_CACHE_HOME/flashport``, else ``~/.cache/flashport``, under a
name keyed by the source, the compiler and its version, the flags, the CPU's feature flags and the
jaxlib version, so a changed input builds a new library and an unchanged one is reused. Each build
writes a private temporary file and renames it into place (atomic), so concurrent builders (test
workers) never load a half-written library; at worst they compile the same thing twice.

A missing compiler or a failed build never raises into a user's program: :func:`load` returns the
reason, and the backend reports itself unable to take the call (``auto`` falls back to
``blockwise``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax

SOURCE = pathlib.Path(__file__).with_name("flash_cpu.cc")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread", "-w")
# The FFI handler symbols flash_cpu.cc exports, by the target names they are registered under.
TARGETS = {"flashport_cpu_forward": "FlashportCpuForward", "flashport_cpu_backward": "FlashportCpuBackward"}
BUILD_TIMEOUT_S = 300


def cache_dir() -> pathlib.Path:
    """Where built libraries are kept (see the module docstring for the order of the env vars)."""
    if os.environ.get("FLASHPORT_CACHE_DIR"):
        return pathlib.Path(os.environ["FLASHPORT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "flashport"


def compiler() -> str | None:
    """The C++ compiler to build with, or None when there is none."""
    for name in (os.environ.get("FLASHPORT_CXX"), os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name:
            found = shutil.which(name)
            if found:
                return found
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def library_path(cxx: str) -> pathlib.Path:
    """The cache path of the library ``cxx`` builds from the current source on this machine."""
    try:
        version = subprocess.run(
            [cxx, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError) as err:
        version = f"unknown ({err})"
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), cxx.encode(), version.encode(), " ".join(FLAGS).encode()):
        key.update(part)
        key.update(b"\0")
    key.update(_cpu_flags().encode())
    key.update(jax.lib.__version__.encode() if hasattr(jax.lib, "__version__") else jax.__version__.encode())
    return cache_dir() / f"flash_cpu-{key.hexdigest()[:20]}.so"


def build(cxx: str, target: pathlib.Path) -> None:
    """Compile the source into ``target`` (temporary file, then an atomic rename).

    Raises:
      RuntimeError with the compiler's output when the build fails.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp.so", dir=target.parent)
    os.close(fd)
    cmd = [cxx, *FLAGS, "-I", jax.ffi.include_dir(), str(SOURCE), "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip()[-2000:]
            raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {done.returncode}): {tail}")
        os.replace(tmp, target)
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(f"`{' '.join(cmd)}` ran past {BUILD_TIMEOUT_S} s") from err
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load() -> tuple[ctypes.CDLL | None, str | None]:
    """Build (or reuse) the library and register its FFI targets for CPU, once per process.

    Returns:
      ``(library, None)`` on success, else ``(None, reason)``.
    """
    cxx = compiler()
    if cxx is None:
        return None, "no C++ compiler found (set FLASHPORT_CXX or CXX, or install g++)"
    try:
        path = library_path(cxx)
        if not path.exists():
            build(cxx, path)
        lib = ctypes.CDLL(str(path))
        for name, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except (OSError, RuntimeError, AttributeError) as err:
        return None, f"building the native CPU kernel failed: {err}"
    return lib, None
