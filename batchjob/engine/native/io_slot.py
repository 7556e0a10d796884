"""IO slots: the host and device buffers of one step's inputs and outputs, and how a plan fills them.

The asynchronous loop has two slots: the CPU fills one while the GPU computes from the other. Inputs are
packed into a few buffers so a step needs four host-to-device copies. Inside a packed buffer, fields sit at
offsets that depend only on the step's token and row counts, so a decode step of a given batch-size bucket
always uses the same device addresses, which is what a CUDA graph of that bucket was captured with.

A step with constrained rows (structured outputs) also has a token bitmask: one row per constrained sampled row,
packed at the front of a fixed-size buffer, written by the host once the tokens its constraint depends on are
back, and copied separately from the other inputs (see model_runner.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchjob.engine.native.attention import AttentionMetadata
from batchjob.engine.native.sampler import SamplingTensors
from batchjob.engine.native.scheduler import StepPlan

INT_TOKEN_FIELDS = ("input_ids", "positions", "slot_mapping", "carry_idx", "carry_mask")
INT_ROW_FIELDS = ("logits_indices", "seeds", "out_positions", "top_k", "mask_rows")
FLOAT_ROW_FIELDS = ("temperature", "top_p", "min_p")


@dataclass(frozen=True)
class SlotLimits:
    max_tokens: int
    max_rows: int
    max_blocks_per_seq: int
    max_top_logprobs: int
    bitmask_words: int  # int32 words of one token bitmask row: ceil(vocab / 32)


@dataclass(frozen=True)
class StepShape:
    """Token count T, sequence count B and sampled-row count S of a step (padded sizes for a graph)."""

    tokens: int
    seqs: int
    rows: int

    def int_fields(self) -> dict[str, tuple[int, int]]:
        offsets, at = {}, 0
        for name in INT_TOKEN_FIELDS:
            offsets[name] = (at, self.tokens)
            at += self.tokens
        for name in INT_ROW_FIELDS:
            offsets[name] = (at, self.rows)
            at += self.rows
        return offsets

    @property
    def int_size(self) -> int:
        return len(INT_TOKEN_FIELDS) * self.tokens + len(INT_ROW_FIELDS) * self.rows

    @property
    def meta_size(self) -> int:
        return 2 * self.seqs + 1


def _pinned(shape, dtype, pin: bool) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, pin_memory=pin)


class IOSlot:
    def __init__(self, index: int, limits: SlotLimits, device: torch.device) -> None:
        self.index = index
        self.limits = limits
        pin = device.type == "cuda"
        t, b = limits.max_tokens, limits.max_rows
        int_size, meta_size = StepShape(t, b, b).int_size, 2 * b + 1
        self.host_int = _pinned(int_size, torch.int64, pin)
        self.host_meta = _pinned(meta_size, torch.int32, pin)
        self.host_tables = _pinned((b, limits.max_blocks_per_seq), torch.int32, pin)
        self.host_float = _pinned(3 * b, torch.float32, pin)
        self.dev_int = torch.zeros(int_size, dtype=torch.int64, device=device)
        self.dev_meta = torch.zeros(meta_size, dtype=torch.int32, device=device)
        self.dev_tables = torch.zeros((b, limits.max_blocks_per_seq), dtype=torch.int32, device=device)
        self.dev_float = torch.zeros(3 * b, dtype=torch.float32, device=device)
        k = max(limits.max_top_logprobs, 1)
        self.dev_tokens = torch.zeros(b, dtype=torch.int64, device=device)
        self.dev_logprobs = torch.zeros(b, dtype=torch.float32, device=device)
        self.dev_top_ids = torch.zeros((b, k), dtype=torch.int64, device=device)
        self.dev_top_logprobs = torch.zeros((b, k), dtype=torch.float32, device=device)
        self.host_tokens = _pinned(b, torch.int64, pin)
        self.host_logprobs = _pinned(b, torch.float32, pin)
        self.host_top_ids = _pinned((b, k), torch.int64, pin)
        self.host_top_logprobs = _pinned((b, k), torch.float32, pin)
        self.host_bitmask = _pinned((b, limits.bitmask_words), torch.int32, pin)
        self.dev_bitmask = torch.full((b, limits.bitmask_words), -1, dtype=torch.int32, device=device)
        self.events = None  # set by the runner on CUDA: h2d_done, compute_done, d2h_done, bitmask_done

    @property
    def device_bytes(self) -> int:
        tensors = (self.dev_int, self.dev_meta, self.dev_tables, self.dev_float, self.dev_tokens, self.dev_logprobs)
        tensors += (self.dev_top_ids, self.dev_top_logprobs, self.dev_bitmask)
        return sum(t.numel() * t.element_size() for t in tensors)

    def fill(self, plan: StepPlan, shape: StepShape, block_size: int) -> int:
        """Write `plan` into the host buffers, padded to `shape` (padding: scratch block 0, no carry-over).
        Returns how many sampled rows are constrained (the bitmask rows the step needs)."""
        n, t, rows = len(plan.seqs), plan.num_tokens, int(plan.samples.sum())
        counts, starts = plan.counts, plan.starts
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        positions = np.arange(t, dtype=np.int64) - np.repeat(cu[:-1] - starts, counts)
        seq_of_token = np.repeat(np.arange(n), counts)

        tables = self.host_tables.numpy()
        for i, seq in enumerate(plan.seqs):
            tables[i, : len(seq.block_table)] = seq.block_table
        tables[n : shape.seqs, :] = 0

        ints = self.host_int.numpy()
        view = {name: ints[o : o + size] for name, (o, size) in shape.int_fields().items()}
        view["input_ids"][:t] = np.concatenate(
            [s.tokens[a : a + c] for s, a, c in zip(plan.seqs, starts, counts, strict=True)]
        )
        view["positions"][:t] = positions
        blocks = tables[seq_of_token, positions // block_size].astype(np.int64)
        view["slot_mapping"][:t] = blocks * block_size + positions % block_size
        # A chunk whose last input token is still pending gets it from the previous step's output row.
        carrying = plan.carry_rows >= 0
        view["carry_idx"][:t] = 0
        view["carry_mask"][:t] = 0
        view["carry_idx"][cu[1:][carrying] - 1] = plan.carry_rows[carrying]
        view["carry_mask"][cu[1:][carrying] - 1] = 1
        for name in INT_TOKEN_FIELDS:
            view[name][t:] = 0

        sampled = [s for s, keep in zip(plan.seqs, plan.samples, strict=True) if keep]
        view["logits_indices"][:rows] = cu[1:][plan.samples] - 1
        view["logits_indices"][rows:] = np.arange(rows, shape.rows)
        view["seeds"][:rows] = [s.seed for s in sampled]
        # The sampled token's index in the output: its position minus the prompt length.
        view["out_positions"][:rows] = [s.num_tokens - 1 - s.prompt_len for s in sampled]
        sampler_rows = np.array([s.sampler_row for s in sampled], dtype=np.float64).reshape(rows, 4)
        view["top_k"][:rows] = sampler_rows[:, 0]
        for name in ("seeds", "out_positions", "top_k"):
            view[name][rows:] = 0
        constrained = np.fromiter((s.matcher is not None for s in sampled), dtype=bool, count=rows)
        masked = int(constrained.sum())
        view["mask_rows"][:] = -1
        view["mask_rows"][:rows][constrained] = np.arange(masked)

        meta = self.host_meta.numpy()
        meta[: n + 1] = cu
        meta[n + 1 : shape.seqs + 1] = t + np.arange(1, shape.seqs - n + 1)
        seq_lens = meta[shape.seqs + 1 : 2 * shape.seqs + 1]
        seq_lens[:n] = starts + counts
        seq_lens[n:] = 1

        floats = self.host_float.numpy()
        temperature, top_p, min_p = (floats[i * shape.rows : (i + 1) * shape.rows] for i in range(3))
        temperature[:rows], top_p[:rows], min_p[:rows] = sampler_rows[:, 1], sampler_rows[:, 2], sampler_rows[:, 3]
        temperature[rows:], top_p[rows:], min_p[rows:] = 0.0, 1.0, 0.0
        return masked

    def copy_inputs(self, shape: StepShape) -> None:
        """Host -> device copy of exactly what `shape` uses (non-blocking: the caller orders it by events)."""
        self.dev_int[: shape.int_size].copy_(self.host_int[: shape.int_size], non_blocking=True)
        self.dev_meta[: shape.meta_size].copy_(self.host_meta[: shape.meta_size], non_blocking=True)
        self.dev_tables[: shape.seqs].copy_(self.host_tables[: shape.seqs], non_blocking=True)
        self.dev_float[: 3 * shape.rows].copy_(self.host_float[: 3 * shape.rows], non_blocking=True)

    def copy_bitmask(self, rows: int) -> None:
        """Host -> device copy of the first `rows` bitmask rows (non-blocking, ordered by events)."""
        self.dev_bitmask[:rows].copy_(self.host_bitmask[:rows], non_blocking=True)

    def int_views(self, shape: StepShape) -> dict[str, torch.Tensor]:
        return {name: self.dev_int[o : o + size] for name, (o, size) in shape.int_fields().items()}

    def sampling_tensors(self, shape: StepShape) -> SamplingTensors:
        ints, r = self.int_views(shape), shape.rows
        return SamplingTensors(
            temperature=self.dev_float[:r],
            top_k=ints["top_k"],
            top_p=self.dev_float[r : 2 * r],
            min_p=self.dev_float[2 * r : 3 * r],
            seeds=ints["seeds"],
            positions=ints["out_positions"],
        )

    def device_views(self, shape: StepShape, max_query_len: int, max_seq_len: int):
        """The device tensors of a step of `shape`: (ints by name, attention metadata, sampling tensors)."""
        ints = self.int_views(shape)
        meta = AttentionMetadata(
            cu_query_lens=self.dev_meta[: shape.seqs + 1],
            seq_lens=self.dev_meta[shape.seqs + 1 : 2 * shape.seqs + 1],
            block_tables=self.dev_tables[: shape.seqs],
            slot_mapping=ints["slot_mapping"],
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
        )
        return ints, meta, self.sampling_tensors(shape)

    def poison_host_inputs(self) -> None:
        """Debug mode: garbage in every host input buffer, so a copy still reading them would corrupt a step."""
        for buf in (self.host_int, self.host_meta, self.host_tables):
            buf.fill_(-7777)
        self.host_float.fill_(float("nan"))
        self.host_bitmask.fill_(0)  # a constrained row left unfilled would allow no token at all
