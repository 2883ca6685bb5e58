"""A sentence-transformers Transformer that gives each input's embedding itself (its output `sentence_embedding`):
CLIP's, SigLIP's and SigLIP 2's, whose rows sentence-transformers takes from the model's own `get_text_features` and
`get_image_features`, so no Pooling module follows. No torch.

bouquet computes those methods as transformers does (models/clip.py, models/siglip.py, models/siglip2.py), with one
deliberate difference for SigLIP's and SigLIP 2's texts. Both were trained on texts padded to a fixed length and
pool their last position (SigLIP 2's tokenizer pads on the left, so there the pads shift the text's positions);
sentence-transformers pads a batch's texts to its longest unless the module's `processing_kwargs` say
`padding: "max_length"`, so its own row of a short text moves with the texts beside it. bouquet pads every text to
the processor's max_length, as transformers' docs ask, and says so once at load (`warn_if_st_pads_short`); the rows
agree wherever sentence-transformers' padding reaches that length too.

sentence-transformers preprocesses a SigLIP 2's images through transformers' Siglip2Processor, whose class defaults
(`max_num_patches` 256, `patch_size` 16) win over the image processor's saved settings when the processor is
called; bouquet preprocesses by the saved settings, so a directory whose settings differ is refused
(`_check_naflex_settings`): sentence-transformers' rows of it would be other images' (or fail, at another patch).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from bouquet.image_processor_file import read_image_processor_json

# The architectures whose own rows bouquet computes, and each modality's method sentence-transformers calls.
POOLED_ARCHITECTURES = ("CLIPModel", "SiglipModel", "Siglip2Model")
_METHODS = {"text": "get_text_features", "image": "get_image_features"}
# What `processing_kwargs` may say for a model that pools itself: only how texts are padded and truncated (any
# other setting, an image size say, would change rows bouquet computes from the model's own files).
_TEXT_PADDINGS = {True: "longest", "longest": "longest", "max_length": "max_length"}
_TEXT_TRUNCATIONS = (True, "longest_first")
_ARCHITECTURES_PADDED = ("SiglipModel", "Siglip2Model")  # trained on texts padded to max_length (module docstring)
# transformers' Siglip2Processor.images_kwargs: what its call uses whatever the image processor saved (docstring).
_SIGLIP2_CALL_SETTINGS = {"max_num_patches": 256, "patch_size": 16}

logger = logging.getLogger(__name__)


def check_model_pools(folder: Path, architectures: list[str], config: dict[str, Any]) -> str:
    """Checks a Transformer that outputs sentence embeddings (`folder`, its config.json's `architectures`, its
    sentence_bert_config.json's `config`) is one bouquet computes, by each modality's method as sentence-transformers
    calls it; returns how sentence-transformers pads its texts ("longest" or "max_length")."""
    if not architectures or architectures[0] not in POOLED_ARCHITECTURES:
        raise ValueError(
            f"{folder / 'config.json'}: a Transformer that gives sentence embeddings itself is not supported for "
            f"{architectures[0] if architectures else 'an unnamed architecture'}; bouquet runs those of "
            f"{' and '.join(POOLED_ARCHITECTURES)}"
        )
    settings_file = folder / "sentence_bert_config.json"
    for modality, settings in (config.get("modality_config") or {}).items():
        method = settings.get("method") if isinstance(settings, dict) else None
        if _METHODS.get(modality) != method:
            raise ValueError(
                f"{settings_file}: modality {modality!r} through {method!r} is not supported; bouquet runs "
                f"{', '.join(f'{k} through {v}' for k, v in _METHODS.items())}"
            )
    if architectures[0] == "Siglip2Model":
        _check_naflex_settings(folder)
    return _text_padding(settings_file, config.get("processing_kwargs") or {})


def _text_padding(settings_file: Path, processing: dict[str, Any]) -> str:
    text = processing.get("text") or {}
    others = sorted(set(processing) - {"text"}) + sorted(set(text) - {"padding", "truncation"})
    padding = text.get("padding", True)
    if others or padding not in _TEXT_PADDINGS or text.get("truncation", True) not in _TEXT_TRUNCATIONS:
        raise ValueError(
            f"{settings_file}: processing_kwargs {processing!r} is not supported; bouquet runs a model that pools "
            "itself with its processor's own settings, texts padded ('longest' or 'max_length') and truncated"
        )
    return _TEXT_PADDINGS[padding]


def _check_naflex_settings(folder: Path) -> None:
    """Refuses a SigLIP 2 whose saved image processor settings sentence-transformers would not use (module
    docstring); settings left out are the image processor's defaults, which are the processor call's."""
    try:
        saved = json.loads(read_image_processor_json(folder) or "{}")
    except json.JSONDecodeError:  # the gateway refuses images by settings it cannot read, saying why
        return
    saved = saved if isinstance(saved, dict) else {}
    differ = {key: saved[key] for key, value in _SIGLIP2_CALL_SETTINGS.items() if saved.get(key, value) != value}
    if differ:
        raise ValueError(
            f"{folder}: its image processor's {differ} are not what sentence-transformers preprocesses this SigLIP 2's "
            f"images with (transformers' Siglip2Processor calls it with {_SIGLIP2_CALL_SETTINGS} whatever was saved), "
            "so its rows could not be sentence-transformers'; serve the model's transformers directory instead, or "
            f"save its image processor with {_SIGLIP2_CALL_SETTINGS}"
        )


def warn_if_st_pads_short(path: Path, architecture: str, st_padding: str | None) -> None:
    """Says once, where the model is loaded, when sentence-transformers' own text rows of it differ from bouquet's,
    and why (module docstring)."""
    if architecture not in _ARCHITECTURES_PADDED or st_padding != "longest":
        return
    logger.warning(
        "%s: sentence-transformers pads this model's texts to each batch's longest, so its own text rows differ from "
        "bouquet's unless the batch's longest text reaches max_length: bouquet pads every text to max_length, as %s "
        "was trained and as transformers' processor pads them (processing_kwargs "
        '{"text": {"padding": "max_length"}} in sentence_bert_config.json has sentence-transformers pad so too)',
        path, architecture,
    )  # fmt: skip
