"""The CPU paged-attention backend computes exactly what the float64 reference says, and stores K/V where
the slot mapping says."""

from __future__ import annotations

import random

import pytest
import torch

from batchjob.engine.native.layers.attention import (
    TorchPagedAttention,
    dense_reference_attention,
    make_metadata,
)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 16


def random_step(block_size: int, query_lens: list[int], seq_lens: list[int], seed: int = 0):
    """A paged cache holding random context for each sequence in shuffled, non-contiguous blocks, plus the
    step's new q/k/v. Unused cache slots hold NaN, as uninitialised memory may."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = 2 * sum(blocks_needed) + 3
    free = list(range(1, num_blocks))  # block 0 stays the scratch block
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in blocks_needed]
    k_cache = torch.full((num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    for table, seq_len, q_len in zip(tables, seq_lens, query_lens, strict=True):
        for pos in range(seq_len - q_len):
            block, offset = table[pos // block_size], pos % block_size
            k_cache[block, offset] = torch.randn(NUM_KV_HEADS, HEAD_DIM, generator=gen)
            v_cache[block, offset] = torch.randn(NUM_KV_HEADS, HEAD_DIM, generator=gen)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    meta = make_metadata(query_lens, seq_lens, tables, block_size)
    return q, k, v, k_cache, v_cache, meta


@pytest.mark.parametrize("block_size", [16, 1])
@pytest.mark.parametrize(
    ("query_lens", "seq_lens"),
    [
        ([7, 1, 20, 1, 3], [7, 35, 20, 2, 40]),  # fresh prefills, decodes and chunked-prefill continuations
        ([1, 1, 1], [1, 17, 33]),  # decode-only step
        ([40], [40]),  # single long prefill
    ],
)
def test_torch_paged_attention_matches_dense_reference(block_size, query_lens, seq_lens):
    q, k, v, k_cache, v_cache, meta = random_step(block_size, query_lens, seq_lens)
    expected = dense_reference_attention(q, k, v, k_cache, v_cache, meta, scale=HEAD_DIM**-0.5)

    out = TorchPagedAttention().forward(q, k, v, k_cache, v_cache, meta, scale=HEAD_DIM**-0.5)

    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_torch_paged_attention_stores_new_kv_at_slot_mapping():
    q, k, v, k_cache, v_cache, meta = random_step(4, [3, 1], [5, 9])

    TorchPagedAttention().forward(q, k, v, k_cache, v_cache, meta, scale=1.0)

    torch.testing.assert_close(k_cache.flatten(0, 1)[meta.slot_mapping], k)
    torch.testing.assert_close(v_cache.flatten(0, 1)[meta.slot_mapping], v)


def test_dense_reference_leaves_caches_untouched():
    q, k, v, k_cache, v_cache, meta = random_step(4, [3, 1], [5, 9])
    before = k_cache.clone()

    dense_reference_attention(q, k, v, k_cache, v_cache, meta, scale=1.0)

    torch.testing.assert_close(k_cache, before, equal_nan=True)


def test_make_metadata_maps_new_tokens_to_their_block_slots():
    meta = make_metadata([2, 1], [5, 3], [[7, 3], [2]], block_size=4)

    assert meta.cu_query_lens.tolist() == [0, 2, 3]
    # sequence 0: positions 3 and 4 -> block 7 offset 3, block 3 offset 0; sequence 1: position 2 of block 2
    assert meta.slot_mapping.tolist() == [7 * 4 + 3, 3 * 4 + 0, 2 * 4 + 2]
    assert meta.block_tables.tolist() == [[7, 3], [2, 0]]
    assert (meta.max_query_len, meta.max_seq_len) == (2, 5)


@pytest.mark.parametrize(("window", "softcap"), [(5, 0.0), (1, 0.0), (0, 2.0), (6, 1.5)])
def test_sliding_window_and_softcap_match_the_dense_reference(window, softcap):
    # Prefills, chunked continuations and decodes, with contexts longer than the window.
    q, k, v, k_cache, v_cache, meta = random_step(4, [7, 1, 12, 3], [7, 30, 20, 40])
    expected = dense_reference_attention(q, k, v, k_cache, v_cache, meta, 0.3, window=window, softcap=softcap)

    out = TorchPagedAttention().forward(q, k, v, k_cache, v_cache, meta, 0.3, window=window, softcap=softcap)

    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    plain = dense_reference_attention(q, k, v, k_cache, v_cache, meta, 0.3)
    assert not torch.allclose(out.double(), plain, atol=1e-3)  # the case really windows or caps something
