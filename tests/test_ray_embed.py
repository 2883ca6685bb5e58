"""`bouquet embed --ray` and `bouquet.ray.Embedder` on a local Ray cluster of 2 CPUs: the vectors `bouquet embed`
computes, every row exactly once, and the same when an actor dies mid-run."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import row_cosines
from corpus import NON_ASCII_TEXTS, documents, queries

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'ray[data]' (the test extras pin it)")
pytest.importorskip("ray.data", reason="Ray Data is not installed: pip install 'ray[data]'")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from ray_actors import DyingEmbedder  # noqa: E402
from ray_start import init_local_ray  # noqa: E402

import bouquet  # noqa: E402
from bouquet.cli import main  # noqa: E402
from bouquet.config import EmbedConfig, RayConfig  # noqa: E402
from bouquet.offline.embed import embed_file  # noqa: E402
from bouquet.offline.ray_job import _parquet_blocks, embed_on_ray  # noqa: E402
from bouquet.ray import Embedder  # noqa: E402


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    # The workers import this bouquet, and tests/ray_actors.py, whatever their sys.path.
    paths = [Path(bouquet.__file__).resolve().parent.parent, Path(__file__).resolve().parent]
    init_local_ray(
        num_cpus=2,
        object_store_memory=500 * 2**20,
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(map(str, paths))}},
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def texts() -> list[str]:
    # Long and short interleaved, so each batch's length sort must be undone.
    return [text for pair in zip(documents(150), queries(150), strict=True) for text in pair] + list(NON_ASCII_TEXTS)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory, texts: list[str]) -> Path:
    path = tmp_path_factory.mktemp("input") / "in.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return path


@pytest.fixture(scope="module")
def reference(source: Path, minilm_fp32, minilm_tokenizer) -> np.ndarray:
    """`bouquet embed`'s rows: the same engine in this process."""
    output = source.with_name("reference.npy")
    embed_file(minilm_fp32, minilm_tokenizer, EmbedConfig(source, output), progress_bar=False)
    return np.load(output)


@pytest.mark.long
@pytest.mark.process
def test_an_actor_killed_mid_run_jsonl_to_parquet(cluster, tmp_path: Path, source, reference) -> None:
    """The CLI's job (`map_batches(Embedder, ...)` on an actor pool, as a user's pipeline runs it), one actor of two
    dying on its second batch: every line exactly once in the shards, with `bouquet embed`'s vectors."""
    marker, loads, output = tmp_path / "died", tmp_path / "loads", tmp_path / "embeddings"
    loads.mkdir()
    config = EmbedConfig(source, output, ray=RayConfig(actors=2, batch_rows=32))
    args = {"marker": str(marker), "loads": str(loads), "dtype": "float32"}
    assert embed_on_ray(config, args, DyingEmbedder, progress_bar=False) == len(reference)
    assert marker.exists() and len(list(loads.iterdir())) == 3  # two actors, and the dead one's restart
    table = pq.read_table(output)  # pyarrow alone reads it: no Ray extension types
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 384)
    ids = table.column("id").to_numpy()
    assert sorted(ids) == list(range(len(reference)))  # every line exactly once
    rows = table.column("embedding").combine_chunks().flatten().to_numpy().reshape(-1, 384)
    assert row_cosines(rows, reference[ids]).min() >= 0.99999
    assert set(tmp_path.iterdir()) == {loads, marker, output}  # no .partial left


@pytest.mark.long  # a local Ray cluster's start: half a minute
@pytest.mark.process
def test_cli_parquet_with_ids_to_npy_in_id_order(cluster, tmp_path: Path, texts, reference) -> None:
    order = np.random.default_rng(0).permutation(len(texts))
    source = tmp_path / "corpus"
    source.mkdir()
    for part, ids in enumerate(np.array_split(order, 2)):  # two files, ids out of row order
        pq.write_table(pa.table({"id": ids, "text": [texts[i] for i in ids]}), source / f"part-{part}.parquet")
    output = tmp_path / "out.npy"
    argv = ["embed", str(source), "-o", str(output), "--dtype", "float32", "--ray", "--batch-rows", "48"]
    assert main(argv) == 0
    rows = np.load(output)
    assert rows.dtype == np.float32 and rows.shape == reference.shape
    assert row_cosines(rows, reference).min() >= 0.99999
    assert set(tmp_path.iterdir()) == {source, output}  # no .partial left


def test_embedder_keeps_the_other_columns_and_refuses_what_is_not_text(texts, reference) -> None:
    embedder = Embedder(device="cpu", dtype="float32", cpu_workers=1)  # no Ray: called as an actor would call it
    try:
        batch = {"id": np.array([5, 3]), "lang": np.array(["en", "en"]), "text": np.array([texts[5], texts[3]])}
        out = embedder(batch)
        assert set(out) == {"id", "lang", "embedding"} and out["id"].tolist() == [5, 3]
        assert out["embedding"].dtype == np.float32
        assert row_cosines(out["embedding"], reference[[5, 3]]).min() >= 0.99999
        with pytest.raises(ValueError, match='"text" must hold strings; row 1 of the batch holds NoneType'):
            embedder({"text": np.array(["a", None], dtype=object)})
        with pytest.raises(ValueError, match='the batch has no "text" column; its columns: body'):
            embedder({"body": np.array(["a"])})
    finally:
        embedder.engine.close()


def test_parquet_without_ids_is_numbered_in_order(tmp_path: Path) -> None:
    source = tmp_path / "corpus"
    source.mkdir()
    pq.write_table(pa.table({"text": ["a", "b", "c"]}), source / "0.parquet")
    pq.write_table(pa.table({"text": ["d", "e"]}), source / "1.parquet")
    blocks = list(_parquet_blocks(source, rows=2, to_npy=True))
    assert pa.concat_tables(blocks).to_pydict() == {"id": [0, 1, 2, 3, 4], "text": ["a", "b", "c", "d", "e"]}
    assert max(block.num_rows for block in blocks) == 2


def test_npy_needs_integer_ids(tmp_path: Path) -> None:
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["x"], "text": ["a"]}), source)
    with pytest.raises(ValueError, match="needs integer ids"):
        list(_parquet_blocks(source, rows=2, to_npy=True))
    (block,) = _parquet_blocks(source, rows=2, to_npy=False)
    assert block.to_pydict() == {"id": ["x"], "text": ["a"]}


@pytest.mark.long
@pytest.mark.process
def test_parquet_needs_a_text_column(cluster, tmp_path: Path, capsys) -> None:
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [0, 1], "body": ["a", "b"]}), source)
    assert main(["embed", str(source), "-o", str(tmp_path / "out.npy"), "--ray"]) == 2
    assert 'parquet input needs a "text" column of strings' in capsys.readouterr().err


def test_parquet_output_goes_to_a_new_directory(tmp_path: Path, source, capsys) -> None:
    (tmp_path / "out" / "old.parquet").parent.mkdir()
    (tmp_path / "out" / "old.parquet").touch()
    assert main(["embed", str(source), "-o", str(tmp_path / "out"), "--ray"]) == 2
    assert "exists: parquet shards go into a new or empty directory" in capsys.readouterr().err


def test_ray_flags_need_ray(source, tmp_path: Path, capsys) -> None:
    assert main(["embed", str(source), "-o", str(tmp_path / "out.npy"), "--actors", "2"]) == 2
    assert "--actors is for --ray only" in capsys.readouterr().err
