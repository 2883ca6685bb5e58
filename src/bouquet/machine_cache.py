"""Measurements cached per machine: what start-up times once (the CPU attention table, the int8 product) and
later starts read back. The key holds everything that changes the timings on top of the caller's own: the CPU
model, the probed features, the torch release, the ISA caps (`ONEDNN_MAX_CPU_ISA`, `ATEN_CPU_CAPABILITY`) and
bouquet's kernel sources (a plan measured on an older kernel once kept int8 documents on `_int_mm` after the VNNI
kernel had overtaken it)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from bouquet.cpu_features import cpu_features
from bouquet.kernels.build import cache_dir, sources_digest

logger = logging.getLogger(__name__)


def measurement_path(kind: str, key: dict[str, Any]) -> Path:
    """Where this machine's measurement of `kind` for `key` lives (under the cache root, beside the kernels)."""
    features = cpu_features()
    machine = {
        "cpu": features.model_name,
        "features": sorted(features.flags),
        "torch": torch.__version__,
        "onednn_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
        "aten_capability": os.environ.get("ATEN_CPU_CAPABILITY", ""),
        "kernels": sources_digest(),
    }
    digest = hashlib.sha256(json.dumps({**machine, **key}, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir().parent / kind / f"cpu-{digest}.json"


def write_measurement(path: Path, document: dict[str, Any]) -> None:
    """`document` and the CPU it was measured on, written under a temporary name and renamed (replicas may start
    together). A cache that cannot be written is only logged: the next start measures again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as file:
            json.dump({**document, "cpu": cpu_features().describe()}, file, indent=1)
        os.replace(file.name, path)
    except OSError as error:
        logger.warning("could not cache a measurement in %s: %s", path, error)
