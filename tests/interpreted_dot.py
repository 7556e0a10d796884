"""`tl.dot` in Triton's interpreter with the property the GPU's MMA has: an output element's bits depend on its row
of the left operand and its column of the right, never on the tile's other rows or columns or on its shape.

The interpreter hands `tl.dot` to numpy's matmul, and so to the machine's BLAS, whose kernels for a tile's edges
round differently from its middle: on an AVX2 machine (OpenBLAS's Haswell kernels) a row's product changed with the
rows beside it and with the tile's width. The deterministic mode's tests compare rows computed in tiles of different
shapes and neighbours bit for bit, as the GPU test file does on a GPU; here each product is summed over K in order,
one multiply and one add at a time (numpy's elementwise operations round each once, with no fused multiply-add), so
a row's bits are the same in any tile. The interpreter's own checks and conversions are kept.
"""

from __future__ import annotations

import numpy as np


def _ordered_matmul(a: np.ndarray, b: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """a [..., M, K] @ b [..., K, N] in `dtype`, each element summed over K from 0 in order."""
    a, b = a.astype(dtype, copy=False), b.astype(dtype, copy=False)
    out = np.zeros(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]), dtype=dtype)
    for k in range(a.shape[-1]):
        out += a[..., :, k : k + 1] * b[..., k : k + 1, :]
    return out


def install() -> bool:
    """Route the interpreter's `tl.dot` through `_ordered_matmul`; False where this Triton has no such interpreter
    (its builder's layout changed): the tests then run on numpy's matmul as before."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "InterpreterBuilder", None)
    convert = getattr(interpreter, "_convert_float", None)
    if builder is None or convert is None or not hasattr(builder, "create_dot"):
        return False

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a_data, b_data = a.data, b.data
        if any(x.dtype.primitive_bitwidth == 8 and x.dtype.is_floating() for x in (a, b)):
            a_data = convert(a_data, a.dtype, interpreter.tl.float16, None).view(np.float16)
            b_data = convert(b_data, b.dtype, interpreter.tl.float16, None).view(np.float16)
        product = _ordered_matmul(a_data, b_data, d.data.dtype)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    builder.create_dot = create_dot
    return True
