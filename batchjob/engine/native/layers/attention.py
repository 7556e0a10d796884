"""Paged attention: the per-step metadata every backend reads, the CPU (plain torch) backend, and a float64
reference that tests of every backend compare against.

KV cache layout, per layer: `k_cache`, `v_cache` of shape [num_blocks, block_size, num_kv_heads, head_dim];
token slot `s` is block `s // block_size`, offset `s % block_size`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """One flat (varlen) step: B sequences, T = sum of their new tokens.

    Query token j of sequence b (j in [0, q_len_b)) sits at position seq_len_b - q_len_b + j and attends
    causally to cache positions [0, that position]. Padding tokens (CUDA graphs) write to block 0, which the
    block manager reserves as a scratch block; their outputs are ignored. A padded step may have sequences of
    no new token, and tokens past `cu_query_lens[B]` that belong to no sequence: their output is undefined
    (zero on the CPU backend; the Triton kernels leave it unwritten).
    """

    cu_query_lens: torch.Tensor  # int32 [B+1], prefix sums of new-token counts (decode sequence: 1 token)
    seq_lens: torch.Tensor  # int32 [B], context length after this step (cached + new tokens)
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_seq], physical block ids; unused entries: any valid id
    slot_mapping: torch.Tensor  # int64 [T], flat cache slot where each new token's K/V goes
    max_query_len: int  # host-side bounds, for the CPU path and kernel choice; never needed on device
    max_seq_len: int
    # int32 [B], the sequences longest context first: a decode kernel's programs start the longest first, so
    # the GPU does not end a layer waiting on a few long sequences started last. None: in batch order.
    decode_order: torch.Tensor | None = None


class PagedAttentionBackend(Protocol):
    # Whether the rope kernel may write each step's keys and values into the cache for this backend (then
    # `forward` gets kv_stored=True and skips its own store).
    kv_from_rope: bool

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,  # > 0: a query at position p attends only keys at positions > p - window (sliding window)
        softcap: float = 0.0,  # > 0: scores become softcap * tanh(scores / softcap) before the softmax (Gemma 2)
        kv_stored: bool = False,  # k, v are already in the cache (written by the rope kernel)
    ) -> torch.Tensor:  # [T, Hq, D]; k, v are stored at meta.slot_mapping first (unless kv_stored)
        ...


def longest_first(seq_lens: Sequence[int] | np.ndarray) -> np.ndarray:
    """The sequences' indices by context length, longest first, ties in batch order: `decode_order`."""
    return np.argsort(-np.asarray(seq_lens), kind="stable")


