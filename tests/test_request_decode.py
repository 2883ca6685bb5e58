"""Each kind of report msgspec gives while decoding a body into its route's struct (http/decode.py) is answered as
the route's own error: its class (status), code, and the offending field's path in `param`; with
--allow-unknown-fields the lenient twin ignores a field no struct declares, at the top and inside TEI's similarity
parameters, while what a struct always refuses (Jina's image inputs) stays refused. No server: the decoders alone."""

from __future__ import annotations

import orjson
import pytest

from bouquet.gateway.api import cohere, jina, multimodal, openai, perplexity, tei, tei_bodies, tei_scores, vllm
from bouquet.gateway.errors import ApiError, InvalidRequest, Unprocessable
from bouquet.gateway.http.decode import BodyDecoder, EitherDecoder, present

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


# Routes of two shapes decode the body once (http/decode.EitherDecoder), into the struct of its shape.


def test_each_shape_comes_out_as_its_own_struct() -> None:
    root = tei.ROOT.decode(orjson.dumps({"inputs": ["a", "b"], "normalize": False}))
    assert isinstance(root, tei_bodies.TEIEmbedRequest) and (root.inputs, root.normalize) == (["a", "b"], False)
    assert root.truncate is None and root.model is None  # defaults as the struct's own
    similarity = tei.ROOT.decode(orjson.dumps({"inputs": {"source_sentence": "a", "sentences": ["b"]}}))
    assert isinstance(similarity, tei_bodies.SimilarityRequest) and similarity.inputs.sentences == ["b"]
    rerank = tei_scores.RERANK_BODIES.decode(orjson.dumps({"query": "q", "documents": ["a"], "top_n": 1}))
    assert isinstance(rerank, cohere.CohereRerankRequest) and rerank.top_n == 1
    assert isinstance(tei_scores.RERANK_BODIES.decode(b'{"query": "q", "texts": ["a"]}'), tei_bodies.TEIRerankRequest)
    assert isinstance(tei.TOKENIZE_BODIES.decode(b'{"prompt": "a"}'), vllm.VLLMTokenizeRequest)
    assert isinstance(tei.TOKENIZE_BODIES.decode(b'{"inputs": "a"}'), tei_bodies.TEITokenizeRequest)


TWO_SHAPES_REFUSED = [
    # (decoder, body, error class, code, param)
    (tei_scores.RERANK_BODIES, {"query": "q", "texts": ["a"], "documents": ["b"]}, InvalidRequest,
     "unsupported_parameter", "texts"),  # a field of the other shape, refused by name
    (tei_scores.RERANK_BODIES, {"query": "q", "texts": ["a"], "top_n": 1}, InvalidRequest, "unsupported_parameter",
     "top_n"),
    (tei_scores.RERANK_BODIES, {"texts": ["a"]}, InvalidRequest, "missing_required_parameter", "query"),
    (tei_scores.RERANK_BODIES, {"query": "q"}, InvalidRequest, "missing_required_parameter", "texts"),
    (tei_scores.RERANK_BODIES, {"query": "q", "texts": ["a"], "x": 1}, InvalidRequest, "unsupported_parameter", "x"),
    (tei.ROOT, {"inputs": {"source_sentence": "a", "sentences": ["b"]}, "normalize": True}, InvalidRequest,
     "unsupported_parameter", "normalize"),
    (tei.ROOT, {"inputs": "a", "parameters": {}}, InvalidRequest, "unsupported_parameter", "parameters"),
    (tei.ROOT, {"inputs": {"source_sentence": "a"}}, InvalidRequest, "missing_required_parameter",
     "inputs.sentences"),
    (tei.ROOT, {"inputs": 5}, Unprocessable, "invalid_type", "inputs"),
    # both shapes take add_special_tokens, TEI's as a boolean and vLLM's as a boolean or null: checked as the shape's
    (tei.TOKENIZE_BODIES, {"inputs": "a", "add_special_tokens": None}, Unprocessable, "invalid_type",
     "add_special_tokens"),
    (tei.TOKENIZE_BODIES, {"prompt": "a", "add_special_tokens": 1}, Unprocessable, "invalid_type",
     "add_special_tokens"),
]  # fmt: skip


@pytest.mark.parametrize(("decoder", "body", "kind", "code", "param"), TWO_SHAPES_REFUSED)
def test_a_body_of_two_shapes_is_refused_as_its_shape_refuses(
    decoder: EitherDecoder, body: dict, kind: type[ApiError], code: str, param: str
) -> None:
    with pytest.raises(kind) as raised:
        decoder.decode(orjson.dumps(body))
    assert (type(raised.value), raised.value.code, raised.value.param) == (kind, code, param)


