"""The IO slot's packed buffers: where each field of a step sits."""

from __future__ import annotations

import pytest
import torch

from batchjob.engine.native.io_slot import FIELD_ALIGN_BYTES, IOSlot, SlotLimits, StepShape


@pytest.mark.parametrize("tokens,seqs,rows", [(1, 1, 1), (3, 3, 3), (7, 5, 4), (33, 17, 16), (8192, 256, 256)])
def test_every_slot_field_starts_on_an_aligned_address(tokens, seqs, rows):
    """Triton compiles one variant per pointer alignment: a field at an odd offset would double the kernels."""
    shape = StepShape(tokens, seqs, rows)
    slot = IOSlot(
        0, SlotLimits(max_tokens=8192, max_rows=256, max_blocks_per_seq=8, max_top_logprobs=4), torch.device("cpu")
    )
    ints, meta, params = slot.device_views(shape, 1, 1)
    views = [*ints.values(), meta.cu_query_lens, meta.seq_lens, params.temperature, params.top_p, params.min_p]
    assert all(v.data_ptr() % FIELD_ALIGN_BYTES == 0 for v in views)
    assert [len(v) for v in ints.values()] == [tokens] * 5 + [rows] * 4
    ends = sorted((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()) for v in ints.values())
    assert all(end <= start for (_, end), (start, _) in zip(ends[:-1], ends[1:], strict=True))  # no overlap
