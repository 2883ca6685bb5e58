"""bench/gpu_check.py --dry-run on the CPU: a lent GPU must never be spent on a script error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from gpu_check import eager_rows, graph_stats

from bouquet.engine.cuda_graphs import Bucket, GraphStats

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.long
@pytest.mark.process
def test_gpu_check_dry_run(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run", "--out-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = (tmp_path / "gpu-results.md").read_text()
    assert "FAILED" not in report and "SKIPPED" not in report, report
    checks = ("parity", "graph == eager", "eager vs graph, 1 x 16", "eager vs graph, 8 x 64", "saturation knee")
    for check in (*checks, "bert-base: one replica, 50-token inputs"):
        assert check in report.replace("bfloat16 (sdpa) vs float32", "parity"), check
    assert (tmp_path / "attention-table.json").exists()
    committed = ROOT / "docs" / "gpu-results.md"  # only a real GPU run may write there
    assert not committed.exists() or "dry run" not in committed.read_text()


@pytest.mark.process
def test_gpu_check_leaves_its_report_when_stopped_by_the_hard_limit(tmp_path: Path) -> None:
    script = [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run", "--out-dir", str(tmp_path)]
    result = subprocess.run([*script, "--hard-limit-s", "2"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr[-3000:]
    report = (tmp_path / "gpu-results.md").read_text()
    assert "matrix-product rate" in report and "ABORTED: hard time limit of 2 s" in report, report


def _stand_in_engine(graphs: object) -> SimpleNamespace:
    """An engine as gpu_check reads it on a GPU: `runner.graphs` is the CudaGraphRunner (None when eager)."""
    engine = SimpleNamespace(runner=SimpleNamespace(graphs=graphs))
    engine.embed = lambda batch: np.full((1, 2), 0.0 if engine.runner.graphs is None else 1.0)
    return engine


def test_graph_stats_and_eager_rows_on_a_gpu_engine() -> None:
    lazy = SimpleNamespace(stats=GraphStats(1, 1, 3), capture_errors={Bucket(4096, 8): "RuntimeError: no room"})
    engine = _stand_in_engine(SimpleNamespace(graphs=lazy))
    stats = graph_stats(engine)  # type: ignore[arg-type]
    assert stats == "1 eager, 1 captured, 3 replayed; capture of 4096x8 failed: RuntimeError: no room"
    runner = engine.runner.graphs
    assert eager_rows(engine, batch=None)[0, 0] == 0.0  # type: ignore[arg-type]
    assert engine.runner.graphs is runner  # the graphs are put back
    assert graph_stats(_stand_in_engine(None)) == "eager (no CUDA graphs)"  # type: ignore[arg-type]
