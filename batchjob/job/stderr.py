"""The job's stderr, whose reader may be gone before the job is: a pipe to a program stopped by the same Ctrl-C
(`python -m batchjob ... 2>&1 | tee run.log`), a terminal hung up, a launcher that died. Writing there raises
(BrokenPipeError: Python ignores SIGPIPE), so a job stopping on a signal would fail after its commit with status 1,
never saying it may resume nor requeuing its Slurm task, and the interpreter's last flush of stderr would fail
again (status 120). From the first write that fails, stderr goes to /dev/null instead: the messages are dropped,
the log lines are still in the run's `batchjob.log` beside the output, and the job ends as it would have."""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO


class DroppedWhenUnread:
    """A text stream that passes everything to `stream` until a write fails, then drops it (`stream`'s descriptor
    is pointed at /dev/null, so writes from elsewhere in the process, native code included, go there too)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError:
            self._drop()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError:
            self._drop()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def _drop(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)
        self._stream.flush()  # what the failed write left buffered goes to /dev/null now


def drop_stderr_when_unread() -> None:
    """Make this process's stderr a `DroppedWhenUnread` (before logging is set up: its handler writes there)."""
    if sys.stderr is not None:  # None: started with no stderr at all
        sys.stderr = DroppedWhenUnread(sys.stderr)
