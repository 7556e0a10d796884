"""Sizing and allocating the paged KV cache.

On a GPU the cache takes what is left of `gpu_memory_utilization` of the card after the weights and the
peak activations of the largest step, measured by running that step once. On CPU the budget is explicit
(`engine.kv_cache_gb`, default 1 GB), or a block count (`engine.num_kv_blocks`) on either device.
"""

from __future__ import annotations

import logging

import torch

from batchjob.engine.api import EngineSetupError
from batchjob.engine.native.layers.attention import make_metadata
from batchjob.engine.native.options import NativeOptions

log = logging.getLogger("batchjob.engine.native")
CPU_DEFAULT_KV_GB = 1.0


def allocate_kv_cache(spec, num_blocks: int, block_size: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    shape = (2, spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    cache = torch.zeros(shape, dtype=spec.cache_dtype, device=device)
    return [(cache[0, layer], cache[1, layer]) for layer in range(spec.num_layers)]


def profile_peak_bytes(model, spec, opts: NativeOptions, device: torch.device) -> int:
    """Peak device memory of the largest step this engine will run (a full token budget of prefill, and
    logits for every sequence)."""
    tokens = max(1, min(opts.max_num_batched_tokens, spec.max_model_len * opts.max_num_seqs))
    seq_len = min(tokens, spec.max_model_len)
    lengths = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
    blocks_per_seq = -(-seq_len // opts.block_size)
    scratch = allocate_kv_cache(spec, 1 + blocks_per_seq * len(lengths), opts.block_size, device)
    tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)) for i in range(len(lengths))]
    meta = make_metadata(lengths, lengths, tables, opts.block_size, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    ids = torch.zeros(tokens, dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])
    with torch.no_grad():
        hidden = model(ids, positions, meta, scratch)
        rows = min(opts.max_num_seqs, tokens)
        logits = model.compute_logits(hidden[:rows])
        logits.sort(dim=-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    # No empty_cache(): the blocks of this largest step stay cached for the eager steps to come. Handing them
    # back would make those steps cudaMalloc/cudaFree next to a near-full card, which blocks the CPU until
    # the step in flight ends and undoes the async overlap (measured on W2: eager launches 33 ms vs 9 ms).
    del scratch, hidden, logits
    return peak


def decide_num_blocks(model, spec, opts: NativeOptions, device: torch.device) -> int:
    block_bytes = spec.kv_bytes_per_token * opts.block_size
    if opts.num_kv_blocks is not None:
        return opts.num_kv_blocks
    if opts.kv_cache_gb is not None or device.type != "cuda":
        gb = opts.kv_cache_gb if opts.kv_cache_gb is not None else CPU_DEFAULT_KV_GB
        if device.type == "cuda":
            _check_fits(int(gb * 2**30), device)
        return max(2, int(gb * 2**30) // block_bytes)
    peak = profile_peak_bytes(model, spec, opts, device)
    free, total = torch.cuda.mem_get_info(device)
    # Memory outside torch's allocator (CUDA context, other processes) counts against the budget too.
    outside = total - free - torch.cuda.memory_reserved(device)
    budget = int(total * opts.gpu_memory_utilization) - peak - outside
    # The ranks of a tensor-parallel engine share one block manager: every rank takes the smallest count.
    num_blocks = model.tp.min_int(budget // block_bytes, device)
    if num_blocks < 2:
        raise EngineSetupError(no_room_for_kv_cache(peak, outside, total, opts.gpu_memory_utilization))
    log.info(
        "KV cache: %d blocks of %d tokens (%.1f GiB); weights+activations peak %.1f GiB of %.1f GiB",
        num_blocks,
        opts.block_size,
        num_blocks * block_bytes / 2**30,
        peak / 2**30,
        total / 2**30,
    )
    return num_blocks


# Above this, memory outside the engine is another process's, not only the CUDA context's.
_CONTEXT_BYTES = 2 * 2**30


def no_room_for_kv_cache(peak: int, outside: int, total: int, utilization: float) -> str:
    """Why no KV cache fits `utilization` of a `total`-byte GPU, and what to change."""
    gib = 2**30
    held = ""
    if outside > _CONTEXT_BYTES:
        held = (
            f", and {outside / gib:.1f} GiB of it is held outside this engine (another process on the same GPU: "
            "see nvidia-smi; free it, or give this job a GPU of its own)"
        )
    return (
        f"no GPU memory left for the KV cache: engine.gpu_memory_utilization={utilization} allows "
        f"{total * utilization / gib:.1f} GiB of {total / gib:.1f} GiB, the weights and the largest step take "
        f"{peak / gib:.1f} GiB{held}; raise engine.gpu_memory_utilization or lower engine.max_num_batched_tokens"
    )


def _check_fits(nbytes: int, device: torch.device) -> None:
    free, total = torch.cuda.mem_get_info(device)
    if nbytes > free:
        raise EngineSetupError(
            f"engine.kv_cache_gb={nbytes / 2**30:g} does not fit: {free / 2**30:.1f} GiB of the GPU's "
            f"{total / 2**30:.1f} GiB is free after the weights; lower engine.kv_cache_gb, or leave it null to "
            "size the cache from engine.gpu_memory_utilization"
        )
