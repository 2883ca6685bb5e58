"""`bouquet embed` as a user runs it (a real subprocess, real files), and its pipeline in-process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import embed_ids, row_cosines
from corpus import NON_ASCII_TEXTS, documents, queries

from bouquet.batch import Batch
from bouquet.config import EmbedConfig
from bouquet.engine.lazy_tensor import LazyTensor
from bouquet.offline.embed import embed_file
from bouquet.offline.input_reader import InputError
from bouquet.replica.testing import RecordingEngine


def _run(*args: str, warmup: bool = False) -> subprocess.CompletedProcess[str]:
    """The command in a process of its own; without `warmup`, oneDNN's primitives are built as steps meet them
    (a second or more at start, tested in test_memory.py) unless the test is about a default run."""
    command = [sys.executable, "-m", "bouquet.cli", "embed", *args, *([] if warmup else ["--cpu-warmup-tokens", "0"])]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    # Interleaved long and short, so sorting inside the pipeline must be undone for the output order.
    return [text for pair in zip(documents(60), queries(60), strict=True) for text in pair] + list(NON_ASCII_TEXTS)


@pytest.mark.long  # CI's long tier: the default run stays within its ~10 minutes
@pytest.mark.process
def test_jsonl_rows_in_input_order(tmp_path: Path, texts, minilm_fp32, minilm_tokenizer) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    result = _run(
        str(source), "-o", str(tmp_path / "out.npy"), "--batch-tokens", "512", "--dtype", "float32", warmup=True
    )
    assert result.returncode == 0, result.stderr
    out = np.load(tmp_path / "out.npy")
    assert out.dtype == np.float32 and out.shape == (len(texts), 384)
    assert row_cosines(out, embed_ids(minilm_fp32, minilm_tokenizer.encode(texts))).min() >= 0.99999
    assert "100%" in result.stderr  # the progress bar


@pytest.mark.long  # CI's long tier: the default run stays within its ~10 minutes
@pytest.mark.process
def test_txt_without_normalization(tmp_path: Path, minilm_fp32, minilm_tokenizer) -> None:
    lines = ["one line", "another line of text", "Ünïcödé ☃"]
    source = tmp_path / "in.txt"
    source.write_text("\n".join(lines) + "\n")
    result = _run(
        str(source), "-o", str(tmp_path / "out.npy"), "--no-normalize", "--cpu-workers", "1", "--dtype", "float32"
    )
    assert result.returncode == 0, result.stderr
    expected = embed_ids(minilm_fp32, minilm_tokenizer.encode(lines), normalize=False)
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.process
def test_cpu_workers_must_be_positive(tmp_path: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_text("a line\n")
    result = _run(str(source), "-o", str(tmp_path / "out.npy"), "--cpu-workers", "0")
    assert result.returncode == 2 and "cpu_workers must be positive" in result.stderr
    assert not (tmp_path / "out.npy").exists()


def _with_bad_third_line(tmp_path: Path, line: str) -> Path:
    source = tmp_path / "in.jsonl"
    good = json.dumps({"text": "fine"})
    source.write_text(f"{good}\n{good}\n{line}\n{good}\n")
    return source


@pytest.mark.long  # CI's long tier: the default run stays within its ~10 minutes
@pytest.mark.process
def test_bad_line_is_named_and_nothing_is_written(tmp_path: Path) -> None:
    source = _with_bad_third_line(tmp_path, "{not json")
    result = _run(str(source), "-o", str(tmp_path / "out.npy"))
    assert result.returncode == 2
    assert "in.jsonl:3: invalid JSON" in result.stderr
    assert list(tmp_path.iterdir()) == [source]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"title": "no text"}', 'no "text" field'),
        ('{"text": 42}', '"text" must be a string'),
        ('["text"]', 'no "text" field'),
    ],
)
def test_every_bad_line_kind_is_named(tmp_path: Path, minilm_fp32, minilm_tokenizer, line: str, message: str) -> None:
    """The same pipeline as the command's (the exit status and stderr are tested above), in this process."""
    source = _with_bad_third_line(tmp_path, line)
    with pytest.raises(InputError, match=f"in.jsonl:3: {message}"):
        embed_file(minilm_fp32, minilm_tokenizer, EmbedConfig(source, tmp_path / "out.npy"), progress_bar=False)
    assert list(tmp_path.iterdir()) == [source]


@pytest.mark.long  # CI's long tier: the default run stays within its ~10 minutes
@pytest.mark.process
def test_invalid_utf8_is_named(tmp_path: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_bytes(b"fine\n\xff\xfe broken\n")
    result = _run(str(source), "-o", str(tmp_path / "out.npy"))
    assert result.returncode == 2 and "in.txt:2: not valid UTF-8" in result.stderr


@pytest.mark.long  # CI's long tier: the default run stays within its ~10 minutes
def test_windows_run_through_the_scheduler_and_land_in_input_order(tmp_path: Path, texts, recorder, minilm_tokenizer):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    config = EmbedConfig(source, tmp_path / "out.npy", batch_tokens=256, sort_window=16)  # 9 windows
    assert embed_file(recorder, minilm_tokenizer, config, progress_bar=False) == len(texts)
    expected = embed_ids(recorder.engine, minilm_tokenizer.encode(texts))
    assert row_cosines(np.load(tmp_path / "out.npy"), expected).min() >= 0.99999
    assert sum(batch.num_seqs for batch in recorder.batches) == len(texts)
    assert all(batch.num_tokens <= 256 or batch.num_seqs == 1 for batch in recorder.batches)
    assert sorted(tmp_path.iterdir()) == sorted([source, tmp_path / "out.npy"])  # no .partial left


class _FailingEngine(RecordingEngine):
    def step(self, batch: Batch) -> LazyTensor:
        raise RuntimeError("the device fell over")


def test_a_failed_step_fails_the_run_and_leaves_no_file(tmp_path: Path, minilm_fp32, minilm_tokenizer):
    source = tmp_path / "in.txt"
    source.write_text("one line\nanother line\n")
    engine = _FailingEngine(minilm_fp32)
    try:
        with pytest.raises(RuntimeError, match="engine step failed: the device fell over"):
            embed_file(engine, minilm_tokenizer, EmbedConfig(source, tmp_path / "out.npy"), progress_bar=False)
    finally:
        engine.close()
    assert list(tmp_path.iterdir()) == [source]
