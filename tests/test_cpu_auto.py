"""`auto` on the CPU: cpu_varlen or SDPA per max-sequence-length bucket, measured at start-up on the workers'
thread count, cached per machine and shape, or read from `--attention-table`; the choice logged."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from bouquet.config import EngineConfig
from bouquet.engine.engine import Engine
from bouquet.layers.attention_backends import AttentionShape, timing
from bouquet.layers.attention_backends.sdpa import SdpaBackend
from bouquet.layers.attention_backends.selection import AutoBackend, BackendTable, create_auto_backend

CPU = torch.device("cpu")
SHAPE = AttentionShape(num_heads=4, num_kv_heads=2, head_dim=16, causal=False, dtype=torch.float32)


@pytest.fixture(autouse=True)
def own_cache(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("BOUQUET_CACHE_DIR", str(tmp_path / "cache"))


def fake_timings(monkeypatch, calls: list[tuple[str, int, int]]) -> None:
    """cpu_varlen faster up to 64 tokens, SDPA above; each case recorded with the thread count it ran on."""

    def prepare_call(backend, shape, seq_len, device, batch_tokens=8192, mixed=False):
        calls.append((backend.name, seq_len, torch.get_num_threads()))
        assert batch_tokens == timing.CPU_BATCH_TOKENS and mixed
        return (backend.name, seq_len)

    def time_calls(cases, device):
        return {
            name: (1.0 if seq_len <= 64 else 3.0) if name == "cpu_varlen" else 2.0
            for name, (_, seq_len) in cases.items()
        }

    monkeypatch.setattr(timing, "prepare_call", prepare_call)
    monkeypatch.setattr(timing, "time_calls", time_calls)


def never_timed(monkeypatch, why: str) -> None:
    monkeypatch.setattr(timing, "prepare_call", lambda *args: pytest.fail(why))


def test_cpu_lengths_double_up_to_the_models_limit_and_the_measured_cap() -> None:
    assert timing.cpu_lengths(256) == (16, 32, 64, 128, 256)
    assert timing.cpu_lengths(300) == (16, 32, 64, 128, 256, 512)
    assert timing.cpu_lengths(8) == (16,)
    assert timing.cpu_lengths(32_768)[-1] == timing.CPU_MAX_MEASURED_LENGTH


def test_a_buckets_batch_spreads_its_lengths_like_a_real_step() -> None:
    assert timing.bucket_seq_lens(256, 1024, mixed=False) == [256] * 4
    mixed = timing.bucket_seq_lens(256, 1024, mixed=True)
    assert len(mixed) == 4 and mixed[0] == 256 and min(mixed) > 128 and mixed == sorted(mixed, reverse=True)
    assert timing.bucket_seq_lens(2048, 1024, mixed=True) == [2048]


def test_measured_fastest_per_length_on_the_workers_threads_logged_and_cached(monkeypatch, caplog) -> None:
    calls: list[tuple[str, int, int]] = []
    fake_timings(monkeypatch, calls)
    with caplog.at_level(logging.INFO):
        auto = create_auto_backend(CPU, SHAPE, max_seq_length=256, threads=1)
    assert isinstance(auto, AutoBackend)
    expected = ((16, "cpu_varlen"), (32, "cpu_varlen"), (64, "cpu_varlen"), (128, "sdpa"), (256, "sdpa"))
    assert auto.table.rows == expected
    assert {threads for *_, threads in calls} == {1}
    assert {(name, length) for name, length, _ in calls} == {(n, n_) for n in ("cpu_varlen", "sdpa") for n_ in
                                                            (16, 32, 64, 128, 256)}  # fmt: skip
    assert "measured in" in caplog.text and "<=128: sdpa (sdpa 2e+03 ms, cpu_varlen 3e+03 ms)" in caplog.text
    # A second start on this machine reads the cache: nothing is timed again.
    calls.clear()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        again = create_auto_backend(CPU, SHAPE, max_seq_length=256, threads=1)
    assert calls == [] and isinstance(again, AutoBackend) and again.table == auto.table
    assert "cached in" in caplog.text


def test_the_cache_is_per_shape_and_thread_count(monkeypatch) -> None:
    calls: list[tuple[str, int, int]] = []
    fake_timings(monkeypatch, calls)
    create_auto_backend(CPU, SHAPE, max_seq_length=64, threads=1)
    count = len(calls)
    create_auto_backend(CPU, SHAPE, max_seq_length=64, threads=2)
    assert len(calls) == 2 * count and {threads for *_, threads in calls[count:]} == {2}
    create_auto_backend(CPU, AttentionShape(8, 8, 16, True, torch.float32), max_seq_length=64, threads=1)
    assert len(calls) == 3 * count


def test_one_backend_at_every_length_is_used_without_dispatch(monkeypatch) -> None:
    monkeypatch.setattr(timing, "prepare_call", lambda backend, *args: backend.name)
    monkeypatch.setattr(timing, "time_calls", lambda cases, device: {n: 1.0 if n == "sdpa" else 2.0 for n in cases})
    assert isinstance(create_auto_backend(CPU, SHAPE, max_seq_length=128), SdpaBackend)


def test_a_broken_cache_file_is_measured_again(monkeypatch) -> None:
    calls: list[tuple[str, int, int]] = []
    fake_timings(monkeypatch, calls)
    create_auto_backend(CPU, SHAPE, max_seq_length=32)
    path = timing.cpu_cache_path(SHAPE, (16, 32), 1, ["cpu_varlen", "sdpa"])
    assert json.loads(path.read_text())["rows"][0] == {"max_seqlen": 16, "backend": "cpu_varlen"}
    path.write_text("{not json")
    calls.clear()
    create_auto_backend(CPU, SHAPE, max_seq_length=32)
    assert calls


def test_an_attention_table_file_is_used_on_the_cpu_too(monkeypatch, tmp_path, caplog) -> None:
    never_timed(monkeypatch, "a given table is not measured")
    path = tmp_path / "table.json"
    path.write_text(BackendTable(((64, "sdpa"), (8192, "cpu_varlen"))).to_json())
    with caplog.at_level(logging.INFO):
        auto = create_auto_backend(CPU, SHAPE, table_path=path)
    assert isinstance(auto, AutoBackend) and auto.table.rows == ((64, "sdpa"), (8192, "cpu_varlen"))
    assert str(path) in caplog.text
    path.write_text(BackendTable(((64, "flash_attn"), (8192, "cpu_varlen"))).to_json())  # a GPU's row: SDPA here
    assert create_auto_backend(CPU, SHAPE, table_path=path).table.rows == ((64, "sdpa"), (8192, "cpu_varlen"))


def test_position_bias_leaves_sdpa_alone_unmeasured(monkeypatch, caplog) -> None:
    never_timed(monkeypatch, "one candidate is not measured")
    shape = AttentionShape(4, 4, 16, False, torch.float32, position_bias=True)
    with caplog.at_level(logging.INFO):
        assert isinstance(create_auto_backend(CPU, shape), SdpaBackend)
    assert "cpu_varlen not available" in caplog.text


def test_calls_are_timed_in_turns_and_a_failing_one_is_left_out(caplog) -> None:
    order: list[str] = []

    def failing() -> None:
        order.append("b")
        raise RuntimeError("no kernel for this head size")

    with caplog.at_level(logging.WARNING):
        seconds = timing.time_calls({"a": lambda: order.append("a"), "b": failing, "c": lambda: order.append("c")}, CPU)
    assert set(seconds) == {"a", "c"} and all(value >= 0 for value in seconds.values())
    assert order[:5] == ["a", "b", "c", "a", "c"] and "no kernel for this head size" in caplog.text


def test_real_timings_choose_a_backend_that_runs(caplog) -> None:
    """No fake: both backends timed on this CPU, and every row names one of them."""
    with caplog.at_level(logging.INFO):
        backend = create_auto_backend(CPU, SHAPE, max_seq_length=64, threads=1)
    rows = backend.table.rows if isinstance(backend, AutoBackend) else ((64, backend.name),)
    assert {name for _, name in rows} <= {"cpu_varlen", "sdpa"}
    assert "attention auto (measured in" in caplog.text


def test_engine_measures_on_its_workers_share_of_threads(minilm_path, monkeypatch, tmp_path) -> None:
    calls: list[tuple[str, int, int]] = []
    fake_timings(monkeypatch, calls)
    engine = Engine(EngineConfig(minilm_path, "cpu", "float32", num_threads=2, cpu_workers=2))
    try:
        assert isinstance(engine.attn_backend, AutoBackend)
        assert {threads for *_, threads in calls} == {1}
        assert max(length for _, length, _ in calls) == 256  # MiniLM's limit
        assert torch.get_num_threads() == 2
    finally:
        engine.close()
    table = tmp_path / "table.json"
    table.write_text(BackendTable(((512, "sdpa"),)).to_json())
    engine = Engine(EngineConfig(minilm_path, "cpu", "float32", attention_table=table))
    try:
        assert isinstance(engine.attn_backend, SdpaBackend)
    finally:
        engine.close()
