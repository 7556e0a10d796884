"""The Triton paged-attention kernels built for the CPU interpreter, with the random paged steps and the
reference check their tests share. Import it only after skipping on CUDA machines (there the compiled kernels
are tested by tests/gpu)."""

from __future__ import annotations

import os

# Kernels are built as interpreted or compiled when their module is imported, so this must come first.
os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402
import random  # noqa: E402

import torch  # noqa: E402
from triton.runtime import interpreter  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from batchjob.engine.native.kernels import (  # noqa: E402
    attention_tile,
    decode_attention,
    prefill_attention,
    split_decode_attention,
)
from batchjob.engine.native.layers import triton_attention  # noqa: E402
from batchjob.engine.native.layers.attention import dense_reference_attention, make_metadata  # noqa: E402

if not isinstance(decode_attention._decode_one_split_kernel, InterpretedFunction):
    # Another test module imported the kernels before the interpreter was switched on; on a CPU-only
    # machine compiled kernels cannot run at all, so rebuild them interpreted (helpers first).
    for module in (attention_tile, split_decode_attention, decode_attention, prefill_attention, triton_attention):
        importlib.reload(module)


def _patch_lang_tensor_for_numpy_2_4(tensor, scope) -> None:
    """triton 3.6's interpreter turns a scalar (a 1-element array) into a loop bound with `int(array)`,
    which numpy >= 2.4 refuses; `.item()` works on any numpy (upstream triton-lang/triton#9171)."""
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))


_patch_lang_tensor = interpreter._patch_lang_tensor
interpreter._patch_lang_tensor = _patch_lang_tensor_for_numpy_2_4

TritonPagedAttention = triton_attention.TritonPagedAttention
NUM_KV_HEADS = 2


def random_step(
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    group: int,
    head_dim: int = 32,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """Random context already in the cache (shuffled blocks, NaN in every unused slot, block 0 reserved)
    plus the step's new q/k/v."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = 2 * sum(blocks_needed) + 3
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in blocks_needed]
    k_cache = torch.full((num_blocks, block_size, NUM_KV_HEADS, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    meta = make_metadata(query_lens, seq_lens, tables, block_size)
    for table, seq_len, q_len in zip(tables, seq_lens, query_lens, strict=True):
        cached = torch.arange(seq_len - q_len)
        blocks, offsets = torch.tensor(table)[cached // block_size], cached % block_size
        k_cache[blocks, offsets] = torch.randn(len(cached), NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
        v_cache[blocks, offsets] = torch.randn(len(cached), NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
    return q, k, v, k_cache, v_cache, meta


def check_against_reference(
    step,
    backend: TritonPagedAttention,
    atol: float = 1e-4,
    scale: float | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    q, k, v, k_cache, v_cache, meta = step
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    expected = dense_reference_attention(q, k, v, k_cache, v_cache, meta, scale, window, softcap)

    out = backend.forward(q, k, v, k_cache, v_cache, meta, scale, window=window, softcap=softcap)

    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=atol)
    return out
