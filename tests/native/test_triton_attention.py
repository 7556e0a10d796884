"""The Triton paged-attention kernels compute what the float64 dense reference says, on CPU through the
Triton interpreter: the K/V store, split-K decode (graph-safe launch, early-exiting splits) and varlen
prefill over the paged cache, for GQA ratios 1/2/4, block sizes 1 and 16 and odd lengths."""

from __future__ import annotations

import dataclasses

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("on a GPU, tests/gpu/test_triton_attention_gpu.py runs these checks compiled", allow_module_level=True)

from interpreted_attention import (  # noqa: E402
    TritonPagedAttention,
    check_against_reference,
    decode_attention,
    prefill_attention,
    random_step,
    triton_attention,
)

from batchjob.engine.native.layers.attention import AttentionMetadata, TorchPagedAttention  # noqa: E402


@pytest.mark.parametrize("block_size", [16, 1])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_prefill_mixed_batch_matches_dense_reference(group, block_size):
    # A fresh prefill, a chunk continuing 30 cached tokens, decodes inside the batch, a 70-token prompt
    # spanning two KV tiles: none of the lengths a multiple of the block size.
    step = random_step([5, 7, 1, 70, 1], [5, 37, 19, 70, 2], block_size, group)
    check_against_reference(step, TritonPagedAttention())


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("group", [1, 4])
def test_row_sums_on_the_tensor_cores_match_dense_reference(group, block_m):
    # PrefillConfig.row_sum_dot: the softmax's row sums by a dot with ones, in a mixed step and a decode step.
    config = prefill_attention.PrefillConfig(block_m=block_m, row_sum_dot=True)
    backend = TritonPagedAttention(prefill_config=config, deterministic=True)
    check_against_reference(random_step([5, 7, 1, 70, 1], [5, 37, 19, 70, 2], 16, group), backend)
    check_against_reference(random_step([1, 1, 1], [5, 70, 19], 16, group), backend)


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("block_size", [16, 1])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_decode_matches_dense_reference(group, block_size, splits):
    # One split: stage 1 writes the output itself and the reduce is not launched.
    step = random_step([1, 1, 1, 1], [1, 17, 45, 130], block_size, group)
    check_against_reference(step, TritonPagedAttention(num_decode_splits=splits))


def test_one_split_once_every_multiprocessor_has_a_program_reading_the_block_table_ahead_below_two():
    # 132 multiprocessors (an H200), 8 KV heads: the launch follows the batch size alone.
    launch = {
        seqs: (decode_attention.default_num_splits(seqs, 8, 132), decode_attention.default_config(seqs, 8, 132))
        for seqs in (8, 16, 17, 32, 33, 64)
    }
    assert launch[8] == (5, decode_attention.DEFAULT_DECODE_CONFIG)
    assert launch[16] == (3, decode_attention.DEFAULT_DECODE_CONFIG)  # 128 programs: one split would idle 4 SMs
    assert launch[17] == launch[32] == (1, decode_attention.FEW_PROGRAMS_DECODE_CONFIG)
    assert launch[33] == launch[64] == (1, decode_attention.DEFAULT_DECODE_CONFIG)


def test_sliding_layers_and_fixed_splits_keep_the_default_tiles():
    backend = TritonPagedAttention()
    device = torch.device("cpu")  # one SM: a batch of 1 sequence x 1 KV head is one program, below two an SM
    assert backend.decode_launch_config(1, 1, device) == decode_attention.FEW_PROGRAMS_DECODE_CONFIG
    assert backend.decode_launch_config(1, 1, device, window=256) == decode_attention.DEFAULT_DECODE_CONFIG
    # A split count fixed above one runs the reduce too: the default tiles, no variant of its own.
    assert TritonPagedAttention(3).decode_launch_config(1, 1, device) == decode_attention.DEFAULT_DECODE_CONFIG


@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize(("block_n", "block_size"), [(16, 16), (64, 16), (16, 64), (64, 128)])
def test_one_split_reading_the_block_table_a_tile_ahead_matches_reference(block_n, block_size, softcap):
    # Contexts ending inside a tile, on a tile's end and a token past it; cache blocks smaller and larger than a
    # tile; every unused cache slot holds NaN.
    config = dataclasses.replace(decode_attention.FEW_PROGRAMS_DECODE_CONFIG, block_n=block_n)
    step = random_step([1] * 5, [5, 64, 65, 130, 300], block_size, 2, seed=4)
    check_against_reference(step, TritonPagedAttention(1, config), softcap=softcap)


