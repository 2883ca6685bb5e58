"""Each kind of report msgspec gives while decoding a body into its route's struct (http/decode.py) is answered as
the route's own error: its class (status), code, and the offending field's path in `param`; with
--allow-unknown-fields the lenient twin ignores a field no struct declares, at the top and inside TEI's similarity
parameters, while what a struct always refuses (Jina's image inputs) stays refused. No server: the decoders alone."""

from __future__ import annotations

import orjson
import pytest

from bouquet.gateway.api import cohere, jina, openai, perplexity, tei_bodies, vllm
from bouquet.gateway.errors import ApiError, InvalidRequest, Unprocessable
from bouquet.gateway.http.decode import BodyDecoder, present

REFUSED = [
    # (decoder, body, error class, code, param)
    (openai.EMBEDDINGS, {"input": "a", "x": 1}, InvalidRequest, "unsupported_parameter", "x"),
    (openai.EMBEDDINGS, {"model": "m"}, InvalidRequest, "missing_required_parameter", "input"),
    (openai.EMBEDDINGS, {"input": ["a", True]}, Unprocessable, "invalid_type", "input[1]"),
    (openai.EMBEDDINGS, {"input": ["a", ""]}, InvalidRequest, "empty_input", "input[1]"),
    (openai.EMBEDDINGS, {"input": [[1], []]}, InvalidRequest, "empty_input", "input[1]"),
    (openai.EMBEDDINGS, {"input": "a", "dimensions": 1.5}, Unprocessable, "invalid_type", "dimensions"),
    (tei_bodies.SIMILARITY, {"inputs": {"source_sentence": "a"}}, InvalidRequest, "missing_required_parameter",
     "inputs.sentences"),
    (tei_bodies.SIMILARITY, {"inputs": {"source_sentence": "a", "sentences": ["b"]}, "parameters": {"x": 1}},
     InvalidRequest, "unsupported_parameter", "parameters.x"),
    (tei_bodies.SIMILARITY, {"inputs": "a"}, Unprocessable, "invalid_type", "inputs"),
    (cohere.V1_RERANK, {"query": "q", "documents": [{"title": "t"}]}, InvalidRequest,
     "missing_required_parameter", "documents[0].text"),
    (cohere.V1_RERANK, {"query": "q", "documents": ["a"], "top_n": 0}, InvalidRequest, "invalid_value", "top_n"),
    (perplexity.CONTEXTUAL, {"input": [["a"], []]}, InvalidRequest, "empty_input", "input[1]"),
    (vllm.DETOKENIZE, {"tokens": [1, "2"]}, Unprocessable, "invalid_type", "tokens[1]"),
]  # fmt: skip


@pytest.mark.parametrize(("decoder", "body", "kind", "code", "param"), REFUSED)
def test_each_report_is_the_routes_error(
    decoder: BodyDecoder, body: dict, kind: type[ApiError], code: str, param: str
) -> None:
    with pytest.raises(kind) as raised:
        decoder.decode(orjson.dumps(body))
    assert (type(raised.value), raised.value.code, raised.value.param) == (kind, code, param)
    assert param.split(".")[-1].split("[")[0] in raised.value.message  # the message names the field too


def test_a_body_that_is_not_an_object_or_not_json() -> None:
    with pytest.raises(Unprocessable, match="JSON object"):
        openai.EMBEDDINGS.decode(b"[1, 2]")
    with pytest.raises(InvalidRequest) as raised:
        openai.EMBEDDINGS.decode(b'{"input": "a",')
    assert raised.value.code == "invalid_json"


def test_unknown_fields_are_ignored_leniently_but_not_jinas_image_inputs() -> None:
    similarity = {"inputs": {"source_sentence": "a", "sentences": ["b"]}, "parameters": {"x": 1}, "y": 2}
    assert tei_bodies.SIMILARITY.decode(orjson.dumps(similarity), strict=False).inputs.sentences == ["b"]
    assert openai.EMBEDDINGS.decode(orjson.dumps({"input": "a", "x": 1}), strict=False).input == "a"
    image = {"input": [{"text": "a", "image": "data:..."}], "x": 1}
    with pytest.raises(InvalidRequest) as raised:
        jina.MULTI_VECTOR.decode(orjson.dumps(image), strict=False)
    assert (raised.value.code, raised.value.param) == ("unsupported_parameter", "input[0].image")


def test_a_route_of_two_shapes_sees_which_fields_are_there() -> None:
    assert present(b'{"inputs": {"source_sentence": "a"}, "x": [1]}') == {"inputs": b"{"}
    assert present(b'{"query": "q", "documents": ["a"]}') == {"documents": b"["}
    assert present(b'{"prompt": "a"}') == {"prompt": b'"'}
