"""A tiny random-weight Qwen3-VL (transformers' Qwen3VLForConditionalGeneration, the layout Qwen3-VL-Embedding
checkpoints are saved in) with its image processor, saved by `save_pretrained`, and transformers' own forward with
Qwen3-VL-Embedding's pooling as the reference."""

from __future__ import annotations

import base64
import io
import shutil
from pathlib import Path

import numpy as np
import torch
from family_models import TOKENIZER_FILES, spread_weights
from PIL import Image

# Special tokens of the tiny model, inside MiniLM's vocabulary (whose tokenizer the engine's directory carries).
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 30000, 30001, 30002, 30003
PATCH, MERGE, TEMPORAL = 8, 2, 2
MIN_PIXELS, MAX_PIXELS = 4 * 16 * 16, 64 * 16 * 16


def qwen3_vl_config():
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=30522, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128, max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                             "mrope_interleaved": True},
        ),
        vision_config=dict(
            depth=3, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=PATCH, temporal_patch_size=TEMPORAL,
            spatial_merge_size=MERGE, out_hidden_size=64, num_position_embeddings=16, deepstack_visual_indexes=[0, 1],
        ),
        image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )  # fmt: skip


def image_processor():
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL,
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )  # fmt: skip


def save_qwen3_vl(path: Path, tokenizer_dir: Path, seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration(qwen3_vl_config())
    spread_weights(model, seed=seed, scale=0.3)
    with torch.no_grad():  # 384 pixel values a patch at std 1 would drown the position embeddings
        model.model.visual.patch_embed.proj.weight.mul_(0.05)
    model.save_pretrained(path)
    image_processor().save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, path / name)
    return model.eval()


def images(sizes: list[tuple[int, int]], seed: int = 0) -> list[Image.Image]:
    """RGB images of the given (width, height), of smooth random content."""
    rng = np.random.default_rng(seed)
    out = []
    for width, height in sizes:
        small = rng.integers(0, 256, (max(2, height // 6), max(2, width // 6), 3), dtype=np.uint8)
        out.append(Image.fromarray(small).resize((width, height), Image.Resampling.BILINEAR))
    return out


def png_uri(picture: Image.Image) -> str:
    """The image as a PNG data URI, as a client sends it in `image_url` or `/embeddings_image`'s `input`."""
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def preprocess(picture: Image.Image) -> tuple[np.ndarray, np.ndarray]:
    """transformers' processor's patches [P, patch_dim] float32 and grid (1, rows, columns) of one image."""
    out = image_processor()(images=[picture], return_tensors="np")
    return np.asarray(out["pixel_values"], np.float32), np.asarray(out["image_grid_thw"][0], np.int32)


def image_tokens(grid: np.ndarray) -> list[int]:
    """An image's span in a prompt: vision start, one placeholder per merged block, vision end."""
    return [VISION_START, *[IMAGE_TOKEN] * (int(np.prod(grid)) // MERGE**2), VISION_END]


def reference_rows(model: torch.nn.Module, sequences: list[list[int]], patches: list[list[np.ndarray]],
                   grids: list[list[np.ndarray]]) -> np.ndarray:  # fmt: skip
    """transformers' Qwen3VLModel forward one sequence at a time (no padding), then Qwen3-VL-Embedding's pooling:
    the last token's final hidden state, L2-normalised."""
    rows = []
    with torch.no_grad():
        for ids, seq_patches, seq_grids in zip(sequences, patches, grids, strict=True):
            input_ids = torch.tensor([ids])
            kwargs = {}
            if seq_grids:
                kwargs = dict(
                    pixel_values=torch.from_numpy(np.concatenate(seq_patches)),
                    image_grid_thw=torch.from_numpy(np.stack(seq_grids)).long(),
                    mm_token_type_ids=(input_ids == IMAGE_TOKEN).int(),
                )
            hidden = model.model(input_ids=input_ids, **kwargs).last_hidden_state[0, -1]
            rows.append(torch.nn.functional.normalize(hidden, dim=-1))
    return torch.stack(rows).numpy()


# Qwen's special tokens, as Qwen3-VL's tokenizer has them; a tiny byte-level BPE of its own around them.
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|image_pad|>", "<|video_pad|>"]  # fmt: skip
# Qwen3-VL's chat template's output for system and user messages of text and image parts, with the generation
# prompt: written for this test (the tiny tokenizer has no template of its own).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen_tokenizer():
    """A byte-level BPE trained here on a few sentences, with Qwen's special tokens (ids 0-6)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=QWEN_SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = ["Represent the user's input.", "A photo of a cat on a red sofa.", "Find the chart of revenue.",
              "The quick brown fox jumps over the lazy dog."] * 20  # fmt: skip
    tokenizer.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def save_qwen3_vl_with_tokenizer(path: Path, seed: int = 0) -> tuple[torch.nn.Module, object]:
    """The tiny model with a Qwen-style tokenizer (its chat template set) and its image processor, all saved in
    `path`. (transformers' Qwen3VLProcessor itself needs torchvision for its video processor, not installed here.)"""
    from transformers import Qwen3VLForConditionalGeneration

    tokenizer = qwen_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN_SPECIAL}
    config = qwen3_vl_config()
    config.text_config.vocab_size = len(tokenizer)
    config.image_token_id, config.video_token_id = ids["<|image_pad|>"], ids["<|video_pad|>"]
    config.vision_start_token_id, config.vision_end_token_id = ids["<|vision_start|>"], ids["<|vision_end|>"]
    model = Qwen3VLForConditionalGeneration(config)
    spread_weights(model, seed=seed, scale=0.3)
    with torch.no_grad():
        model.model.visual.patch_embed.proj.weight.mul_(0.05)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    image_processor().save_pretrained(path)
    return model.eval(), tokenizer


def processor_rows(model: torch.nn.Module, tokenizer, conversations: list[list[dict]]) -> np.ndarray:
    """Qwen3VLProcessor's steps with transformers' pieces (the tokenizer's chat template with the generation prompt;
    each image's <|image_pad|> repeated prod(grid) / merge^2 times, Qwen3VLProcessor.replace_image_token's rule;
    the image processor's patches), then Qwen3VLModel, one conversation at a time, pooled as Qwen3-VL-Embedding
    pools: the last token's state, L2-normalised."""
    rows = []
    with torch.no_grad():
        for conversation in conversations:
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
            pictures = [part["image"] for message in conversation for part in message["content"]
                        if isinstance(part, dict) and part["type"] == "image"]  # fmt: skip
            kwargs = {}
            if pictures:
                out = image_processor()(images=pictures, return_tensors="pt")
                pieces = text.split("<|image_pad|>")
                counts = [int(grid.prod()) // MERGE**2 for grid in out["image_grid_thw"]]
                text = pieces[0] + "".join(
                    "<|image_pad|>" * n + rest for n, rest in zip(counts, pieces[1:], strict=True)
                )
                kwargs = dict(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
            input_ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
            if pictures:
                kwargs["mm_token_type_ids"] = (input_ids == model.config.image_token_id).int()
            hidden = model.model(input_ids=input_ids, **kwargs).last_hidden_state[0, -1]
            rows.append(torch.nn.functional.normalize(hidden, dim=-1))
    return torch.stack(rows).numpy()
