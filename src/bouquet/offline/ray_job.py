"""`bouquet embed --ray`: the same job on a Ray cluster through Ray Data. This process reads the input and gives
every text an id, the cluster's actors embed (`bouquet.ray`'s `Embedder`, one engine each), and the rows come back
here: into one .npy in id order, or into parquet shards of (id, embedding). Only this process reads and writes files,
so the cluster needs no shared storage, only the model on every node.

Ids make the output exactly once whatever fails. A .jsonl or .txt line's id is its 0-based line number (each line
checked as `bouquet embed` checks it); parquet brings its own "id" column, or its rows are numbered in order. An
actor that dies takes its batch's output with it: Ray Data restarts the actor and runs the batch again, and the
output is checked as it is written: every id exactly once.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import ray
import ray.data
from tqdm import tqdm

from bouquet.config import EmbedConfig, RayConfig
from bouquet.offline.input_reader import read_texts
from bouquet.ray import EMBEDDING_COLUMN, TEXT_COLUMN, Embedder

ID_COLUMN = "id"
SHARD_ROWS = 65_536  # rows a parquet shard holds: 96 MiB at 384 float32 dimensions


def embed_on_ray(
    config: EmbedConfig, embedder_args: dict[str, Any], embedder: type[Embedder] = Embedder, progress_bar: bool = True
) -> int:
    """Embeds config.input_path into config.output_path (.npy, else a directory of parquet shards); returns the
    number of texts. `embedder_args`: `embedder`'s keyword arguments (tests pass an `Embedder` that dies)."""
    assert config.ray is not None, "embed_on_ray needs a RayConfig"
    output = config.output_path.resolve()
    to_npy = output.suffix == ".npy"
    if not to_npy:
        _check_empty(output)
    with _connected(config.ray.address):
        dataset, num_rows = _read(config.input_path.resolve(), config.ray.batch_rows, to_npy)
        embedded = dataset.map_batches(embedder, fn_constructor_kwargs=embedder_args, **_map_args(config.ray))
        embedded.context.enable_progress_bars = False  # this bar instead, as `bouquet embed`'s
        bar = tqdm(total=num_rows, unit="text", desc="embed", dynamic_ncols=True, disable=not progress_bar)
        with bar as progress:
            batches = _counted(embedded.iter_batches(batch_format="numpy", batch_size=None), progress)
            (_write_npy if to_npy else _write_parquet)(batches, output, num_rows)
    return num_rows


@contextmanager
def _connected(address: str | None) -> Iterator[None]:
    """The caller's Ray session where it has one (a notebook, a test), else one for this job."""
    if ray.is_initialized():
        yield
        return
    try:
        ray.init(address=address)
    except ConnectionError as exc:
        raise ValueError(f"--ray {address}: {exc}") from exc
    try:
        yield
    finally:
        ray.shutdown()


def _map_args(config: RayConfig) -> dict[str, Any]:
    return {
        "compute": ray.data.ActorPoolStrategy(size=config.actors or _actors_that_fit(config)),
        "batch_size": config.batch_rows,
        "num_cpus": config.cpus_per_actor,
        "num_gpus": config.gpus_per_actor,
        # Retries are Ray Data's defaults for an actor pool (max_restarts and max_task_retries -1): a dead actor is
        # restarted and the batch it held runs again, as often as it takes. Ray 2.60 deprecates setting them.
    }