@pytest.mark.parametrize("programs", [1, 3, 64])
def test_a_persistent_grid_takes_every_sequence_and_head_in_turn(programs):
    # 5 sequences x 2 KV heads = 10 pairs: one program takes all of them, 3 take 4, 3 and 3, 64 leave most
    # programs without one.
    config = dataclasses.replace(decode_attention.DEFAULT_DECODE_CONFIG, programs=programs)
    step = random_step([1] * 5, [1, 17, 64, 65, 130], 16, 2, seed=5)
    check_against_reference(step, TritonPagedAttention(1, config))


def test_a_grid_of_heads_first_gives_the_same_output():
    # The grid's dimensions swapped (a sequence's KV heads side by side): every (sequence, head) pair once.
    step = random_step([1] * 5, [1, 17, 64, 65, 130], 16, 2, seed=6)
    heads_first = dataclasses.replace(decode_attention.DEFAULT_DECODE_CONFIG, heads_first=True)
    out = TritonPagedAttention(1, heads_first).forward(*step, scale=0.3)
    assert torch.equal(out, TritonPagedAttention(1).forward(*step, scale=0.3))
    check_against_reference(step, TritonPagedAttention(1, heads_first))


def test_decode_with_more_splits_than_context_tiles_matches_reference():
    # 8 splits over at most 3 tiles of 64 tokens: most split programs exit at once and the reduce
    # must ignore the partials they never wrote.
    step = random_step([1, 1, 1], [3, 64, 129], 16, 4, seed=1)
    check_against_reference(step, TritonPagedAttention(num_decode_splits=8))