def test_a_body_of_two_shapes_leniently_ignores_the_other_shapes_fields() -> None:
    body = {"query": "q", "texts": ["a"], "top_n": 1, "x": 2}
    parsed = tei_scores.RERANK_BODIES.decode(orjson.dumps(body), strict=False)
    assert isinstance(parsed, tei_bodies.TEIRerankRequest) and parsed.texts == ["a"]
    assert tei.TOKENIZE_BODIES.decode(b'{"prompt": "a", "add_special_tokens": null}').add_special_tokens is None


# `/v1/embeddings` takes the text form and vLLM's chat form (`messages`): one decode (openai.EMBEDDING_BODIES), where
# it took two for the chat form before: the text form's struct, then on its report the chat form's (`two_passes`).
def two_passes(body: bytes, strict: bool = True) -> object:
    try:
        return openai.EMBEDDINGS.decode(body, strict)
    except ApiError as error:
        if (error.code, error.param) not in {("unsupported_parameter", "messages"),
                                             ("missing_required_parameter", "input")}:  # fmt: skip
            raise
        try:
            return multimodal.CHAT_EMBEDDINGS.decode(body, strict)
        except ApiError as chat_error:
            if (chat_error.code, chat_error.param) == ("missing_required_parameter", "messages"):
                raise error from None
            raise


CHAT = {"role": "user", "content": "a query"}
IMAGE = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}}]}
BOTH_FORMS = [
    {"input": "a", "model": "m", "dimensions": 8, "encoding_format": "base64", "normalize": False},
    {"input": [[1, 2], [3]], "truncate_prompt_tokens": 4},
    {"model": "m", "messages": [CHAT], "encoding_format": "float", "dimensions": 8, "embed_dtype": "int8"},
    {"messages": [IMAGE], "user": "u", "normalize": True},
]
BOTH_FORMS_REFUSED = [
    {"model": "m"},  # neither form: the text form's missing input
    {"messages": [CHAT], "truncate_prompt_tokens": 4},  # the text form's field in the chat form
    {"input": "a", "x": 1},
    {"messages": [CHAT], "x": 1},
    {"x": 1, "messages": [CHAT]},
    {"messages": []},
    {"messages": [{"role": "user", "content": []}]},
    {"messages": [{"content": "a"}]},
    {"messages": "a"},
    {"messages": [CHAT], "dimensions": "8"},
    {"messages": [CHAT], "normalize": 1},
    {"input": "a", "dimensions": 1.5},
    {"input": ["a", ""]},
    {"input": ["a", True]},
]


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "lenient"])
@pytest.mark.parametrize("body", BOTH_FORMS, ids=lambda body: "chat" if "messages" in body else "text")
def test_both_embedding_forms_decode_once_into_their_struct(body: dict, strict: bool) -> None:
    raw = orjson.dumps(body)
    assert openai.EMBEDDING_BODIES.decode(raw, strict) == two_passes(raw, strict)


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "lenient"])
@pytest.mark.parametrize("body", BOTH_FORMS_REFUSED, ids=lambda body: orjson.dumps(body).decode())
def test_both_embedding_forms_are_refused_as_before(body: dict, strict: bool) -> None:
    raw = orjson.dumps(body)
    try:
        expected: object = two_passes(raw, strict)
    except ApiError as error:
        expected = (type(error), error.code, error.param)
    try:
        found: object = openai.EMBEDDING_BODIES.decode(raw, strict)
    except ApiError as error:
        assert (error.param or "").split(".")[-1].split("[")[0] in error.message  # the message names the field
        found = (type(error), error.code, error.param)
    assert found == expected


def test_messages_decide_the_form_of_a_body_with_both() -> None:
    # refused by name as before; with --allow-unknown-fields the chat form is read and `input` ignored (before, the
    # text form's decode came first and ignored `messages`): `messages` is what tells the forms apart, in one place
    raw = orjson.dumps({"input": "a", "messages": [CHAT]})
    with pytest.raises(InvalidRequest) as raised:
        openai.EMBEDDING_BODIES.decode(raw)
    assert (raised.value.code, raised.value.param) == ("unsupported_parameter", "input")
    with pytest.raises(InvalidRequest) as before:
        two_passes(raw)
    assert (before.value.code, before.value.param) == ("unsupported_parameter", "input")
    assert openai.EMBEDDING_BODIES.decode(raw, strict=False) == multimodal.CHAT_EMBEDDINGS.decode(raw, strict=False)
