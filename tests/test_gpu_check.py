"""bench/gpu_check.py --dry-run on the CPU: a lent GPU must never be spent on a script error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
    for check in ("parity", "graph == eager", "eager vs graph, 1 x 16", "eager vs graph, 8 x 64", "saturation knee"):
        assert check in report.replace("bfloat16 (sdpa) vs float32", "parity"), check
    assert (tmp_path / "attention-table.json").exists()
    committed = ROOT / "docs" / "gpu-results.md"  # only a real GPU run may write there
    assert not committed.exists() or "dry run" not in committed.read_text()
