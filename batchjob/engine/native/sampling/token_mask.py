"""Structured outputs on the device: forbidding the tokens a row's constraint does not allow.

A step's constrained rows get one bitmask row each, packed at the front of the slot's bitmask buffer (bit
`v % 32` of int32 word `v // 32` allows token `v`); `mask_rows[r]` is logits row r's bitmask row, -1 for an
unconstrained row. Shapes and addresses are fixed per batch-size bucket, so the step is graph-capturable. On
CUDA one Triton kernel writes -inf over forbidden tokens and reads no logits; on CPU `torch_apply_token_bitmask`
does the same with torch ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenMask:
    """A step's structured-outputs mask: `bitmask` [M, ceil(V / 32)] int32 and `rows` [R] int64 (see above)."""

    bitmask: torch.Tensor
    rows: torch.Tensor

    def apply_(self, logits: torch.Tensor) -> torch.Tensor:
        return apply_token_bitmask_(logits, self.bitmask, self.rows)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, mask_rows: torch.Tensor) -> torch.Tensor:
    """Set `logits[r, v] = -inf` where `mask_rows[r] >= 0` and bit v of `bitmask[mask_rows[r]]` is clear; in place,
    returns `logits`. `logits` [R, V] float32, `bitmask` [M, ceil(V / 32)] int32, `mask_rows` [R] int64."""
    if logits.is_cuda:
        from batchjob.engine.native.kernels import token_mask

        token_mask.apply_token_bitmask(logits, bitmask, mask_rows)
        return logits
    return torch_apply_token_bitmask_(logits, bitmask, mask_rows)


def torch_apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, mask_rows: torch.Tensor) -> torch.Tensor:
    rows, vocab = logits.shape
    words = bitmask[mask_rows.clamp(min=0)]
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((words[:, :, None] >> shifts) & 1).reshape(rows, -1)[:, :vocab].bool()
    allowed |= (mask_rows < 0)[:, None]
    return logits.masked_fill_(~allowed, float("-inf"))


def one_hot_bitmask_(row: torch.Tensor, token: int) -> None:
    """Make the int32 bitmask `row` allow exactly `token` (a token the constraint already forced)."""
    row.zero_()
    bit = token % 32
    # int32 words: bit 31 is the sign bit.
    row[token // 32] = (1 << bit) - (1 << 32 if bit == 31 else 0)
