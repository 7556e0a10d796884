"""A step's inputs as one message: what the job process of a tensor-parallel engine sends every rank.

The job process lays out and fills a step exactly as a single-device engine does (`layout_step`,
`IOSlot.fill`, into host buffers of its own), then ships the used part of each host input buffer. A rank copies
them into its next slot's host buffers and launches the step as if it had filled them itself, so every rank runs
the same step from the same bytes. Block tables travel only as wide as the longest one in the step: the columns
past a sequence's blocks are never read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from batchjob.engine.native.runtime.io_slot import IOSlot

if TYPE_CHECKING:
    from batchjob.engine.native.runtime.step_layout import StepLayout


@dataclass(frozen=True)
class PackedStep:
    layout: StepLayout
    ints: np.ndarray
    meta: np.ndarray
    tables: np.ndarray
    floats: np.ndarray

    @classmethod
    def pack(cls, slot: IOSlot, layout: StepLayout, table_width: int) -> PackedStep:
        """Copies of the host buffers of `slot`, filled for a step of `layout`."""
        shape = layout.shape
        return cls(
            layout=layout,
            ints=slot.host_int[: shape.int_size].numpy().copy(),
            meta=slot.host_meta[: shape.meta_size].numpy().copy(),
            tables=slot.host_tables[: shape.seqs, :table_width].numpy().copy(),
            floats=slot.host_float[: shape.float_size].numpy().copy(),
        )

    def unpack_into(self, slot: IOSlot) -> None:
        shape = self.layout.shape
        slot.host_int[: shape.int_size].numpy()[:] = self.ints
        slot.host_meta[: shape.meta_size].numpy()[:] = self.meta
        slot.host_tables[: shape.seqs, : self.tables.shape[1]].numpy()[:] = self.tables
        slot.host_float[: shape.float_size].numpy()[:] = self.floats
