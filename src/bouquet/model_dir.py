"""Reads a local Hugging Face / sentence-transformers model directory.

Only JSON and file listing happen here, never torch, so the gateway can use it to learn prompts and limits.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class PoolingMethod(enum.Enum):
    CLS = "cls"
    MEAN = "mean"
    LAST = "last"


# sentence-transformers' 1_Pooling/config.json flag -> our method.
_POOLING_FLAGS = {
    "pooling_mode_cls_token": PoolingMethod.CLS,
    "pooling_mode_mean_tokens": PoolingMethod.MEAN,
    "pooling_mode_lasttoken": PoolingMethod.LAST,
}
_UNSUPPORTED_POOLING_FLAGS = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True)
class ModelSpec:
    """Everything about a model directory that is not a weight."""

    path: Path
    name: str
    hf_config: dict[str, Any]
    weight_files: tuple[Path, ...]
    tokenizer_file: Path
    pooling: PoolingMethod
    normalize: bool
    max_seq_length: int
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None

    @property
    def architecture(self) -> str:
        return self.hf_config["architectures"][0]

    @property
    def hidden_size(self) -> int:
        return int(self.hf_config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    def prompt(self, prompt_name: str | None = None) -> str:
        """The text put before each input: `prompt_name`'s prompt, else the model's default, else none."""
        name = prompt_name or self.default_prompt_name
        if name is None:
            return ""
        if name not in self.prompts:
            known = ", ".join(sorted(self.prompts)) or "none"
            raise ValueError(f"unknown prompt_name {name!r}; this model's prompts: {known}")
        return self.prompts[name]


def read_model_dir(path: str | Path, name: str | None = None) -> ModelSpec:
    """Reads a model directory; raises FileNotFoundError or ValueError naming what is wrong."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"model directory not found: {root}")
    hf_config = _read_json(_require(root / "config.json"))
    if not hf_config.get("architectures"):
        raise ValueError(f"{root / 'config.json'} has no 'architectures' entry")
    modules = _read_optional_json(root / "modules.json") or []
    st_config = _read_optional_json(root / "config_sentence_transformers.json") or {}
    return ModelSpec(
        path=root,
        name=name or root.name,
        hf_config=hf_config,
        weight_files=_find_weights(root),
        tokenizer_file=_require(root / "tokenizer.json"),
        pooling=_read_pooling(root, modules, hf_config),
        normalize=any(module.get("type") == _NORMALIZE_MODULE for module in modules),
        max_seq_length=_read_max_seq_length(root, hf_config),
        prompts=dict(st_config.get("prompts") or {}),
        default_prompt_name=st_config.get("default_prompt_name"),
    )


def _require(path: Path) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"model file missing: {path}")
    return path


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc


def _read_optional_json(path: Path) -> Any:
    return _read_json(path) if path.is_file() else None


def _find_weights(root: Path) -> tuple[Path, ...]:
    shards = sorted(root.glob("model-*-of-*.safetensors"))
    if shards:
        return tuple(shards)
    for file_name in _WEIGHT_FILES:
        if (root / file_name).is_file():
            return (root / file_name,)
    raise FileNotFoundError(f"model weights missing in {root}: expected one of {', '.join(_WEIGHT_FILES)}")


def _read_pooling(root: Path, modules: list[dict[str, Any]], hf_config: dict[str, Any]) -> PoolingMethod:
    pooling_module = next((m for m in modules if m.get("type", "").endswith("models.Pooling")), None)
    if pooling_module is None:
        # No sentence-transformers metadata: decoders embed with their last token, encoders with CLS.
        is_decoder = hf_config.get("model_type", "").startswith("qwen")
        return PoolingMethod.LAST if is_decoder else PoolingMethod.CLS
    config_path = _require(root / pooling_module.get("path", "1_Pooling") / "config.json")
    config = _read_json(config_path)
    if "pooling_mode" in config:
        return _parse_pooling_name(config["pooling_mode"], config_path)
    for flag in _UNSUPPORTED_POOLING_FLAGS:
        if config.get(flag):
            raise ValueError(f"{config_path}: unsupported pooling {flag}; supported: cls, mean, last")
    chosen = [method for flag, method in _POOLING_FLAGS.items() if config.get(flag)]
    if len(chosen) != 1:
        raise ValueError(f"{config_path}: expected exactly one pooling mode, found {len(chosen)}")
    return chosen[0]


def _parse_pooling_name(name: str, source: Path) -> PoolingMethod:
    aliases = {"cls": "cls", "mean": "mean", "lasttoken": "last", "last": "last"}
    if name not in aliases:
        raise ValueError(f"{source}: unsupported pooling {name!r}; supported: cls, mean, last")
    return PoolingMethod(aliases[name])


def _read_max_seq_length(root: Path, hf_config: dict[str, Any]) -> int:
    # sentence_bert_config.json holds the length the model was trained for; tokenizer.json's truncation
    # (128 for all-MiniLM-L6-v2) is a leftover of export and must not win.
    st_config = _read_optional_json(root / "sentence_bert_config.json") or {}
    limits = [st_config.get("max_seq_length"), hf_config.get("max_position_embeddings")]
    known = [int(limit) for limit in limits if limit]
    if not known:
        raise ValueError(f"{root}: no max_seq_length or max_position_embeddings to bound sequence length")
    return min(known)
