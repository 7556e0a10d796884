"""A sequence: one sample of one request, as the scheduler and the output processor see it.

Token ids live in a preallocated numpy array. With the asynchronous loop a sequence ends in up to two *pending*
tokens: tokens that steps in flight will sample, whose values the host does not know yet. They are
placeholders (0) here; the device carries each one over into the next step's input.

A constrained sequence (structured outputs) has a grammar `matcher`. When its constraint forces the next tokens
(a schema's keys and punctuation), they may be appended at once (*jump-forward*, `engine.jump_forward`); a token
that a step in flight samples but the constraint already forced is known before it arrives: positions below
`forced_until` are.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batchjob.engine.api import Request
from batchjob.engine.native.scheduling.block_manager import block_hash

# `Sequence.stop_ids` of a sequence that more than a token id can end (a constraint, stop strings).
NOT_PLAIN: frozenset[int] = frozenset({-1})


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class RequestGroup:
    """The `n` sequences of one request; its completion is emitted when all of them finish."""

    request: Request
    prompt_len: int
    sequences: list[Sequence] = field(default_factory=list)
    num_finished: int = 0


@dataclass(eq=False)
class Sequence:
    seq_id: int
    group: RequestGroup
    sample_index: int
    tokens: np.ndarray
    prompt_len: int
    max_len: int
    seed: int
    num_tokens: int = 0
    num_computed: int = 0
    num_registered: int = 0
    pending: deque[tuple[int, int]] = field(default_factory=deque)  # (output row of a step in flight, position)
    forced_until: int = 0
    inflight: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    block_table: list[int] = field(default_factory=list)
    prompt_hashes: list[int] = field(default_factory=list)
    prompt_blocks: list[bytes] = field(default_factory=list)  # each full prompt block's token ids
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    stop_text: str | None = None
    stop_matcher: Any = None
    # (top_k, temperature, top_p, min_p, logprobs or -1): read every step this sequence samples in, so looked up
    # once.
    sampler_row: tuple = ()
    matcher: Any = None  # batchjob.engine.grammar.Matcher of a constrained sequence
    # The token ids that end this sequence, or NOT_PLAIN; set by the output processor at its first token.
    stop_ids: frozenset[int] | None = None
    error: str | None = None
    # `block_table` as an array (`table_array`), and the list it was made from
    _table_array: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32), repr=False)
    _table_source: list[int] | None = field(default=None, repr=False)

    @classmethod
    def create(
        cls, seq_id: int, group: RequestGroup, sample_index: int, max_len: int, seed: int, block_size: int
    ) -> Sequence:
        prompt = np.asarray(group.request.prompt_ids, dtype=np.int64)
        sp = group.request.sampling
        tokens = np.zeros(max_len + 1, dtype=np.int64)
        tokens[: len(prompt)] = prompt
        hashes, blocks, h = [], [], 0
        for start in range(0, len(prompt) - block_size + 1, block_size):
            block = prompt[start : start + block_size]
            h = block_hash(h, block.tolist())
            hashes.append(h)
            blocks.append(block.tobytes())
        return cls(
            seq_id=seq_id,
            group=group,
            sample_index=sample_index,
            tokens=tokens,
            prompt_len=len(prompt),
            max_len=max_len,
            seed=seed,
            num_tokens=len(prompt),
            prompt_hashes=hashes,
            prompt_blocks=blocks,
            sampler_row=(sp.top_k, sp.temperature, sp.top_p, sp.min_p, -1 if sp.logprobs is None else sp.logprobs),
        )

    @property
    def sampling(self):
        return self.group.request.sampling

    @property
    def num_output(self) -> int:
        return self.num_tokens - self.prompt_len

    @property
    def output_ids(self) -> np.ndarray:
        return self.tokens[self.prompt_len : self.num_tokens]

    @property
    def ready_for_prefill(self) -> bool:
        # A preempted sequence whose last token is still pending cannot be recomputed yet: its value is unknown.
        return not self.pending

    def table_array(self) -> np.ndarray:
        """`block_table` as an int32 array for the step's host buffers, converted again only when the table has
        changed: blocks are only ever appended to a table or the whole list replaced (admission, preemption,
        release), so the same list at the same length holds the same blocks."""
        table = self.block_table
        if self._table_source is not table or len(self._table_array) != len(table):
            self._table_array = np.array(table, dtype=np.int32)
            self._table_source = table
        return self._table_array

    def carry_row(self) -> int:
        """The output row of the step in flight that samples this sequence's last token, or -1 when the host
        knows that token (nothing pending, or a pending token the constraint forced)."""
        if self.pending and self.pending[-1][1] >= self.forced_until:
            return self.pending[-1][0]
        return -1

    def append_pending(self, row: int) -> None:
        """The step being scheduled samples this sequence's next token into output row `row`."""
        self.tokens[self.num_tokens] = 0
        self.pending.append((row, self.num_tokens))
        self.num_tokens += 1

    def resolve_oldest(self, token: int) -> tuple[int, bool]:
        """Fill in the oldest pending token (its step has completed). Returns its position and whether the
        constraint had forced it (its value was already in place: the caller checks that `token` equals it)."""
        _, position = self.pending.popleft()
        if position < self.forced_until:
            return position, True
        self.tokens[position] = token
        return position, False

    def append_forced(self, forced: list[int]) -> int:
        """Jump-forward: append tokens the constraint forces. The first replaces the pending token when a step in
        flight samples it (its mask allows only that token); returns how many tokens need no step of their own."""
        replaces_pending = bool(self.pending) and self.pending[-1][1] == self.num_tokens - 1
        start = self.num_tokens - 1 if replaces_pending else self.num_tokens
        self.tokens[start : start + len(forced)] = forced
        self.num_tokens = start + len(forced)
        self.forced_until = self.num_tokens
        return len(forced) - replaces_pending

    def truncate_after(self, position: int) -> None:
        """Stop at `position`: later tokens (sampled by steps already in flight) are discarded."""
        self.num_tokens = position + 1
        self.forced_until = min(self.forced_until, self.num_tokens)
        self.pending.clear()
