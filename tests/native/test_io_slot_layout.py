"""The packed IO-slot buffers: every field of every step shape starts on a 16-byte boundary (Triton compiles a
kernel variant per pointer alignment, so a field whose alignment moved with the batch would compile mid-run),
and no two fields overlap."""

from __future__ import annotations

import itertools

import torch

from batchjob.engine.native.io_slot import IOSlot, SlotLimits, StepShape


def test_every_field_of_every_shape_is_16_byte_aligned_and_apart():
    limits = SlotLimits(max_tokens=70, max_rows=19, max_blocks_per_seq=5, max_top_logprobs=0, bitmask_words=3)
    slot = IOSlot(0, limits, torch.device("cpu"))
    # Mixed graphs pad the sequences to the limit, which may exceed the tokens of a small bucket.
    for tokens, seqs in itertools.product([1, 2, 3, 5, 16, 17, 70], [1, 2, 3, 4, 7, 8, 19]):
        shape = StepShape(tokens=tokens, seqs=seqs, rows=seqs)
        ints, meta, params = slot.device_views(shape, max_query_len=1, max_seq_len=1)
        views = [*ints.values(), meta.cu_query_lens, meta.seq_lens, meta.block_tables, meta.slot_mapping]
        views += [params.temperature, params.top_p, params.min_p, slot.dev_bitmask]
        for view in views:
            assert view.data_ptr() % 16 == 0, (shape, view.shape)
        # The same field reached twice (slot_mapping is also in the metadata) counts once.
        fields = sorted({(view.data_ptr(), view.nbytes) for view in views})
        for buffer in (slot.dev_int, slot.dev_meta, slot.dev_float, slot.dev_tables):
            start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.nbytes
            inside = [(ptr, size) for ptr, size in fields if start <= ptr < end]
            assert all(ptr + size <= end for ptr, size in inside), shape
            assert all(a + a_size <= b for (a, a_size), (b, _) in itertools.pairwise(inside)), shape
        assert ints["slot_mapping"].shape[0] == tokens and meta.seq_lens.shape[0] == seqs
        assert meta.cu_query_lens.shape[0] == seqs + 1 and params.min_p.shape[0] == seqs
        assert ints["mask_rows"].shape[0] == seqs
