"""Loading a model directory: what it reads, and an error naming the culprit for everything it rejects."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bouquet.config import EngineConfig
from bouquet.engine.engine import Engine
from bouquet.model_dir import PoolingMethod, PoolingSpec, read_model_dir


@pytest.fixture
def model_copy(tmp_path: Path, minilm_path: Path) -> Path:
    target = tmp_path / "minilm"
    shutil.copytree(minilm_path, target)
    return target


def _load(path: Path) -> Engine:
    engine = Engine(EngineConfig(model_path=path, device="cpu", dtype="float32", cpu_warmup_tokens=0))
    engine.close()
    return engine


def _edit_weights(path: Path, edit) -> None:
    weights = load_file(str(path / "model.safetensors"))
    edit(weights)
    save_file(weights, str(path / "model.safetensors"))


def test_reads_the_bundled_model(minilm_path: Path) -> None:
    spec = read_model_dir(minilm_path)
    assert spec.architecture == "BertModel"
    assert spec.pooling == PoolingSpec((PoolingMethod.MEAN,))
    assert spec.normalize is True
    assert spec.max_seq_length == 256  # sentence_bert_config.json, not tokenizer.json's 128
    assert spec.hidden_size == 384


def test_reads_prompts(model_copy: Path) -> None:
    prompts = {"query": "Instruct: find the passage\nQuery: ", "document": ""}
    (model_copy / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": prompts, "default_prompt_name": "query"})
    )
    spec = read_model_dir(model_copy)
    assert spec.prompt() == prompts["query"]
    assert spec.prompt("document") == ""
    with pytest.raises(ValueError, match=r"unknown prompt_name 'passage'.*document, query"):
        spec.prompt("passage")


@pytest.mark.parametrize("file_name", ["config.json", "tokenizer.json", "model.safetensors"])
def test_missing_file_is_named(model_copy: Path, file_name: str) -> None:
    (model_copy / file_name).unlink()
    with pytest.raises(FileNotFoundError, match=file_name.replace(".", r"\.")):
        _load(model_copy)


def test_missing_directory_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"model directory not found: .*nowhere"):
        read_model_dir(tmp_path / "nowhere")


def test_pytorch_bin_weights_load(model_copy: Path) -> None:
    weights = load_file(str(model_copy / "model.safetensors"))
    torch.save(weights, model_copy / "pytorch_model.bin")
    (model_copy / "model.safetensors").unlink()
    assert _load(model_copy).spec.weight_files[0].name == "pytorch_model.bin"


def test_unknown_architecture_is_named(model_copy: Path) -> None:
    config = json.loads((model_copy / "config.json").read_text())
    config["architectures"] = ["GPT2Model"]
    (model_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"config\.json: unknown architecture 'GPT2Model'; supported: .*BertModel.*Qwen3Model"
    ):
        _load(model_copy)


def test_missing_weight_is_named(model_copy: Path) -> None:
    _edit_weights(model_copy, lambda w: w.pop("encoder.layer.3.output.LayerNorm.weight"))
    with pytest.raises(ValueError, match=r"missing weight: encoder\.layer\.3\.output\.LayerNorm\.weight"):
        _load(model_copy)


def test_missing_fused_part_is_named(model_copy: Path) -> None:
    _edit_weights(model_copy, lambda w: w.pop("encoder.layer.1.attention.self.key.bias"))
    with pytest.raises(ValueError, match=r"missing weight: encoder\.layer\.1\.attention\.self\.key\.bias"):
        _load(model_copy)


def test_unused_weight_is_named(model_copy: Path) -> None:
    _edit_weights(model_copy, lambda w: w.update({"encoder.layer.0.extra.weight": torch.zeros(3)}))
    with pytest.raises(ValueError, match=r"unused weight in checkpoint: encoder\.layer\.0\.extra\.weight"):
        _load(model_copy)


def test_misshaped_weight_is_named(model_copy: Path) -> None:
    _edit_weights(model_copy, lambda w: w.update({"embeddings.LayerNorm.bias": torch.zeros(383)}))
    with pytest.raises(ValueError, match=r"weight embeddings\.LayerNorm\.bias has shape \(383,\).*\(384,\)"):
        _load(model_copy)


def test_unsupported_pooling_is_named(model_copy: Path) -> None:
    config_path = model_copy / "1_Pooling" / "config.json"
    config = json.loads(config_path.read_text())
    config.update(pooling_mode="splade")
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported pooling 'splade'; supported: cls, max, mean"):
        read_model_dir(model_copy)


def test_a_config_in_another_form_is_named(model_copy: Path) -> None:
    config = json.loads((model_copy / "config.json").read_text())
    config["n_embd"] = config.pop("hidden_size")  # as remote-code configs (nomic's first release) spell it
    (model_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json has no 'hidden_size'"):
        read_model_dir(model_copy)
