"""The packed IO-slot buffers: every field of every step shape starts on a 16-byte boundary (Triton compiles a
kernel variant per pointer alignment, so a field whose alignment moved with the batch would compile mid-run),
and no two fields overlap; and what a step writes in them."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from batchjob.engine import Request, SamplingParams
from batchjob.engine.native.runtime.io_slot import IOSlot, SlotLimits, StepShape
from batchjob.engine.native.scheduling.plan import StepPlan
from batchjob.engine.native.scheduling.sequence import RequestGroup, Sequence


def test_every_field_of_every_shape_is_16_byte_aligned_and_apart():
    limits = SlotLimits(max_tokens=70, max_rows=19, max_blocks_per_seq=5, max_top_logprobs=0, bitmask_words=3)
    slot = IOSlot(0, limits, torch.device("cpu"))
    # Mixed graphs pad the sequences to the limit, which may exceed the tokens of a small bucket.
    for tokens, seqs in itertools.product([1, 2, 3, 5, 16, 17, 70], [1, 2, 3, 4, 7, 8, 19]):
        shape = StepShape(tokens=tokens, seqs=seqs, rows=seqs)
        ints, meta, params = slot.device_views(shape, max_query_len=1, max_seq_len=1)
        views = [*ints.values(), meta.cu_query_lens, meta.seq_lens, meta.decode_order, meta.block_tables]
        views += [meta.slot_mapping]
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
        assert ints["mask_rows"].shape[0] == seqs and meta.decode_order.shape[0] == seqs


def test_a_step_lists_its_sequences_longest_context_first_padding_last():
    # Decodes after 40, 3, 90 and 12 cached tokens and a 20-token chunk, padded as a mixed graph pads: the decode
    # kernel's programs start the sequences in this order (the chunk's program exits at once wherever it sits).
    limits = SlotLimits(max_tokens=32, max_rows=8, max_blocks_per_seq=8, max_top_logprobs=0, bitmask_words=1)
    slot = IOSlot(0, limits, torch.device("cpu"))
    starts, counts = [40, 3, 90, 0, 12], [1, 1, 1, 20, 1]
    seqs = []
    for i, (start, count) in enumerate(zip(starts, counts, strict=True)):
        request = Request(i, (5,) * (start + count), SamplingParams(max_new_tokens=4))
        seqs.append(Sequence.create(i, RequestGroup(request, start + count), 0, start + count + 4, 0, 16))
    for seq in seqs:
        seq.block_table = list(range(1, 8))
    plan = StepPlan(seqs, np.array(starts), np.array(counts), np.ones(5, dtype=bool), np.full(5, -1))
    shape = StepShape(tokens=32, seqs=8, rows=8)
    slot.fill(plan, shape, block_size=16)
    slot.copy_inputs(shape)
    _, meta, _ = slot.device_views(shape, max_query_len=20, max_seq_len=91)

    assert meta.seq_lens.tolist() == [41, 4, 91, 20, 13, 1, 1, 1]
    assert meta.decode_order.tolist() == [2, 0, 3, 4, 1, 5, 6, 7]
