"""The GPU check's report: sections run time-boxed and fail-soft; the markdown and its state are rewritten after
every row, and a run that dies is resumed by a fresh process where it stopped.

A lent GPU is scarce, so nothing in one section may cost the others:
- each section runs on a thread of its own and is waited for at most its time limit; an exception is recorded
  (a row, and its traceback under "Failures") and the next section runs;
- a section still running at its limit (a hung kernel), or one that leaves the device unusable (a sticky CUDA
  error such as an illegal address), ends the process with RESTART; a process that dies outright (a segfault)
  leaves its section marked as started. Either way bench/gpu_run.sh starts the check again with --resume: the
  new process reads the state file, marks such a section "crashed", skips every section already done, and goes
  on with what earlier sections found (`shared`). A fresh process has a fresh CUDA context;
- sections due past the budget are skipped; a watchdog ends the process at the hard limit. Both are counted
  from the first attempt's start.
Files are replaced atomically, so a run killed from outside leaves the last complete report.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RESTART = 4  # exit code: resume in a fresh process (bench/gpu_run.sh)
ABORTED = 3  # exit code: the hard time limit was reached
_TRACEBACK_CHARS = 6000  # per failure: the end of a traceback, where the error is


@dataclass
class Section:
    name: str
    status: str  # "started", "ok", "failed", "timed out", "crashed", "skipped"
    seconds: float = 0.0


@dataclass
class Report:
    path: Path | None = None  # the markdown; its state beside it, as .json
    header: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.time)  # wall clock at the first attempt's start
    budget_s: float = float("inf")  # sections due after started + budget_s are skipped
    rows: list[tuple[str, str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failures: list[tuple[str, str]] = field(default_factory=list)  # (section, traceback or stack)
    sections: list[Section] = field(default_factory=list)
    shared: dict[str, Any] = field(default_factory=dict)  # what later sections need from earlier ones, as JSON
    attempts: int = 1
    healthy: Callable[[], bool] = field(default=lambda: True, repr=False)  # whether the device still works
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    @classmethod
    def resume(cls, path: Path) -> Report:
        """The report a previous attempt left (its state file), to go on with; a new one if there is none."""
        try:
            state = json.loads(state_path(path).read_text())
        except (OSError, ValueError):
            return cls(path)
        report = cls(path, state["header"], state["started"], state["budget_s"], attempts=state["attempts"] + 1)
        report.rows = [tuple(row) for row in state["rows"]]  # type: ignore[misc]
        report.notes, report.shared = state["notes"], state["shared"]
        report.failures = [tuple(failure) for failure in state["failures"]]  # type: ignore[misc]
        report.sections = [Section(**section) for section in state["sections"]]
        for section in report.sections:
            if section.status == "started":  # the process died inside it
                section.status = "crashed"
                report.add(section.name, f"CRASHED attempt {report.attempts - 1}: the process died in this section")
        return report

    def add(self, check: str, result: str, goal: str = "") -> None:
        with self.lock:
            self.rows.append((check, result, goal))
            print(f"| {check} | {result} | {goal} |", flush=True)
            self.write()

    def note(self, text: str) -> None:
        with self.lock:
            self.notes.append(text)
            self.write()

    def fail(self, check: str, result: str, details: str) -> None:
        """A row saying what went wrong, and the traceback (or a stuck thread's stack) under Failures."""
        with self.lock:
            self.failures.append((check, details[-_TRACEBACK_CHARS:]))
            self.add(check, result)
        print(details, file=sys.stderr, flush=True)

    def done(self, name: str) -> Section | None:
        return next((section for section in self.sections if section.name == name), None)

    def run(self, name: str, check: Callable[[], None], limit_s: float) -> bool:
        """Runs `check` on its own thread for at most `limit_s` seconds; True if it returned without error, now
        or in an earlier attempt. Skipped past the budget; an error is recorded, never raised; a hang or a
        broken device ends the process for a fresh one to resume."""
        if (earlier := self.done(name)) is not None:
            return earlier.status == "ok"
        if time.time() > self.started + self.budget_s:
            self.add(name, "SKIPPED: time budget spent (--budget-s)")
            self._record(Section(name, "skipped"))
            return False
        section = Section(name, "started")
        self._record(section)  # on disk before it runs: a process that dies in it leaves the mark
        began = time.monotonic()
        section.status = self._run_thread(name, check, limit_s)
        section.seconds = time.monotonic() - began
        self.write()
        if section.status == "timed out" or (section.status == "failed" and not self._device_works()):
            self.note(f"attempt {self.attempts} ended after {name!r} ({section.status}): resumed in a fresh process")
            finish(RESTART)
        return section.status == "ok"

    def _device_works(self) -> bool:
        """`healthy()` within 15 s: a device that does not answer counts as broken."""
        answers: list[bool] = []
        thread = threading.Thread(target=lambda: answers.append(self.healthy()), daemon=True)
        thread.start()
        thread.join(15)
        return bool(answers and answers[0])

    def _run_thread(self, name: str, check: Callable[[], None], limit_s: float) -> str:
        errors: list[BaseException] = []

        def target() -> None:
            try:
                check()
            except BaseException as error:  # recorded below; the section's thread must not die silently
                errors.append(error)

        thread = threading.Thread(target=target, name=f"gpu-check: {name}", daemon=True)
        thread.start()
        thread.join(limit_s)
        if thread.is_alive():
            frame = sys._current_frames().get(thread.ident or -1)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no stack)"
            self.fail(name, f"TIMED OUT after {limit_s:.0f} s: its stack under Failures", stack)
            return "timed out"
        if errors:
            error = errors[0]
            details = "".join(traceback.format_exception(error))
            self.fail(name, f"FAILED: {type(error).__name__}: {one_line(str(error))[:300]}", details)
            return "failed"
        return "ok"

    def _record(self, section: Section) -> None:
        with self.lock:
            self.sections.append(section)
            self.write()

    def write(self) -> None:
        if self.path is None:
            return
        with self.lock:
            state = {
                "header": self.header, "started": self.started, "budget_s": self.budget_s, "rows": self.rows,
                "notes": self.notes, "failures": self.failures, "shared": self.shared, "attempts": self.attempts,
                "sections": [asdict(section) for section in self.sections],
            }  # fmt: skip
            replace_file(state_path(self.path), json.dumps(state, indent=1))
            replace_file(self.path, self.markdown())

    def markdown(self) -> str:
        lines = [*self.header, "", "| check | result | goal |", "| --- | --- | --- |"]
        lines += [f"| {cell(c)} | {cell(r)} | {cell(g)} |" for c, r, g in self.rows]
        lines += ["", *[f"- {n}" for n in self.notes]]
        if self.sections:
            lines += ["", "## Sections", "", "| section | status | seconds |", "| --- | --- | --- |"]
            lines += [f"| {cell(s.name)} | {s.status} | {s.seconds:.1f} |" for s in self.sections]
        if self.failures:
            lines += ["", "## Failures"]
            for name, details in self.failures:
                lines += ["", f"### {name}", "", "```", details.rstrip().replace("```", "'''"), "```"]
        return "\n".join([*lines, ""])

    def start_watchdog(self, hard_limit_s: float) -> None:
        """At `hard_limit_s` from the first attempt's start, records the stop, writes the report and ends the
        process (a section may hang; the lent machine's command limit would otherwise end it with nothing)."""

        def stop() -> None:
            time.sleep(max(0.0, self.started + hard_limit_s - time.time()))
            self.add("run", f"ABORTED: hard time limit of {hard_limit_s:.0f} s reached (--hard-limit-s)")
            finish(ABORTED)

        threading.Thread(target=stop, name="gpu-check-watchdog", daemon=True).start()


def state_path(path: Path) -> Path:
    return path.with_suffix(".json")


def replace_file(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def finish(code: int) -> None:
    """Ends the process now: a section left running (a hung kernel) must not hold the exit, nor CUDA's teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cell(text: str) -> str:
    """Text for one markdown table cell."""
    return one_line(text).replace("|", "\\|")


def one_line(text: str) -> str:
    return " ".join(text.split())
