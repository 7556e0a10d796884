"""Named steps of the commit protocol where tests end the process, to prove each step's recovery.

A no-op unless `BATCHJOB_CRASH_AT=STEP` (or `STEP:N`, the N-th time that step is reached) is set: then the
process ends at once with `os._exit`, as a kill -9 would, leaving whatever the step left on storage.
"""

from __future__ import annotations

import os
from collections import Counter

ENV = "BATCHJOB_CRASH_AT"
EXIT_STATUS = 86
STEPS = (
    "part-written",  # the part is durable under the temp folder (local disks only)
    "part-committed",  # the part is visible under its final name: the commit point
    "part-synced",  # output.dir's entry for it is fsynced (local disks only)
    "manifest-written",  # its manifest object exists
    "manifest-synced",  # the manifest folder's entry for it is fsynced (local disks only)
)
_reached: Counter[str] = Counter()


def crash_point(step: str) -> None:
    wanted = os.environ.get(ENV)
    if not wanted:
        return
    name, _, nth = wanted.partition(":")
    if name != step:
        return
    _reached[step] += 1
    if _reached[step] >= int(nth or 1):
        os._exit(EXIT_STATUS)
