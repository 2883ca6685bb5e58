"""`bouquet embed`: a file of texts to a float32 .npy, rows in input order.

The replica's scheduler drives the engine here too, on an event loop in this process: each window of texts,
sorted by length, is queued as one request; the scheduler cuts token-budget steps from the queue, keeps two in
flight and hands the rows back. A thread reads and tokenizes the next window meanwhile, so the queue never runs
dry while the engine computes. `embed_texts` is that pipeline on any texts in memory: `bouquet.ray`'s actors run it
on each batch of a Ray Dataset, so both paths tokenize, sort and batch alike.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice

import numpy as np
from tqdm import tqdm

from bouquet import event_loop
from bouquet.batch import Batch, RowOptions
from bouquet.chat_templates import ChatTemplate
from bouquet.config import EmbedConfig, SchedulerConfig
from bouquet.model_dir import ModelSpec
from bouquet.offline.input_reader import count_texts, read_texts
from bouquet.replica.scheduler import Scheduler, StepEngine
from bouquet.text_messages import ConversationTokenizer, TextMessages, required_chat_template
from bouquet.tokenizer import TextTokenizer, tokenizer_json

# Windows queued at once: the one being computed and the next behind it, so the engine never waits for the
# tokenizer, while memory holds two windows' tokens at most.
_WINDOWS_QUEUED = 2


OfflineTokenizer = TextTokenizer | ConversationTokenizer


def offline_tokenizer(spec: ModelSpec, max_length: int) -> OfflineTokenizer:
    """The model's texts to ids as the gateway tokenizes them: as they are (after the prompt), or as conversations
    where its sentence-transformers Transformer takes chat messages (text_messages.py)."""
    source = tokenizer_json(spec.tokenizer_file, spec.do_lower_case)
    if spec.st_messages is None:
        return TextTokenizer(source, max_length)
    template = ChatTemplate(required_chat_template(spec))
    return ConversationTokenizer(source, max_length, TextMessages(template, spec.st_messages))


@dataclass(frozen=True)
class _Window:
    batch: Batch  # its texts' token ids, shortest first
    rows: np.ndarray  # [B] the output row of each of its sequences


def embed_file(
    engine: StepEngine, tokenizer: OfflineTokenizer, config: EmbedConfig, prompt: str = "", progress_bar: bool = True
) -> int:
    """Embeds every text of config.input_path into config.output_path; returns the number of texts."""
    num_texts = count_texts(config.input_path)  # every line checked before anything is written
    partial = config.output_path.with_name(config.output_path.name + ".partial")
    output = np.lib.format.open_memmap(partial, mode="w+", dtype=np.float32, shape=(num_texts, engine.dimension))
    try:
        bar = tqdm(total=num_texts, unit="text", desc="embed", dynamic_ncols=True, disable=not progress_bar)
        with bar as progress:
            embed_texts(
                engine,
                tokenizer,
                read_texts(config.input_path),
                output,
                normalize=config.normalize,
                batch_tokens=config.batch_tokens,
                sort_window=config.sort_window,
                prompt=prompt,
                on_rows=progress.update,
            )
        output.flush()
        del output
        os.replace(partial, config.output_path)
    finally:
        partial.unlink(missing_ok=True)
    return num_texts


def embed_texts(
    engine: StepEngine,
    tokenizer: OfflineTokenizer,
    texts: Iterable[str],
    output: np.ndarray,  # [N, dim] float32: row i gets text i
    *,
    normalize: bool | None = None,  # None: as the model's Normalize module says
    batch_tokens: int = EmbedConfig.batch_tokens,
    sort_window: int = EmbedConfig.sort_window,
    prompt: str = "",
    on_rows: Callable[[int], None] | None = None,
) -> None:
    """The texts' rows into `output` in their order: windows of `sort_window` texts, sorted by length, through the
    scheduler in steps of `batch_tokens`, on an event loop of the caller's thread."""
    normalize = engine.spec.normalize if normalize is None else normalize
    options = RowOptions(normalize=normalize, prompt_tokens=tokenizer.prompt_tokens(prompt))
    windows = _windows(tokenizer, iter(texts), options, sort_window, prompt)
    event_loop.run(_embed_windows(engine, windows, _scheduler_config(batch_tokens), output, on_rows))


def _scheduler_config(batch_tokens: int) -> SchedulerConfig:
    return SchedulerConfig(
        max_batch_tokens=batch_tokens,
        max_batch_seqs=batch_tokens,  # every sequence holds a token: the token budget is the only cap
        max_queue_tokens=sys.maxsize,  # bounded by _WINDOWS_QUEUED instead: a window may hold any number
    )


async def _embed_windows(
    engine: StepEngine,
    windows: Iterator[_Window],
    config: SchedulerConfig,
    output: np.ndarray,  # [N, dim] float32
    on_rows: Callable[[int], None] | None,
) -> None:
    scheduler = Scheduler(engine, config)
    loop = asyncio.get_running_loop()
    queued: deque[tuple[_Window, asyncio.Future[np.ndarray]]] = deque()
    with ThreadPoolExecutor(1, thread_name_prefix="bouquet-tokenize") as tokenizer_thread:
        try:
            while window := await loop.run_in_executor(tokenizer_thread, next, windows, None):
                queued.append((window, asyncio.ensure_future(scheduler.embed(window.batch, on_rows=on_rows))))
                if len(queued) == _WINDOWS_QUEUED:
                    await _write(*queued.popleft(), output)
            while queued:
                await _write(*queued.popleft(), output)
        finally:
            scheduler.close()  # after an error: what is queued or in flight fails rather than runs on
            await asyncio.gather(*(rows for _, rows in queued), return_exceptions=True)


async def _write(window: _Window, rows: asyncio.Future[np.ndarray], output: np.ndarray) -> None:
    output[window.rows] = await rows


def _windows(
    tokenizer: OfflineTokenizer, texts: Iterator[str], options: RowOptions, sort_window: int, prompt: str
) -> Iterator[_Window]:
    first_row = 0
    while window := list(islice(texts, sort_window)):
        ids = tokenizer.encode_prompted(window, prompt)
        # Sorted by length, the steps cut from a window hold similar lengths: less padding where attention pads.
        order = np.argsort(np.fromiter(map(len, ids), np.int32, len(ids)), kind="stable")
        yield _Window(Batch.pack([ids[i] for i in order], options), first_row + order)
        first_row += len(window)
