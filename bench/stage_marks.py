"""Timestamps at the stages of a served request, inside `bouquet serve`'s own processes (bench/served_stages.py).

Imported by a `sitecustomize` that served_stages.py puts first on the servers' PYTHONPATH, with
$BOUQUET_STAGE_MARKS naming a directory: each function in STAGES is wrapped as its module is first imported, so
that its entry and exit append (label, perf_counter_ns) to the process's list, written to DIR/PID.txt every
second and at exit. perf_counter_ns is CLOCK_MONOTONIC on Linux, one clock for every process, so the gateway's
and the replica's marks fall on the client's timeline. A mark costs ~1-2 us; the servers' code is unchanged.
"""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import importlib.machinery
import inspect
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

# module -> (attribute path within it, label); '>' and '<' are appended to the label at entry and exit
STAGES: dict[str, list[tuple[str, str]]] = {
    "bouquet.gateway.http.protocol": [("BoundedHttpProtocol.data_received", "gateway: HTTP bytes read")],
    "uvicorn.protocols.http.httptools_impl": [("RequestResponseCycle.send", "gateway: ASGI send")],
    "bouquet.gateway.http.body": [("read_body", "gateway: body read")],
    "bouquet.gateway.http.endpoint": [("unless_disconnected", "gateway: route's work")],
    "bouquet.gateway.service": [("Service.sequences", "gateway: tokenize")],
    "bouquet.gateway.replicas.pool": [("ReplicaPool._call", "gateway: replica call")],
    "grpc.aio._call": [("UnaryUnaryCall._invoke", "gateway: grpc invoke")],
    "bouquet.replica.server": [("EmbeddingServicer.Embed", "replica: Embed"), ("decode_request", "replica: decode")],
    "bouquet.replica.scheduler": [("Scheduler._hand_out_finished", "replica: hand out")],
    "bouquet.engine.engine": [("Engine.step", "replica: engine.step"), ("Engine._run_on_cpu", "engine: forward")],
}

_marks: list[tuple[str, int]] = []


def _mark(label: str) -> None:
    _marks.append((label, time.perf_counter_ns()))


def _flush(directory: str) -> None:
    taken = _marks[:]
    del _marks[: len(taken)]
    if taken:
        with open(os.path.join(directory, f"{os.getpid()}.txt"), "a") as out:
            out.writelines(f"{label}\t{ns}\n" for label, ns in taken)


def _wrapped(function: Callable[..., Any], label: str) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(function):

        @functools.wraps(function)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            _mark(label + ">")
            try:
                return await function(*args, **kwargs)
            finally:
                _mark(label + "<")

        return timed_async

    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        _mark(label + ">")
        try:
            return function(*args, **kwargs)
        finally:
            _mark(label + "<")

    return timed


def _wrap_stages(module: ModuleType, stages: list[tuple[str, str]]) -> None:
    for path, label in stages:
        *owners, name = path.split(".")
        owner: Any = module
        for part in owners:
            owner = getattr(owner, part)
        setattr(owner, name, _wrapped(getattr(owner, name), label))


class _StageFinder(importlib.abc.MetaPathFinder):
    """Finds STAGES' modules through the other finders and wraps their functions once they have run."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in STAGES:
            return None
        for finder in sys.meta_path:
            found = None if finder is self else getattr(finder, "find_spec", lambda *_: None)(fullname, path, target)
            if found is not None and found.loader is not None:
                run = found.loader.exec_module

                def exec_module(module: ModuleType, run: Callable[[ModuleType], None] = run) -> None:
                    run(module)
                    _wrap_stages(module, STAGES[fullname])

                found.loader.exec_module = exec_module  # type: ignore[method-assign]
                return found
        return None


def install(directory: str) -> None:
    sys.meta_path.insert(0, _StageFinder())
    atexit.register(_flush, directory)

    def flush_every_second() -> None:
        while True:
            time.sleep(1.0)
            _flush(directory)

    threading.Thread(target=flush_every_second, name="stage-marks", daemon=True).start()


if os.environ.get("BOUQUET_STAGE_MARKS"):
    install(os.environ["BOUQUET_STAGE_MARKS"])
