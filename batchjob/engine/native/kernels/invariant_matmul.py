"""A matmul whose every row is computed the same way whatever the other rows (`engine.deterministic`).

BLAS picks its kernel, tile and split of K by the row count, so a row's product changes in its last bits with
the batch it is computed in. Here one launch shape serves every row count: tiles of `BLOCK_M` x `BLOCK_N`, K
walked in `BLOCK_K` steps from 0, and K split into a number of parts chosen from the weight's shape and the
GPU alone (enough programs to fill the GPU at a decode step's few rows). A part's float32 sum is written as it
is; `reduce_parts` (or the fused RMSNorm after a projection that feeds the residual) adds the parts in order,
so an output element's arithmetic is fixed by the weight's shape.

Where a step has rows enough for waves of programs without splitting (`serial`), each program computes every
part of its tile itself, one after another, and adds them in the same order in registers: the same float32
arithmetic, the same bits, without writing and reading back parts x rows x N float32 sums (at a prefill chunk's
8,192 rows, more bytes than the weight). Its parts' K steps run as one pipelined loop (Triton flattens the loop
over parts, whose inner loop has the same bounds for every part): with a loop per part, the pipeline drained and
filled again at every part, and the 1B's projections of three and four parts (qkv, o, down) ran at 0.54-0.66x of
cuBLAS's speed at 8,192 rows, flattened at 0.70-0.81x; its four projections at 2,048 and 8,192 rows 1.12x and 1.14x
faster, on one H100 (docs/benchmarks.md).

On Hopper and later GPUs a launch of more than one row tile loads its tiles by the tensor memory accelerator, from
descriptors of the input and the weight (`_tma`); elsewhere (one row tile, an older GPU, a tensor whose rows are not
16-byte aligned) each thread loads its share by address. Both load the same tiles and hand the same products to
the same MMA instructions: the bits do not depend on which one ran (tests/gpu/test_deterministic_gpu.py).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from batchjob.engine.native.kernels.attention_tile import dot_precision

BLOCK_M = 128
BLOCK_N = 64
BLOCK_K = 64
MAX_PARTS = 4
# Row tiles walked together down each column tile (program order only: a tile's arithmetic is the same wherever it
# runs): a prefill step's GROUP_M row tiles of the input stay in L2 while the weight's column tiles pass them,
# instead of the whole input being read again for every column tile.
GROUP_M = 8
# A step serializes K's parts within each program from this many waves of programs of the split launch's tile: below
# it (a decode step's few rows), splitting K is what fills the GPU. From one wave rather than four, W2 and W1 in
# this mode ran 1.018x and 1.007x; from half a wave rather than one, 1.012x and 0.980x (docs/benchmarks.md).
SERIAL_WAVES = 1
# From two row tiles on, from half a wave. Over the multi-part projections of the 1B and the 8B at 16-512 rows on
# one H100, each call timed in a CUDA graph: at one row tile split was faster at every count; at more, serial where
# its programs made half a wave was faster or within 0.005 ms (the 1B's qkv at 256 rows 0.012 against 0.017 ms, o at
# 512 0.013 against 0.020; the 8B's down at 160 0.130 against 0.125), and split below half a wave (the 1B's down at
# 256 rows 0.025 against 0.040). scripts/dev/matmul_shapes.py --multi-tile-waves; docs/benchmarks.md.
MULTI_TILE_SERIAL_WAVES = 0.5
# The serial launch's tile, warps and pipeline stages. A larger tile reads each input and weight tile for more
# outputs; an element's arithmetic (K's parts in order, each summed from its start) is meant not to change with it,
# but whether the GPU's MMA instructions of another shape and K step round alike is measured
# (scripts/dev/matmul_shapes.py, tests/gpu/test_deterministic_gpu.py), not assumed.
SERIAL_BLOCK_M = BLOCK_M
SERIAL_BLOCK_N = 128
SERIAL_BLOCK_K = BLOCK_K
SERIAL_WARPS = 8
SERIAL_STAGES = 4
# Where the serial launch's own tiles would be fewer programs than this many waves (a decode step's few hundred rows:
# 512 rows of the 1B's qkv make 96 tiles of 128 x 128 for 132 multiprocessors), it takes the split launch's narrower
# column tiles and warps instead: twice the programs, each half the columns. 0: never.
NARROW_BELOW_WAVES = 1
# A weight whose K is one part keeps one float32 sum a thread, not two: its serial launch takes tiles of twice the
# rows (fewer reads of each weight tile) where they pad the step's rows no further than `SERIAL_BLOCK_M`'s do: 129
# to 256 rows and 385 to 512 in one and two such tiles, but 257 to 384 in three of 128 rows, not two of 256, which
# computed 272 rows in as many products as 512 (the 1B's decode graph at 384 rows 2.88 ms against 3.30 in two).
ONE_PART_BLOCK_M = 256
ONE_PART_STAGES = 3
# Tiles loaded by the GPU's tensor memory accelerator (Hopper and later) rather than by each thread's addresses, where
# the step has more than one row tile and the tensors allow (`_tma`): the same tiles, the same products. With one row
# tile a launch streams the weight, and loads by address measured faster there.
TMA_LOADS = True
# A step whose rows are not a whole number of row tiles computes its last tile from the step's last `BLOCK_M` rows
# (some of them the tile before's too, stored once), so no tile reads past the input's end; a row's bits do not
# depend on where in a tile it sits. A TMA load of a tile partly past the end took longer than a whole one: the 1B's
# lm_head at 272 rows 0.512 ms, shifted 0.419 (384 rows: 0.391), down 0.049 / 0.040, its decode graph at 272 rows
# 3.34 / 2.76 ms, on one H100 (scripts/dev/matmul_shapes.py; docs/benchmarks.md).
SHIFT_LAST_ROW_TILE = True


@triton.jit
def _part_product(
    a, b, row0, col0, m, n, k, k_lo, k_per_part, stride_am, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
):  # fmt: skip
    """The float32 product of the tile's rows from row0 and columns from col0 over K in [k_lo, k_lo + k_per_part),
    BLOCK_K at a time from k_lo, columns at or beyond `k` read as zeros (a last part shorter than the others takes
    as many steps, its last adding zeros: the sum's bits are the same), so that the loop's bounds are the same for
    every part and the serial launch's loop over parts flattens (the module's docstring). With TMA, `a` and `b` are
    the input's and the weight's descriptors: a tile's rows or columns beyond the tensor read as zeros (`_launch`
    takes descriptors only where K's parts are whole K steps)."""
    rows, cols = row0 + tl.arange(0, BLOCK_M), col0 + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < m, cols < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in range(0, k_per_part, BLOCK_K):
        k0 = k_lo + step
        if TMA:
            a_tile = a.load([row0, k0])
            b_tile = b.load([col0, k0]).T
        else:
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < k
            a_tile = tl.load(
                a + rows[:, None].to(tl.int64) * stride_am + ks[None, :], row_mask[:, None] & k_mask[None, :], other=0.0
            )
            b_tile = tl.load(
                b + cols[None, :].to(tl.int64) * stride_bn + ks[:, None], col_mask[None, :] & k_mask[:, None], other=0.0
            )
        acc = tl.dot(a_tile, b_tile, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit(do_not_specialize=["m"])
def _parts_kernel(
    a,
    b,
    bias_ptr,
    c_ptr,
    m,
    n,
    k,
    stride_am,
    stride_bn,
    stride_cp,
    stride_cm,
    k_per_part,
    HAS_BIAS: tl.constexpr,
    SERIAL_PARTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
    SHIFT_LAST: tl.constexpr,
):
    """Grid (tiles, parts): program (t, p) writes part p of tile t, the tiles ordered in groups of GROUP_M row
    tiles down each column tile. With SERIAL_PARTS > 1 the grid has one part and each program computes all of them
    and adds them in order, as `_reduce_kernel` would. `a` and `b` are the input and the weight: pointers, or with
    TMA descriptors of their tiles."""
    row_tiles, col_tiles = tl.cdiv(m, BLOCK_M), tl.cdiv(n, BLOCK_N)
    tile = tl.program_id(0)
    group = tile // (GROUP_M * col_tiles)
    first_row_tile = group * GROUP_M
    group_rows = tl.minimum(row_tiles - first_row_tile, GROUP_M)
    within = tile % (GROUP_M * col_tiles)
    pid_m = first_row_tile + within % group_rows
    pid_n = within // group_rows
    part = tl.program_id(1)
    row0, col0 = pid_m * BLOCK_M, pid_n * BLOCK_N
    # The last row tile computes the step's last BLOCK_M rows and stores those past the tile before it (`SHIFT_LAST`).
    load_row0 = row0
    if SHIFT_LAST:
        load_row0 = tl.maximum(tl.minimum(row0, m - BLOCK_M), 0)
    # Part 0's sum starts from zero as the split launch's does (0 + x is x: a sum that starts at +0 is never -0).
    # Flattened into one loop over every part's K steps, pipelined across the parts' boundaries.
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for p in tl.range(0, SERIAL_PARTS, flatten=True):
        acc += _part_product(
            a, b, load_row0, col0, m, n, k, (part + p) * k_per_part, k_per_part, stride_am, stride_bn,
            BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, TMA,
        )  # fmt: skip
    rows, cols = load_row0 + tl.arange(0, BLOCK_M), col0 + tl.arange(0, BLOCK_N)
    row_mask, col_mask = (rows >= row0) & (rows < m), cols < n
    if HAS_BIAS:  # one part only, or all of them
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + part * stride_cp + rows[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), row_mask[:, None] & col_mask[None, :])


