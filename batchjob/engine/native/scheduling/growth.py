"""Whether the KV cache can hold the running sequences of known length to their ends (the scheduler's admission).

A sequence that ignores EOS and has no stop and no constraint runs to its `max_len`: its growth is known. For
the sequences of known length (and one about to be admitted), the cache's use is projected step by step, each
growing a token a step and freeing its blocks after its last one. The use peaks just before some sequence ends,
so the peak is the largest of the uses at those ends:

    use(t) = fixed + sum over sequences still running at t of blocks(tokens + t)

where `fixed` is every other block in use (sequences whose end is unknown, steps in flight, prefix blocks shared
between sequences counted once). With the sequences sorted by tokens to come, the k longest are the ones still
running at the k-th end, so every end's use comes from one cumulative sum. Blocks are rounded up per sequence,
so the projection never falls below what the cache will hold.
"""

from __future__ import annotations

import numpy as np

from batchjob.engine.native.scheduling.sequence import Sequence


def runs_to_max_len(seq: Sequence) -> bool:
    """Whether `seq` ends only at its `max_len`: EOS ignored, no stop token or text, no constraint."""
    sampling = seq.sampling
    return sampling.ignore_eos and not sampling.stop_token_ids and not sampling.stop and seq.matcher is None


class GrowthProjection:
    """The running sequences of known length as arrays (tokens now, tokens to come), built for one step's
    admissions and extended by each sequence admitted in it."""

    def __init__(self, running: list[Sequence], block_size: int, capacity: int) -> None:
        known = [seq for seq in running if runs_to_max_len(seq)]
        self.tokens = np.fromiter((seq.num_tokens for seq in known), dtype=np.int64, count=len(known))
        self.to_come = np.fromiter((seq.max_len - seq.num_tokens for seq in known), dtype=np.int64, count=len(known))
        self.held = sum(len(seq.block_table) for seq in known)
        self.block_size = block_size
        self.capacity = capacity

    def fits(self, used: int, seq: Sequence, blocks: int) -> bool:
        """Whether the cache, with `used` blocks in use once `seq` holds its `blocks`, holds every sequence of
        known length, `seq` among them if its length is known, to its end."""
        tokens, to_come, held = self._with(seq, blocks)
        if not len(tokens):
            return used <= self.capacity
        order = np.argsort(-to_come, kind="stable")
        ends = to_come[order]
        running_at_end = np.arange(1, len(ends) + 1)
        # blocks(n + t) <= (n + t + block_size - 1) / block_size, summed over the sequences still running at t
        peak = used - held + (np.cumsum(tokens[order] + self.block_size - 1) + ends * running_at_end) / self.block_size
        return float(peak.max()) <= self.capacity

    def add(self, seq: Sequence) -> None:
        """`seq` was admitted: it is one of the running sequences from now on."""
        self.tokens, self.to_come, self.held = self._with(seq, len(seq.block_table))

    def _with(self, seq: Sequence, blocks: int) -> tuple[np.ndarray, np.ndarray, int]:
        """The arrays and held blocks with `seq`, holding `blocks`, among the sequences if its length is known."""
        if not runs_to_max_len(seq):
            return self.tokens, self.to_come, self.held
        return (
            np.append(self.tokens, seq.num_tokens),
            np.append(self.to_come, seq.max_len - seq.num_tokens),
            self.held + blocks,
        )
