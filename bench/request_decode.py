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

Last, `/v1/embeddings`' two forms (the text form's `input`, vLLM's chat form's `messages`), strict and with
--allow-unknown-fields: the route's one decode (`openai.EMBEDDING_BODIES`) against what it did before, the text
form's struct, and on its report (`messages` unknown, `input` missing) the chat form's, alternated body by body.

Times are the thread's CPU time (the machine is shared: wall time would count the other processes' turns).

    .venv/bin/python bench/request_decode.py [--repeats 50] [--forms-only]
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
from bouquet.gateway.api import multimodal, openai, tei, tei_bodies, tei_scores
from bouquet.gateway.api.openai import parse_openai
from bouquet.gateway.errors import ApiError
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


def openai_forms(texts: list[str]) -> dict[str, bytes]:
    """`/v1/embeddings` bodies of both forms, keys in the order vLLM's examples send them."""
    image = "data:image/png;base64," + "iVBORw0KGgo" * 20_000  # the size of a ~160 KB image, as base64 sends it
    chat = lambda content: orjson.dumps({"model": "m", "messages": [{"role": "user", "content": content}],  # noqa: E731
                                         "encoding_format": "float"})  # fmt: skip
    return {
        "text form, 1 text": orjson.dumps({"model": "m", "input": texts[0], "encoding_format": "float"}),
        f"text form, {INPUTS} texts": orjson.dumps({"model": "m", "input": texts, "encoding_format": "float"}),
        "chat form, 1 text": chat(texts[0]),
        "chat form, 1 image": chat([{"type": "image_url", "image_url": {"url": image}}]),
    }


def two_passes(strict: bool) -> Callable[[bytes], object]:
    """`/v1/embeddings`' decode before: the text form's struct, then on its report the chat form's."""

    def decode(body: bytes) -> object:
        try:
            return openai.EMBEDDINGS.decode(body, strict)
        except ApiError:
            return multimodal.CHAT_EMBEDDINGS.decode(body, strict)

    return decode


def median_ms(decode: Callable[[bytes], object], body: bytes, repeats: int) -> float:
    return alternated_ms([decode], body, repeats)[0]


def alternated_ms(decodes: list[Callable[[bytes], object]], body: bytes, repeats: int) -> list[float]:
    """Each decode's median thread CPU time (ms) on `body`, the decodes taking turns on each repeat."""
    for decode in decodes:
        decode(body)  # warm: caches, lazy schema builds
    times: list[list[float]] = [[] for _ in decodes]
    for _ in range(repeats):
        for decode, spent in zip(decodes, times, strict=True):
            started = time.thread_time()
            decode(body)
            spent.append(time.thread_time() - started)
    return [1000 * statistics.median(spent) for spent in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--forms-only", action="store_true", help="only /v1/embeddings' two forms")
    args = parser.parse_args()
    print(f"CPU: {cpu_features().describe()}; msgspec {msgspec.__version__}, pydantic {pydantic.VERSION}, "
          f"orjson {orjson.__version__}; median of {args.repeats}, ms per body")  # fmt: skip
    texts = orjson.loads(bodies()["texts"])["input"]
    if not args.forms_only:
        compare_decoders(args.repeats, texts)
    openai_two_forms(args.repeats, texts)


def compare_decoders(repeats: int, texts: list[str]) -> None:
    for kind, body in bodies().items():
        results = {name: median_ms(decode, body, repeats) for name, decode in decoders().items()}
        first = next(iter(results.values()))
        print(f"\n{kind}: {INPUTS} inputs, {len(body) / 1e6:.2f} MB")
        for name, ms in results.items():
            print(f"  {name:32} {ms:8.2f} ms   {first / ms:5.2f}x the route's")
    print(f"\nroutes of two shapes, {INPUTS} texts:")
    for route, (body, once, twice) in two_shapes(texts).items():
        one, two = median_ms(once, body, repeats), median_ms(twice, body, repeats)
        print(f"  {route:20} decoded once {one:6.2f} ms, probed then decoded {two:6.2f} ms: {two / one:5.2f}x")


def openai_two_forms(repeats: int, texts: list[str]) -> None:
    for strict in (True, False):
        print(f"\n/v1/embeddings' two forms{'' if strict else ', --allow-unknown-fields'} (ms per body):")
        for form, body in openai_forms(texts).items():
            once = lambda body, strict=strict: openai.EMBEDDING_BODIES.decode(body, strict)  # noqa: E731
            one, two = alternated_ms([once, two_passes(strict)], body, repeats)
            print(f"  {form:22} one decode {one:8.4f}, before {two:8.4f}: {two / one:5.2f}x")


if __name__ == "__main__":
    main()
