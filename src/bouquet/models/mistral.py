"""Mistral decoders used as embedders (e5-mistral, SFR-Embedding-Mistral): Llama's layers, which are Qwen2's
without the q/k/v biases; causal, with the config's `sliding_window` (null: none) on every layer.

transformers' Mistral masks with its `sliding_window` the same way as Qwen2 (query i sees key j when
i - window < j <= i), so the layers, the window's off-by-one and the weight names are Qwen2's, and so is the code.
"""

from __future__ import annotations

from typing import Any

from bouquet.models.qwen2 import Qwen2Config, Qwen2Model


class MistralModel(Qwen2Model):
    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> MistralModel:
        # Unlike Qwen2, transformers' Mistral reads neither `use_sliding_window` nor `layer_types`.
        windows = (hf_config.get("sliding_window"),) * hf_config["num_hidden_layers"]
        return cls(Qwen2Config.from_hf(hf_config, attention_bias=False, windows=windows))
