"""C kernels shipped as source and compiled on first use, like inductor's and Triton's: a plain C file builds
in about 2 s with the system's C compiler (no torch or Python headers), so installing needs no
build step, and each machine's build is cached under the hash of its source, flags, compiler and architecture.

A kernel that uses OpenMP links `libgomp.so.1`; loaded after torch, the dynamic loader resolves that to the
runtime torch already loaded (same soname), so torch's per-thread team sizes apply to the kernel too.
`load_kernel` checks that, since a second runtime would keep thread pools of its own beside torch's.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

import torch  # noqa: F401  (loaded first: the kernels' libgomp.so.1 must resolve to torch's)

from bouquet.kernels.openmp import find_thread_setter, on_passing_thread

logger = logging.getLogger(__name__)

# Vector code for AVX-512 and AVX2 comes from the sources' target_clones; no -march, so a build runs on any
# x86-64 (and GCC 12 fails on these clones when its baseline already has AVX-512, e.g. under -march=native).
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


def find_compiler() -> list[str]:
    """$CC if set (it may carry arguments, e.g. "ccache gcc"), else the first of cc, gcc, clang on PATH."""
    if os.environ.get("CC"):
        command = shlex.split(os.environ["CC"])
        path = shutil.which(command[0]) if command else None
        if path is None:
            raise KernelBuildError(f"CC={os.environ['CC']!r} is not a command found on PATH")
        return [path, *command[1:]]
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return [path]
    raise KernelBuildError("no C compiler found (tried cc, gcc, clang); install gcc or set CC")


def build_kernel(name: str) -> Path:
    """The shared library for `kernels/<name>.c`, compiled now unless this machine has built it already. Every
    failure (no compiler, a failed or hung compile, an unwritable cache) is a KernelBuildError."""
    source = resources.files("bouquet.kernels").joinpath(f"{name}.c").read_bytes()
    headers = _headers(name)
    compiler = find_compiler()
    # A home directory shared between machines of different architectures must not share builds.
    parts = [source, *headers.values(), " ".join(CFLAGS).encode(), " ".join(compiler).encode()]
    parts.append(_compiler_version(compiler))
    key = hashlib.sha256(b"\0".join([*parts, platform.machine().encode()])).hexdigest()
    target = cache_dir() / f"{name}-{key[:16]}.so"
    if target.exists():
        return target
    try:
        _compile(name, source, headers, compiler, target)
    except (OSError, subprocess.SubprocessError) as error:
        raise KernelBuildError(f"building {name}.c into {target.parent} failed: {error}") from error
    logger.info("compiled kernel %s into %s", name, target)
    return target


@functools.cache
def sources_digest() -> str:
    """A digest of every kernel source and header shipped: measurements of the kernels' speed are cached under it
    (machine_cache.py), so a changed kernel is measured again rather than judged by its predecessor's timings."""
    files = sorted(
        (file.name, file.read_bytes())
        for file in resources.files("bouquet.kernels").iterdir()
        if file.name.endswith((".c", ".h"))
    )
    return hashlib.sha256(b"\0".join(name.encode() + b"\0" + text for name, text in files)).hexdigest()[:16]


def _headers(name: str) -> dict[str, bytes]:
    """The kernel's own headers, `kernels/<name>_*.h`, by file name: compiled beside it and part of its hash."""
    files = resources.files("bouquet.kernels").iterdir()
    found = {
        file.name: file.read_bytes() for file in files if file.name.startswith(f"{name}_") and file.name.endswith(".h")
    }
    return dict(sorted(found.items()))


def _compile(name: str, source: bytes, headers: dict[str, bytes], compiler: list[str], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Compiled under a temporary name and renamed: replicas starting together never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        for header, text in headers.items():
            (Path(scratch) / header).write_bytes(text)
        source_path = Path(scratch) / f"{name}.c"
        source_path.write_bytes(source)
        output = Path(scratch) / target.name
        result = subprocess.run(
            [*compiler, *CFLAGS, "-o", str(output), str(source_path)],
            capture_output=True, text=True, timeout=_COMPILE_SECONDS,
        )  # fmt: skip
        if result.returncode != 0:
            raise KernelBuildError(f"compiling {name}.c with {' '.join(compiler)} failed:\n{result.stderr[-2000:]}")
        os.replace(output, target)


def load_kernel(name: str) -> ctypes.CDLL:
    """Builds (or finds) and loads the kernel; it must export `bouquet_omp_max_threads` for the runtime check."""
    path = build_kernel(name)
    try:
        library = ctypes.CDLL(str(path))
    except OSError as error:
        raise KernelBuildError(f"loading {path} failed: {error}") from error
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


def _compiler_version(compiler: list[str]) -> bytes:
    try:
        return subprocess.run([*compiler, "--version"], capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise KernelBuildError(f"{' '.join(compiler)} --version failed: {error}") from error
