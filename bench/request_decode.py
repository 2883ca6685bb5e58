"""What decoding and validating a large `/v1/embeddings` body costs (issue 26 item 2: typed request structs,
"measure the decode cost of a 2,048-input body with each before choosing"):

- the route's: `parse_openai(body)`, the bytes decoded into gateway/api/openai.py's `EmbeddingsRequest` (msgspec;
  types, bounds and field names checked while decoding) and its job built with the checks types cannot say;
- msgspec alone: this file's smaller struct, `msgspec.json.Decoder(Struct).decode(body)`, plus a hook for what
  types cannot say (the experiment that chose msgspec);
- pydantic v2: `Model.model_validate_json(body)` (its Rust core parses and validates in one pass), the same hook;
- orjson.loads alone: the parse with no check at all, the floor a hand-written parser starts from.

(Before the structs, the route's was orjson.loads and a hand-written walk of the dicts; run this file from a
checkout of that commit to measure it.) Bodies: 2,048 texts of ~40 words; 2,048 lists of 128 token ids; 2,048
mixed. Prints the median of `--repeats` runs (ms per body) and each against the first: above 1.0x is faster.

Then the routes that take a body in one of two shapes (TEI's `POST /`, `/rerank`, `/tokenize`, with 2,048 texts):
their one decode (http/decode.EitherDecoder) against looking for the shape's fields first (`present`) and then
decoding the shape's struct, the two passes they made before.

    .venv/bin/python bench/request_decode.py [--repeats 50]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any, Literal

import msgspec
import orjson
import pydantic

from bouquet.cpu_features import cpu_features
from bouquet.gateway.api import tei, tei_bodies, tei_scores
from bouquet.gateway.api.openai import parse_openai
from bouquet.gateway.http.decode import present

INPUTS = 2048
WORDS = [
    "packed",
    "sequences",
    "run",
    "without",
    "padding",
    "through",
    "the",
    "encoder",
    "while",
    "the",
    "scheduler",
    "cuts",
    "batches",
]
Input = str | list[str | int | list[int]]


class OpenAIRequest(msgspec.Struct, forbid_unknown_fields=True):
    input: Input
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None
    user: str | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        _check_inputs(self.input)


class OpenAIModel(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", strict=True)
    input: str | list[str] | list[int] | list[list[int]] | list[str | list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None
    user: str | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    @pydantic.model_validator(mode="after")
    def _inputs(self) -> OpenAIModel:
        _check_inputs(self.input)
        return self


def _check_inputs(value: Any) -> None:
    """What the types leave open: not empty, no empty text, ids of one kind (all ints, or all lists / texts)."""
    items = [value] if isinstance(value, str) else value
    if not items:
        raise ValueError("'input' must not be empty")
    if isinstance(items[0], int):
        if not all(isinstance(item, int) and not isinstance(item, bool) for item in items):
            raise ValueError("'input' mixes token ids and lists")
        return
    for item in items:
        if isinstance(item, int) or not item:
            raise ValueError("'input' holds an empty or stray item")


def bodies() -> dict[str, bytes]:
    texts = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(40)) for i in range(INPUTS)]
    ids = [[101 + (i * 7 + j) % 30000 for j in range(128)] for i in range(INPUTS)]
    mixed: list[Any] = [texts[i] if i % 2 else ids[i] for i in range(INPUTS)]
    make = lambda inputs: orjson.dumps({"input": inputs, "model": "m", "encoding_format": "float"})  # noqa: E731
    return {"texts": make(texts), "token ids": make(ids), "mixed": make(mixed)}


def decoders() -> dict[str, Callable[[bytes], object]]:
    decoder = msgspec.json.Decoder(OpenAIRequest)
    return {
        "the route's (parse_openai)": parse_openai,
        "msgspec Struct alone": decoder.decode,
        "pydantic v2 model": OpenAIModel.model_validate_json,
        "orjson.loads alone (no checks)": orjson.loads,
    }


def two_shapes(texts: list[str]) -> dict[str, tuple[bytes, Callable[[bytes], object], Callable[[bytes], object]]]:
    """Per route: a body, its one decode, and the probe-then-decode it replaced."""

    def probed(field: str, decode: Callable[[bytes], object]) -> Callable[[bytes], object]:
        return lambda body: (present(body).get(field), decode(body))

    return {
        "TEI POST / (embed)": (orjson.dumps({"inputs": texts}), tei.ROOT.decode,
                               probed("inputs", tei_bodies.EMBED.decode)),
        "TEI /rerank": (orjson.dumps({"query": "q", "texts": texts}), tei_scores.RERANK_BODIES.decode,
                        probed("documents", tei_bodies.RERANK.decode)),
        "TEI /tokenize": (orjson.dumps({"inputs": texts}), tei.TOKENIZE_BODIES.decode,
                          probed("prompt", tei_bodies.TOKENIZE.decode)),
    }  # fmt: skip


def median_ms(decode: Callable[[bytes], object], body: bytes, repeats: int) -> float:
    decode(body)  # warm: caches, lazy schema builds
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        decode(body)
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    print(f"CPU: {cpu_features().describe()}; msgspec {msgspec.__version__}, pydantic {pydantic.VERSION}, "
          f"orjson {orjson.__version__}; median of {args.repeats}, ms per body")  # fmt: skip
    for kind, body in bodies().items():
        results = {name: median_ms(decode, body, args.repeats) for name, decode in decoders().items()}
        first = next(iter(results.values()))
        print(f"\n{kind}: {INPUTS} inputs, {len(body) / 1e6:.2f} MB")
        for name, ms in results.items():
            print(f"  {name:32} {ms:8.2f} ms   {first / ms:5.2f}x the route's")
    texts = orjson.loads(bodies()["texts"])["input"]
    print(f"\nroutes of two shapes, {INPUTS} texts:")
    for route, (body, once, twice) in two_shapes(texts).items():
        one, two = median_ms(once, body, args.repeats), median_ms(twice, body, args.repeats)
        print(f"  {route:20} decoded once {one:6.2f} ms, probed then decoded {two:6.2f} ms: {two / one:5.2f}x")


if __name__ == "__main__":
    main()
