"""The interpreter's `tl.dot` as the tests run it (tests/interpreted_dot.py): a row's bits the same whatever the
tile around it, through a real Triton kernel in the interpreter, and a product numpy's matmul agrees with."""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from interpreted_dot import _ordered_matmul

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's dot: a machine without CUDA")


@triton.jit
def _tile_product(a, b, c, m, n, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows, cols, ks = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, K)
    a_tile = tl.load(a + rows[:, None] * K + ks[None, :], mask=rows[:, None] < m, other=0.0)
    b_tile = tl.load(b + cols[None, :] * K + ks[:, None], mask=cols[None, :] < n, other=0.0)
    acc = tl.dot(a_tile, b_tile, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), input_precision="ieee")
    tl.store(c + rows[:, None] * n + cols[None, :], acc, mask=(rows[:, None] < m) & (cols[None, :] < n))


def _product(x: torch.Tensor, weight: torch.Tensor, block_m: int, block_n: int) -> torch.Tensor:
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.float32)
    _tile_product[(1,)](x, weight, out, x.shape[0], weight.shape[0], x.shape[1], block_m, block_n)
    return out


def test_a_rows_product_is_the_same_bits_in_any_tile_and_beside_any_rows():
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(100, 64, generator=generator)
    weight = torch.randn(120, 64, generator=generator)
    whole = _product(x, weight, 128, 128)
    assert torch.equal(_product(x, weight[:64], 128, 64), whole[:, :64])
    assert torch.equal(_product(x[37:41], weight, 16, 128), whole[37:41])
    assert torch.equal(_product(x[99:], weight[5:9], 16, 16), whole[99:, 5:9])
    assert torch.allclose(whole, x @ weight.t(), atol=1e-4)


def test_the_ordered_product_matches_numpys_in_every_dtype_and_batch():
    rng = np.random.default_rng(6)
    a, b = rng.standard_normal((2, 5, 33)), rng.standard_normal((2, 33, 7))
    for dtype in (np.float32, np.float64):
        ordered = _ordered_matmul(a.astype(dtype), b.astype(dtype), np.dtype(dtype))
        assert ordered.dtype == dtype and ordered.shape == (2, 5, 7)
        np.testing.assert_allclose(ordered, a @ b, rtol=1e-4, atol=1e-4)
