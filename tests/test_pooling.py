"""The eager path's pooling (`pool_eager`, fewer ops with the batch's options on the host) gives the rows the
general, capturable `pool` gives, for every method, lone and packed sequences, and every head option."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bouquet.layers.pooling import pool, pool_eager
from bouquet.model_dir import PoolingMethod

HEADS = {
    "all normalised, full width": ([0, 0, 0], [True, True, True]),
    "none normalised": ([0, 0, 0], [False, False, False]),
    "mixed normalisation": ([0, 0, 0], [True, False, True]),
    "truncated rows": ([8, 0, 3], [True, True, False]),
}


def _cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)


@pytest.mark.parametrize("method", list(PoolingMethod))
@pytest.mark.parametrize("lengths", [[7], [1], [5, 1, 9]])
@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_eager_matches_pool(method: PoolingMethod, lengths: list[int], head: str, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(len(lengths) * 7 + len(head))
    hidden = torch.randn(sum(lengths), 16, generator=generator).to(dtype)
    cu_seqlens = _cu_seqlens(lengths)
    dimensions = np.array(HEADS[head][0][: len(lengths)], dtype=np.int32)
    normalize = np.array(HEADS[head][1][: len(lengths)], dtype=bool)

    expected = pool(method, hidden, cu_seqlens, torch.from_numpy(dimensions), torch.from_numpy(normalize))
    got = pool_eager(method, hidden, cu_seqlens, dimensions, normalize)

    assert got.dtype == torch.float32 and got.shape == (len(lengths), 16)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
