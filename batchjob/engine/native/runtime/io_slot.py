"""IO slots: the host and device buffers of one step's inputs and outputs, and how a plan fills them.

The asynchronous loop has two slots: the CPU fills one while the GPU computes from the other. Inputs are
packed into a few buffers so a step needs four host-to-device copies. Inside a packed buffer, fields sit at
offsets that depend only on the step's token and row counts (`StepShape` lays them out), so a step padded to a
graph bucket (step_layout.py) always uses the same device addresses, which is what the CUDA graph of that
bucket was captured with.

A step with constrained rows (structured outputs) also has a token bitmask: one row per constrained sampled row,
packed at the front of a fixed-size buffer, written by the host once the tokens its constraint depends on are
back, and copied separately from the other inputs (see split_steps.py). Which bitmask row a sampled row reads
is the packed field `mask_rows`; the bitmask buffer itself never moves, and its rows are exactly ceil(V / 32)
words, the size llguidance writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchjob.engine.native.layers.attention import AttentionMetadata, longest_first
from batchjob.engine.native.sampling.sampler import SamplingTensors
from batchjob.engine.native.scheduling.plan import StepPlan

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


# Every field starts on a 16-byte boundary: Triton specialises a kernel on whether each pointer argument is
# 16-byte aligned, so fields at offsets that move with the step's sizes would compile extra variants mid-run.
FIELD_ALIGN_BYTES = 16


def _aligned(count: int, element_size: int) -> int:
    per_line = FIELD_ALIGN_BYTES // element_size
    return -(-count // per_line) * per_line


def _layout(fields: list[tuple[str, int]], element_size: int) -> tuple[dict[str, tuple[int, int]], int]:
    """(offset, length) of each field packed in order, each from a 16-byte boundary, and the total length."""
    offsets, at = {}, 0
    for name, size in fields:
        offsets[name] = (at, size)
        at += _aligned(size, element_size)
    return offsets, at


@dataclass(frozen=True)
class StepShape:
    """Token count T, sequence count B and sampled-row count S of a step (padded sizes for a graph), and the
    layout of the packed buffers for it: (offset, length) of each field, in elements. Every reader and writer
    of the packed buffers asks here."""

    tokens: int
    seqs: int
    rows: int

    def int_fields(self) -> dict[str, tuple[int, int]]:
        """The int64 buffer: per-token fields, then per-row fields."""
        return self._int_layout()[0]

    def meta_fields(self) -> dict[str, tuple[int, int]]:
        """The int32 buffer the attention kernels read: cu_query_lens [B + 1], seq_lens [B], decode_order [B]."""
        return self._meta_layout()[0]

    def float_fields(self) -> dict[str, tuple[int, int]]:
        """The float32 buffer: per-row sampling parameters."""
        return self._float_layout()[0]

    @property
    def int_size(self) -> int:
        return self._int_layout()[1]

    @property
    def meta_size(self) -> int:
        return self._meta_layout()[1]

    @property
    def float_size(self) -> int:
        return self._float_layout()[1]

    def _int_layout(self) -> tuple[dict[str, tuple[int, int]], int]:
        fields = [(name, self.tokens) for name in INT_TOKEN_FIELDS] + [(name, self.rows) for name in INT_ROW_FIELDS]
        return _layout(fields, 8)

    def _meta_layout(self) -> tuple[dict[str, tuple[int, int]], int]:
        return _layout([("cu_query_lens", self.seqs + 1), ("seq_lens", self.seqs), ("decode_order", self.seqs)], 4)

    def _float_layout(self) -> tuple[dict[str, tuple[int, int]], int]:
        return _layout([(name, self.rows) for name in FLOAT_ROW_FIELDS], 4)


def _views(buffer, fields: dict[str, tuple[int, int]]) -> dict:
    return {name: buffer[offset : offset + size] for name, (offset, size) in fields.items()}


def _pinned(shape, dtype, pin: bool) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, pin_memory=pin)


class IOSlot:
    def __init__(self, index: int, limits: SlotLimits, device: torch.device) -> None:
        self.index = index
        self.limits = limits
        pin = device.type == "cuda"
        b = limits.max_rows
        # Field offsets grow with the shape, so the largest step's layout holds every smaller one.
        largest = StepShape(tokens=limits.max_tokens, seqs=b, rows=b)
        self.host_int = _pinned(largest.int_size, torch.int64, pin)
        self.host_meta = _pinned(largest.meta_size, torch.int32, pin)
        self.host_tables = _pinned((b, limits.max_blocks_per_seq), torch.int32, pin)
        self._table_rows = list(self.host_tables.numpy())
        self.host_float = _pinned(largest.float_size, torch.float32, pin)
        self.dev_int = torch.zeros(largest.int_size, dtype=torch.int64, device=device)
        self.dev_meta = torch.zeros(largest.meta_size, dtype=torch.int32, device=device)
        self.dev_tables = torch.zeros((b, limits.max_blocks_per_seq), dtype=torch.int32, device=device)
        self.dev_float = torch.zeros(largest.float_size, dtype=torch.float32, device=device)
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
        """Write `plan` into the host buffers, padded to `shape`. Padding tokens write their K/V into the scratch
        block 0 and carry nothing over; a padding sequence has one padding token while they last (a decode
        bucket: every one) and none after that; padding tokens past the last sequence's belong to none (a mixed
        bucket); padding rows sample the first token's logits. Returns how many sampled rows are constrained
        (the bitmask rows the step needs)."""
        n, t, rows = len(plan.seqs), plan.num_tokens, int(plan.samples.sum())
        counts, starts = plan.counts, plan.starts
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        positions = np.arange(t, dtype=np.int64) - np.repeat(cu[:-1] - starts, counts)
        seq_of_token = np.repeat(np.arange(n), counts)

        tables = self.host_tables.numpy()
        # Each row through a view of its own: a cheaper assignment than tables[i, :k].
        for row, seq in zip(self._table_rows[:n], plan.seqs, strict=True):
            table = seq.table_array()
            row[: len(table)] = table
        tables[n : shape.seqs, :] = 0

        view = _views(self.host_int.numpy(), shape.int_fields())
        if t == n:  # decodes only: one token each, read as scalars (a slice each costs more than the copy)
            view["input_ids"][:t] = [s.tokens[a] for s, a in zip(plan.seqs, starts.tolist(), strict=True)]
        else:
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

        sampled = plan.sampled
        view["logits_indices"][:rows] = cu[1:][plan.samples] - 1
        view["logits_indices"][rows:] = 0
        view["seeds"][:rows] = [s.seed for s in sampled]
        # The sampled token's index in the output: its position minus the prompt length.
        view["out_positions"][:rows] = [s.num_tokens - 1 - s.prompt_len for s in sampled]
        sampler_rows = plan.sampler_rows
        view["top_k"][:rows] = sampler_rows[:, 0]
        for name in ("seeds", "out_positions", "top_k"):
            view[name][rows:] = 0
        constrained = plan.constrained
        masked = int(constrained.sum())
        view["mask_rows"][:] = -1
        view["mask_rows"][:rows][constrained] = np.arange(masked)

        meta = _views(self.host_meta.numpy(), shape.meta_fields())
        meta["cu_query_lens"][: n + 1] = cu
        padding_seqs = np.arange(1, shape.seqs - n + 1)
        meta["cu_query_lens"][n + 1 :] = t + np.minimum(padding_seqs, shape.tokens - t)
        meta["seq_lens"][:n] = starts + counts
        meta["seq_lens"][n:] = padding_seqs <= shape.tokens - t
        # Longest context first (a chunk's sequence too: its decode program exits at once, wherever it sits).
        meta["decode_order"][:] = longest_first(meta["seq_lens"])

        temperature, top_p, min_p = _views(self.host_float.numpy(), shape.float_fields()).values()
        temperature[:rows], top_p[:rows], min_p[:rows] = sampler_rows[:, 1], sampler_rows[:, 2], sampler_rows[:, 3]
        temperature[rows:], top_p[rows:], min_p[rows:] = 0.0, 1.0, 0.0
        return masked

    def copy_inputs(self, shape: StepShape) -> None:
        """Host -> device copy of exactly what `shape` uses (non-blocking: the caller orders it by events)."""
        self.dev_int[: shape.int_size].copy_(self.host_int[: shape.int_size], non_blocking=True)
        self.dev_meta[: shape.meta_size].copy_(self.host_meta[: shape.meta_size], non_blocking=True)
        self.dev_tables[: shape.seqs].copy_(self.host_tables[: shape.seqs], non_blocking=True)
        self.dev_float[: shape.float_size].copy_(self.host_float[: shape.float_size], non_blocking=True)

    def copy_bitmask(self, rows: int) -> None:
        """Host -> device copy of the first `rows` bitmask rows (non-blocking, ordered by events)."""
        self.dev_bitmask[:rows].copy_(self.host_bitmask[:rows], non_blocking=True)

    def int_views(self, shape: StepShape) -> dict[str, torch.Tensor]:
        return _views(self.dev_int, shape.int_fields())

    def sampling_tensors(self, shape: StepShape) -> SamplingTensors:
        ints, floats = self.int_views(shape), _views(self.dev_float, shape.float_fields())
        return SamplingTensors(
            temperature=floats["temperature"],
            top_k=ints["top_k"],
            top_p=floats["top_p"],
            min_p=floats["min_p"],
            seeds=ints["seeds"],
            positions=ints["out_positions"],
        )

    def device_views(self, shape: StepShape, max_query_len: int, max_seq_len: int):
        """The device tensors of a step of `shape`: (ints by name, attention metadata, sampling tensors)."""
        ints = self.int_views(shape)
        meta_views = _views(self.dev_meta, shape.meta_fields())
        meta = AttentionMetadata(
            cu_query_lens=meta_views["cu_query_lens"],
            seq_lens=meta_views["seq_lens"],
            block_tables=self.dev_tables[: shape.seqs],
            slot_mapping=ints["slot_mapping"],
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            decode_order=meta_views["decode_order"],
        )
        return ints, meta, self.sampling_tensors(shape)

    def poison_host_inputs(self) -> None:
        """Debug mode: garbage in every host input buffer, so a copy still reading them would corrupt a step."""
        for buf in (self.host_int, self.host_meta, self.host_tables):
            buf.fill_(-7777)
        self.host_float.fill_(float("nan"))
        self.host_bitmask.fill_(0)  # a constrained row left unfilled would allow no token at all
