"""bge-m3 at a tiny shape with all three heads, and FlagEmbedding's M3 formulas to compare against.

The model: a random-weight XLMRobertaModel saved with transformers (tests/sparse_models.py's `build_bge_m3`: CLS
pooling and Normalize as sentence-transformers saves bge-m3, `sparse_linear.pt`), and `colbert_linear.pt` beside it,
both written as FlagEmbedding writes them: `torch.save(linear.state_dict(), ...)` of an nn.Linear (colbert_dim -1:
hidden to hidden, with its bias). Weights are spread wide (std 0.3) so attention is far from uniform.

FlagEmbedding itself is not installed in the test environment: its 1.4.2 (the newest) installs, but `import
FlagEmbedding` fails with transformers 5 (its MiniCPM reranker imports `transformers.modeling_attn_mask_utils`,
gone in 5.0), and its package's `__init__` imports every model. So `FlagM3` reimplements, on transformers' forward,
what its 1.4.2 source does, read line by line: `M3Embedder.encode_single_device` (dense: the [CLS] state,
normalised; lexical weights: relu(sparse_linear(state)) per token, `_process_token_weights`: the cls, eos, pad and
unk ids of `special_tokens_map` left out, weights > 0 kept, the largest per id, keys the ids as strings; ColBERT:
colbert_linear on every state but the first, normalised, `_process_colbert_vecs`), and `compute_score_single_device`
(dense: the normalised rows' dot product; sparse: the vocabulary-wide rows, scatter_reduce "amax" of the weights at
their ids with the unused ids zeroed, dotted; ColBERT: `compute_colbert_score`, each query vector's best dot
product summed and divided by the query's vectors; 'sparse+dense' and 'colbert+sparse+dense' the weighted means,
weights [1, 1, 1] by default). Each text runs alone (no padding), so a pair's scores are compute_score's for that pair
alone: in a padded batch FlagEmbedding's ColBERT max can also meet a padding vector's zero.
"""

from __future__ import annotations

import shutil
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from sparse_models import LIMIT, WEIGHT_SCALE, build_bge_m3

_UNUSED = ("cls_token", "eos_token", "pad_token", "unk_token")


def build_m3(out: Path, tokenizer_dir: Path, name: str, colbert: bool = True, seed: int = 0) -> Path:
    """bge-m3's directory as `out/name`; without `colbert`, only its sparse head beside the dense model."""
    model_dir, _ = build_bge_m3(out / f"{name}-build", tokenizer_dir, seed)
    if colbert:
        linear = torch.nn.Linear(64, 64)
        generator = torch.Generator().manual_seed(seed + 5)
        with torch.no_grad():
            linear.weight.copy_(WEIGHT_SCALE * torch.randn(linear.weight.shape, generator=generator))
            linear.bias.copy_(0.1 * torch.randn(linear.bias.shape, generator=generator))
        torch.save(linear.state_dict(), model_dir / "colbert_linear.pt")
    return Path(shutil.move(model_dir, out / name))


def _linear(path: Path, out_features: int) -> torch.nn.Linear:
    linear = torch.nn.Linear(64, out_features)
    linear.load_state_dict(torch.load(path, weights_only=True))
    return linear.eval()


class FlagM3:
    """FlagEmbedding 1.4.2's BGEM3FlagModel on the model directory, float32 on the CPU (the module says what of it)."""

    def __init__(self, model_dir: Path):
        from transformers import AutoTokenizer, XLMRobertaModel

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = XLMRobertaModel.from_pretrained(str(model_dir), add_pooling_layer=False).eval()
        self.sparse_linear = _linear(model_dir / "sparse_linear.pt", 1)
        self.colbert_linear = _linear(model_dir / "colbert_linear.pt", 64)
        named = self.tokenizer.special_tokens_map
        self.unused = {self.tokenizer.convert_tokens_to_ids(named[key]) for key in _UNUSED if key in named}
        self.vocab_size = self.model.config.vocab_size

    @torch.no_grad()
    def _forward(self, text: str, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:  # ids [T], states [T, H]
        inputs = self.tokenizer([text], max_length=max_length, truncation=True, return_tensors="pt")
        states = self.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).last_hidden_state
        return inputs["input_ids"][0], states[0]

    @torch.no_grad()
    def _outputs(self, text: str, max_length: int) -> tuple[torch.Tensor, ...]:  # ids, dense, weights, colbert
        ids, states = self._forward(text, max_length)
        dense = torch.nn.functional.normalize(states[0], dim=-1)
        weights = torch.relu(self.sparse_linear(states)).squeeze(-1)
        colbert = torch.nn.functional.normalize(self.colbert_linear(states[1:]), dim=-1)
        return ids, dense, weights, colbert

    def encode(self, texts: list[str], max_length: int = LIMIT) -> dict[str, list]:
        """`encode(texts, return_dense=True, return_sparse=True, return_colbert_vecs=True)`."""
        answer: dict[str, list] = {"dense_vecs": [], "lexical_weights": [], "colbert_vecs": []}
        for text in texts:
            ids, dense, weights, colbert = self._outputs(text, max_length)
            answer["dense_vecs"].append(dense.numpy())
            answer["lexical_weights"].append(self._process_token_weights(weights.tolist(), ids.tolist()))
            answer["colbert_vecs"].append(colbert.numpy())
        return answer

    def _process_token_weights(self, weights: list[float], ids: list[int]) -> dict[str, float]:
        result: dict[str, float] = defaultdict(int)
        for weight, token_id in zip(weights, ids, strict=True):
            if token_id not in self.unused and weight > 0 and weight > result[str(token_id)]:
                result[str(token_id)] = weight
        return dict(result)

    def _sparse_vector(self, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:  # [vocab]
        vector = torch.zeros(self.vocab_size).scatter_reduce(-1, ids, weights, reduce="amax")
        vector[list(self.unused)] *= 0.0
        return vector

    def compute_score(
        self, pairs: list[tuple[str, str]], weights: list[float] | None = None, max_length: int = LIMIT,
        max_passage_length: int | None = None,
    ) -> dict[str, list[float]]:  # fmt: skip
        """`compute_score(pairs, weights_for_different_modes=weights, max_query_length=max_length,
        max_passage_length=max_passage_length or max_length)`, each pair alone."""
        w = weights or [1.0, 1.0, 1.0]
        scores: dict[str, list[float]] = defaultdict(list)
        for query, passage in pairs:
            q_ids, q_dense, q_weights, q_colbert = self._outputs(query, max_length)
            p_ids, p_dense, p_weights, p_colbert = self._outputs(passage, max_passage_length or max_length)
            dense = float(q_dense @ p_dense)
            sparse = float(self._sparse_vector(q_ids, q_weights) @ self._sparse_vector(p_ids, p_weights))
            colbert = float((q_colbert @ p_colbert.T).max(-1).values.sum() / len(q_colbert))
            scores["colbert"].append(colbert)
            scores["sparse"].append(sparse)
            scores["dense"].append(dense)
            # on tensors, as FlagEmbedding's: weights (0, 0, w) give a NaN, not a ZeroDivisionError
            pair = (torch.tensor(sparse) * w[1] + torch.tensor(dense) * w[0]) / (w[1] + w[0])
            scores["sparse+dense"].append(float(pair))
            scores["colbert+sparse+dense"].append((colbert * w[2] + sparse * w[1] + dense * w[0]) / sum(w))
        return dict(scores)


def cosines(ours: np.ndarray, theirs: np.ndarray) -> np.ndarray:  # per row
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
