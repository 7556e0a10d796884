"""The compiled Triton paged-attention kernels on a GPU at real sizes: bf16 within ~1e-2 of a float64 dense
reference, fp32 tight, and a captured decode graph that replays correctly with other lengths."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    # Importing the kernels here, uninterpreted, would leave them unusable for the CPU interpreter tests.
    pytest.skip("needs CUDA", allow_module_level=True)

from batchjob.engine.native.attention import AttentionMetadata, make_metadata  # noqa: E402
from batchjob.engine.native.triton_attention import TritonPagedAttention, store_kv  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")


def random_step(query_lens, seq_lens, block_size, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    """Random cached context in shuffled blocks (block 0 reserved, NaN in unused slots) plus new q/k/v."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 8
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, start = [], 0
    for n in blocks_needed:
        tables.append(order[start : start + n])
        start += n
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    for table, seq_len, q_len in zip(tables, seq_lens, query_lens, strict=True):
        cached = torch.arange(seq_len - q_len)
        blocks, offsets = torch.tensor(table)[cached // block_size], cached % block_size
        k_cache[blocks, offsets] = torch.randn(len(cached), num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
        v_cache[blocks, offsets] = torch.randn(len(cached), num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(DEVICE, dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    return q, k, v, k_cache, v_cache, make_metadata(query_lens, seq_lens, tables, block_size, device=DEVICE)


def reference(q, k, v, k_cache, v_cache, meta, scale) -> torch.Tensor:
    """float64 causal attention per sequence on the GPU, K/V gathered through the block table of a cache
    copy holding the step's K/V (the dense_reference_attention semantics, vectorised per sequence)."""
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
        scores = torch.einsum("qhd,shd->hqs", query, keys) * scale
        scores = scores.masked_fill(positions[None, None, :] > query_pos[None, :, None], float("-inf"))
        out[cu[b] : cu[b + 1]] = torch.einsum("hqs,shd->qhd", scores.softmax(-1), values)
    return out


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.double() - expected).norm() / expected.norm()).item()


LLAMA_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128)


@pytest.mark.parametrize(("num_seqs", "context"), [(64, 1024), (32, 1152)])
def test_bf16_decode_at_llama_8b_shape_matches_reference(num_seqs, context):
    gen = torch.Generator().manual_seed(num_seqs)
    seq_lens = (context - torch.randint(0, 300, (num_seqs,), generator=gen)).tolist()
    step = random_step([1] * num_seqs, seq_lens, 16, dtype=torch.bfloat16, **LLAMA_8B)
    out = TritonPagedAttention().forward(*step, scale=128**-0.5)
    assert relative_error(out, reference(*step, scale=128**-0.5)) < 1e-2


@pytest.mark.parametrize("block_size", [16, 1, 256])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(32, 8, 128), (16, 8, 64), (8, 8, 128)])
def test_bf16_mixed_prefill_and_decode_batch_matches_reference(block_size, num_heads, num_kv_heads, head_dim):
    query_lens = [1, 1, 37, 513, 1000, 1, 250]
    seq_lens = [1, 777, 37, 1300, 1000, 2049, 251]
    step = random_step(query_lens, seq_lens, block_size, num_heads, num_kv_heads, head_dim, torch.bfloat16)
    scale = head_dim**-0.5
    out = TritonPagedAttention().forward(*step, scale=scale)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, reference(*step, scale=scale)) < 1e-2


def test_fp32_prefill_and_decode_match_reference_tightly():
    # The fp32 engine is compared token for token with transformers: no TF32 anywhere.
    prefill = random_step([5, 300, 1], [5, 700, 90], 16, dtype=torch.float32, **LLAMA_8B)
    decode = random_step([1] * 8, [3, 64, 65, 500, 1025, 7, 9, 2000], 16, dtype=torch.float32, **LLAMA_8B)
    for step in (prefill, decode):
        out = TritonPagedAttention().forward(*step, scale=0.088)
        torch.testing.assert_close(out.double(), reference(*step, scale=0.088), atol=2e-5, rtol=2e-5)


def test_store_writes_every_token_at_its_slot():
    q, k, v, k_cache, v_cache, meta = random_step([100, 1, 33], [300, 20, 33], 16, dtype=torch.bfloat16, **LLAMA_8B)
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    assert torch.equal(k_cache.flatten(0, 1)[meta.slot_mapping], k)
    assert torch.equal(v_cache.flatten(0, 1)[meta.slot_mapping], v)


def test_captured_decode_graph_replays_with_other_seq_lens():
    num_seqs, max_blocks, block_size, scale = 16, 160, 16, 128**-0.5
    backend = TritonPagedAttention()
    # Static inputs the graph reads; each replay rewrites them in place, as the engine's IO slots do.
    first = random_step(
        [1] * num_seqs, [5 + 3 * i for i in range(num_seqs)], block_size, dtype=torch.bfloat16, **LLAMA_8B
    )
    q, k, v = (t.clone() for t in first[:3])
    num_blocks = num_seqs * max_blocks + 1
    k_cache = torch.zeros(num_blocks, block_size, 8, 128, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    meta = AttentionMetadata(
        cu_query_lens=torch.arange(num_seqs + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.ones(num_seqs, dtype=torch.int32, device=DEVICE),
        block_tables=torch.zeros(num_seqs, max_blocks, dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.zeros(num_seqs, dtype=torch.int64, device=DEVICE),
        max_query_len=1,
        max_seq_len=1,
    )

    def load(step) -> None:
        """Copy a random step into the static buffers: its context into the big cache, lengths and tables."""
        sq, sk, sv, sk_cache, sv_cache, smeta = step
        for dst, src in ((q, sq), (k, sk), (v, sv)):
            dst.copy_(src)
        k_cache[: sk_cache.shape[0]].copy_(sk_cache.nan_to_num())
        v_cache[: sv_cache.shape[0]].copy_(sv_cache.nan_to_num())
        meta.seq_lens.copy_(smeta.seq_lens)
        meta.block_tables.zero_()
        meta.block_tables[:, : smeta.block_tables.shape[1]].copy_(smeta.block_tables)
        meta.slot_mapping.copy_(smeta.slot_mapping)

    load(first)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile and warm up outside the capture
            backend.forward(q, k, v, k_cache, v_cache, meta, scale)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, k_cache, v_cache, meta, scale)

    gen = torch.Generator().manual_seed(7)
    for seed, longest in ((1, 40), (2, 2500), (3, 700)):
        # Contexts far longer (and shorter) than at capture: more tiles, more live splits, same launch.
        lens = torch.randint(1, longest, (num_seqs,), generator=gen).tolist()
        step = random_step([1] * num_seqs, lens, block_size, dtype=torch.bfloat16, seed=seed, **LLAMA_8B)
        load(step)
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(out, reference(*step, scale=scale)) < 1e-2
        assert torch.equal(k_cache.flatten(0, 1)[meta.slot_mapping], k)
