"""The pooler against sentence-transformers' own Pooling module: every mode alone and concatenated, with and
without the prompt's tokens, lone and packed sequences; and the eager head shortcut against the general head."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bouquet.layers.pooling import Pooler
from bouquet.model_dir import PoolingMethod, PoolingSpec

WIDTH = 16
HEADS = {
    "all normalised, full width": ([0, 0, 0], [True, True, True]),
    "none normalised": ([0, 0, 0], [False, False, False]),
    "mixed normalisation": ([0, 0, 0], [True, False, True]),
    "truncated rows": ([8, 0, 3], [True, True, False]),
}
MODES = [[method] for method in PoolingMethod] + [[PoolingMethod.CLS, PoolingMethod.MEAN, PoolingMethod.MAX]]


def _cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)


def _reference(hidden: torch.Tensor, lengths: list[int], modes: list[PoolingMethod], include_prompt: bool, prompt: int):
    """sentence-transformers' Pooling on the same states, right-padded as its tokenizer pads them."""
    from sentence_transformers.sentence_transformer.modules import Pooling

    names = tuple(mode.value for mode in modes)
    module = Pooling(WIDTH, pooling_mode=names if len(names) > 1 else names[0], include_prompt=include_prompt)
    padded = torch.zeros(len(lengths), max(lengths), WIDTH)
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
    for index, (start, length) in enumerate(zip(np.cumsum([0, *lengths[:-1]]), lengths, strict=True)):
        padded[index, :length] = hidden[start : start + length].float()
        mask[index, :length] = 1
    features = {"token_embeddings": padded, "attention_mask": mask, "prompt_length": prompt}
    return module(features)["sentence_embedding"]


@pytest.mark.parametrize("modes", MODES, ids=lambda modes: "+".join(mode.value for mode in modes))
@pytest.mark.parametrize("lengths", [[7], [1], [5, 2, 9]])
@pytest.mark.parametrize("include_prompt", [True, False], ids=["with_prompt", "without_prompt"])
def test_pooler_matches_sentence_transformers(modes, lengths: list[int], include_prompt: bool) -> None:
    generator = torch.Generator().manual_seed(len(lengths) * 7 + len(modes))
    hidden = torch.randn(sum(lengths), WIDTH, generator=generator) * 3
    prompt = 3  # longer than some sequences: those are all prompt
    pooler = Pooler(PoolingSpec(tuple(modes), include_prompt), WIDTH)
    num_seqs = len(lengths)
    got = pooler(
        hidden,
        _cu_seqlens(lengths),
        torch.full((num_seqs,), prompt, dtype=torch.int32),
        torch.zeros(num_seqs, dtype=torch.int32),
        torch.zeros(num_seqs, dtype=torch.bool),
    )
    expected = _reference(hidden, lengths, modes, include_prompt, prompt)
    assert got.dtype == torch.float32 and got.shape == (num_seqs, WIDTH * len(modes)) == (num_seqs, pooler.dimension)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", list(PoolingMethod))
@pytest.mark.parametrize("lengths", [[7], [1], [5, 1, 9]])
@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_head_shortcut_matches_general_head(method, lengths: list[int], head: str, dtype: torch.dtype) -> None:
    """The CPU path tells the pooler when every row keeps its width and shares one normalisation; the rows
    must be the ones the general (capturable) head gives."""
    generator = torch.Generator().manual_seed(len(lengths) * 7 + len(head))
    hidden = torch.randn(sum(lengths), WIDTH, generator=generator).to(dtype)
    dimensions = torch.tensor(HEADS[head][0][: len(lengths)], dtype=torch.int32)
    normalize = torch.tensor(HEADS[head][1][: len(lengths)], dtype=torch.bool)
    args = (hidden, _cu_seqlens(lengths), torch.zeros(len(lengths), dtype=torch.int32), dimensions, normalize)
    pooler = Pooler(PoolingSpec((method,)), WIDTH)

    expected = pooler(*args)
    uniform = None if dimensions.any() else (bool(normalize.all()) if normalize.all() == normalize.any() else None)
    got = pooler(*args, uniform_normalize=uniform)

    assert got.dtype == torch.float32 and got.shape == (len(lengths), WIDTH)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
