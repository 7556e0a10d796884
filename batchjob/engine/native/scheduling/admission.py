"""Offline admission order: which of the pulled requests starts next.

An offline job may run its requests in any order: each completion carries its request's id, so the output is
the same whatever the order. The queue pulls up to `window` requests ahead of the scheduler's free slots and
hands them out in a sweep over their prompts' token ids in sorted order: after a prompt P, the smallest one
that sorts at or after P, wrapping round to the smallest when none does. Prompts sharing a prefix sort next to
each other, so they are admitted one after another while the prefix's KV blocks are still cached, and the
prefix is prefilled once per group instead of once per copy evicted in between. A sweep passes every prompt
once, so none waits for ever; at most `window` requests are held, so memory stays bounded. `window=0` keeps
arrival order.
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
