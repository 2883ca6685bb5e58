"""An `Embedder` that dies, for tests/test_ray_embed.py: its own module, so Ray's workers import it by name."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from bouquet.ray import Embedder


class DyingEmbedder(Embedder):
    """Exits its process on its second batch, once in the whole run (the first to create `marker`): a crashed or
    OOM-killed actor. Each engine load leaves a file in `loads`."""

    def __init__(self, marker: str, loads: str, **kwargs: Any):
        super().__init__(**kwargs)
        Path(loads, f"{os.getpid()}-{id(self)}").touch()
        self.marker = marker
        self.calls = 0

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.calls += 1
        if self.calls == 2:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                os._exit(1)
        return super().__call__(batch)
