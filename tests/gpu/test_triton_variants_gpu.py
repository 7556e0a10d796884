"""After one step of each layer kind (window on or off, soft-cap on or off), the attention kernels compile
nothing more, whatever the steps vary: batch size, lengths, decode splits, block-table width, buffer offsets
(metadata as views into packed buffers, as the engine's IO slots hold it), window and soft-cap values.

Run on a machine with a CUDA GPU:  python -m pytest tests/gpu -q
"""

from __future__ import annotations

import random

import pytest
import torch

if not torch.cuda.is_available():
    # Importing the kernels here, uninterpreted, would leave them unusable for the CPU interpreter tests.
    pytest.skip("needs CUDA", allow_module_level=True)

from attention_cases import packed_metadata, random_paged_step  # noqa: E402

from batchjob.engine.native.kernels import (
    decode_attention,  # noqa: E402
    prefill_attention,  # noqa: E402
    split_decode_attention,  # noqa: E402
)
from batchjob.engine.native.layers import triton_attention  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
KERNELS = {
    "store": triton_attention._store_kv_kernel,
    "decode": split_decode_attention._decode_split_kernel,
    "one_split": decode_attention._decode_one_split_kernel,
    "reduce": split_decode_attention._decode_reduce_kernel,
    "prefill": prefill_attention._prefill_kernel,
}
KINDS = [(0, 0.0), (256, 0.0), (0, 30.0), (256, 30.0)]  # (window, softcap) of each layer kind
# Variants one dtype and head layout may compile over all four kinds: the store knows no kind, the reduce
# only whether a window is on, and the one-split kernel (kinds without a window) one per soft-cap setting and
# launch shape (reading the block table a tile ahead below two programs a multiprocessor, or not).
MOST_VARIANTS = {"store": 1, "decode": 4, "one_split": 4, "reduce": 2, "prefill": 4}
# A head layout no other test compiles, so the counts start from this test's own launches.
HEADS = dict(num_heads=12, num_kv_heads=4, head_dim=64)


def compiled_variants() -> dict[str, int]:
    return {name: sum(len(caches[0]) for caches in kernel.device_caches.values()) for name, kernel in KERNELS.items()}


def run_step(dtype, query_lens, seq_lens, splits, offset, width, window, softcap, seed) -> None:
    q, k, v, k_cache, v_cache, meta = random_paged_step(
        query_lens, seq_lens, 16, dtype=dtype, device=DEVICE, seed=seed, **HEADS
    )
    meta = packed_metadata(meta, offset, max(width, meta.block_tables.shape[1]))
    backend = triton_attention.TritonPagedAttention(num_decode_splits=splits)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.125, window=window, softcap=softcap)
    assert not out.isnan().any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nothing_compiles_after_one_step_of_each_layer_kind(dtype):
    before = compiled_variants()
    for window, softcap in KINDS:
        run_step(dtype, [1, 1], [5, 40], None, 0, 0, window, softcap, seed=0)
        run_step(dtype, [1, 1], [5, 40], 1, 0, 0, window, softcap, seed=0)  # as a batch too wide to split
        run_step(dtype, [1] * 40, [30] * 40, None, 0, 0, window, softcap, seed=0)  # one split, table read ahead
        run_step(dtype, [7, 1], [7, 30], None, 0, 0, window, softcap, seed=0)
    warmed = compiled_variants()
    assert all(warmed[name] - before[name] <= MOST_VARIANTS[name] for name in KERNELS), (before, warmed)

    rng = random.Random(0)
    for seed in range(40):
        window, softcap = rng.choice(KINDS)
        window = window and rng.choice([1, 100, 256, 5000])
        softcap = softcap and rng.choice([5.0, 30.0, 50.0])
        # 1 and multiples of 16 are what Triton specialises integers on; default splits vary with the batch.
        num_seqs = rng.choice([1, 2, 3, 15, 16, 17, 32, 33, 66, 100])
        seq_lens = [rng.randint(1, 600) for _ in range(num_seqs)]
        decode = rng.random() < 0.5
        query_lens = [1] * num_seqs if decode else [rng.randint(1, s) for s in seq_lens]
        splits = rng.choice([None, None, 1, 16])
        offset, width = rng.randint(0, 7), rng.choice([0, 48, 64, 129])
        run_step(dtype, query_lens, seq_lens, splits, offset, width, window, softcap, seed)

    assert compiled_variants() == warmed
