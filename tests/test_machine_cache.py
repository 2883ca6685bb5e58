"""Measurements cached per machine (machine_cache.py) are keyed by the kernels' sources as well as the CPU: a plan
timed on an older kernel must not outlive it."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import pytest

from bouquet import machine_cache
from bouquet.kernels import build


@pytest.fixture
def kernel_sources(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """A copy of the shipped kernel sources that `build` reads in place of the package's."""
    copy = tmp_path / "kernels"
    shutil.copytree(Path(str(resources.files("bouquet.kernels"))), copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(build.resources, "files", lambda package: copy)
    build.sources_digest.cache_clear()
    yield copy
    build.sources_digest.cache_clear()


def test_a_changed_kernel_source_moves_every_measurement(kernel_sources: Path) -> None:
    key = {"shapes": [[384, 1536]], "threads": 1}
    before = machine_cache.measurement_path("int8", key)
    assert machine_cache.measurement_path("int8", key) == before  # stable while nothing changes
    header = kernel_sources / "int8_linear_vnni.h"
    header.write_text(header.read_text() + "\n// a changed tile\n")
    build.sources_digest.cache_clear()
    assert machine_cache.measurement_path("int8", key) != before
    assert machine_cache.measurement_path("attention", key).parent.name == "attention"


def test_files_beside_the_sources_do_not_count(kernel_sources: Path) -> None:
    before = build.sources_digest()
    (kernel_sources / "notes.txt").write_text("not a kernel")
    build.sources_digest.cache_clear()
    assert build.sources_digest() == before
