"""Paged-attention steps shared by the CPU (interpreter) and GPU kernel tests: a sliding window's forgotten
past, metadata laid out the way the engine's IO slots hold it, random steps at real sizes and a vectorised
float64 reference for them."""

from __future__ import annotations

import torch

from batchjob.engine.native.layers.attention import AttentionMetadata, make_metadata


def forget_outside_windows(k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, window: int) -> None:
    """NaN in every cached key and value no query of the step can see through a `window` (what the cache may
    hold once blocks out of every window are freed and reused): a kernel that reads one poisons its output.
    A window of 0 (none) forgets nothing."""
    if window <= 0:
        return
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


def random_paged_step(
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
):
    """Random cached context in shuffled blocks (block 0 reserved, NaN in unused slots) plus new q/k/v:
    (q, k, v, k_cache, v_cache, meta)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 8
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, start = [], 0
    for n in blocks_needed:
        tables.append(order[start : start + n])
        start += n
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    for table, seq_len, q_len in zip(tables, seq_lens, query_lens, strict=True):
        cached = torch.arange(seq_len - q_len)
        blocks, offsets = torch.tensor(table)[cached // block_size], cached % block_size
        k_cache[blocks, offsets] = torch.randn(len(cached), num_kv_heads, head_dim, generator=gen).to(device, dtype)
        v_cache[blocks, offsets] = torch.randn(len(cached), num_kv_heads, head_dim, generator=gen).to(device, dtype)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    return q, k, v, k_cache, v_cache, make_metadata(query_lens, seq_lens, tables, block_size, device=device)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """float64 attention per sequence on the tensors' device, K/V gathered through the block table of a cache
    copy holding the step's K/V: the dense_reference_attention semantics, vectorised per sequence for sizes
    where a loop per query would be slow. Keys no query sees may be NaN (see forget_outside_windows)."""
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    k_all = k_cache.double().flatten(0, 1).clone()
    v_all = v_cache.double().flatten(0, 1).clone()
    k_all[meta.slot_mapping] = k.double()
    v_all[meta.slot_mapping] = v.double()
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    cu = meta.cu_query_lens.tolist()
    for b, seq_len in enumerate(meta.seq_lens.tolist()):
        positions = torch.arange(seq_len, device=q.device)
        slots = meta.block_tables[b].long()[positions // block_size] * block_size + positions % block_size
        keys = k_all[slots].repeat_interleave(group, dim=1)  # [S, Hq, D]
        values = v_all[slots].repeat_interleave(group, dim=1)
        query = q[cu[b] : cu[b + 1]].double()  # [Q, Hq, D]
        query_pos = seq_len - query.shape[0] + torch.arange(query.shape[0], device=q.device)
        hidden = positions[None, :] > query_pos[:, None]  # [Q, S]
        if window > 0:
            hidden |= positions[None, :] <= query_pos[:, None] - window
        # Hidden keys get probability 0, but 0 * NaN is NaN: forgotten (NaN) keys and values become zeros.
        scores = torch.einsum("qhd,shd->hqs", query, keys.nan_to_num()) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        probs = scores.masked_fill(hidden[None], float("-inf")).softmax(-1)
        out[cu[b] : cu[b + 1]] = torch.einsum("hqs,shd->qhd", probs, values.nan_to_num())
    return out
