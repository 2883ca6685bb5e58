"""A model's image processor settings as its directory holds them, as text: transformers 5 saves a processor's
(`CLIPProcessor.save_pretrained`, sentence-transformers' CLIP) in `processor_config.json`, the image processor's
nested under `image_processor`; earlier versions, and an image processor saved alone, in `preprocessor_config.json`.
Read in transformers' order: the nested settings when there are any, else the file of their own. No torch: the
replica sends the text in Info and the gateway preprocesses by it (gateway/image_processing.py)."""

from __future__ import annotations

import json
from pathlib import Path

IMAGE_PROCESSOR_FILE = "preprocessor_config.json"
PROCESSOR_FILE = "processor_config.json"


def read_image_processor_json(folder: Path) -> str:
    """The image processor's settings as JSON text; "" when the directory has none. A processor_config.json that
    is not JSON is passed on as it is, for the gateway to refuse as it refuses any settings it cannot follow."""
    processor = folder / PROCESSOR_FILE
    if processor.is_file():
        text = processor.read_text(encoding="utf-8")
        try:
            config = json.loads(text)
        except json.JSONDecodeError:
            return text
        nested = config.get("image_processor") if isinstance(config, dict) else None
        if isinstance(nested, dict):  # else a processor of text alone, or one from before transformers nested it
            return json.dumps(nested, indent=2)
    own = folder / IMAGE_PROCESSOR_FILE
    return own.read_text(encoding="utf-8") if own.is_file() else ""
