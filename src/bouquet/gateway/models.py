"""What the gateway knows about each model it fronts: learned from a replica's Info RPC, plus the tokenizer
from the model's directory (matched by name), so requests can be checked and tokenized before any replica."""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

from bouquet.config import DEFAULT_MODEL_PACKAGE
from bouquet.gateway.errors import InvalidRequest, NotFound
from bouquet.gateway.tokenization import ModelTokenizer
from bouquet.model_dir import read_model_dir
from bouquet.proto import embedding_pb2

# The bundled model's directory is called "model"; clients ask for it by its published names.
_BUNDLED_NAMES = ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")


@dataclass(frozen=True)
class ServedModel:
    name: str  # as the replica's Info reports it
    aliases: tuple[str, ...]  # other names a request's `model` may use; the first is the public id
    dimension: int
    max_seq_length: int
    vocab_size: int
    pooling: str
    dtype: str
    max_batch_tokens: int
    prompts: dict[str, str]
    default_prompt_name: str | None
    tokenizer: ModelTokenizer | None  # None: no model directory given for it, token-id input only

    @property
    def id(self) -> str:
        return self.aliases[0] if self.aliases else self.name

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

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
                f"the gateway has no tokenizer for model {self.id!r} (start it with --model DIR); send token ids",
                "no_tokenizer",
                "input",
            )
        return self.tokenizer


class ModelCatalog:
    """Model directories the gateway may tokenize for, by model name, and the models replicas have reported."""

    def __init__(self, model_dirs: tuple[Path, ...], executor: Executor):
        self._dirs = {read_model_dir(path).name: Path(path) for path in model_dirs}
        self._executor = executor
        self._models: dict[str, ServedModel] = {}  # by every name and alias
        self.ordered: list[ServedModel] = []  # in order of discovery; the first is the default

    def register(self, info: embedding_pb2.InfoResponse) -> ServedModel:
        known = self._models.get(info.model_name)
        if known is not None:
            return known
        model = self._create(info)
        for name in model.names:
            self._models.setdefault(name, model)
        self.ordered.append(model)
        return model

    def get(self, name: str | None) -> ServedModel:
        """The model a request names; the default (first discovered) one when it names none."""
        if name is None and self.ordered:
            return self.ordered[0]
        model = self._models.get(name) if name is not None else None
        if model is None:
            known = ", ".join(m.id for m in self.ordered) or "none yet"
            raise NotFound(f"the model {name!r} does not exist; served models: {known}", "model_not_found", "model")
        return model

    def _create(self, info: embedding_pb2.InfoResponse) -> ServedModel:
        path = self._dirs.get(info.model_name)
        tokenizer = None
        if path is not None:
            tokenizer = ModelTokenizer(path / "tokenizer.json", info.max_seq_length, self._executor)
        bundled = path is not None and path.parent.name == DEFAULT_MODEL_PACKAGE
        return ServedModel(
            name=info.model_name, aliases=_BUNDLED_NAMES if bundled else (), dimension=info.dimension,
            max_seq_length=info.max_seq_length, vocab_size=info.vocab_size, pooling=info.pooling, dtype=info.dtype,
            max_batch_tokens=info.max_batch_tokens, prompts=dict(info.prompts),
            default_prompt_name=info.default_prompt_name or None, tokenizer=tokenizer,
        )  # fmt: skip
