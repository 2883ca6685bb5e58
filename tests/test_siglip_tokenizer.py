"""SigLIP (v1) with its own tokenizer, as released checkpoints ship it: transformers' SiglipTokenizer over a
sentencepiece model (`spiece.model`, no tokenizer.json; lowercases, strips punctuation, appends EOS, pads to 64),
which bouquet rebuilds as a `tokenizers` Tokenizer (sentencepiece_tokenizer.py). A unigram model trained here on
the standard library's docstrings, saved by SiglipTokenizer.save_pretrained (with a SiglipProcessor) beside a tiny
random-weight SiglipModel (test_siglip.py), in four directories:
- "saved": as saved (transformers 5 writes no model_input_names: the attention mask is given, pads masked);
- "released": tokenizer_config.json as the released checkpoints' (input_ids alone: pads are keys);
- "cased": `do_lower_case` false;
- "st": sentence-transformers' save of "saved".
Token ids against SiglipTokenizer's, token for token, on a few thousand varied texts (case, punctuation, whitespace,
unicode, long texts truncated at 64, empty); then each directory served over real HTTP on loopback against
`get_text_features` on what SiglipTokenizer gives with `padding="max_length"` (float32, cosine >= 0.99999); ids
under other sentencepiece settings (character maps, byte fallback); and the sentencepiece models bouquet does not
read refused, naming the file."""

from __future__ import annotations

import collections
import inspect
import io
import json
import random
import re
import shutil
import string
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from conftest import row_cosines
from family_models import TOKENIZER_FILES
from in_process import engines, served
from test_siglip import save_siglip

from bouquet.model_dir import read_model_dir
from bouquet.sentencepiece_tokenizer import siglip_tokenizer
from bouquet.text_padding import TextPadding, read_text_padding
from bouquet.tokenizer import TextTokenizer, tokenizer_json

BOUND = 0.99999
VARIANTS = ("saved", "released", "cased", "st")
EOS_ID = 2  # sentencepiece's </s>, SiglipTokenizer's EOS and pad
# Pieces of text the random texts are made of: ASCII, accents composed and not, letters that lowercase to two,
# scripts the vocabulary lacks, compatibility forms the model's NFKC map rewrites, whitespace of every kind, "▁".
ATOMS = [*string.printable, "é", "e\u0301", "ß", "İ", "Σ", "ΟΔΟΣ", "ς", "日本", "ｶﾞ", "ﬁ", "①", "！", "Ｈｅｌｌｏ",
         "\u3000", "\xa0", "\u2028", "\x1c", "\x85", "\u200b", "¨", "\x01", "▁", "🎉", "  ", "\t\n"]  # fmt: skip
# sentencepiece trainer settings other than its defaults (the released SigLIP's, as far as the files show)
SETTINGS = [{"normalization_rule_name": "identity"}, {"normalization_rule_name": "nfkc_cf"}, {"byte_fallback": True}]
TEXTS = [
    "A Photo, of a CAT!", "a photo of a cat", "Two dogs -- running (fast) on the beach...", "",
    "Return a new string object " * 12,  # over 64 tokens: cut at 64, EOS last
]  # fmt: skip


def docstring_lines() -> list[str]:
    lines = []
    for module in (string, re, textwrap, json, collections, inspect):
        for value in vars(module).values():
            doc = getattr(value, "__doc__", None)
            if isinstance(doc, str):
                lines += [line.strip() for line in doc.splitlines() if line.strip()]
    return lines


