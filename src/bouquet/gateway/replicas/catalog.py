"""What the gateway knows about each model it fronts, learned from a replica's Info RPC, and its tokenizer (from
a local model directory of that name, else from Info), so requests are checked and tokenized before any replica."""

from __future__ import annotations

import logging
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

from bouquet.chat_templates import ChatTemplate, TemplateError, read_chat_template
from bouquet.config import DEFAULT_MODEL_PACKAGE
from bouquet.gateway.errors import InvalidRequest, NotFound, Unavailable
from bouquet.gateway.image_processing import ModelImages, model_images
from bouquet.gateway.naflex_images import NaflexProcessing
from bouquet.gateway.replicas.tokenization import ModelTokenizer
from bouquet.image_processor_file import read_image_processor_json
from bouquet.model_dir import ModelSpec, read_model_dir
from bouquet.pair_templates import PairTemplate, pair_template
from bouquet.proto import embedding_pb2
from bouquet.st_messages import StMessages
from bouquet.text_messages import TextMessages
from bouquet.tokenizer import tokenizer_json

logger = logging.getLogger(__name__)

# The bundled model's directory is called "model"; clients ask for it by its published names.
_BUNDLED_NAMES = ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")


_TASK_ROUTES = {
    "embed": ("/v1/embeddings", "/embed", "/v1/contextualizedembeddings"),
    "score": ("/rerank", "/v1/rerank", "/score", "/predict"),
    "sparse": ("/embed_sparse",),
    # ColBERT's per-token vectors, and their MaxSim scores on the reranking routes (docs/late-interaction.md)
    "multi_vector": ("/v1/multi-vector", "/rerank", "/v1/rerank", "/score"),
}


@dataclass(frozen=True)
class ServedModel:
    name: str  # as the replica's Info reports it
    aliases: tuple[str, ...]  # other names a request's `model` may use; the first is the public id
    dimension: int
    max_seq_length: int
    vocab_size: int
    family: str  # the models/ file serving it
    architecture: str
    task: str  # "embed", "score" (a cross-encoder: its rows are raw logits), "sparse" (SPLADE) or "multi_vector"
    score_activation: str
    pooling: str
    normalize: bool  # rows are normalised when a request does not say
    dtype: str
    max_batch_tokens: int
    prompts: dict[str, str]
    default_prompt_name: str | None
    tokenizer: ModelTokenizer | None  # None: the replica sent none and no local directory has it; token ids only
    labels: tuple[str, ...] = ()  # a score model's label names by index (TEI's /predict)
    sparse_dimension: int = 0  # a sparse row's width (SPLADE, bge-m3's sparse head); 0: no sparse rows
    served_names: tuple[str, ...] = ()  # the replica's --served-model-name, each listed by /v1/models
    # How its per-token (ColBERT) vectors are laid out, from Info; None: the model gives none (late_interaction.py)
    multi_vector: embedding_pb2.MultiVector | None = None
    # The images it takes and how they are preprocessed, from Info (image_processing.py); None: it takes none
    images: ModelImages | None = None
    # A text-and-image model's zero-shot logit, exp(logit_scale) x cosine + logit_bias, from Info (zero_shot.py)
    logit_scale: float | None = None
    logit_bias: float | None = None

    @property
    def routes(self) -> str:
        """The routes that serve this model, for errors that send a client elsewhere."""
        served = [*_TASK_ROUTES[self.task]] + (
            ["/embed_sparse", "/encode"] if self.sparse_dimension and self.task != "sparse" else []
        )
        if self.task == "embed" and self.sparse_dimension and self.multi_vector is not None:  # bge-m3's heads
            served.append("/compute_score")
        return ", ".join(served)

    def wrong_task(self, wanted: str) -> InvalidRequest:
        """The 400 (TEI: 424) for a route this model cannot serve, naming its task and the routes it has."""
        message = f"the model {self.id!r} (task {self.task!r}) makes no {wanted}; it is served on {self.routes}"
        return InvalidRequest(message, "wrong_task", "model")

    @property
    def pair_template(self) -> PairTemplate | None:
        """A decoder reranker's prompt template for pairs (pair_templates.py); None: its tokenizer pairs them, or its
        chat template does (a conversation model's, text_messages.py)."""
        if self.conversations:
            return None
        return pair_template(self.architecture, self.task)

    @property
    def conversations(self) -> bool:
        """Whether its texts and pairs are conversations, as sentence-transformers 6 writes them (text_messages.py)."""
        return self.tokenizer is not None and self.tokenizer.messages is not None

    @property
    def id(self) -> str:
        return self.aliases[0] if self.aliases else self.name

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    @property
    def listed_names(self) -> tuple[str, ...]:
        """The names /v1/models lists: each served name, else the id."""
        return self.served_names or (self.id,)

    def prompt(self, prompt_name: str | None) -> str:
        """`prompt_name`'s text, else the model's default prompt, else none."""
        name = prompt_name or self.default_prompt_name
        if name is None:
            return ""
        if name not in self.prompts:
            known = ", ".join(sorted(self.prompts)) or "none"
            raise InvalidRequest(
                f"unknown prompt_name {name!r}; this model's prompts: {known}", "invalid_value", "prompt_name"
            )
        return self.prompts[name]

    def require_tokenizer(self) -> ModelTokenizer:
        if self.tokenizer is None:
            raise InvalidRequest(
                f"the gateway has no tokenizer for model {self.id!r} (its replica sent none; start the gateway "
                "with --model DIR); send token ids",
                "no_tokenizer",
                "input",
            )
        return self.tokenizer


