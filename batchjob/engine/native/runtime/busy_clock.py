"""GPU-busy accounting: timing events recorded around the compute of each step, resolved lazily (reading an
event's time before it completes would block or fail, so the newest pairs are left until later)."""

from __future__ import annotations

import torch


class BusyClock:
    """GPU-busy accounting from timing events recorded around each step's compute, resolved lazily."""

    def __init__(self, keep_timeline: int = 4000) -> None:
        self.pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.origin: torch.cuda.Event | None = None
        self.busy_ms = 0.0
        self.first_ms: float | None = None
        self.last_ms = 0.0
        self.timeline: list[tuple[float, float]] = []
        self.keep_timeline = keep_timeline

    def pair(self) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if self.origin is None:
            self.origin = start
        self.pending.append((start, end))
        return start, end

    def resolve(self, keep_last: int = 2) -> None:
        """Account the steps known complete (all but the last `keep_last`, which may still run)."""
        done = self.pending[: max(0, len(self.pending) - keep_last)]
        self.pending = self.pending[len(done) :]
        for start, end in done:
            s, e = self.origin.elapsed_time(start), self.origin.elapsed_time(end)
            self.first_ms = s if self.first_ms is None else self.first_ms
            self.busy_ms += e - s
            self.last_ms = e
            if len(self.timeline) < self.keep_timeline:
                self.timeline.append((s / 1000.0, e / 1000.0))

    def fraction(self) -> float | None:
        span = self.last_ms - (self.first_ms or 0.0)
        return self.busy_ms / span if span > 0 else None
