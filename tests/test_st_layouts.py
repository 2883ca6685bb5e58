"""Model directories in every sentence-transformers layout in use, served as sentence-transformers computes them.

Each case runs `bouquet embed` (the real command, in process) and sentence-transformers on the same texts: short
ones, ones over the model's limit, non-ASCII, with and without a prompt. Rows must agree by cosine (float32
>= 0.99999, bfloat16 >= 0.999 against the float32 reference) and by length (a model without Normalize
returns raw rows).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import row_cosines
from family_models import save_sentence_transformer
from st_models import tiny_bert, to_legacy_layout
from torch import nn

from bouquet.cli import main as bouquet
from bouquet.config import EngineConfig
from bouquet.engine.engine import Engine
from bouquet.model_dir import read_model_dir

BOUNDS = {"float32": 0.99999, "bfloat16": 0.999}
TEXTS = [
    "A short query.",
    "Packed sequences need no padding; " * 60,  # over every limit used here
    "Ünïcödé façade, naïve café: 東京で会いましょう.",
    "one",
    "The scheduler cuts batches by a token budget and runs them first come, first served.",
]
# Parity tests check numbers: oneDNN's primitives are built as steps meet them, not all at start (a second per
# engine; the warm-up itself is tested in test_memory.py).
NO_WARMUP = ["--cpu-warmup-tokens", "0"]
PROMPTS = {"query": "Represent this sentence for searching relevant passages: ", "document": ""}


def embed_with_bouquet(tmp_path: Path, model: Path, dtype: str, prompt_name: str | None = None) -> np.ndarray:
    source = tmp_path / "texts.jsonl"
    source.write_text("".join(json.dumps({"text": text}) + "\n" for text in TEXTS))
    out = tmp_path / "rows.npy"
    args = [
        "embed",
        str(source),
        "-o",
        str(out),
        "--model",
        str(model),
        "--dtype",
        dtype,
        "--device",
        "cpu",
        *NO_WARMUP,
    ]
    assert bouquet([*args, *(["--prompt-name", prompt_name] if prompt_name else [])]) == 0
    return np.load(out)


def embed_with_sentence_transformers(model: Path, prompt_name: str | None = None) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(model), device="cpu")
    return reference.encode(TEXTS, prompt_name=prompt_name, convert_to_numpy=True)


def assert_same_rows(rows: np.ndarray, expected: np.ndarray, dtype: str) -> None:
    cosines = row_cosines(rows, expected)
    assert cosines.min() >= BOUNDS[dtype], f"min cosine {cosines.min():.7f}"
    lengths = np.linalg.norm(rows, axis=1) / np.linalg.norm(expected, axis=1)
    np.testing.assert_allclose(lengths, 1.0, rtol=1e-3 if dtype == "float32" else 2e-2)


@pytest.fixture(scope="module")
def minilm_current(tmp_path_factory, minilm_path: Path) -> Path:
    """The bundled MiniLM re-saved by the installed sentence-transformers, as a user's own model would be."""
    from sentence_transformers import SentenceTransformer

    out = tmp_path_factory.mktemp("minilm") / "minilm-current"
    SentenceTransformer(str(minilm_path), device="cpu").save(str(out))
    return out