def train_spiece(path: Path, **options: object) -> Path:
    """A sentencepiece model (unigram, 500 pieces unless `options` say otherwise) trained on docstring lines."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(docstring_lines()), model_writer=model, minloglevel=2, **{"vocab_size": 500, **options}
    )
    path.write_bytes(model.getvalue())
    return path


def varied_texts() -> list[str]:
    rng = random.Random(0)
    made = ["".join(rng.choice(ATOMS) for _ in range(rng.randint(0, 60))) for _ in range(3000)]
    lines = docstring_lines()
    return [*TEXTS, "   ", "!!!", "x\x00y", "▁▁▁", *made, *lines[::20], " ".join(lines[:40])]


def edit_json(path: Path, **changes: object) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.fixture(scope="module")
def models(tmp_path_factory, minilm_path: Path) -> tuple[dict[str, Path], torch.nn.Module]:
    from sentence_transformers import SentenceTransformer
    from transformers import SiglipImageProcessor, SiglipProcessor, SiglipTokenizer

    root = tmp_path_factory.mktemp("siglip-spiece")
    spiece = train_spiece(root / "spiece.model")
    paths = {variant: root / variant for variant in VARIANTS}
    model = None
    for variant in ("saved", "released", "cased"):
        model = save_siglip(paths[variant], minilm_path)  # the same weights each time
        for name in TOKENIZER_FILES:
            (paths[variant] / name).unlink()  # MiniLM's, which save_siglip put beside the model
        tokenizer = SiglipTokenizer(vocab_file=str(spiece), do_lower_case=variant != "cased")
        images = SiglipImageProcessor(size={"height": 32, "width": 32})
        SiglipProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(paths[variant])
    edit_json(paths["released"] / "tokenizer_config.json", model_input_names=["input_ids"])
    SentenceTransformer(str(paths["saved"]), device="cpu").save(str(paths["st"]))
    assert not any(path.joinpath("tokenizer.json").exists() for path in paths.values())
    assert model is not None
    return paths, model


@pytest.fixture(scope="module")
def server(models) -> Iterator[httpx.Client]:
    with (
        engines(*models[0].values()) as built,
        served(built, listen=True) as running,
        httpx.Client(base_url=running.url, timeout=120) as client,
    ):
        yield client


def siglip_rows(path: Path, model: torch.nn.Module, texts: list[str]) -> np.ndarray:
    """transformers' rows: the directory's tokenizer (SiglipTokenizer) padding to max_length, as SigLIP's docs ask."""
    from transformers import AutoTokenizer

    inputs = AutoTokenizer.from_pretrained(path)(texts, padding="max_length", truncation=True, return_tensors="pt")
    with torch.no_grad():
        return model.get_text_features(**inputs).pooler_output.numpy()


@pytest.mark.parametrize("variant", ["saved", "cased", "st"])
def test_token_ids_are_siglip_tokenizers(models, variant: str) -> None:
    from transformers import AutoTokenizer

    path = models[0][variant]
    reference = AutoTokenizer.from_pretrained(path)
    assert type(reference).__name__ == "SiglipTokenizer"
    spec = read_model_dir(path)
    assert spec.tokenizer_file == path / "spiece.model"
    ours = TextTokenizer(tokenizer_json(spec.tokenizer_file, spec.do_lower_case), 64)
    texts = varied_texts()
    expected = reference(texts, truncation=True, max_length=64)["input_ids"]
    got = ours.encode(texts)
    wrong = [(text, want, have) for text, want, have in zip(texts, expected, got, strict=True) if want != have]
    assert not wrong, f"{len(wrong)} of {len(texts)} texts differ, e.g. {wrong[:3]}"
    assert max(len(ids) for ids in got) == 64 and all(ids[-1] == EOS_ID for ids in got)
    assert ours.vocab_size == len(reference)


@pytest.mark.parametrize("options", SETTINGS)
def test_token_ids_are_siglip_tokenizers_under_other_sentencepiece_settings(tmp_path: Path, options) -> None:
    """Other character maps (none; NFKC with case folding), and bytes for characters the vocabulary lacks, which show
    each such character rather than one <unk> for a run of them: the halfwidth "ｶﾞ" is left out there, the one
    difference of `tokenizers`' Precompiled in these texts (sentencepiece_tokenizer.py)."""
    from transformers import SiglipTokenizer

    SiglipTokenizer(vocab_file=str(train_spiece(tmp_path / "trained.model", **options))).save_pretrained(tmp_path)
    reference = SiglipTokenizer.from_pretrained(tmp_path)
    ours = TextTokenizer(siglip_tokenizer(tmp_path / "spiece.model"), 64)
    texts = [text for text in varied_texts() if "ｶﾞ" not in text or not options.get("byte_fallback")]
    expected = reference(texts, truncation=True, max_length=64)["input_ids"]
    wrong = [(text, want, have) for text, want, have in zip(texts, expected, ours.encode(texts), strict=True)
             if want != have]  # fmt: skip
    assert not wrong, f"{len(wrong)} of {len(texts)} texts differ, e.g. {wrong[:3]}"


