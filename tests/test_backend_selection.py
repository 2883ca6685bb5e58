"""The `auto` attention backend chosen from a table, on the CPU."""

from __future__ import annotations

import json

import pytest
import torch

from bouquet.engine.context import ForwardContext
from bouquet.layers.attention_backends import AttentionShape, BackendUnavailableError, create_attention_backend
from bouquet.layers.attention_backends.sdpa import SdpaBackend
from bouquet.layers.attention_backends.selection import (
    AutoBackend,
    BackendTable,
    create_auto_backend,
    load_backends,
    measure_timings,
)

SHAPE = AttentionShape(num_heads=4, num_kv_heads=2, head_dim=16, causal=False, dtype=torch.float32)


def test_table_from_timings_picks_the_fastest_per_length() -> None:
    timings = {64: {"flash_attn": 1.0, "flashinfer": 2.0}, 8192: {"flash_attn": 9.0, "flashinfer": 5.0}}
    table = BackendTable.from_timings(timings)
    assert table.rows == ((64, "flash_attn"), (8192, "flashinfer"))
    assert [table.choose(n) for n in (1, 64, 65, 8192, 100_000)] == [
        "flash_attn",
        "flash_attn",
        "flashinfer",
        "flashinfer",
        "flashinfer",
    ]


def test_table_round_trips_through_json(tmp_path) -> None:
    table = BackendTable(((512, "flash_attn"), (8192, "flashinfer")))
    path = tmp_path / "table.json"
    path.write_text(table.to_json())
    assert BackendTable.load(path) == table
    assert json.loads(path.read_text())["rows"][0] == {"max_seqlen": 512, "backend": "flash_attn"}


def test_table_falls_back_for_backends_that_did_not_load() -> None:
    table = BackendTable(((512, "flash_attn"), (8192, "flashinfer")))
    assert table.restricted_to({"flashinfer"}, "sdpa").rows == ((512, "sdpa"), (8192, "flashinfer"))


def test_table_rejects_unsorted_rows() -> None:
    with pytest.raises(ValueError, match="increasing"):
        BackendTable(((512, "a"), (64, "b")))


def test_auto_is_sdpa_on_the_cpu() -> None:
    assert isinstance(create_auto_backend(torch.device("cpu"), SHAPE), SdpaBackend)


def test_missing_gpu_backends_name_their_package() -> None:
    for name, package in (("flash_attn", "flash-attn"), ("flashinfer", "flashinfer-python")):
        try:
            create_attention_backend(name)
        except BackendUnavailableError as error:
            assert package in str(error)
    _, missing = load_backends(("flash_attn", "flashinfer", "sdpa"))
    assert "sdpa" not in missing


class _Tagged(SdpaBackend):
    """SDPA that records which batch lengths it served."""

    def __init__(self, tag: str, served: list[str]):
        super().__init__()
        self.tag, self.served = tag, served

    def prepare(self, ctx: ForwardContext):
        self.served.append(self.tag)
        return super().prepare(ctx)


def test_auto_dispatches_each_batch_by_max_seqlen() -> None:
    served: list[str] = []
    backends = {"short": _Tagged("short", served), "long": _Tagged("long", served)}
    auto = AutoBackend(backends, BackendTable(((16, "short"), (64, "long"))))
    auto.bind(SHAPE)
    for seq_lens in ([5, 16], [40, 3]):
        total = sum(seq_lens)
        q, k = torch.randn(total, 4, 16), torch.randn(total, 2, 16)
        cu_seqlens = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32)
        ctx = ForwardContext(cu_seqlens, max(seq_lens), seq_lens, auto)
        ctx.attn_metadata = auto.prepare(ctx)
        out = auto.forward(q, k, k, ctx, False, 0.25)
        reference = SdpaBackend()
        ctx.attn_metadata = reference.prepare(ctx)
        torch.testing.assert_close(out, reference.forward(q, k, k, ctx, False, 0.25))
    assert served == ["short", "long"]
    assert not auto.supports_cuda_graphs


def test_measure_timings_runs_on_the_cpu() -> None:
    timings = measure_timings({"sdpa": SdpaBackend()}, SHAPE, torch.device("cpu"), (16, 32))
    assert set(timings) == {16, 32} and all(t["sdpa"] > 0 for t in timings.values())
