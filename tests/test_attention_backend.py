"""The SDPA backend over packed sequences against plain per-sequence attention."""

from __future__ import annotations

import pytest
import torch
from conftest import packed_context, per_sequence_attention

from bouquet.layers.attention_backends import available_backends, create_attention_backend
from bouquet.layers.attention_backends.sdpa import SdpaBackend, plan_groups

SHAPES = {
    "mixed": [5, 17, 1, 64, 63, 9, 9, 9, 33],
    "equal": [16, 16, 16, 16],
    "single": [40],
}


@pytest.mark.parametrize("min_efficiency", [0.0, 0.8, 1.01])  # one padded group / grouped / per sequence
@pytest.mark.parametrize("seq_lens", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2)])
def test_packed_attention_matches_per_sequence(seq_lens, causal, heads, kv_heads, min_efficiency) -> None:
    torch.manual_seed(0)
    total, head_dim = sum(seq_lens), 16
    q = torch.randn(total, heads, head_dim)
    k, v = torch.randn(total, kv_heads, head_dim), torch.randn(total, kv_heads, head_dim)
    backend = SdpaBackend(min_efficiency=min_efficiency)
    out = backend.forward(q, k, v, packed_context(backend, seq_lens), causal, head_dim**-0.5)
    expected = per_sequence_attention(q, k, v, seq_lens, causal, head_dim**-0.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_groups_cover_every_sequence_once_within_the_efficiency_bound() -> None:
    seq_lens = [3, 100, 90, 4, 50, 256, 250, 7, 7, 7]
    groups = plan_groups(seq_lens, min_efficiency=0.8)
    assert sorted(i for group in groups for i in group) == list(range(len(seq_lens)))
    for group in groups:
        longest = max(seq_lens[i] for i in group)
        assert sum(seq_lens[i] ** 2 for i in group) >= 0.8 * len(group) * longest**2


def test_registry_names_what_it_has() -> None:
    assert "sdpa" in available_backends()
    with pytest.raises(ValueError, match="unknown attention backend 'flash'; available: sdpa"):
        create_attention_backend("flash")
