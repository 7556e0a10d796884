"""One step's work as the scheduler planned it: its sequences in batch order and the chunk each feeds."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import chain

import numpy as np

from batchjob.engine.native.scheduling.sequence import Sequence


@dataclass
class StepPlan:
    """Sequences of one step, in batch order: first position and token count of each chunk, whether the
    chunk ends in a sampled token, and for a chunk whose last input token is still pending, the row of the
    previous step's output that holds it (-1 otherwise)."""

    seqs: list[Sequence]
    starts: np.ndarray
    counts: np.ndarray
    samples: np.ndarray
    carry_rows: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.counts.sum())

    # What the step layout and the IO slot both read of the sampled rows, gathered once a step: a pass over
    # every sequence costs tens of microseconds of the loop's thread at 256 rows.
    @cached_property
    def sampled(self) -> list[Sequence]:
        """The sequences whose chunk ends in a sampled token, in row order."""
        return [seq for seq, keep in zip(self.seqs, self.samples.tolist(), strict=True) if keep]

    @cached_property
    def sampler_rows(self) -> np.ndarray:
        """float64 [rows, 5]: each sampled row's `Sequence.sampler_row`."""
        rows = self.sampled
        values = chain.from_iterable([seq.sampler_row for seq in rows])
        return np.fromiter(values, dtype=np.float64, count=5 * len(rows)).reshape(-1, 5)

    @cached_property
    def constrained(self) -> np.ndarray:
        """bool [rows]: which sampled rows are under a constraint."""
        sampled = self.sampled
        return np.fromiter((seq.matcher is not None for seq in sampled), dtype=bool, count=len(sampled))

    @property
    def is_decode(self) -> bool:
        return bool((self.counts == 1).all())
