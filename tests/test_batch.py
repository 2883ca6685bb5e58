"""The packed batch every hop shares: packing, slicing and concatenating, and the one token-budget cutter."""

from __future__ import annotations

import numpy as np
import pytest

from bouquet.batch import Batch, RowOptions, count_within_budget, token_budget_runs

FIELDS = ("input_ids", "cu_seqlens", "dimensions", "normalize", "prompt_lens", "token_type_ids")


def assert_same(a: Batch, b: Batch) -> None:
    for name in FIELDS:
        left, right = getattr(a, name), getattr(b, name)
        assert (left is None) == (right is None), name
        if left is not None:
            assert left.dtype == right.dtype, name
            np.testing.assert_array_equal(left, right, err_msg=name)


def cu(lengths: list[int]) -> np.ndarray:
    return Batch.pack([[1] * length for length in lengths]).cu_seqlens


def test_pack_lays_sequences_end_to_end_with_every_sequence_finished_alike() -> None:
    batch = Batch.pack([[101, 7, 102], [101, 102]], RowOptions(dimensions=64, normalize=False, prompt_tokens=1))
    assert batch.input_ids.tolist() == [101, 7, 102, 101, 102] and batch.input_ids.dtype == np.int32
    assert batch.cu_seqlens.tolist() == [0, 3, 5] and batch.cu_seqlens.dtype == np.int32
    assert (batch.num_seqs, batch.num_tokens, batch.seq_lens.tolist()) == (2, 5, [3, 2])
    assert batch.dimensions.tolist() == [64, 64] and batch.normalize.tolist() == [False, False]
    assert batch.prompt_lens.tolist() == [1, 1] and batch.token_type_ids is None
    assert batch.options() == RowOptions(64, False, 1)


def test_slices_concatenate_back_to_the_batch() -> None:
    batch = Batch.pack([[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]], token_type_ids=[[0, 0, 1], [1], [0, 1], [1, 1, 0, 0]])
    middle = batch.slice(1, 3)
    assert middle.input_ids.tolist() == [4, 5, 6] and middle.cu_seqlens.tolist() == [0, 1, 3]
    assert middle.token_type_ids is not None and middle.token_type_ids.tolist() == [1, 0, 1]
    assert batch.slice(0, batch.num_seqs) is batch
    assert_same(Batch.concat([batch.slice(0, 1), middle, batch.slice(3, 4)]), batch)


def test_concat_keeps_each_sequence_options_and_fills_missing_token_types_with_zeros() -> None:
    typed = Batch.pack([[1, 2]], RowOptions(dimensions=8), token_type_ids=[[1, 1]])
    plain = Batch.pack([[3], [4, 5]], RowOptions(normalize=False, prompt_tokens=1))
    step = Batch.concat([plain, typed])
    assert step.cu_seqlens.tolist() == [0, 1, 3, 5] and step.input_ids.tolist() == [3, 4, 5, 1, 2]
    assert step.token_type_ids is not None and step.token_type_ids.tolist() == [0, 0, 0, 1, 1]
    assert step.dimensions.tolist() == [0, 0, 8] and step.normalize.tolist() == [False, False, True]
    assert step.prompt_lens.tolist() == [1, 1, 0]
    assert Batch.concat([plain, plain]).token_type_ids is None


@pytest.mark.parametrize(("dimensions", "width"), [((0,), 384), ((32, 64), 64), ((0, 64), 384)])
def test_width_is_the_widest_row(dimensions: tuple[int, ...], width: int) -> None:
    batch = Batch.concat([Batch.pack([[1]], RowOptions(dimensions=d)) for d in dimensions])
    assert batch.width(384) == width


@pytest.mark.parametrize(
    ("lengths", "max_tokens", "max_seqs", "runs"),
    [
        ([3, 3, 3], 6, None, [(0, 2), (2, 3)]),
        ([2, 2], 4, None, [(0, 2)]),  # an exact fit stays one run
        ([10, 1, 1], 5, None, [(0, 1), (1, 3)]),  # over the budget alone: a run of its own, never dropped
        ([1, 10, 1], 5, None, [(0, 1), (1, 2), (2, 3)]),
        ([1] * 5, 100, 2, [(0, 2), (2, 4), (4, 5)]),  # the sequence cap
        ([10] * 9, 30.0, None, [(0, 3), (3, 6), (6, 9)]),  # an evened-out (fractional) budget, as the gateway's
        ([], 8, None, []),
    ],
)
def test_token_budget_runs(lengths: list[int], max_tokens: float, max_seqs: int | None, runs: list[tuple[int, int]]):
    assert token_budget_runs(cu(lengths), max_tokens, max_seqs) == runs


def test_count_within_budget_from_a_sequence_on() -> None:
    cu_seqlens = cu([3, 3, 3, 3])
    assert count_within_budget(cu_seqlens, 1, 6) == 2
    assert count_within_budget(cu_seqlens, 1, 5) == 1
    assert count_within_budget(cu_seqlens, 1, 2) == 0  # the caller decides whether it runs alone
    assert count_within_budget(cu_seqlens, 1, 100, max_seqs=2) == 2
    assert count_within_budget(cu_seqlens, 3, 100) == 1
    assert count_within_budget(cu_seqlens, 0, 2**40) == 4  # no overflow past int32


def test_patch_images_count_their_patches_in_the_budget() -> None:
    """Qwen3-VL's vision tower runs on every patch before its merger makes 2 x 2 of them one token: a sequence's
    share of the budget is its tokens plus its images' patches, through slices and concatenations; a batch without
    patch images counts its tokens alone."""
    grids = np.array([[1, 4, 4], [1, 2, 4], [1, 4, 6]])  # 16, 8 and 24 patches: 4, 2 and 6 tokens
    sequences = [[1] * 8, [2] * 3, [3] * 14, [4] * 5]  # 0: one image in 8 tokens, 2: two images in 14
    batch = Batch.pack(sequences).with_patch_images(np.zeros((48, 12), np.float32), grids, [1, 0, 2, 0])
    assert batch.cu_budget.tolist() == [0, 8 + 16, 27, 27 + 14 + 8 + 24, 78] and batch.budget_tokens == 78
    assert batch.slice(1, 4).cu_budget.tolist() == [0, 3, 49, 54]
    assert Batch.concat([batch.slice(2, 4), batch.slice(0, 2)]).cu_budget.tolist() == [0, 46, 51, 75, 78]
    # 30 tokens: one run of 30 by tokens alone; by the budget's count the images take most of it
    assert token_budget_runs(batch.cu_seqlens, 30) == [(0, 4)]
    assert token_budget_runs(batch.cu_budget, 30) == [(0, 2), (2, 3), (3, 4)]
    texts = Batch.pack(sequences)
    assert texts.cu_budget is texts.cu_seqlens and texts.budget_tokens == 30
    images = Batch.pack_images(np.zeros((2, 3, 4, 4), np.float32), tokens_per_image=5)
    assert images.cu_budget.tolist() == [0, 5, 10]  # CLIP's image tokens are its tower's: counted once
