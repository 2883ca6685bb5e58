"""C kernels shipped as source and compiled on first use, like inductor's and Triton's: a plain C file builds
in a fraction of a second with the system's C compiler (no torch or Python headers), so installing needs no
build step, and each machine's build is cached under the hash of its source, flags and compiler.

A kernel that uses OpenMP links `libgomp.so.1`; loaded after torch, the dynamic loader resolves that to the
runtime torch already loaded (same soname), so torch's per-thread team sizes apply to the kernel too.
`load_kernel` checks that, since a second runtime would keep thread pools of its own beside torch's.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

import torch  # noqa: F401  (loaded first: the kernels' libgomp.so.1 must resolve to torch's)

from bouquet.engine.cpu_threads import find_thread_setter, on_passing_thread

logger = logging.getLogger(__name__)

# Vector code for AVX-512 and AVX2 comes from the sources' target_clones; no -march, so a build runs anywhere.
CFLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-Wall", "-Wno-psabi")
_COMPILE_SECONDS = 120


class KernelBuildError(RuntimeError):
    """No C compiler, a failed compile, or a kernel that would not share torch's OpenMP runtime."""


def cache_dir() -> Path:
    """$BOUQUET_CACHE_DIR, else $XDG_CACHE_HOME/bouquet, else ~/.cache/bouquet; kernels go in `kernels/`."""
    root = os.environ.get("BOUQUET_CACHE_DIR")
    if root:
        return Path(root) / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "bouquet" / "kernels"


def find_compiler() -> str:
    """$CC if set, else the first of cc, gcc, clang on PATH."""
    candidates = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    for name in candidates:
        path = shutil.which(name)
        if path:
            return path
    raise KernelBuildError(f"no C compiler found (tried {', '.join(candidates)}); install gcc or set CC")


def build_kernel(name: str) -> Path:
    """The shared library for `kernels/<name>.c`, compiled now unless this machine has built it already."""
    source = resources.files("bouquet.kernels").joinpath(f"{name}.c").read_bytes()
    compiler = find_compiler()
    version = _compiler_version(compiler)
    key = hashlib.sha256(b"\0".join([source, " ".join(CFLAGS).encode(), compiler.encode(), version])).hexdigest()
    target = cache_dir() / f"{name}-{key[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Compiled under a temporary name and renamed: replicas starting together never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        source_path = Path(scratch) / f"{name}.c"
        source_path.write_bytes(source)
        output = Path(scratch) / target.name
        result = subprocess.run(
            [compiler, *CFLAGS, "-o", str(output), str(source_path)],
            capture_output=True, text=True, timeout=_COMPILE_SECONDS,
        )  # fmt: skip
        if result.returncode != 0:
            raise KernelBuildError(f"compiling {name}.c with {compiler} failed:\n{result.stderr[-2000:]}")
        os.replace(output, target)
    logger.info("compiled kernel %s into %s", name, target)
    return target


def load_kernel(name: str) -> ctypes.CDLL:
    """Builds (or finds) and loads the kernel; it must export `bouquet_omp_max_threads` for the runtime check."""
    library = ctypes.CDLL(str(build_kernel(name)))
    _check_shared_runtime(library, name)
    return library


def _check_shared_runtime(library: ctypes.CDLL, name: str) -> None:
    """On a passing thread, torch's runtime is told 1 then 2 threads; the kernel's runtime must see both."""
    setter = find_thread_setter()
    if setter is None:
        raise KernelBuildError(f"{name}: torch's OpenMP runtime was not found, so the kernel's cannot be checked")
    library.bouquet_omp_max_threads.restype = ctypes.c_int

    def seen() -> list[int]:
        counts = []
        for count in (1, 2):
            setter(count)
            counts.append(library.bouquet_omp_max_threads())
        return counts

    counts = on_passing_thread(seen)
    if counts != [1, 2]:
        raise KernelBuildError(f"{name}: its OpenMP runtime is not torch's (set 1 and 2 threads, it saw {counts})")


def _compiler_version(compiler: str) -> bytes:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise KernelBuildError(f"{compiler} --version failed: {error}") from error