def test_decode_and_prefill_kernels_agree_on_a_decode_step():
    q, k, v, k_cache, v_cache, meta = random_step([1, 1, 1], [9, 66, 200], 16, 2, seed=2)
    scale = 0.2
    decoded = TritonPagedAttention(num_decode_splits=3).forward(q, k, v, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)

    prefilled = prefill_attention.paged_prefill_attention(
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_query_lens, scale, out
    )

    torch.testing.assert_close(decoded, prefilled, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_m", [16, 64])
def test_a_decode_step_in_longest_first_order_writes_every_bit_as_in_batch_order(block_m):
    # `order`: programs take the sequences longest first, the spare programs none; each row's sums are the same
    # bits as in batch order.
    q, k, v, k_cache, v_cache, meta = random_step([1, 1, 1, 1, 1], [9, 200, 66, 131, 2], 16, 4, seed=3)
    decoded = TritonPagedAttention(num_decode_splits=1).forward(q, k, v, k_cache, v_cache, meta, 0.2)  # stores k, v
    config = prefill_attention.PrefillConfig(block_m=block_m)
    paged = (q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_query_lens, 0.2)
    in_batch_order = prefill_attention.paged_prefill_attention(*paged, torch.full_like(q, 7.0), config)
    order = torch.tensor([1, 3, 2, 0, 4], dtype=torch.int32)
    ordered = prefill_attention.paged_prefill_attention(*paged, torch.full_like(q, 7.0), config, order=order)
    assert torch.equal(ordered, in_batch_order)
    torch.testing.assert_close(ordered, decoded, atol=1e-5, rtol=1e-5)


def test_head_dim_16_and_block_size_larger_than_a_kv_tile():
    check_against_reference(random_step([3, 40], [50, 40], 128, 2, head_dim=16), TritonPagedAttention())
    check_against_reference(random_step([1, 1], [50, 140], 128, 2, head_dim=16), TritonPagedAttention())


def test_half_precision_inputs_give_outputs_in_their_dtype():
    # bf16 is checked on the GPU only: the interpreter's tl.dot multiplies bf16 bit patterns as integers.
    half = torch.float16
    check_against_reference(random_step([4, 1], [20, 33], 16, 2, dtype=half), TritonPagedAttention(), atol=2e-2)
    check_against_reference(random_step([1, 1], [20, 33], 16, 2, dtype=half), TritonPagedAttention(), atol=2e-2)


@pytest.mark.parametrize(
    ("splits", "config"),
    [
        (1, decode_attention.DEFAULT_DECODE_CONFIG),
        (1, decode_attention.FEW_PROGRAMS_DECODE_CONFIG),
        (4, decode_attention.DEFAULT_DECODE_CONFIG),
    ],
)
def test_padding_sequence_of_length_zero_decodes_to_zeros_not_nan(splits, config):
    # A CUDA-graph bucket larger than the batch pads with empty sequences whose token writes to block 0.
    q, k, v, k_cache, v_cache, meta = random_step([1, 1], [5, 12], 16, 2, seed=3)
    padded = AttentionMetadata(
        cu_query_lens=torch.arange(4, dtype=torch.int32),
        seq_lens=torch.tensor([5, 12, 0], dtype=torch.int32),
        block_tables=torch.cat([meta.block_tables, torch.zeros_like(meta.block_tables[:1])]),
        slot_mapping=torch.cat([meta.slot_mapping, torch.zeros(1, dtype=torch.int64)]),
        max_query_len=1,
        max_seq_len=12,
    )
    q, k, v = (torch.cat([t, torch.randn_like(t[:1])]) for t in (q, k, v))

    triton_attention.store_kv(k, v, k_cache, v_cache, padded.slot_mapping)
    out = torch.full_like(q, float("nan"))  # whatever a graph's memory pool last held
    decode_attention.paged_decode_attention(
        q, k_cache, v_cache, padded.block_tables, padded.seq_lens, padded.cu_query_lens, 0.25, splits, out, config
    )

    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert not out[:2].isnan().any()


@pytest.mark.parametrize(
    ("splits", "config"),
    [
        (1, decode_attention.DEFAULT_DECODE_CONFIG),
        (1, decode_attention.FEW_PROGRAMS_DECODE_CONFIG),
        (1, dataclasses.replace(decode_attention.DEFAULT_DECODE_CONFIG, programs=3)),
        (3, decode_attention.DEFAULT_DECODE_CONFIG),
    ],
)
def test_a_mixed_step_splits_its_rows_between_the_decode_and_varlen_kernels(splits, config):
    # Each kernel writes only its own rows (the others keep their NaN), and together they are the step.
    q, k, v, k_cache, v_cache, meta = step = random_step([4, 1, 6, 1], [4, 40, 70, 9], 16, 2, seed=7)
    triton_attention.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    tables = (meta.block_tables, meta.seq_lens, meta.cu_query_lens)
    one_token = torch.tensor([4, 11])

    decoded = torch.full_like(q, float("nan"))
    decode_attention.paged_decode_attention(q, k_cache, v_cache, *tables, 0.3, splits, decoded, config)
    chunked = torch.full_like(q, float("nan"))
    prefill_attention.paged_prefill_attention(q, k_cache, v_cache, *tables, 0.3, chunked, skip_single=True)

    written = ~decoded.isnan().any(-1).any(-1)
    assert torch.equal(written.nonzero().flatten(), one_token)
    assert torch.equal(chunked.isnan().any(-1).any(-1).nonzero().flatten(), one_token)
    decoded[~written] = chunked[~written]
    torch.testing.assert_close(decoded, TritonPagedAttention().forward(*step, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "config",
    [
        decode_attention.DEFAULT_DECODE_CONFIG,
        decode_attention.FEW_PROGRAMS_DECODE_CONFIG,
        dataclasses.replace(decode_attention.DEFAULT_DECODE_CONFIG, heads_first=False),
        dataclasses.replace(decode_attention.DEFAULT_DECODE_CONFIG, programs=3),
    ],
)
def test_programs_taking_the_longest_sequences_first_write_what_batch_order_writes(config):
    # Each sequence's rows come from the same arithmetic whichever program takes it: bit-equal, a mixed step's
    # chunk (skipped by the decode kernel) included.
    q, k, v, k_cache, v_cache, meta = random_step([1, 1, 6, 1, 1], [4, 70, 30, 9, 41], 16, 2, seed=11)
    triton_attention.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    tables = (meta.block_tables, meta.seq_lens, meta.cu_query_lens)
    in_batch_order = torch.full_like(q, float("nan"))
    decode_attention.paged_decode_attention(q, k_cache, v_cache, *tables, 0.3, 1, in_batch_order, config)
    longest_first = torch.argsort(meta.seq_lens, descending=True, stable=True).to(torch.int32)
    assert longest_first.tolist() == [1, 4, 2, 3, 0]
    for order in (longest_first, longest_first.flip(0)):
        out = torch.full_like(q, float("nan"))
        decode_attention.paged_decode_attention(q, k_cache, v_cache, *tables, 0.3, 1, out, config, order=order)
        assert torch.equal(out.nan_to_num(7.0), in_batch_order.nan_to_num(7.0))
    assert in_batch_order[[0, 1, 8, 9]].isfinite().all() and in_batch_order[2:8].isnan().all()


def _pad_like_a_mixed_graph(step, tokens: int, seqs: int):
    """`step` padded as io_slot.py pads a mixed graph's step: a one-token sequence in the scratch block per
    padding token while sequences last, zero-length sequences after that, and tokens past the last sequence's
    that belong to none. Padding q/k/v are NaN, as whatever an earlier graph left in the memory pool may be."""
    q, k, v, k_cache, v_cache, meta = step
    t, n = q.shape[0], meta.seq_lens.shape[0]
    padding = torch.arange(1, seqs - n + 1, dtype=torch.int32)
    padded = AttentionMetadata(
        cu_query_lens=torch.cat([meta.cu_query_lens, t + padding.clamp(max=tokens - t)]),
        seq_lens=torch.cat([meta.seq_lens, (padding <= tokens - t).to(torch.int32)]),
        block_tables=torch.cat(
            [meta.block_tables, torch.zeros((seqs - n, meta.block_tables.shape[1]), dtype=torch.int32)]
        ),
        slot_mapping=torch.cat([meta.slot_mapping, torch.zeros(tokens - t, dtype=torch.int64)]),
        max_query_len=meta.max_query_len,
        max_seq_len=meta.max_seq_len,
    )
    q, k, v = (torch.cat([x, torch.full((tokens - t, *x.shape[1:]), float("nan"))]) for x in (q, k, v))
    return q, k, v, k_cache, v_cache, padded


@pytest.mark.parametrize("backend", [TritonPagedAttention(), TorchPagedAttention()], ids=["triton", "torch"])
@pytest.mark.parametrize(("tokens", "seqs"), [(17, 7), (48, 5)], ids=["zero-length sequences", "tokens of no sequence"])
def test_a_step_padded_for_a_mixed_graph_leaves_every_real_token_bit_for_bit(backend, tokens, seqs):
    step = random_step([5, 1, 9], [5, 20, 30], 16, 2, seed=5)
    scale = 0.25
    unpadded = backend.forward(*step, scale)
    q, k, v, k_cache, v_cache, meta = _pad_like_a_mixed_graph(step, tokens, seqs)

    out = backend.forward(q, k, v, k_cache, v_cache, meta, scale)

    assert out.shape == q.shape
    assert torch.equal(out[:15], unpadded)
    assert not unpadded.isnan().any()


def test_store_puts_each_new_token_at_its_slot_and_nowhere_else():
    q, k, v, k_cache, v_cache, meta = random_step([6, 1, 9], [6, 30, 21], 4, 2, seed=4)
    before_k, before_v = k_cache.clone(), v_cache.clone()

    triton_attention.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)

    flat_k, flat_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    assert torch.equal(flat_k[meta.slot_mapping], k) and torch.equal(flat_v[meta.slot_mapping], v)
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[meta.slot_mapping] = False
    torch.testing.assert_close(flat_k[untouched], before_k.flatten(0, 1)[untouched], equal_nan=True)
    torch.testing.assert_close(flat_v[untouched], before_v.flatten(0, 1)[untouched], equal_nan=True)


def test_store_reads_k_and_v_as_strided_views_of_a_fused_qkv_projection():
    q, k, v, k_cache, v_cache, meta = random_step([3, 2], [3, 9], 16, 2, seed=5)
    fused = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    q_view, k_view, v_view = fused.split([q[0].numel(), k[0].numel(), v[0].numel()], dim=1)
    step = (q_view.view(q.shape), k_view.view(k.shape), v_view.view(v.shape), k_cache, v_cache, meta)

    check_against_reference(step, TritonPagedAttention())

    assert torch.equal(k_cache.flatten(0, 1)[meta.slot_mapping], k)


def test_unsupported_head_dim_is_refused_with_the_fix():
    q, k, v, k_cache, v_cache, meta = random_step([2], [2], 16, 1, head_dim=24)
    with pytest.raises(ValueError, match="power of two >= 16"):
        TritonPagedAttention().forward(q, k, v, k_cache, v_cache, meta, 1.0)


def test_small_tiles_match_reference_across_many_tiles_and_splits():
    backend = TritonPagedAttention(
        num_decode_splits=5,
        decode_config=decode_attention.DecodeConfig(block_n=16),
        prefill_config=prefill_attention.PrefillConfig(block_m=16, block_n=16),
    )
    check_against_reference(random_step([9, 1, 22], [41, 60, 22], 8, 4, seed=6), backend)
    check_against_reference(random_step([1, 1, 1], [41, 60, 99], 8, 4, seed=6), backend)