class ModelCatalog:
    """The models replicas have reported, each with its tokenizer: from a local model directory of the same name
    when the gateway was given one, else from the replica's Info."""

    def __init__(self, model_dirs: tuple[Path, ...], executor: Executor):
        self._specs = {spec.name: spec for spec in map(read_model_dir, model_dirs)}
        self._executor = executor
        self._models: dict[str, ServedModel] = {}  # by every name and alias
        # in the order of the gateway's model directories (--model), then of discovery; the first is the default
        self.ordered: list[ServedModel] = []

    def needs_tokenizer(self, info: embedding_pb2.InfoResponse) -> bool:
        """Whether registering `info` needs the tokenizer JSON from the replica (large, so asked only then)."""
        return info.model_name not in self._models and self._local_spec(info) is None

    def register(self, info: embedding_pb2.InfoResponse) -> ServedModel:
        known = self._models.get(info.model_name)
        if known is not None:
            return known
        model = self._create(info)
        for name in model.names:
            other = self._models.setdefault(name, model)
            if other is not model:
                logger.warning("the name %r is %r's already; %r is not served under it", name, other.name, model.name)
        self.ordered.append(model)
        # the default is the first model given, not whichever replica happened to answer first
        given = {name: index for index, name in enumerate(self._specs)}
        self.ordered.sort(key=lambda served: given.get(served.name, len(given)))
        return model

    def get(self, name: str | None) -> ServedModel:
        """The model a request names; the default (the first given, else the first discovered) when it names none."""
        if not self.ordered:
            # Not the client's mistake: the replicas are starting, or cannot be reached (a TLS or token mismatch).
            raise Unavailable("no replica has reported its model yet", "no_healthy_replica", "model")
        if name is None:
            first = next(iter(self._specs), None)  # the default is the first --model, once its replica reports
            if first is not None and first not in self._models:
                message = f"the default model {first!r} is not served yet (still loading?); name another model"
                raise Unavailable(message, "no_healthy_replica", "model")
            return self.ordered[0]
        model = self._models.get(name) if name is not None else None
        if model is None and name in self._specs:  # one of the gateway's models (--model) whose replica is loading
            message = f"the model {name!r} is not served yet: no replica has reported it (still loading?)"
            raise Unavailable(message, "no_healthy_replica", "model")
        if model is None:
            known = ", ".join(m.id for m in self.ordered) or "none yet"
            raise NotFound(f"the model {name!r} does not exist; served models: {known}", "model_not_found", "model")
        return model

    def _local_spec(self, info: embedding_pb2.InfoResponse) -> ModelSpec | None:
        """The local directory of the replica's model: the same name, and the same architecture, width and
        vocabulary, since a name is only a directory's name and two models may share one (the bundled: "model")."""
        spec = self._specs.get(info.model_name)
        served = (info.architecture, info.vocab_size)
        return spec if spec is not None and (spec.architecture, spec.vocab_size) == served else None

    def _create(self, info: embedding_pb2.InfoResponse) -> ServedModel:
        spec = self._local_spec(info)
        if spec is None and info.model_name in self._specs:
            path = self._specs[info.model_name].path
            logger.warning(
                "%s is not the model %r a replica serves; using the replica's tokenizer", path, info.model_name
            )
        source = info.tokenizer_json
        if spec is not None:
            source = tokenizer_json(spec.tokenizer_file, spec.do_lower_case)
        messages = _text_messages(spec, info)
        if messages is not None and info.task == "score" and (failure := messages.pair_failure()) is not None:
            # Every pair is refused (as sentence-transformers refuses them): said once here, not only per request.
            logger.warning(
                "the reranker %r cannot score pairs: its chat template cannot carry one (%s)", info.model_name, failure
            )
        template = None if messages is not None else pair_template(info.architecture, info.task or "embed")
        tokenizer = ModelTokenizer(source, info.max_seq_length, self._executor, template, messages) if source else None
        bundled = spec is not None and spec.path.parent.name == DEFAULT_MODEL_PACKAGE
        served_names = tuple(info.served_names)
        aliases = tuple(dict.fromkeys([*served_names, *(_BUNDLED_NAMES if bundled else ())]))  # served first: the id
        return ServedModel(
            name=info.model_name, aliases=aliases, dimension=info.dimension, served_names=served_names,
            max_seq_length=info.max_seq_length, vocab_size=info.vocab_size, pooling=info.pooling,
            family=info.family, architecture=info.architecture, task=info.task or "embed",
            score_activation=info.score_activation or "Identity", normalize=info.normalize, dtype=info.dtype,
            max_batch_tokens=info.max_batch_tokens,
            prompts=dict(info.prompts), default_prompt_name=info.default_prompt_name or None, tokenizer=tokenizer,
            labels=_labels(spec, info), sparse_dimension=info.sparse_dimension,
            multi_vector=info.multi_vector if info.HasField("multi_vector") else None,
            images=_images(spec, info),
            logit_scale=info.logit_scale if info.HasField("logit_scale") else None,
            logit_bias=info.logit_bias if info.HasField("logit_bias") else None,
        )  # fmt: skip


