"""Calls into bouquet's C kernels, recorded so that a CPU graph (engine/cpu_graphs.py) can replay them.

Every kernel call a forward makes goes through `kernel_call`. While a thread records (`recording`), each call
is kept with its arguments, exactly as passed: raw pointers and sizes. Replaying the list makes the same calls
on the same memory, with none of the Python between them (modules, views, allocations, argument packing),
which is most of a short step's time on the CPU. The recorder only keeps calls; whoever records makes sure
the memory behind every pointer outlives the recording and that nothing but these calls computed anything.

A recorded call may also be a torch op that writes into a tensor given to it (`torch._int_mm(a, b, out=c)`, where
oneDNN's own product is the fastest this CPU has): its arguments are then tensors, kept alive by the recording, and
`inside_kernel_call` tells a watcher of the ops (cpu_graphs' dispatch mode) that the op is one of the calls a replay
makes again. A torch op with no output argument goes through `op_call`: a replay runs it again and copies its
answer into the tensor its capture returned.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

_local = threading.local()


class KernelFailed(RuntimeError):
    """A replayed kernel returned non-zero: it could not allocate its scratch, or its ISA is missing."""


@dataclass
class KernelProgram:
    """The kernel calls of one recorded run, in order."""

    calls: list[tuple[Callable[..., int], tuple[object, ...]]] = field(default_factory=list)

    def replay(self) -> None:
        for function, args in self.calls:
            if function(*args):
                raise KernelFailed(f"{getattr(function, '__name__', function)} failed on replay")


def kernel_call(function: Callable[..., int], *args: object) -> int:
    """`function(*args)`, kept in the thread's recording if one is open. Returns the kernel's status."""
    program: KernelProgram | None = getattr(_local, "program", None)
    if program is None:
        return function(*args)
    program.calls.append((function, args))
    _local.inside = True
    try:
        return function(*args)
    finally:
        _local.inside = False


class CopiedAnswer:
    """A recorded op with no output argument: its first run's answer is kept, and a replay runs the op again and
    copies the new answer into it (the calls recorded after it read that memory)."""

    def __init__(self, op: Callable[..., Any], args: tuple[object, ...]) -> None:
        self.op, self.args = op, args
        self.answer: Any = None
        self.__name__ = getattr(op, "__name__", str(op))

    def __call__(self) -> int:
        answer = self.op(*self.args)
        if self.answer is None:
            self.answer = answer
        else:
            self.answer.copy_(answer)
        return 0


def op_call(op: Callable[..., Any], *args: object) -> Any:
    """`op(*args)` for a torch op that returns a new tensor (oneDNN's matmuls have no output argument): recorded, when
    this thread records, as a call whose replays copy their answer into the tensor returned now."""
    if not is_recording():
        return op(*args)
    call = CopiedAnswer(op, args)
    kernel_call(call)
    return call.answer


def is_recording() -> bool:
    """Whether this thread has a recording open."""
    return getattr(_local, "program", None) is not None


def inside_kernel_call() -> bool:
    """Whether this thread is running a call that its open recording keeps."""
    return bool(getattr(_local, "inside", False))


@contextmanager
def recording() -> Iterator[KernelProgram]:
    """Records this thread's kernel calls until the block ends."""
    assert getattr(_local, "program", None) is None, "recordings do not nest"
    program = KernelProgram()
    _local.program = program
    try:
        yield program
    finally:
        _local.program = None
