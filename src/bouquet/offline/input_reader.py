"""Texts from a `.jsonl` (a "text" field per line) or `.txt` (a text per line) file, checked line by line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


class InputError(ValueError):
    """A bad input line; the message names the file and line."""


def count_texts(path: Path) -> int:
    """Validates every line and returns how many texts there are, so nothing is written for a bad file."""
    count = 0
    for count, _ in enumerate(read_texts(path), start=1):  # noqa: B007
        pass
    return count


def read_texts(path: Path) -> Iterator[str]:
    parse = _parse_jsonl_line if path.suffix == ".jsonl" else _parse_txt_line
    with path.open("rb") as lines:
        for line_no, raw in enumerate(lines, start=1):
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as exc:
                raise InputError(f"{path}:{line_no}: not valid UTF-8 ({exc.reason})") from exc
            yield parse(line, path, line_no)


def _parse_txt_line(line: str, path: Path, line_no: int) -> str:
    return line


def _parse_jsonl_line(line: str, path: Path, line_no: int) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}:{line_no}: invalid JSON ({exc.msg})") from exc
    if not isinstance(record, dict) or "text" not in record:
        raise InputError(f'{path}:{line_no}: no "text" field')
    if not isinstance(record["text"], str):
        raise InputError(f'{path}:{line_no}: "text" must be a string, got {type(record["text"]).__name__}')
    return record["text"]
