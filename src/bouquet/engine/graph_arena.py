"""One block of memory that a thread's CPU graphs share for the buffers their layers allocate.

A graph's capture allocates its intermediates (each linear's output, attention's, the scratch of a kernel) with
torch.empty, and the recorded calls address them by pointer: kept per graph, that is ~92 KB a token for MiniLM in
float32, so that a 64 MB budget held a lone query's shapes up to 32 tokens and queries of 33-64 tokens ran eagerly
or paid a capture on their first sightings (the served p99, docs/benchmarks.md). A thread replays one graph at a
time, and in a replay every such buffer is written before it is read (the capture ran the same calls on memory
fresh from torch.empty: nothing could be read from it before a call wrote it), and the step's answer is copied out
before the next replay. So after its capture a graph's allocations are moved into the thread's arena: the recorded
pointers and tensors that address them are rewritten to the same offsets in the arena, and the capture's own
buffers are freed. Every graph then costs its few private buffers, and the arena that of the largest graph.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bouquet.kernels.recording import CopiedAnswer, KernelProgram

_ALIGN = 64  # bytes: a cache line, and every dtype's alignment

Call = tuple[Callable[..., int], tuple[object, ...]]


@dataclass(frozen=True)
class _Block:
    start: int  # the capture's address
    size: int
    offset: int  # in the arena


class GraphArena:
    """A thread's shared buffer, replaced by a larger one when a graph does not fit: graphs moved into the smaller
    one keep it alive, so the caller sizes the first arena for the largest graph it expects."""

    def __init__(self) -> None:
        self.memory = torch.empty(0, dtype=torch.uint8)

    @property
    def nbytes(self) -> int:
        return self.memory.numel()

    def relocate(
        self, program: KernelProgram, allocated: list[torch.UntypedStorage], output: torch.Tensor, size: int = 0
    ) -> tuple[torch.Tensor, int]:
        """Moves the buffers in `allocated` (the capture's own: `allocated_by`) into the arena: rewrites `program`'s
        calls to address them there, and returns the graph's output as the arena's tensor (holding the capture's answer)
        and the bytes of the new arena if one was needed (its size `size`, or what the graph needs if more)."""
        blocks, needed = _layout(allocated)
        grown = 0
        if needed > self.nbytes:
            self.memory = torch.empty(max(needed, size), dtype=torch.uint8)
            grown = self.nbytes
        base = self.memory.data_ptr()
        program.calls[:] = [_moved_call(call, blocks, base, self.memory) for call in program.calls]
        moved = _moved(output, blocks, base, self.memory)
        assert isinstance(moved, torch.Tensor)
        moved.copy_(output)
        return moved, grown


def allocated_by(program: KernelProgram, allocations: list[torch.UntypedStorage]) -> list[torch.UntypedStorage]:
    """The memory a capture created: what its run allocated, and the answers of the torch ops it recorded as calls
    (a replay copies each op's new answer into the first one's memory, which later calls read)."""
    answers = [f.answer for f, _ in program.calls if isinstance(f, CopiedAnswer)]
    strided = [a for a in answers if isinstance(a, torch.Tensor) and not a.is_mkldnn and a.layout is torch.strided]
    return [*allocations, *(answer.untyped_storage() for answer in strided)]


def arena_bytes(allocated: list[torch.UntypedStorage]) -> int:
    """The bytes `allocated` takes in an arena (each buffer on a cache line of its own)."""
    return _layout(allocated)[1]


def _layout(allocated: list[torch.UntypedStorage]) -> tuple[list[_Block], int]:
    blocks, offset = [], 0
    for start, storage in sorted({s.data_ptr(): s for s in allocated if s.nbytes()}.items()):
        blocks.append(_Block(start, storage.nbytes(), offset))
        offset += -(-storage.nbytes() // _ALIGN) * _ALIGN
    return blocks, offset


def _moved_call(call: Call, blocks: list[_Block], base: int, memory: torch.Tensor) -> Call:
    function, args = call
    if isinstance(function, CopiedAnswer):  # a torch op run again on replay: its inputs and answer may be moved
        function.args = tuple(_moved(arg, blocks, base, memory) for arg in function.args)
        function.answer = _moved(function.answer, blocks, base, memory)
    return function, tuple(_moved(arg, blocks, base, memory) for arg in args)


def _moved(arg: object, blocks: list[_Block], base: int, memory: torch.Tensor) -> object:
    """A pointer into a moved block, or a tensor on one, at the same offset in the arena; anything else as it is
    (`blocks` sorted by address)."""
    if isinstance(arg, bool) or not isinstance(arg, int | torch.Tensor):
        return arg
    if isinstance(arg, torch.Tensor) and (arg.is_mkldnn or arg.layout is not torch.strided):
        return arg  # oneDNN's packed weights: opaque, and never the capture's own
    address = arg.untyped_storage().data_ptr() if isinstance(arg, torch.Tensor) else arg
    index = bisect.bisect_right(blocks, address, key=lambda b: b.start) - 1
    block = blocks[index] if index >= 0 and address < blocks[index].start + blocks[index].size else None
    if block is None:
        return arg
    if isinstance(arg, int):
        return base + block.offset + (arg - block.start)
    byte_offset = block.offset + arg.storage_offset() * arg.element_size()
    view = torch.empty(0, dtype=arg.dtype)
    view.set_(memory.untyped_storage(), byte_offset // arg.element_size(), arg.shape, arg.stride())
    return view
