"""The CUDA attention backend: Triton kernels over the paged KV cache.

`TritonPagedAttention.forward` stores this step's K/V at `slot_mapping`, then runs the split-K decode
kernels over the step's one-token sequences (all of them in a decode step) and, when the step carries
prefill chunks, the varlen prefill kernel over the rest. In a mixed step of an 8B model with 256 decodes
at 1,300 tokens of context and four 1,024-token prompts, the two launches took 498 us a layer on an H200
against 610 us for the varlen kernel over everything (docs/history/benchmarks-2026.md).

A layer's sliding window and soft-cap are runtime arguments: each kernel compiles once per dtype, head
layout and (window on, soft-cap on) combination, never per value, batch size, length or buffer offset, so
a warm-up that runs each layer kind once leaves nothing to compile during the run.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from batchjob.engine.native.kernels.attention_tile import cache_value
from batchjob.engine.native.kernels.decode_attention import (
    DEFAULT_DECODE_CONFIG,
    MAX_SPLITS,
    DecodeConfig,
    default_config,
    default_num_splits,
    paged_decode_attention,
)
from batchjob.engine.native.kernels.prefill_attention import (
    DEFAULT_PREFILL_CONFIG,
    PrefillConfig,
    paged_prefill_attention,
)

if TYPE_CHECKING:
    from batchjob.engine.native.layers.attention import AttentionMetadata

# The varlen kernel's launch under `engine.deterministic`, where it takes every token, a decode step's included
# (most of its work in a mixed workload). One config serves every step, so a token's sums are the same in any. A
# decode's one token packs 4 of a program's rows where a 1B's 4 query heads share a KV head, so a program of 16
# rows, not the default's 64, wastes less of each tile's dots: at 256 / 512 decodes of a 1B (contexts of 64-1,536
# tokens) a layer took 170.9 / 318.9 us against 185.9 / 340.8 in 64 rows, on one H100
# (`scripts/dev/decode_attention_shapes.py --deterministic`, docs/benchmarks.md).
DETERMINISTIC_PREFILL_CONFIG = PrefillConfig(block_m=16, block_n=64, num_warps=4, num_stages=2)


# Each step's slot mapping is a view at a step-dependent offset in a packed buffer: not specialising on its
# alignment keeps one compiled variant.
@triton.jit(do_not_specialize_on_alignment=["slot_mapping_ptr"])
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    # A negative slot means "no cache entry" (vLLM's convention); the engine's padding uses block 0 instead.
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_P2)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h < NUM_KV_HEADS)[:, None]
    k = tl.load(k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = block * stride_kcb + in_block * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    v_dst = block * stride_vcb + in_block * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(k_cache_ptr + k_dst, cache_value(k, k_cache_ptr), mask=mask)
    tl.store(v_cache_ptr + v_dst, cache_value(v, v_cache_ptr), mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write `k`, `v` [T, Hkv, D] into the caches [num_blocks, block_size, Hkv, D] at flat slots [T]."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    _store_kv_kernel[(k.shape[0],)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_P2=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        num_warps=4,
    )


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the Triton interpreter on CPU: few programs keep tests fast
    return torch.cuda.get_device_properties(device).multi_processor_count


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_attention_shapes(q: torch.Tensor, k: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Raise ValueError for a layout the kernels cannot run, naming what to change."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {num_kv_heads} KV heads")
    if head_dim < 16 or not _is_power_of_two(head_dim) or q.shape[2] != head_dim or k.shape[2] != head_dim:
        raise ValueError(
            f"head_dim must be a power of two >= 16 and equal in q, k and the cache "
            f"(q {q.shape[2]}, k {k.shape[2]}, cache {head_dim}); use the torch attention backend for others"
        )
    if not _is_power_of_two(block_size):
        raise ValueError(f"KV block size {block_size} is not a power of two; choose e.g. 16")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("q, k, v and the caches need a contiguous last (head_dim) dimension")


class TritonPagedAttention:
    """PagedAttentionBackend on CUDA (also runs under TRITON_INTERPRET=1 on CPU, for tests).

    `num_decode_splits` fixes the decode split count and `decode_config` its launch shape; by default both come
    from the batch size and the SM count only, so every replay of a captured decode graph launches identically.
    The rope kernel writes each step's keys and values into the cache (`kv_from_rope`), one launch fewer a layer.

    `deterministic` (engine.deterministic): every token, decodes included, goes through the varlen kernel with
    every key tile masked, so a token's attention is computed alike whatever the step (the decode kernels split a
    context by the batch size).
    """

    kv_from_rope = True

    def __init__(
        self,
        num_decode_splits: int | None = None,
        decode_config: DecodeConfig | None = None,
        prefill_config: PrefillConfig | None = None,
        deterministic: bool = False,
    ) -> None:
        if num_decode_splits is not None and not 1 <= num_decode_splits <= MAX_SPLITS:
            raise ValueError(f"num_decode_splits must be in [1, {MAX_SPLITS}], got {num_decode_splits}")
        self.num_decode_splits = num_decode_splits
        self.decode_config = decode_config
        self.prefill_config = prefill_config or (
            DETERMINISTIC_PREFILL_CONFIG if deterministic else DEFAULT_PREFILL_CONFIG
        )
        self.deterministic = deterministic

    def decode_splits(self, num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
        if self.num_decode_splits is not None:
            return self.num_decode_splits
        return default_num_splits(num_seqs, num_kv_heads, _sm_count(device))

    def decode_launch_config(
        self, num_seqs: int, num_kv_heads: int, device: torch.device, window: int = 0
    ) -> DecodeConfig:
        """The decode kernel's launch shape: the one given, else by the batch size. Only a one-split launch without
        a window takes `default_config`'s choice (sliding layers and split counts above one run the split kernel
        in the default tiles: another launch shape there would compile variants of its own)."""
        if self.decode_config is not None:
            return self.decode_config
        if window > 0 or self.decode_splits(num_seqs, num_kv_heads, device) != 1:
            return DEFAULT_DECODE_CONFIG
        return default_config(num_seqs, num_kv_heads, _sm_count(device))

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
        check_attention_shapes(q, k, k_cache)
        if window < 0 or softcap < 0:
            raise ValueError(f"window ({window}) and softcap ({softcap}) must be >= 0 (0 turns each off)")
        if not kv_stored:
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        # Every step's one-token sequences go through the decode kernels; a mixed step's chunks then through
        # the varlen kernel, which skips those rows (it would read their context a third slower).
        paged = (q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_query_lens, scale)
        if self.deterministic:
            return paged_prefill_attention(
                *paged, out, self.prefill_config, window=window, softcap=softcap, mask_every_tile=True
            )
        num_seqs, num_kv_heads = meta.seq_lens.shape[0], k_cache.shape[2]
        num_splits = self.decode_splits(num_seqs, num_kv_heads, q.device)
        config = self.decode_launch_config(num_seqs, num_kv_heads, q.device, window)
        paged_decode_attention(*paged, num_splits, out, config, window=window, softcap=softcap, order=meta.decode_order)
        if meta.max_query_len == 1:
            return out
        return paged_prefill_attention(
            *paged, out, self.prefill_config, window=window, softcap=softcap, skip_single=True
        )
