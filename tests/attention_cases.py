"""Paged-attention steps shared by the CPU (interpreter) and GPU kernel tests: a sliding window's forgotten
past, and metadata laid out the way the engine's IO slots hold it."""

from __future__ import annotations

import torch

from batchjob.engine.native.attention import AttentionMetadata


def forget_outside_windows(k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, window: int) -> None:
    """NaN in every cached key and value no query of the step can see through a `window` (what the cache may
    hold once blocks out of every window are freed and reused): a kernel that reads one poisons its output."""
    block_size = k_cache.shape[1]
    cu = meta.cu_query_lens.tolist()
    for b, seq_len in enumerate(meta.seq_lens.tolist()):
        first_query = seq_len - (cu[b + 1] - cu[b])
        unseen = torch.arange(max(0, first_query - window + 1))
        table = meta.block_tables[b].long().cpu()
        blocks, offsets = table[unseen // block_size], unseen % block_size
        k_cache[blocks.to(k_cache.device), offsets.to(k_cache.device)] = float("nan")
        v_cache[blocks.to(v_cache.device), offsets.to(v_cache.device)] = float("nan")


def packed_metadata(meta: AttentionMetadata, offset: int, table_width: int) -> AttentionMetadata:
    """`meta` as the engine's IO slots lay it out: `cu_query_lens` and `seq_lens` one after the other in one
    int32 buffer and `slot_mapping` in an int64 buffer, both from element `offset` (so any 4- or 8-byte
    alignment), and block tables `table_width` columns wide (a profile run and the real run differ there)."""
    device = meta.seq_lens.device
    num_seqs, num_tokens = meta.seq_lens.shape[0], meta.slot_mapping.shape[0]
    ints = torch.zeros(offset + 2 * num_seqs + 1, dtype=torch.int32, device=device)
    cu_query_lens = ints[offset : offset + num_seqs + 1]
    seq_lens = ints[offset + num_seqs + 1 :]
    cu_query_lens.copy_(meta.cu_query_lens)
    seq_lens.copy_(meta.seq_lens)
    slots = torch.zeros(offset + num_tokens, dtype=torch.int64, device=device)
    slots[offset:].copy_(meta.slot_mapping)
    tables = torch.zeros(num_seqs, table_width, dtype=torch.int32, device=device)
    tables[:, : meta.block_tables.shape[1]].copy_(meta.block_tables)
    return AttentionMetadata(
        cu_query_lens=cu_query_lens,
        seq_lens=seq_lens,
        block_tables=tables,
        slot_mapping=slots[offset:],
        max_query_len=meta.max_query_len,
        max_seq_len=meta.max_seq_len,
    )
