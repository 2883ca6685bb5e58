"""SigLIP 2's texts as transformers 5 tokenizes and pads them, over real HTTP on loopback: a tiny random-weight
Siglip2Model beside a real Siglip2Tokenizer (a BPE vocabulary trained here, with capitals) saved by `save_pretrained`
with its own tokenizer_config.json, against `get_text_features` on what transformers' `AutoProcessor` gives for
`text=..., padding="max_length", max_length=64` (float32, cosine >= 0.99999). AutoTokenizer loads Siglip2Tokenizer
for any siglip2 directory: it lowercases in front of tokenizer.json's normaliser and pads on the left unless the
files say otherwise. Six directories: as saved; with a Gemma-style tokenizer.json that does not lowercase itself
(transformers lowercases all the same); with tokenizer_config.json's `padding_side: "right"`; with its
`model_input_names` giving no attention mask (the left pads are then keys); with released SigLIP 2's
`add_bos_token: false, add_eos_token: true` and a tokenizer.json whose post-processor appends <eos>; with both flags
true beside a post-processor that adds nothing. transformers 5 drops tokenizer_config.json's `add_bos_token` and
`add_eos_token` whenever a tokenizer.json is loaded (tokenization_utils_base.py), so the file's post-processor alone
says which special tokens a text gets, as in bouquet's `tokenizers`; transformers 4's GemmaTokenizerFast rebuilt the
post-processor from the flags instead. Then the class rules and those flags on their own against AutoTokenizer's
ids, for siglip2 and SigLIP (v1) directories naming other classes."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from conftest import row_cosines
from in_process import engines, served
from siglip2_models import save_siglip2, siglip2_tokenizer

from bouquet.model_dir import read_model_dir
from bouquet.text_padding import read_text_padding
from bouquet.tokenizer import TextTokenizer, tokenizer_json

BOUND = 0.99999
TEXTS = [
    "A Photo of TWO Cats", "a photo of two cats", "Dogs", "THE EIFFEL TOWER at night by the river in Paris",
    "Old maps " * 30,  # over 64 tokens: truncated to 64 by both
]  # fmt: skip
VARIANTS = ("saved", "gemma-json", "right", "unmasked", "eos", "flags")
# tokenizer.json post-processors: "$A <eos>" (what a Gemma tokenizer saved with add_eos_token true writes), "$A".
APPEND_EOS = {
    "type": "TemplateProcessing",
    "single": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "<eos>", "type_id": 0}}],
    "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
    "special_tokens": {"<eos>": {"id": "<eos>", "ids": [1], "tokens": ["<eos>"]}},
}  # fmt: skip
TOKENIZER_CHANGES = {"eos": {"add_bos_token": False, "add_eos_token": True},
                     "flags": {"add_bos_token": True, "add_eos_token": True}}  # fmt: skip


def save_variant(path: Path, saved: Path, variant: str) -> None:
    """`saved` copied to `path`, changed as `variant` says."""
    shutil.copytree(saved, path)
    if variant == "gemma-json":  # the normaliser Gemma's tokenizer.json has: spaces to "▁", no Lowercase
        tokenizer = json.loads((path / "tokenizer.json").read_text())
        tokenizer["normalizer"] = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
        (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    if variant == "eos":
        set_post_processor(path, APPEND_EOS)
    changes = {"right": {"padding_side": "right"}, "unmasked": {"model_input_names": ["input_ids"]}}
    changes = {**changes, **TOKENIZER_CHANGES}.get(variant)
    if changes:  # unmasked: no attention_mask, so the pads before each text are keys
        config = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps({**config, **changes}))


def set_post_processor(path: Path, post_processor: dict | None) -> None:
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    (path / "tokenizer.json").write_text(json.dumps({**tokenizer, "post_processor": post_processor}))


@pytest.fixture(scope="module")
def models(tmp_path_factory, minilm_path: Path) -> tuple[dict[str, Path], torch.nn.Module]:
    root = tmp_path_factory.mktemp("siglip2-tokenizer")
    model = save_siglip2(root / "base", minilm_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        (root / "base" / name).unlink()  # MiniLM's, which save_siglip2 put beside the model
    siglip2_tokenizer().save_pretrained(root / "base")
    paths = {variant: root / variant for variant in VARIANTS}
    for variant, path in paths.items():
        save_variant(path, root / "base", variant)
    return paths, model


@pytest.fixture(scope="module")
def server(models) -> Iterator[httpx.Client]:
    with (
        engines(*models[0].values()) as built,
        served(built, listen=True) as running,
        httpx.Client(base_url=running.url, timeout=120) as client,
    ):
        yield client


def transformers_rows(path: Path, model: torch.nn.Module, texts: list[str]) -> np.ndarray:
    from transformers import AutoProcessor

    inputs = AutoProcessor.from_pretrained(path)(
        text=texts, padding="max_length", max_length=64, truncation=True, return_tensors="pt"
    )
    with torch.no_grad():
        return model.get_text_features(**inputs).pooler_output.numpy()


@pytest.mark.parametrize("variant", VARIANTS)
def test_texts_match_transformers_processor_and_tokenizer_class(server: httpx.Client, models, variant: str) -> None:
    paths, model = models
    answer = server.post("/v1/embeddings", json={"model": variant, "input": TEXTS})
    assert answer.status_code == 200, answer.text
    rows = np.array([item["embedding"] for item in answer.json()["data"]], np.float32)
    cosines = row_cosines(rows, transformers_rows(paths[variant], model, TEXTS))
    assert cosines.min() >= BOUND, np.round(cosines, 6)
    np.testing.assert_allclose(rows[0], rows[1], atol=1e-6)  # capitals or not, one text once lowercased


def test_the_sides_and_the_lowercasing_change_the_rows(models) -> None:
    """What the test above relies on: transformers' rows differ by padding side, by an <eos> appended, and by case
    where nothing lowercases (a right-padded reference against a left-padded one; the tokenizer.json alone against
    the class)."""
    paths, model = models
    left, right, eos = (transformers_rows(paths[variant], model, TEXTS[2:4]) for variant in ("saved", "right", "eos"))
    assert row_cosines(left, right).max() < 0.99
    assert row_cosines(left, eos).max() < 0.99
    raw = TextTokenizer(paths["gemma-json"] / "tokenizer.json", 64).encode(TEXTS[:2])
    assert raw[0] != raw[1]


@pytest.mark.parametrize(
    ("model_type", "named", "side"),
    [
        ("siglip2", "Siglip2Tokenizer", None),
        ("siglip2", "GemmaTokenizer", None),  # as released SigLIP 2 checkpoints are said to name it: overridden
        ("siglip2", "GemmaTokenizer", "right"),
        ("siglip", "GemmaTokenizer", None),  # SigLIP (v1): the class named is the class loaded
        ("siglip", "Siglip2Tokenizer", None),
        ("siglip", "PreTrainedTokenizerFast", None),
    ],
)
def test_the_class_rules_are_transformers_autotokenizers(
    tmp_path: Path, models, model_type: str, named: str, side: str | None
) -> None:
    """bouquet's tokens and padding side for a directory against what AutoTokenizer loads for it (class, ids,
    padding_side), the tokenizer_config.json naming `named` (and `side` where set) in a `model_type` directory."""
    from transformers import AutoTokenizer

    path = tmp_path / "model"
    save_variant(path, models[0]["gemma-json"], "gemma-json")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer_config = {**tokenizer_config, "tokenizer_class": named, **({"padding_side": side} if side else {})}
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    reference = AutoTokenizer.from_pretrained(path)
    spec = read_model_dir(path)
    ours = TextTokenizer(tokenizer_json(spec.tokenizer_file, spec.do_lower_case), 64)
    assert ours.encode(TEXTS[:4]) == reference(TEXTS[:4])["input_ids"], type(reference).__name__
    padding = read_text_padding(path)
    assert padding is not None and padding.left == (reference.padding_side == "left"), type(reference).__name__


@pytest.mark.parametrize("flags", [{}, {"add_bos_token": True}, {"add_bos_token": False, "add_eos_token": True},
                                   {"add_bos_token": True, "add_eos_token": True}])  # fmt: skip
@pytest.mark.parametrize("post_processor", ["saved", "append-eos", "none"])
def test_add_bos_and_eos_flags_give_transformers_ids(tmp_path: Path, models, flags: dict, post_processor: str) -> None:
    """bouquet's ids (over 64 tokens too, cut to 64 with any special token kept) against AutoTokenizer's, for
    tokenizer_config.json's flags beside each post-processor tokenizer.json may hold (the saved "$A", "$A <eos>",
    none): the file decides, the flags change nothing (module docstring)."""
    from transformers import AutoTokenizer

    path = tmp_path / "model"
    save_variant(path, models[0]["saved"], "saved")
    if post_processor != "saved":
        set_post_processor(path, APPEND_EOS if post_processor == "append-eos" else None)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, **flags}))
    reference = AutoTokenizer.from_pretrained(path)(TEXTS, truncation=True, max_length=64)["input_ids"]
    spec = read_model_dir(path)
    ours = TextTokenizer(tokenizer_json(spec.tokenizer_file, spec.do_lower_case), 64).encode(TEXTS)
    assert ours == reference
    assert all(ids[-1] == 1 for ids in ours) == (post_processor == "append-eos")