@triton.jit
def _reduce_kernel(parts_ptr, bias_ptr, out_ptr, numel, n, stride_p, PARTS: tl.constexpr, HAS_BIAS: tl.constexpr):
    offs = tl.program_id(0) * 1024 + tl.arange(0, 1024)
    mask = offs < numel
    acc = tl.load(parts_ptr + offs, mask=mask, other=0.0)
    for p in tl.static_range(1, PARTS):
        acc += tl.load(parts_ptr + p * stride_p + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


@functools.cache
def _has_tma(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _tma(x: torch.Tensor, weight: torch.Tensor, block_m: int, block_k: int, k_per_part: int) -> bool:
    """Whether the launch loads its tiles through descriptors: a GPU with the tensor memory accelerator, more than
    one row tile, 16-bit operands whose rows start 16-byte aligned, and K's parts whole `block_k` steps (a
    descriptor's tile is not masked at a part's end, only at the tensor's)."""
    return (
        TMA_LOADS
        and x.shape[0] > block_m
        and _has_tma(x.device)
        and x.element_size() == 2
        and k_per_part % block_k == 0
        and all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in (x, weight))
    )


def num_parts(weight: torch.Tensor) -> int:
    """Parts K is split into for `weight` [N, K]: enough programs for every multiprocessor at one row tile, at
    most `MAX_PARTS`; a function of the weight's shape and the GPU only."""
    n, k = weight.shape
    tiles = triton.cdiv(n, BLOCK_N)
    parts = min(MAX_PARTS, triton.cdiv(_sm_count(weight.device), tiles), triton.cdiv(k, BLOCK_K))
    return triton.cdiv(k, _k_per_part(k, max(parts, 1)))


def one_part_block_m(rows: int) -> int:
    """The serial launch's row tile for a weight whose K is one part: `ONE_PART_BLOCK_M` where its tiles pad `rows`
    no further than `SERIAL_BLOCK_M`'s, else `SERIAL_BLOCK_M`. Either tile gives a row the same bits."""
    wide, narrow = ONE_PART_BLOCK_M, SERIAL_BLOCK_M
    if rows > narrow and triton.cdiv(rows, wide) * wide <= triton.cdiv(rows, narrow) * narrow:
        return wide
    return narrow


def _k_per_part(k: int, parts: int) -> int:
    return triton.cdiv(triton.cdiv(k, parts), BLOCK_K) * BLOCK_K


def serial(rows: int, weight: torch.Tensor) -> bool:
    """Whether `rows` rows of `weight`'s product fill `SERIAL_WAVES` waves of programs of the split launch's tile
    without splitting K, so that each program computes its tile's parts itself (the same bits as split, without the
    parts' float32 round trip); from two row tiles, `MULTI_TILE_SERIAL_WAVES`. Counted in the split launch's tiles, so
    the serial launch's own tile changes how fast a step runs, never which launch it takes."""
    row_tiles = triton.cdiv(rows, BLOCK_M)
    waves = SERIAL_WAVES if row_tiles == 1 else MULTI_TILE_SERIAL_WAVES
    return row_tiles * triton.cdiv(weight.shape[0], BLOCK_N) >= waves * _sm_count(weight.device)


def partial_products(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 [parts, rows, N]: part p is x @ weight^T over the p-th `_k_per_part` columns of K (`num_parts`)."""
    out = torch.empty((num_parts(weight), x.shape[0], weight.shape[0]), dtype=torch.float32, device=x.device)
    return _launch(x, weight, None, out)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    serial_parts: int = 1,
    serial_tile: bool = False,
) -> torch.Tensor:
    """Fill `out` [parts, rows, N] (float32, or x's dtype for one part, which then adds `bias`); with
    `serial_parts`, `out` [1, rows, N] gets that many parts added in order, then `bias`. `serial_tile`: in the
    serial launch's tiles, warps and stages (`SERIAL_*`, `ONE_PART_*` for K in one part, `NARROW_BELOW_WAVES` for
    rows too few to fill the GPU with them)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    parts, m, n = out.shape
    k = x.shape[1]
    if m == 0:
        return out
    if serial_tile:
        block_m, block_n, block_k, warps, stages = (
            SERIAL_BLOCK_M, SERIAL_BLOCK_N, SERIAL_BLOCK_K, SERIAL_WARPS, SERIAL_STAGES
        )  # fmt: skip
        if serial_parts == 1 and one_part_block_m(m) == ONE_PART_BLOCK_M:
            block_m, stages = ONE_PART_BLOCK_M, ONE_PART_STAGES
        elif triton.cdiv(m, block_m) * triton.cdiv(n, block_n) < NARROW_BELOW_WAVES * _sm_count(x.device):
            block_n, warps = BLOCK_N, 4
    else:
        block_m, block_n, block_k, warps, stages = BLOCK_M, BLOCK_N, BLOCK_K, 4, 4
    stages = stages if x.element_size() <= 2 else 2
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n), parts)
    k_per_part = _k_per_part(k, max(parts, serial_parts))
    a, b, tma = x, weight, _tma(x, weight, block_m, block_k, k_per_part)
    if tma:
        a = TensorDescriptor(x, [m, k], [x.stride(0), 1], [block_m, block_k])
        b = TensorDescriptor(weight, [n, k], [weight.stride(0), 1], [block_n, block_k])
    _parts_kernel[grid](
        a, b, x if bias is None else bias, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        out.stride(1), k_per_part, HAS_BIAS=bias is not None, SERIAL_PARTS=serial_parts, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=GROUP_M, DOT_PRECISION=dot_precision(x.dtype), TMA=tma,
        SHIFT_LAST=SHIFT_LAST_ROW_TILE, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def reduce_parts(parts: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """[parts, rows, N] float32 -> [rows, N] in `dtype`: the parts added in order, then the bias, rounded once."""
    _, m, n = parts.shape
    out = torch.empty((m, n), dtype=dtype, device=parts.device)
    if m == 0:
        return out
    _reduce_kernel[(triton.cdiv(m * n, 1024),)](
        parts, parts if bias is None else bias, out, m * n, n, parts.stride(0),
        PARTS=parts.shape[0], HAS_BIAS=bias is not None, num_warps=4,
    )  # fmt: skip
    return out


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, K] @ weight [N, K]^T (+ bias) in x's dtype, each row computed alike whatever `rows` is."""
    parts, wide = num_parts(weight), serial(x.shape[0], weight)
    if parts == 1 or wide:
        out = torch.empty((1, x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
        return _launch(x, weight, bias, out, serial_parts=parts, serial_tile=wide)[0]
    return reduce_parts(partial_products(x, weight), bias, x.dtype)