def make_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: str | torch.device = "cpu",
) -> AttentionMetadata:
    """Metadata from per-sequence host lists (tests, simple callers); ragged block tables are 0-padded."""
    if not (len(query_lens) == len(seq_lens) == len(block_tables)):
        raise ValueError(
            f"one entry per sequence expected: {len(query_lens)} query lens, {len(seq_lens)} seq lens, "
            f"{len(block_tables)} block tables"
        )
    width = max(len(table) for table in block_tables)
    slots = []
    for q_len, seq_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        if not 0 < q_len <= seq_len <= len(table) * block_size:
            raise ValueError(f"need 0 < query len ({q_len}) <= seq len ({seq_len}) <= blocks * block_size")
        new_positions = range(seq_len - q_len, seq_len)
        slots += [table[p // block_size] * block_size + p % block_size for p in new_positions]
    cu = [0]
    for q_len in query_lens:
        cu.append(cu[-1] + q_len)
    return AttentionMetadata(
        cu_query_lens=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        block_tables=torch.tensor(
            [list(t) + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32, device=device
        ),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        decode_order=torch.tensor(longest_first(seq_lens), dtype=torch.int32, device=device),
    )


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    for x, cache in ((k, k_cache), (v, v_cache)):
        # torch has no index_copy_ for e4m3 on CPU: its bytes are copied instead
        _bytes(cache).view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, _bytes(cache_values(x, cache.dtype)))


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x


def cache_values(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in the KV cache's dtype; into an e4m3 cache (a scale of 1) it saturates at +-448 (torch's cast would
    make NaN of what lies beyond)."""
    if dtype == torch.float8_e4m3fn:
        return x.float().clamp(-448.0, 448.0).to(dtype)
    return x.to(dtype)


class TorchPagedAttention:
    """Plain-torch paged attention, for CPU runs and as a portable fallback.

    All sequences of a step go through one SDPA call: queries are padded to [B, max_query_len] and each
    sequence's blocks gathered to [B, max_seq_len], with a mask that is causal with the per-sequence offset
    (and the sliding window, if any). Soft-capped scores are computed without SDPA, which cannot cap them.
    The host bounds in the metadata size the padding, so this path is not for CUDA-graph capture.

    `deterministic` (engine.deterministic): each query token is computed on its own, the same way whatever the
    step holds (one padded SDPA call over the step would round a token's sums by the step's shape).
    """

    kv_from_rope = False

    def __init__(self, deterministic: bool = False) -> None:
        self.deterministic = deterministic

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        if not kv_stored:
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if self.deterministic:
            return _per_token_attention(q, k_cache, v_cache, meta, scale, window, softcap)
        num_tokens, num_heads, head_dim = q.shape
        num_seqs = meta.seq_lens.shape[0]
        block_size = k_cache.shape[1]
        device = q.device

        cu = meta.cu_query_lens.long()
        query_lens = cu[1:] - cu[:-1]
        owned = int(cu[-1])  # the tokens of some sequence; those after them are a padded step's spare ones
        token_seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), query_lens)
        token_idx = torch.arange(owned, device=device) - cu[token_seq]
        q_pad = q.new_zeros(num_seqs, meta.max_query_len, num_heads, head_dim)
        q_pad[token_seq, token_idx] = q[:owned]

        num_blocks = -(-meta.max_seq_len // block_size)
        blocks = meta.block_tables[:, :num_blocks].long()
        keys = _bytes(k_cache)[blocks].view(k_cache.dtype).flatten(1, 2)[:, : meta.max_seq_len]  # [B, S, Hkv, D]
        values = _bytes(v_cache)[blocks].view(v_cache.dtype).flatten(1, 2)[:, : meta.max_seq_len]
        key_pos = torch.arange(meta.max_seq_len, device=device)
        seq_lens = meta.seq_lens.long()
        # Slots past a sequence's length hold another sequence's data or uninitialised memory (maybe NaN);
        # a masked score still multiplies its value by 0, and 0 * NaN poisons the output, so zero them.
        in_context = (key_pos[None, :] < seq_lens[:, None])[:, :, None, None]
        keys = torch.where(in_context, keys, 0).to(q.dtype)
        values = torch.where(in_context, values, 0).to(q.dtype)

        query_offsets = torch.arange(meta.max_query_len, device=device)
        query_pos = (seq_lens - query_lens)[:, None] + query_offsets[None, :]
        mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [B, Q, S]; padded queries see >= position 0
        if window > 0:
            mask &= key_pos[None, None, :] > query_pos[:, :, None] - window
        if softcap > 0:
            out = _softcapped_attention(q_pad.transpose(1, 2), keys, values, mask, scale, softcap)
        else:
            out = F.scaled_dot_product_attention(
                q_pad.transpose(1, 2),
                keys.transpose(1, 2),
                values.transpose(1, 2),
                attn_mask=mask[:, None],
                scale=scale,
                enable_gqa=num_heads != keys.shape[2],
            )
        out = out.transpose(1, 2)[token_seq, token_idx]
        return F.pad(out, (0, 0, 0, 0, 0, num_tokens - owned))


def _per_token_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int,
    softcap: float,
) -> torch.Tensor:
    """Each query token's attention alone, its sums over head_dim and over its keys shaped by its position only
    (elementwise products summed by torch's reductions: no BLAS kernel chosen by the step's shape). Tokens past
    the sequences' (a padded step's spare ones) are 0."""
    out = torch.zeros_like(q)
    block_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    cu = meta.cu_query_lens.tolist()
    for b, seq_len in enumerate(meta.seq_lens.tolist()):
        positions = torch.arange(seq_len, device=q.device)
        slots = meta.block_tables[b].long()[positions // block_size] * block_size + positions % block_size
        keys = _bytes(k_cache).flatten(0, 1)[slots].view(k_cache.dtype).to(q.dtype).repeat_interleave(group, dim=1)
        values = _bytes(v_cache).flatten(0, 1)[slots].view(v_cache.dtype).to(q.dtype).repeat_interleave(group, dim=1)
        keys, values = keys.transpose(0, 1), values.transpose(0, 1).float()  # [Hq, S, D]
        q_len = cu[b + 1] - cu[b]
        for j in range(q_len):
            position = seq_len - q_len + j
            first = max(0, position - window + 1) if window > 0 else 0
            token = cu[b] + j
            scores = (q[token][:, None, :] * keys[:, first : position + 1]).sum(-1).float() * scale  # [Hq, S]
            if softcap > 0:
                scores = softcap * torch.tanh(scores / softcap)
            probs = torch.softmax(scores, dim=-1)
            out[token] = (probs[..., None] * values[:, first : position + 1]).sum(1).to(q.dtype)
    return out


def _softcapped_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """q [B, Hq, Q, D], keys/values [B, S, Hkv, D], mask [B, Q, S] -> [B, Hq, Q, D], rounded as transformers'
    eager attention is (softmax in float32, probabilities in the model dtype)."""
    group = q.shape[1] // keys.shape[2]
    keys = keys.transpose(1, 2).repeat_interleave(group, dim=1)
    values = values.transpose(1, 2).repeat_interleave(group, dim=1)
    scores = torch.matmul(q, keys.transpose(2, 3)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, values)


def dense_reference_attention(
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
    """What every backend must compute, written as plainly as possible in float64: same arguments as
    `PagedAttentionBackend.forward`, but the caches are left untouched (the step's K/V are written into a
    copy). Returns float64 [T, Hq, D]. One Python loop iteration per query token: tests only."""
    k_all = k_cache.double().flatten(0, 1).clone()
    v_all = v_cache.double().flatten(0, 1).clone()
    k_all[meta.slot_mapping] = k.double()
    v_all[meta.slot_mapping] = v.double()
    block_size = k_cache.shape[1]
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    cu = meta.cu_query_lens.tolist()
    for b, seq_len in enumerate(meta.seq_lens.tolist()):
        positions = torch.arange(seq_len)
        table = meta.block_tables[b].long().cpu()
        slots = table[positions // block_size] * block_size + positions % block_size
        keys = k_all[slots.to(k_all.device)].cpu().repeat_interleave(group, dim=1)  # [S, Hq, D]
        values = v_all[slots.to(v_all.device)].cpu().repeat_interleave(group, dim=1)
        q_len = cu[b + 1] - cu[b]
        for j in range(q_len):
            position = seq_len - q_len + j
            first = max(0, position - window + 1) if window > 0 else 0
            query = q[cu[b] + j].double().cpu()  # [Hq, D]
            scores = torch.einsum("hd,shd->hs", query, keys[first : position + 1]) * scale
            if softcap > 0:
                scores = softcap * torch.tanh(scores / softcap)
            out[cu[b] + j] = torch.einsum("hs,shd->hd", scores.softmax(-1), values[first : position + 1])
    return out
