"""`bouquet embed`: a file of texts to a float32 .npy, rows in input order.

A producer thread reads, tokenizes and cuts token-budget batches while the engine computes the previous
ones; two steps stay in flight so the engine thread never waits for Python between batches.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, replace
from itertools import islice

import numpy as np
from tqdm import tqdm

from bouquet.config import EmbedConfig
from bouquet.engine.batch import Batch
from bouquet.engine.engine import Engine
from bouquet.engine.lazy_tensor import LazyTensor
from bouquet.offline.input_reader import count_texts, read_texts
from bouquet.tokenizer import TextTokenizer, pack

_STEPS_IN_FLIGHT = 2


@dataclass(frozen=True)
class _Work:
    batch: Batch
    rows: np.ndarray  # [B] output row of each sequence in the batch


def split_by_token_budget(lengths: list[int], max_tokens: int) -> list[slice]:
    """Consecutive runs whose lengths sum to at most max_tokens; a longer sequence gets a run alone."""
    runs, start, total = [], 0, 0
    for i, length in enumerate(lengths):
        if i > start and total + length > max_tokens:
            runs.append(slice(start, i))
            start, total = i, 0
        total += length
    if start < len(lengths):
        runs.append(slice(start, len(lengths)))
    return runs


def embed_file(
    engine: Engine, tokenizer: TextTokenizer, config: EmbedConfig, prompt: str = "", progress_bar: bool = True
) -> int:
    """Embeds every text of config.input_path into config.output_path; returns the number of texts."""
    num_texts = count_texts(config.input_path)  # every line checked before anything is written
    if config.normalize is None:
        config = replace(config, normalize=engine.spec.normalize)
    partial = config.output_path.with_name(config.output_path.name + ".partial")
    output = np.lib.format.open_memmap(partial, mode="w+", dtype=np.float32, shape=(num_texts, engine.dimension))
    try:
        bar = tqdm(total=num_texts, unit="text", desc="embed", dynamic_ncols=True, disable=not progress_bar)
        with bar as progress:
            for work, rows in _run_pipeline(engine, _produce_batches(tokenizer, config, prompt)):
                output[work.rows] = rows
                progress.update(work.batch.num_seqs)
        output.flush()
        del output
        os.replace(partial, config.output_path)
    finally:
        partial.unlink(missing_ok=True)
    return num_texts


def _run_pipeline(engine: Engine, works: Iterator[_Work]) -> Iterator[tuple[_Work, np.ndarray]]:
    in_flight: deque[tuple[_Work, LazyTensor]] = deque()
    for work in works:
        in_flight.append((work, engine.step(work.batch)))
        if len(in_flight) >= _STEPS_IN_FLIGHT:
            done, lazy = in_flight.popleft()
            yield done, lazy.result()
    while in_flight:
        done, lazy = in_flight.popleft()
        yield done, lazy.result()


def _produce_batches(tokenizer: TextTokenizer, config: EmbedConfig, prompt: str) -> Iterator[_Work]:
    """Runs tokenization on its own thread and yields its batches; its errors are re-raised here."""
    handoff: queue.Queue[_Work | BaseException | None] = queue.Queue(maxsize=_STEPS_IN_FLIGHT)
    stop = threading.Event()

    def produce() -> None:
        try:
            for work in _tokenize_windows(tokenizer, config, prompt):
                if stop.is_set():
                    return
                handoff.put(work)
            handoff.put(None)
        except BaseException as exc:  # handed to the consumer, which re-raises it
            handoff.put(exc)

    thread = threading.Thread(target=produce, name="bouquet-tokenize", daemon=True)
    thread.start()
    try:
        while (item := handoff.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer stuck on a full queue
            _drain(handoff)
            thread.join(timeout=0.05)


def _drain(handoff: queue.Queue[_Work | BaseException | None]) -> None:
    while True:
        try:
            handoff.get_nowait()
        except queue.Empty:
            return


def _tokenize_windows(tokenizer: TextTokenizer, config: EmbedConfig, prompt: str) -> Iterator[_Work]:
    texts = read_texts(config.input_path)
    first_row = 0
    while window := list(islice(texts, config.sort_window)):
        ids = tokenizer.encode([prompt + text for text in window] if prompt else window)
        prompt_tokens = tokenizer.prompt_tokens(prompt)
        # Sorting a window by length gives each batch similar lengths: less attention padding per group.
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        for run in split_by_token_budget([len(ids[i]) for i in order], config.batch_tokens):
            members = order[run]
            packed = pack([ids[i] for i in members])
            batch = Batch.from_packed(
                packed.input_ids, packed.cu_seqlens, config.normalize, prompt_tokens=prompt_tokens
            )
            yield _Work(batch, first_row + np.asarray(members))
        first_row += len(window)
