"""Sliding-window attention and score soft-capping in the Triton kernels equal the float64 dense reference,
on CPU through the Triton interpreter. Every cached key no query of a step can see through its window is
NaN, as it may be once the blocks holding it are freed and reused: a kernel that reads one fails."""

from __future__ import annotations

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("on a GPU, tests/gpu/test_triton_attention_gpu.py runs these checks compiled", allow_module_level=True)

from attention_cases import forget_outside_windows  # noqa: E402
from interpreted_attention import (  # noqa: E402
    TritonPagedAttention,
    check_against_reference,
    decode_attention,
    prefill_attention,
    random_step,
)

SMALL_TILES = TritonPagedAttention(
    num_decode_splits=3,
    decode_config=decode_attention.DecodeConfig(block_n=16),
    prefill_config=prefill_attention.PrefillConfig(block_m=16, block_n=16),
)
# A fresh 5-token prompt, a 7-token chunk continuing 30 cached tokens, decodes inside the batch and a
# 40-token prompt: with 16-token tiles, windows of 6 and 20 start mid-tile, and prompt tiles lie wholly before
# the window of the prompt's later queries.
MIXED = ([5, 7, 1, 40, 1], [5, 37, 19, 40, 2])


def windowed_step(query_lens, seq_lens, window, block_size=4, group=2, **kwargs):
    step = random_step(query_lens, seq_lens, block_size, group, **kwargs)
    forget_outside_windows(step[3], step[4], step[5], window)
    return step


@pytest.mark.parametrize("window", [1, 6, 20, 1000])
def test_prefill_and_mixed_steps_with_a_sliding_window_match_the_reference(window):
    check_against_reference(windowed_step(*MIXED, window), SMALL_TILES, window=window)


def test_prefill_with_a_window_under_default_tiles_and_gqa_4_matches_the_reference():
    # 32-query tiles (64 rows / 4 heads) of a 100-token prompt and a chunk crossing the window's edge.
    step = windowed_step([100, 20], [100, 90], 24, block_size=16, group=4, seed=1)
    check_against_reference(step, TritonPagedAttention(), window=24)


@pytest.mark.parametrize("window", [33, 50, 64])
def test_prefill_tiles_inside_every_rows_window_are_read_without_masks_and_the_edges_with(window):
    # 16-key tiles, 8-query programs: a 120-token prompt and a 30-token chunk after 100 cached tokens have
    # masked tiles at the window's start, unmasked ones wholly inside every query's window, masked ones at the
    # diagonal. A key read outside its window is NaN and would show.
    step = windowed_step([120, 30, 1], [120, 130, 77], window, seed=7)
    check_against_reference(step, SMALL_TILES, window=window)


@pytest.mark.parametrize("window", [1, 16, 50, 200])
def test_decode_with_a_sliding_window_matches_the_reference(window):
    # Contexts shorter than, equal to and many tiles longer than the window; 3 splits over the in-window tiles.
    step = windowed_step([1, 1, 1, 1], [1, 17, 45, 130], window, group=4, seed=2)
    check_against_reference(step, SMALL_TILES, window=window)


def test_decode_with_more_splits_than_in_window_tiles_matches_the_reference():
    backend = TritonPagedAttention(num_decode_splits=8, decode_config=decode_attention.DecodeConfig(block_n=16))
    step = windowed_step([1, 1, 1], [40, 100, 333], 20, seed=3)
    check_against_reference(step, backend, window=20)


def test_soft_capped_prefill_and_decode_match_the_reference():
    # scale 1 puts raw scores at ~±6 (head_dim 32): a cap of 3 bends most of them.
    check_against_reference(random_step(*MIXED, 4, 2, seed=4), SMALL_TILES, scale=1.0, softcap=3.0)
    check_against_reference(random_step([1, 1, 1], [9, 66, 200], 4, 2, seed=4), SMALL_TILES, scale=1.0, softcap=3.0)


def test_window_and_soft_cap_together_in_half_precision_match_the_reference():
    step = windowed_step(*MIXED, 10, dtype=torch.float16, seed=5)
    check_against_reference(step, SMALL_TILES, atol=2e-2, scale=0.5, window=10, softcap=5.0)
    step = windowed_step([1, 1], [33, 80], 10, dtype=torch.float16, seed=5)
    check_against_reference(step, SMALL_TILES, atol=2e-2, scale=0.5, window=10, softcap=5.0)


def test_negative_window_or_soft_cap_is_refused():
    q, k, v, k_cache, v_cache, meta = random_step([2], [2], 16, 1)
    with pytest.raises(ValueError, match="must be >= 0"):
        TritonPagedAttention().forward(q, k, v, k_cache, v_cache, meta, 1.0, window=-1)
    with pytest.raises(ValueError, match="must be >= 0"):
        TritonPagedAttention().forward(q, k, v, k_cache, v_cache, meta, 1.0, softcap=-2.0)
