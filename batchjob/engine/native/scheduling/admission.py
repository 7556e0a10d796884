"""Offline admission order: which of the pulled requests starts next.

An offline job may run its requests in any order: each completion carries its request's id, so the output is
the same whatever the order. The queue pulls up to `window` requests ahead of the scheduler's free slots and
hands them out in a sweep over their prompts' token ids in sorted order: after a prompt P, the smallest one
that sorts at or after P, wrapping round to the smallest when none does. Prompts sharing a prefix sort next to
each other, so they are admitted one after another while the prefix's KV blocks are still cached, and the
prefix is prefilled once per group instead of once per copy evicted in between. A sweep passes every prompt
once, so none waits for ever; at most `window` requests are held, so memory stays bounded. `window=0` keeps
arrival order.

A request the engine cannot run at all (`refusal`: an empty or too long prompt, ids outside the vocabulary, an
option it needs) is answered with a failed completion instead of being admitted; the job goes on.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from batchjob.engine.api import Request


class AdmissionQueue:
    def __init__(self, requests: Iterable[Request], window: int) -> None:
        if window < 0:
            raise ValueError(f"the admission window must be >= 0, got {window}")
        self._source = iter(requests)
        self.window = window
        self.exhausted = False
        # (prompt ids, arrival number, request), sorted; the arrival number breaks ties between equal prompts
        # and keeps requests themselves out of the comparison.
        self._held: list[tuple[tuple[int, ...], int, Request]] = []
        self._arrivals = 0
        self._cursor: tuple[tuple[int, ...], int] | None = None

    def __len__(self) -> int:
        return len(self._held)

    def pop(self) -> Request | None:
        """The next request to admit, or None when the input is exhausted and nothing is held."""
        if self.window == 0:
            return self._pull()
        while not self.exhausted and len(self._held) < self.window:
            request = self._pull()
            if request is not None:
                bisect.insort(self._held, (tuple(request.prompt_ids), self._arrivals, request))
                self._arrivals += 1
        if not self._held:
            return None
        index = 0 if self._cursor is None else bisect.bisect_left(self._held, self._cursor)
        prompt, arrival, request = self._held.pop(index if index < len(self._held) else 0)
        self._cursor = (prompt, arrival)
        return request

    def _pull(self) -> Request | None:
        request = next(self._source, None)
        if request is None:
            self.exhausted = True
        return request


def refusal(
    request: Request, max_model_len: int, vocab_size: int, *, detokenize: bool, tensor_parallel: int
) -> str | None:
    """Why the engine cannot run `request`, with the fix, or None where it can."""
    prompt_len = len(request.prompt_ids)
    if prompt_len == 0:
        return "empty prompt: at least one token is needed"
    if prompt_len >= max_model_len:
        return (
            f"prompt has {prompt_len} tokens but the context is {max_model_len} tokens "
            f"(max_model_len); shorten the prompt"
        )
    if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= vocab_size:
        return f"prompt token ids must be in [0, {vocab_size})"
    if request.sampling.stop and not detokenize:
        return "stop strings need engine.detokenize=true"
    if request.sampling.constraint is not None and tensor_parallel > 1:
        return (
            f"structured outputs are not supported with engine.tensor_parallel={tensor_parallel}; "
            "set engine.tensor_parallel=1 (several engines: engine.data_parallel)"
        )
    return None
