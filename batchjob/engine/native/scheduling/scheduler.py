"""Continuous batching: which sequences run in the next step, and how many tokens each.

One step is a flat batch of decodes (one token each) and prefill chunks, bounded by `max_num_seqs` and
`max_num_batched_tokens`. Running sequences come first; when their KV blocks run out, the most recently
admitted sequence is preempted (its blocks freed; it is recomputed later). Waiting sequences are admitted
while blocks and budget last, with prompt blocks shared from the prefix cache. New requests are pulled from
the input only when a sequence slot is free, so memory stays bounded for any input size.

A prompt's blocks fit long before its outputs have grown, so a cache smaller than `max_num_seqs` sequences need
would admit sequences only to preempt them again, each recomputing its prompt and its output so far. Three rules
keep that rare. A sequence is admitted only while `RESERVE` blocks of growth stay free for every running one. A
sequence whose length is known (EOS ignored, no stop, no constraint: it runs to `max_len`) is admitted only if
the cache can hold every such sequence to its end: the cache's use, projected with each of them growing a token a
step and freeing its blocks at its end, never passes the cache's size (`GrowthProjection`). And a preemption
lowers the admission limit to the sequences running then, the number the cache was seen to hold: a finished
sequence's place goes to one waiting, no more; once a `SPARE` share of the cache is free again (shorter requests
in the input), the limit is `max_num_seqs` again. `scripts/dev/simulate_admission.py` replays a workload's
lengths through this scheduler (W5 on the cache of an 8B model on a 141 GB card, `max_num_seqs=1024`: 181
preemptions recomputing 11.6% of the tokens before the first and last rules, none after; W8, the 70B in FP8 on a
141 GB card, recomputed 35.3% of its tokens before the projection, none after).

With the asynchronous loop the step being planned runs after one still in flight; the plan assumes every
sequence in flight grows by its pending token, and blocks are reserved for it.

A decode step whose row count runs fewer tokens a second than a smaller decode graph's runs that graph's rows,
the latest admitted sitting the step out (`SchedulerConfig.decode_rows`, from the graphs' replay times).

With CUDA graphs a step that carries prefill chunks is padded up to a token bucket of the mixed graphs, and a
padded token costs a real token's compute. A step that would overshoot a bucket takes smaller chunks to fill
the bucket below exactly when that keeps at least `CUT_SHARE` of its prefill; the rest of a prompt comes in the
next step, which runs anyway for the decodes. Below that share the step is padded instead, so a prompt is not
cut into slivers that delay its first token for many steps (in a run whose requests finish in waves, that would
delay the whole wave's end). Decodes are never cut for a chunk.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import islice

import numpy as np

from batchjob.engine.native.scheduling.block_manager import KVBlockManager
from batchjob.engine.native.scheduling.growth import GrowthProjection, runs_to_max_len
from batchjob.engine.native.scheduling.plan import StepPlan
from batchjob.engine.native.scheduling.sequence import Sequence, Status

# KV blocks of growth kept free for each running sequence before another is admitted (64 tokens at 16 a block).
RESERVE = 4
# The share of the KV cache that must be free for the admission limit a preemption set to be lifted.
SPARE = 0.25
# The least share of a step's prefill tokens a cut to the bucket below must keep (module docstring).
CUT_SHARE = 0.25


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool = True
    # A constrained sequence whose last sampled token is still in flight sits the next step out, so its next mask
    # can be computed while that step runs (the asynchronous loop's `engine.constrained_lag`).
    constrained_lag: bool = False
    # The mixed CUDA graphs' token buckets (ascending; empty: steps are not padded, so no step is cut to one).
    token_buckets: tuple[int, ...] = ()
    # How many of a decode step's rows run, by how many it has (`step_layout.decode_rows`; empty: all of them).
    decode_rows: tuple[int, ...] = ()


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: KVBlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0  # prompt tokens admitted from the prefix cache instead of computed
        # The sequences the cache was seen to hold: lowered to the running count at each preemption (module
        # docstring), back to `max_num_seqs` once the cache has room to spare
        self.admit_limit = config.max_num_seqs
        self.known_running = 0  # running sequences of known length (`growth.runs_to_max_len`)
        self.sat_out = 0  # decodes that sat a step out (`_sit_out`)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def free_seq_slots(self) -> int:
        return self.config.max_num_seqs - len(self.running) - len(self.waiting)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def _runs_now(self, seq: Sequence) -> bool:
        """Whether running `seq` has tokens to feed this step: not when all are fed, when the pending token
        already ends it (length: no wasted step), or when it sits out for its mask (`constrained_lag`)."""
        if seq.num_tokens == seq.num_computed or seq.num_tokens >= seq.max_len:
            return False
        return not (self.config.constrained_lag and seq.matcher is not None and seq.pending)

    def _demand(self) -> tuple[int, int]:
        """The running sequences' decodes (one token to feed) and all the tokens they have to feed, in one pass."""
        runs_now = self._runs_now
        remaining = [seq.num_tokens - seq.num_computed for seq in self.running if runs_now(seq)]
        return remaining.count(1), sum(remaining)

    def step_budget(self, decodes: int, running_tokens: int) -> int:
        """Tokens this step may take: `max_num_batched_tokens`, or the largest mixed graph's token bucket below
        what the step wants that keeps at least `CUT_SHARE` of its prefill tokens (module docstring). `decodes`
        and `running_tokens`: `_demand()`."""
        limit = self.config.max_num_batched_tokens
        if not self.config.token_buckets or not self.config.enable_chunked_prefill:
            return limit
        wanted = running_tokens
        for seq in islice(self.waiting, max(self.admit_limit - len(self.running), 0)):
            if wanted >= limit or not seq.ready_for_prefill:
                break
            wanted += seq.num_tokens
        wanted = min(wanted, limit)
        prefill = wanted - decodes
        below = [b for b in self.config.token_buckets if b < wanted and b - decodes >= CUT_SHARE * prefill]
        return below[-1] if prefill > 0 and wanted not in self.config.token_buckets and below else limit

    def schedule(self) -> StepPlan | None:
        decodes, running_tokens = self._demand()
        budget = self.step_budget(decodes, running_tokens)
        chosen: list[tuple[Sequence, int, int, bool]] = []
        block_size = self.blocks.block_size
        runs_now, choose = self._runs_now, self._choose

        # Running sequences, oldest first; a sequence in the middle of its prefill continues with a chunk, as
        # long as it leaves a token for each decode after it. This loop runs for every sequence every step, so
        # the common case (a decode whose blocks already hold its token, prompt blocks registered) calls nothing.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if not runs_now(seq):
                i += 1
                continue
            start = seq.num_computed
            remaining = seq.num_tokens - start
            if remaining == 1:
                decodes -= 1
                count = 1
            else:
                count = min(remaining, budget - decodes)
                if count <= 0:
                    i += 1
                    continue
            if start + count > len(seq.block_table) * block_size and not self._reserve(seq, start + count, chosen):
                continue  # `seq` itself was preempted and left self.running: index i is the next one
            choose(chosen, seq, count)
            budget -= count
            i += 1

        # Admit waiting sequences while there is room, in arrival order.
        if self.admit_limit < self.config.max_num_seqs and self.blocks.num_free >= SPARE * self.blocks.num_blocks:
            self.admit_limit = self.config.max_num_seqs
        projection = None
        while self.waiting and budget > 0 and len(self.running) < self.admit_limit:
            seq = self.waiting[0]
            if not seq.ready_for_prefill:
                break
            shared = self.blocks.match_prefix(seq.prompt_hashes, seq.prompt_blocks)
            # Keep at least one token to compute: its logits give the next token.
            shared = shared[: (seq.num_tokens - 1) // self.blocks.block_size]
            cached_tokens = len(shared) * self.blocks.block_size
            remaining = seq.num_tokens - cached_tokens
            count = min(remaining, budget) if self.config.enable_chunked_prefill else remaining
            if count > budget:
                break
            needed = self.blocks.blocks_needed(len(shared), cached_tokens + count)
            if not self._fits(shared, needed + RESERVE * len(self.running)):  # room for the running ones to grow
                break
            known = runs_to_max_len(seq)
            if self.running and (known or self.known_running):  # room for those of known length to end
                if projection is None:
                    projection = GrowthProjection(self.running, self.blocks.block_size, self.blocks.num_blocks - 1)
                used = self.blocks.num_blocks - 1 - self.blocks.num_free + needed + self._reusable(shared)
                if not projection.fits(used, seq, len(shared) + needed):
                    break
            seq.block_table = self.blocks.allocate(shared, needed)
            seq.num_computed = cached_tokens
            self.prefix_hit_tokens += cached_tokens
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            self.known_running += known
            if projection is not None:
                projection.add(seq)
            choose(chosen, seq, count)
            budget -= count

        if not chosen:
            return None
        self._sit_out(chosen)
        seqs, starts, counts, samples = (list(column) for column in zip(*chosen, strict=True))
        carry_rows = [seq.carry_row() for seq in seqs]
        row = 0
        for seq, sampled in zip(seqs, samples, strict=True):
            if sampled:
                seq.append_pending(row)
                row += 1
        return StepPlan(
            seqs=seqs,
            starts=np.array(starts, dtype=np.int64),
            counts=np.array(counts, dtype=np.int64),
            samples=np.array(samples, dtype=bool),
            carry_rows=np.array(carry_rows, dtype=np.int64),
        )

    def _sit_out(self, chosen: list) -> None:
        """A decode step whose row count runs slower for each row than a smaller bucket's (`decode_rows`) runs that
        many; the latest admitted of its rows sit the step out and run in the next one."""
        rows = self.config.decode_rows
        keep = rows[len(chosen)] if len(chosen) < len(rows) else len(chosen)
        if keep == len(chosen):
            return
        if any(count != 1 or start < seq.prompt_len for seq, start, count, _ in chosen):
            return  # a prompt's token: a mixed step (padded to a token bucket), or one a later prompt may share
        for seq, _, _, _ in chosen[keep:]:  # `_choose` undone: a decode's token registers no prompt block
            seq.num_computed -= 1
            seq.inflight -= 1
        self.sat_out += len(chosen) - keep
        del chosen[keep:]

    def _choose(self, chosen: list, seq: Sequence, count: int) -> None:
        start = seq.num_computed
        seq.num_computed += count
        seq.inflight += 1
        chosen.append((seq, start, count, seq.num_computed == seq.num_tokens))
        # Registered now, a later sequence in this same step can share these blocks: every layer stores the
        # step's K/V for all tokens before any of them attends.
        if seq.num_registered < min(seq.num_computed, seq.prompt_len) // self.blocks.block_size:
            self._register_full_prompt_blocks(seq)

    def _reusable(self, shared: list[int]) -> int:
        """The cached blocks of `shared` no sequence holds: free now, taken from the free ones by sharing them."""
        return sum(1 for b in shared if self.blocks.ref_counts[b] == 0)

    def _fits(self, shared: list[int], needed: int) -> bool:
        return needed <= self.blocks.num_free - self._reusable(shared)

    def _reserve(self, seq: Sequence, total_tokens: int, chosen: list) -> bool:
        """Give `seq` blocks for `total_tokens`, preempting later-admitted sequences not yet `chosen` for this
        step if needed. False when `seq` itself had to be preempted (nothing else left to take from)."""
        needed = self.blocks.blocks_needed(len(seq.block_table), total_tokens)
        scheduled = None
        while not self.blocks.can_allocate(needed):
            if scheduled is None:
                scheduled = {entry[0].seq_id for entry in chosen}
            victim = next((s for s in reversed(self.running) if s.seq_id not in scheduled), None)
            if victim is None:
                return False
            self.preempt(victim)
            if victim is seq:
                return False
        for _ in range(needed):
            seq.block_table.append(self.blocks.append_block())
        return True

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.known_running -= runs_to_max_len(seq)
        self.blocks.free(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0
        seq.num_registered = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        self.admit_limit = max(1, min(self.admit_limit, len(self.running)))

    def _register_full_prompt_blocks(self, seq: Sequence) -> None:
        full = min(seq.num_computed, seq.prompt_len) // self.blocks.block_size
        for index in range(seq.num_registered, full):
            parent = seq.block_table[index - 1] if index else None
            self.blocks.register(seq.block_table[index], seq.prompt_hashes[index], seq.prompt_blocks[index], parent)
        seq.num_registered = max(seq.num_registered, full)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark `seq` finished; its blocks are freed once no step in flight still uses them."""
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
            self.known_running -= runs_to_max_len(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.release_if_idle(seq)

    def release_if_idle(self, seq: Sequence) -> None:
        if seq.status is Status.FINISHED and seq.inflight == 0 and seq.block_table:
            self.blocks.free(seq.block_table)
            seq.block_table = []
