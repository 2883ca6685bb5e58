"""Ray Data: `Embedder`, the callable class for `Dataset.map_batches` that embeds a "text" column, one engine per
actor. `bouquet embed --ray` runs it (offline/ray_job.py); in a pipeline of your own:

    import ray
    from bouquet.ray import Embedder

    ds = ray.data.read_parquet("/shared/corpus/")  # columns "id" and "text"
    ds = ds.map_batches(
        Embedder,
        fn_constructor_kwargs={"dtype": "float32"},  # and model=DIR, normalize, batch_tokens, prompt_name, ...
        compute=ray.data.ActorPoolStrategy(size=4),
        batch_size=1024,
        num_cpus=1,  # each actor's engine computes on this many threads
    )
    ds.write_parquet("/shared/embeddings/")  # "id" and "embedding" ([dim] float32 a row)

Each batch goes through the pipeline `bouquet embed` runs (`offline.embed.embed_texts`: sorted by length, token-budget
steps through the scheduler), so the vectors are the same. Every column but "text" passes through, so ids travel
with their rows; Ray Data restarts an actor that dies and runs its batch again (docs/ray.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import ray  # the Ray package: absolute imports never find this module under the name `ray`

from bouquet.config import EmbedConfig, create_engine_config
from bouquet.engine.engine import Engine
from bouquet.offline.embed import embed_texts, offline_tokenizer

TEXT_COLUMN = "text"
EMBEDDING_COLUMN = "embedding"


class Embedder:
    """Loads the engine once, in the actor's `__init__`; each call embeds a batch's "text" column.

    `model`, `device`, `dtype` and `engine_fields` (any other `EngineConfig` field, e.g. `cpu_workers`) build the
    engine as `bouquet embed`'s flags do; `num_threads` defaults to the CPUs Ray gave the actor."""

    def __init__(
        self,
        model: str | Path | None = None,  # a model directory on every node; None: the bundled all-MiniLM-L6-v2
        device: str = "auto",
        dtype: str = "auto",
        *,
        normalize: bool | None = None,  # None: as the model's Normalize module says
        batch_tokens: int = EmbedConfig.batch_tokens,
        prompt_name: str | None = None,  # one of the model's sentence-transformers prompts
        **engine_fields: Any,
    ):
        if engine_fields.get("num_threads") is None:
            engine_fields["num_threads"] = actor_cpus()
        self.engine = Engine(create_engine_config(model, device, dtype, **engine_fields))
        spec = self.engine.spec
        self.tokenizer = offline_tokenizer(spec, self.engine.max_seq_length)
        self.prompt = spec.prompt(prompt_name)
        self.normalize = normalize
        self.batch_tokens = batch_tokens

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The batch's columns but "text", plus "embedding": [B, dim] float32, row i from text i."""
        texts = _texts(batch)
        rows = np.empty((len(texts), self.engine.dimension), dtype=np.float32)
        embed_texts(
            self.engine, self.tokenizer, texts, rows, normalize=self.normalize, batch_tokens=self.batch_tokens,
            prompt=self.prompt,
        )  # fmt: skip
        return {**{name: column for name, column in batch.items() if name != TEXT_COLUMN}, EMBEDDING_COLUMN: rows}

    def __del__(self) -> None:
        if hasattr(self, "engine"):
            self.engine.close()


def _texts(batch: dict[str, np.ndarray]) -> list[str]:
    if TEXT_COLUMN not in batch:
        raise ValueError(f'the batch has no "{TEXT_COLUMN}" column; its columns: {", ".join(batch) or "none"}')
    texts = batch[TEXT_COLUMN].tolist()
    for row, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(f'"{TEXT_COLUMN}" must hold strings; row {row} of the batch holds {type(text).__name__}')
    return texts


def actor_cpus() -> int | None:
    """The CPUs Ray assigned this actor, as intra-op threads; None outside an actor (torch's default)."""
    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return None
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    return max(1, int(cpus)) if cpus else None