def _st_messages(info: embedding_pb2.InfoResponse) -> StMessages | None:
    if not info.HasField("st_messages"):
        return None
    sent = info.st_messages
    return StMessages(sent.generation_prompt, sent.flat, tuple(sorted(sent.special_tokens.items())))


def _text_messages(spec: ModelSpec | None, info: embedding_pb2.InfoResponse) -> TextMessages | None:
    """A model's conversation formatting of its texts, where sentence-transformers makes them conversations (Info's
    st_messages: a text model's, or Qwen3-VL-Embedding's, whose texts alone patch_embed.py embeds the same way) and its
    chat template (Info's, else the local directory's): how its texts are tokenized on every route."""
    st = _st_messages(info)
    if st is None:
        return None
    source = info.chat_template
    if not source and spec is not None:
        source = read_chat_template(spec.tokenizer_file.parent)
    if not source:  # the replica refuses such a directory (replica/server.py); one of another release may not
        logger.error("%r takes its texts as chat messages, but sent no chat template: texts as sent", info.model_name)
        return None
    try:
        return TextMessages(ChatTemplate(source), st)
    except TemplateError as error:  # an image model's (the replica refuses a text model's): its images say it too
        logger.error("%r takes its texts as chat messages, but %s: texts as sent", info.model_name, error)
        return None


def _images(spec: ModelSpec | None, info: embedding_pb2.InfoResponse) -> ModelImages | None:
    """The images a model takes, preprocessed as the replica's preprocessor_config.json says (else the local
    directory's); a config the gateway cannot follow is logged, and its image requests are refused saying why."""
    processor_json = info.image_processor_json
    local = spec.tokenizer_file.parent if spec is not None else None
    if not processor_json and local is not None:
        processor_json = read_image_processor_json(local)
    chat_template = info.chat_template
    if info.image_patch_dim and not info.image_sequences and not chat_template and local is not None:
        chat_template = read_chat_template(local)
    images = model_images(
        tuple(info.image_shape),
        info.image_tokens,
        processor_json,
        info.image_patch_dim,
        chat_template,
        info.image_sequences,
        info.image_max_patches,
        _st_messages(info),
    )
    if images is not None and not images.usable:
        logger.warning("%r takes images, but the gateway cannot preprocess them: %s", info.model_name, images.unusable)
    _warn_over_bound(info.model_name, images)
    return images


def _warn_over_bound(name: str, images: ModelImages | None) -> None:
    """SigLIP 2's processor may resize images to more patches than its replicas take: those are refused."""
    if images is None or not isinstance(images.processing, NaflexProcessing) or not images.max_patches:
        return
    most = images.processing.max_num_patches
    if most > images.max_patches:
        logger.warning(
            "%r: its preprocessor_config.json's max_num_patches %d is over the %d patches an image its replicas "
            "take; images that make more are refused",
            name, most, images.max_patches,
        )  # fmt: skip


def _labels(spec: ModelSpec | None, info: embedding_pb2.InfoResponse) -> tuple[str, ...]:
    """A score model's label names: from its local directory's config.json, else transformers' default names (Info
    carries no labels)."""
    if info.task != "score":
        return ()
    if spec is not None and len(spec.labels) == info.dimension:
        return spec.labels
    return tuple(f"LABEL_{index}" for index in range(info.dimension))