@pytest.mark.parametrize("change", ["tokenizer.json beside", "no class named"])
def test_the_file_is_the_one_transformers_reads(tmp_path: Path, models, minilm_path: Path, change: str) -> None:
    """SiglipTokenizer reads spiece.model even beside a tokenizer.json; with no class named, a siglip directory's
    tokenizer is SiglipTokenizer all the same."""
    from transformers import AutoTokenizer

    path = tmp_path / "model"
    shutil.copytree(models[0]["saved"], path)
    if change == "tokenizer.json beside":
        shutil.copy(minilm_path / "tokenizer.json", path / "tokenizer.json")
    else:
        config = json.loads((path / "tokenizer_config.json").read_text())
        del config["tokenizer_class"]
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    reference = AutoTokenizer.from_pretrained(path)
    assert type(reference).__name__ == "SiglipTokenizer"
    spec = read_model_dir(path)
    assert spec.tokenizer_file == path / "spiece.model"
    texts = varied_texts()[:500]
    ours = TextTokenizer(tokenizer_json(spec.tokenizer_file, spec.do_lower_case), 64)
    assert ours.encode(texts) == reference(texts, truncation=True, max_length=64)["input_ids"]


def test_the_canonicalisation_changes_the_ids(models) -> None:
    """What the test above relies on: case and punctuation change SiglipTokenizer's ids where it keeps them."""
    lowered = TextTokenizer(siglip_tokenizer(models[0]["saved"] / "spiece.model"), 64).encode(TEXTS[:2])
    cased = TextTokenizer(siglip_tokenizer(models[0]["cased"] / "spiece.model"), 64).encode(TEXTS[:2])
    assert lowered[0] == lowered[1] == cased[1] != cased[0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_texts_match_transformers_over_http(server: httpx.Client, models, variant: str) -> None:
    paths, model = models
    texts = [text for text in TEXTS if text]
    answer = server.post("/v1/embeddings", json={"model": variant, "input": texts})
    assert answer.status_code == 200, answer.text
    rows = np.array([item["embedding"] for item in answer.json()["data"]], np.float32)
    expected = siglip_rows(paths[variant], model, texts)
    cosines = row_cosines(rows, expected)
    assert cosines.min() >= BOUND, np.round(cosines, 7)
    assert (row_cosines(rows[:1], rows[1:2]).min() >= 1 - 1e-6) == (variant != "cased")


def test_the_padding_is_siglip_tokenizers(models) -> None:
    """Pads are SiglipTokenizer's "</s>", up to its model_max_length; masked unless model_input_names leaves the
    attention mask out (the released checkpoints' files)."""
    paths = models[0]
    assert read_text_padding(paths["saved"]) == TextPadding(EOS_ID, masked=True, max_length=64)
    assert read_text_padding(paths["released"]) == TextPadding(EOS_ID, masked=False, max_length=64)


@pytest.mark.parametrize(
    ("options", "refusal"),
    [({"model_type": "bpe"}, "unigram"), ({"user_defined_symbols": ["photo"]}, "user-defined pieces"),
     ({"remove_extra_whitespaces": False}, "keeps extra whitespace")],
)  # fmt: skip
def test_sentencepiece_models_bouquet_cannot_rebuild_are_refused(tmp_path: Path, options, refusal: str) -> None:
    spiece = train_spiece(tmp_path / "spiece.model", **options)
    with pytest.raises(ValueError, match=refusal) as refused:
        siglip_tokenizer(spiece)
    assert str(spiece) in str(refused.value)