def _actors_that_fit(config: RayConfig) -> int:
    resources = ray.cluster_resources()
    if config.gpus_per_actor:
        return max(1, int(resources.get("GPU", 0) // config.gpus_per_actor))
    return max(1, int(resources.get("CPU", 0) // config.cpus_per_actor))


def _read(path: Path, batch_rows: int, to_npy: bool) -> tuple[ray.data.Dataset, int]:
    """The input in blocks of `batch_rows` texts, each with its id, put in the object store as read (this process
    holds one block at a time). Read here rather than by Ray Data's read tasks: the actors may hold every CPU, and a
    read task waiting for one would never run (Ray 2.60 lists files in a task of one CPU whatever it is told)."""
    if path.suffix in (".jsonl", ".txt"):
        blocks = _numbered(read_texts(path), batch_rows)
    else:
        blocks = _parquet_blocks(path, batch_rows, to_npy)
    refs, num_rows = [], 0
    for block in blocks:
        refs.append(ray.put(block))
        num_rows += block.num_rows
    if not num_rows:
        raise ValueError(f"{path} holds no texts")
    return ray.data.from_arrow_refs(refs), num_rows


def _numbered(texts: Iterator[str], rows: int) -> Iterator[pa.Table]:
    """Blocks of (id, text), the id each text's 0-based line number: its row in `bouquet embed`'s output."""
    first = 0
    while block := list(islice(texts, rows)):
        yield _block(pa.array(np.arange(first, first + len(block))), pa.array(block, pa.string()))
        first += len(block)


def _parquet_blocks(path: Path, rows: int, to_npy: bool) -> Iterator[pa.Table]:
    """The "id" and "text" columns; without an "id" column, each row's 0-based position in the files' order."""
    files = pads.dataset(path, format="parquet")  # the footers only, until batches are read
    schema = files.schema
    if TEXT_COLUMN not in schema.names or not _is_string(schema.field(TEXT_COLUMN).type):
        raise ValueError(f'{path}: parquet input needs a "{TEXT_COLUMN}" column of strings; its schema: {schema}')
    has_ids = ID_COLUMN in schema.names
    if has_ids and to_npy and not pa.types.is_integer(schema.field(ID_COLUMN).type):
        raise ValueError(f"{path}: .npy output needs integer ids 0..N-1 (each the row it fills); write parquet instead")
    columns = [ID_COLUMN, TEXT_COLUMN] if has_ids else [TEXT_COLUMN]
    first = 0
    for batch in files.to_batches(columns=columns, batch_size=rows):
        texts = batch.column(TEXT_COLUMN)
        if texts.null_count:
            raise ValueError(f'{path}: a null "{TEXT_COLUMN}" at row {first + texts.is_null().index(True).as_py()}')
        ids = batch.column(ID_COLUMN) if has_ids else pa.array(np.arange(first, first + len(batch)))
        yield _block(ids, texts)
        first += len(batch)


def _block(ids: pa.Array, texts: pa.Array) -> pa.Table:
    return pa.table({ID_COLUMN: ids, TEXT_COLUMN: texts})


def _is_string(type_: pa.DataType) -> bool:
    return pa.types.is_string(type_) or pa.types.is_large_string(type_) or pa.types.is_string_view(type_)


def _counted(batches: Iterable[dict[str, np.ndarray]], progress: tqdm) -> Iterator[dict[str, np.ndarray]]:
    for batch in batches:
        yield batch
        progress.update(len(batch[ID_COLUMN]))


def _write_npy(batches: Iterable[dict[str, np.ndarray]], path: Path, num_rows: int) -> None:
    """Rows written where their id says as they arrive, into a .partial renamed once every id has come."""
    partial = path.with_name(path.name + ".partial")
    seen = np.zeros(num_rows, dtype=bool)
    output: np.ndarray | None = None  # [N, dim] float32, opened when the first rows give the width
    try:
        for batch in batches:
            ids, rows = batch[ID_COLUMN], batch[EMBEDDING_COLUMN]
            _mark_once(seen, ids)
            if output is None:
                output = np.lib.format.open_memmap(partial, "w+", np.float32, (num_rows, rows.shape[1]))
            output[ids] = rows
        if not seen.all():
            missing = np.count_nonzero(~seen)
            raise RuntimeError(f"{missing} of {num_rows} rows never came back, the first id {seen.argmin()}")
        assert output is not None
        output.flush()
        del output
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def _mark_once(seen: np.ndarray, ids: np.ndarray) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= len(seen)):
        raise ValueError(f".npy output needs ids 0..{len(seen) - 1}, got {ids.min()}..{ids.max()}")
    values, counts = np.unique(ids, return_counts=True)
    again = np.concatenate([values[counts > 1], values[seen[values]]])
    if again.size:
        raise ValueError(f"id {again[0]} came twice; ids must be unique")
    seen[ids] = True


def _check_empty(path: Path) -> None:
    if path.is_file() or (path.is_dir() and any(path.iterdir())):
        raise ValueError(f"{path} exists: parquet shards go into a new or empty directory (or name a .npy)")


def _write_parquet(batches: Iterable[dict[str, np.ndarray]], path: Path, num_rows: int) -> None:
    """Shards of SHARD_ROWS rows, in the order they come, into a .partial directory renamed once every id is found
    exactly once. Written here, not by Ray Data's write tasks: see _read; and the cluster needs no shared storage."""
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        ids = []
        for shard, table in enumerate(_shards(batches)):
            pq.write_table(table, partial / f"part-{shard:05d}.parquet")
            ids.append(table.column(ID_COLUMN))
        written = sum(map(len, ids))
        distinct = pc.count_distinct(pa.chunked_array(ids)).as_py() if ids else 0
        if written != num_rows or distinct != num_rows:
            raise RuntimeError(f"{written} rows with {distinct} distinct ids for {num_rows} texts; ids must be unique")
        if path.is_dir():
            path.rmdir()  # empty, as _check_empty found it
        os.replace(partial, path)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _shards(batches: Iterable[dict[str, np.ndarray]]) -> Iterator[pa.Table]:
    tables: list[pa.Table] = []
    for batch in batches:
        tables.append(_arrow_rows(batch))
        if sum(table.num_rows for table in tables) >= SHARD_ROWS:
            yield pa.concat_tables(tables)
            tables = []
    if tables:
        yield pa.concat_tables(tables)


def _arrow_rows(batch: dict[str, np.ndarray]) -> pa.Table:
    """Embeddings as fixed_size_list<float>[dim], which pyarrow, pandas, polars and DuckDB read without Ray."""
    rows = batch[EMBEDDING_COLUMN]  # [B, dim] float32
    embedding = pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), rows.shape[1])
    return pa.table({ID_COLUMN: batch[ID_COLUMN], EMBEDDING_COLUMN: embedding})
