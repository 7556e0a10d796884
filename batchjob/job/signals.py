"""Graceful stop on SIGINT, SIGTERM and SIGUSR1 (Slurm sends SIGUSR1/SIGTERM before preemption).

The first signal asks the job to stop taking rows. While the job waits on the engine (`interruptible()`),
the handler also raises `Interrupted` at once, so it need not wait for a long batch to finish: whatever
had finished is committed and the rest is recomputed on rerun. Outside that window (building rows,
committing) the job checks `requested` at its next step. A second signal interrupts unconditionally,
which is safe because a commit torn by it is repaired on the next open, exactly as after a crash.

A data-parallel child hears of one stop by up to three routes (`cluster/data_parallel.py`): the signal itself, its
parent's relay of it, and its parent's death signal, which the kernel may send more than once. A second signal is
one that the same route brings again, and the death signal never counts twice: a child whose parent is gone stops
once, committing what it has.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from batchjob.cluster.data_parallel import PARENT_GONE, RELAYED

# Each signal handled: the route it comes by (None: one whose repeats are the same stop) and the stop it asks for,
# a parent's death as on preemption. Where the relays are the stop signals themselves (not Linux), they count as sent.
_ROUTES: dict[int, tuple[str | None, int]] = {
    PARENT_GONE: (None, signal.SIGTERM),
    **{relay: ("relayed", sig) for sig, relay in RELAYED.items()},
    **{sig: ("signalled", sig) for sig in RELAYED},
}


class Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def exit_code_for(signum: int) -> int:
    """The shell convention for death by a signal, so wrappers and schedulers see why the job ended."""
    return 128 + signum


class StopSignals:
    """Use as a context manager around the generation loop; handlers are restored on exit."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._interruptible = False
        self._previous: dict[int, object] = {}
        self._routes: set[str] = set()  # those a stop came by

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> StopSignals:
        for sig in _ROUTES:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        if self.requested:
            raise Interrupted(self.signum)
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        route, asked = _ROUTES[signum]
        again = route in self._routes
        if route is not None:
            self._routes.add(route)
        if not self.requested:
            self.signum = asked
        if again or self._interruptible:
            self._interruptible = False
            raise Interrupted(self.signum)