@pytest.fixture(scope="module")
def tiny_with_dense(tmp_path_factory, minilm_path: Path) -> Path:
    """A random BERT with two Dense modules, no Normalize, prompts left out of the pooling, a 40-token limit."""
    root = tmp_path_factory.mktemp("tiny")
    dense = [
        {"out_features": 48, "activation_function": nn.Tanh()},
        {"out_features": 32, "bias": False, "activation_function": nn.Identity()},
    ]
    return save_sentence_transformer(
        root / "current", tiny_bert(root / "hf", minilm_path), pooling_mode="mean", include_prompt=False,
        dense=dense, normalize=False, prompts=PROMPTS, max_seq_length=40,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_minilm_saved_by_current_sentence_transformers(tmp_path, minilm_current: Path, minilm_path, dtype) -> None:
    modules = json.loads((minilm_current / "modules.json").read_text())
    assert modules[1]["type"] != "sentence_transformers.models.Pooling"  # the layout that was served wrong
    assert "max_seq_length" not in json.loads((minilm_current / "sentence_bert_config.json").read_text())
    assert read_model_dir(minilm_current).max_seq_length == 256  # from tokenizer_config.json
    expected = embed_with_sentence_transformers(minilm_path)
    assert_same_rows(embed_with_bouquet(tmp_path, minilm_current, dtype), expected, dtype)


POOLINGS = {
    "cls": {"pooling_mode": "cls"},
    "max": {"pooling_mode": "max"},
    "mean_sqrt_len_tokens": {"pooling_mode": "mean_sqrt_len_tokens"},
    "weightedmean": {"pooling_mode": "weightedmean"},
    "lasttoken": {"pooling_mode": "lasttoken"},
    "cls+mean+max": {"pooling_mode": ["cls", "mean", "max"]},
    "mean without the prompt": {"pooling_mode": "mean", "include_prompt": False},
    "weightedmean without the prompt": {"pooling_mode": "weightedmean", "include_prompt": False},
    "cls without the prompt": {"pooling_mode": "cls", "include_prompt": False},
}


@pytest.mark.parametrize("pooling", list(POOLINGS))
def test_every_pooling_mode_on_real_weights(tmp_path, minilm_current: Path, pooling: str) -> None:
    model = tmp_path / "model"
    shutil.copytree(minilm_current, model)
    config_file = model / "1_Pooling" / "config.json"
    config_file.write_text(json.dumps({"embedding_dimension": 384, **POOLINGS[pooling]}))
    st_config = json.loads((model / "config_sentence_transformers.json").read_text())
    st_config["prompts"] = PROMPTS
    (model / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    expected = embed_with_sentence_transformers(model, "query")
    assert_same_rows(embed_with_bouquet(tmp_path, model, "float32", "query"), expected, "float32")


LAYOUTS = ["current", "legacy", "legacy in 0_Transformer"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("prompt_name", [None, "query"])
def test_dense_chain_without_normalize(tmp_path, tiny_with_dense: Path, layout: str, dtype: str, prompt_name) -> None:
    model = tiny_with_dense
    if layout != "current":
        model = to_legacy_layout(tiny_with_dense, tmp_path / "legacy", 40, transformer_subdir=layout != "legacy")
    spec = read_model_dir(model)
    assert (len(spec.dense), spec.normalize, spec.max_seq_length) == (2, False, 40)
    expected = embed_with_sentence_transformers(tiny_with_dense, prompt_name)  # the float32 reference
    assert_same_rows(embed_with_bouquet(tmp_path, model, dtype, prompt_name), expected, dtype)


def test_legacy_layout_loads_the_same_in_sentence_transformers(tmp_path, tiny_with_dense: Path) -> None:
    """The legacy rewrite is a real old layout: sentence-transformers reads it to the same rows."""
    legacy = to_legacy_layout(tiny_with_dense, tmp_path / "legacy", 40, transformer_subdir=True)
    expected = embed_with_sentence_transformers(tiny_with_dense, "query")
    np.testing.assert_allclose(embed_with_sentence_transformers(legacy, "query"), expected, rtol=1e-5, atol=1e-6)


def test_limit_without_sentence_transformers_metadata(tmp_path, minilm_path: Path) -> None:
    model = tiny_bert(tmp_path / "bare", minilm_path, max_positions=96)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("model_max_length")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    spec = read_model_dir(model)
    assert (spec.max_seq_length, spec.pooling, spec.normalize) == (96, None, True)
    engine = Engine(EngineConfig(model_path=model, device="cpu", dtype="float32", cpu_warmup_tokens=0))
    engine.close()
    assert engine.pooler.spec.name == "mean"  # BERT's default, as sentence-transformers pools a bare encoder


def _edit_json(path: Path, edit) -> None:
    value = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps(edit(value) or value))


def _module(kind: str, path: str, index: int) -> dict[str, object]:
    return {"idx": index, "name": str(index), "path": path, "type": f"sentence_transformers.models.{kind}"}


REFUSALS = {
    "an unknown module": (
        lambda m: _edit_json(m / "modules.json", lambda mods: [*mods, _module("LayerNorm", "3_LayerNorm", 3)]),
        r"modules\.json: module 3 \('sentence_transformers\.models\.LayerNorm'.*not supported",
    ),
    "a second Pooling": (
        lambda m: _edit_json(m / "modules.json", lambda mods: [*mods[:2], _module("Pooling", "1_Pooling", 2)]),
        r"modules\.json: module 2 \('sentence_transformers\.models\.Pooling'.*expected Dense or Normalize",
    ),
    "Normalize before Pooling": (
        lambda m: _edit_json(m / "modules.json", lambda mods: [mods[0], {**mods[2], "idx": 1}, {**mods[1], "idx": 2}]),
        r"modules\.json: module 1 .*Normalize.*expected Pooling",
    ),
    "a classification transformer": (
        lambda m: _edit_json(m / "sentence_bert_config.json", lambda c: c.update(transformer_task="text-generation")),
        r"sentence_bert_config\.json: transformer_task 'text-generation'",
    ),
    "a causal LM's logits pooled": (
        lambda m: _edit_json(
            m / "sentence_bert_config.json",
            lambda c: c.update(transformer_task="text-generation", module_output_name="causal_logits"),
        ),
        r"modules\.json: module 1 .*Pooling.*expected LogitScore",
    ),
    "an unknown pooling mode": (
        lambda m: _edit_json(m / "1_Pooling" / "config.json", lambda c: c.update(pooling_mode="splade")),
        r"1_Pooling/config\.json: unsupported pooling 'splade'",
    ),
    "no Transformer": (
        lambda m: _edit_json(m / "modules.json", lambda mods: mods[1:]),
        r"modules\.json: module 0 .*Pooling.*expected Transformer",
    ),
    "a token-level Normalize": (
        lambda m: _edit_json(
            m / "2_Normalize" / "config.json", lambda c: c.update(module_input_name="token_embeddings")
        ),
        r"2_Normalize/config\.json: a Normalize over 'token_embeddings' is not supported",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_module_it_cannot_run_is_refused_naming_the_file(tmp_path, minilm_current: Path, case: str) -> None:
    model = tmp_path / "model"
    shutil.copytree(minilm_current, model)
    edit, message = REFUSALS[case]
    edit(model)
    with pytest.raises(ValueError, match=message):
        read_model_dir(model)


DENSE_REFUSALS = {
    "an unsupported activation": (
        lambda d: _edit_json(d / "config.json", lambda c: c.update(activation_function="torch.nn.modules.Softmax")),
        r"3_Dense/config\.json: activation_function 'torch\.nn\.modules\.Softmax' is not supported",
    ),
    "a width that does not chain": (
        lambda d: _edit_json(d / "config.json", lambda c: c.update(in_features=40)),
        r"Dense module 1 \(.*3_Dense\) takes 40 features, but what comes before it gives 48",
    ),
    "a missing weight": (
        lambda d: (d / "model.safetensors").unlink(),
        r"model weights missing in .*3_Dense",
    ),
}


@pytest.mark.parametrize("case", list(DENSE_REFUSALS))
def test_a_dense_module_it_cannot_run_is_refused(tmp_path, tiny_with_dense: Path, case: str) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_with_dense, model)
    edit, message = DENSE_REFUSALS[case]
    edit(model / "3_Dense")
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        Engine(EngineConfig(model_path=model, device="cpu", dtype="float32", cpu_warmup_tokens=0)).close()


def test_refusal_stops_bouquet_embed_with_the_message(tmp_path, minilm_current: Path, capsys) -> None:
    model = tmp_path / "model"
    shutil.copytree(minilm_current, model)
    _edit_json(model / "modules.json", lambda mods: [*mods, _module("WordWeights", "3_WordWeights", 3)])
    source = tmp_path / "texts.txt"
    source.write_text("hello\n")
    assert bouquet(["embed", str(source), "-o", str(tmp_path / "out.npy"), "--model", str(model)]) == 2
    assert "WordWeights" in capsys.readouterr().err


@pytest.mark.process
def test_a_replica_refuses_the_model_at_start_naming_the_file(tmp_path, minilm_current: Path) -> None:
    import subprocess
    import sys

    model = tmp_path / "model"
    shutil.copytree(minilm_current, model)
    _edit_json(model / "1_Pooling" / "config.json", lambda c: c.update(pooling_mode="splade"))
    command = [sys.executable, "-m", "bouquet.cli", "replica", "--model", str(model), "--listen", "127.0.0.1:0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "1_Pooling/config.json: unsupported pooling 'splade'" in result.stderr
    assert "Traceback" not in result.stderr  # the server stopped cleanly before the event loop closed
