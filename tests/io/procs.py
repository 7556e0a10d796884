"""Second processes for the IO tests: `python procs.py COMMAND ARGS...` (PYTHONPATH = repo root).

job OUT TOTAL BATCH     resume-aware commit loop over row ids 0..TOTAL-1; prints "commit" per part
                        (OUT: a local path or any fsspec URI; BATCHJOB_CRASH_AT ends it at a commit step)
hold-lock OUT [T]       open shard 0 of OUT (lock timeout T s), print "locked", then commit one row a second
                        until killed, exiting 4 with the LockLost message once it may no longer commit
try-open OUT [T]        open shard 0 of OUT (lock timeout T s); exit 3 printing the LockError if refused
peak-rss PATH BATCH [COLUMN]   stream an input's COLUMN (default `prompt`); print rows and peak RSS (MiB)
"""

from __future__ import annotations

import json
import resource
import sys
import time

import numpy as np
import pyarrow as pa

from batchjob.io import InputSpec, LockError, LockLost, OutputDataset, open_input
from batchjob.io.lock import DEFAULT_TIMEOUT_S

JOB = {"model": "tiny", "sampling": {"max_new_tokens": 4}}


def job(out: str, total: int, batch: int) -> None:
    dataset = OutputDataset(out)
    dataset.open(JOB)
    done = dataset.committed_row_ids()
    todo = np.setdiff1d(np.arange(total, dtype=np.int64), done)
    for start in range(0, len(todo), batch):
        ids = todo[start : start + batch]
        dataset.commit(pa.table({"row_id": ids, "generation": [f"gen {i}" for i in ids]}))
        print("commit", flush=True)
    dataset.mark_success()
    dataset.close()
    print("done", flush=True)


def hold_lock(out: str, timeout_s: float) -> None:
    dataset = OutputDataset(out, lock_timeout_s=timeout_s)
    dataset.open(JOB)
    print("locked", flush=True)
    for row in range(1_000_000, 1_000_600):
        time.sleep(1)
        try:
            dataset.commit(pa.table({"row_id": pa.array([row], pa.int64())}))
        except LockLost as exc:
            print(exc, flush=True)
            sys.exit(4)


def try_open(out: str, timeout_s: float) -> None:
    try:
        OutputDataset(out, lock_timeout_s=timeout_s).open(JOB)
    except LockError as exc:
        print(exc, flush=True)
        sys.exit(3)


def peak_rss(path: str, batch_rows: int, column: str = "prompt") -> None:
    source = open_input(InputSpec(path, batch_rows=batch_rows))
    rows = sum(batch.num_rows for batch in source.iter_batches([column]))
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    print(json.dumps({"rows": rows, "peak_mib": peak_mib}), flush=True)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "job":
        job(args[0], int(args[1]), int(args[2]))
    elif command == "hold-lock":
        hold_lock(args[0], float(args[1]) if len(args) > 1 else DEFAULT_TIMEOUT_S)
    elif command == "try-open":
        try_open(args[0], float(args[1]) if len(args) > 1 else DEFAULT_TIMEOUT_S)
    elif command == "peak-rss":
        peak_rss(args[0], int(args[1]), *args[2:])
    else:
        raise SystemExit(f"unknown command {command!r}")
