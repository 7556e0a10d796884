"""One writer per shard: a lock file naming its holder, taken by exclusive create and kept alive as a lease.

The holder refreshes the lock every few seconds from a background thread (a local file's mtime is touched;
an object is re-put conditionally on its ETag). A holder that died without releasing (kill -9, OOM, a lost
node) leaves the file behind; it is stale, and taken over with a warning, when
- it has not been refreshed for `timeout_s` (`output.lock_timeout_s`), wherever the holder ran, or
- its pid is gone (or reused by a newer process) on this same host, or
- it was an earlier run of this same Slurm job: Slurm requeues a job (preemption, node failure) under the
  same SLURM_JOB_ID with a higher SLURM_RESTART_COUNT only once the earlier run is over.
Any other lock is live and refused. Two live writers never share a shard: a holder stops committing once
its lease is older than half the timeout (it stalled, or its storage stopped answering), long before
another process may take the lock over; this assumes the hosts' clocks agree to well within that margin.

Takeover is atomic where the storage allows it: locally the stale file is renamed aside and checked before
a new one is created; on S3 the new lock replaces the stale one only if its ETag is unchanged. Other object
stores (no conditional writes through fsspec) fall back to check-then-write.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

import psutil

from batchjob.io.access import is_access_error
from batchjob.io.storage import Storage

log = logging.getLogger(__name__)
DEFAULT_TIMEOUT_S = 300.0


class LockError(RuntimeError):
    """Another live process holds (or may hold) this shard."""


class LockLost(RuntimeError):
    """This process's lease on its shard ran out or was taken over: it must not commit any more."""


@dataclass(frozen=True)
class LockHolder:
    pid: int
    host: str
    since: str  # ISO 8601, UTC
    process_started: float  # the pid's start time, to recognise a pid reused by an unrelated process
    token: str
    slurm_job_id: str | None = None
    slurm_restart_count: int = 0

    @classmethod
    def this_process(cls) -> LockHolder:
        return cls(
            pid=os.getpid(),
            host=socket.gethostname(),
            since=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            process_started=psutil.Process().create_time(),
            token=uuid.uuid4().hex,
            slurm_job_id=os.environ.get("SLURM_JOB_ID"),
            slurm_restart_count=int(os.environ.get("SLURM_RESTART_COUNT", "0")),
        )

    def stale_reason(self, age_s: float, timeout_s: float) -> str | None:
        """Why this holder is gone, or None if it may still be running. `age_s`: since its last refresh."""
        me = LockHolder.this_process()
        requeued = self.slurm_job_id is not None and self.slurm_job_id == me.slurm_job_id
        if requeued and self.slurm_restart_count < me.slurm_restart_count:
            return f"Slurm requeued job {me.slurm_job_id} (restart {me.slurm_restart_count})"
        if age_s > timeout_s:
            return f"not refreshed for {age_s:.0f} s (output.lock_timeout_s={timeout_s:g})"
        if self.host != me.host:
            return None
        try:
            started = psutil.Process(self.pid).create_time()
        except psutil.NoSuchProcess:
            return "that process is no longer running"
        except psutil.AccessDenied:
            return None
        if abs(started - self.process_started) > 1.0:
            return "that pid now belongs to a newer process"
        return None


@dataclass(frozen=True)
class LockState:
    holder: LockHolder
    age_s: float  # since the last refresh, by this host's clock against the storage's modification time
    version: str | None  # the object's ETag on S3, for conditional replacement


class ShardLock:
    def __init__(self, storage: Storage, path: str, tmp_dir: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not timeout_s > 0:
            raise ValueError(f"output.lock_timeout_s={timeout_s!r}: must be a number of seconds > 0")
        self.storage = storage
        self.path = path
        self.tmp_dir = tmp_dir
        self.timeout_s = float(timeout_s)
        self.refresh_every_s = min(5.0, self.timeout_s / 6)
        self.holder: LockHolder | None = None
        self._version: str | None = None
        self._refreshed_at = 0.0  # time.monotonic() of the last successful refresh
        self._lost: str | None = None
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None

    def acquire(self) -> None:
        me = LockHolder.this_process()
        payload = json.dumps(asdict(me)).encode()
        # Three rounds: a stale lock replaced or removed in one round leaves the name free for the next.
        for _ in range(3):
            if self.storage.create_exclusive(self.path, payload, self.tmp_dir):
                self._start(me, self._current_version())
                return
            state = self.read()
            if state is None:
                continue  # released between our create and our read
            holder = state.holder
            reason = holder.stale_reason(state.age_s, self.timeout_s)
            if reason is None:
                raise LockError(
                    f"{self.path} is held by pid {holder.pid} on host {holder.host} since {holder.since} "
                    f"(refreshed {state.age_s:.0f} s ago): another process is writing this shard. Wait for it, "
                    "or stop it; if it is gone (e.g. its node was lost), rerun once the lock has not been "
                    f"refreshed for output.lock_timeout_s={self.timeout_s:g} s, or delete {self.path}"
                )
            log.warning(
                "taking over stale lock %s: pid %d on %s (since %s): %s",
                self.path,
                holder.pid,
                holder.host,
                holder.since,
                reason,
            )
            version = self._take_over(state, payload)
            if version is not None:
                self._start(me, version)
                return
        raise LockError(f"{self.path} was taken by another process while this one was acquiring it; rerun")

    def read(self) -> LockState | None:
        """The current holder, or None if there is no lock."""
        try:
            if self.storage.is_s3:
                with self.storage.fs.open(self.path, "rb") as f:  # s3fs reads under If-Match of the HEAD's ETag
                    raw, details = f.read(), f.details
                version, modified = details["ETag"], details["LastModified"].timestamp()
            else:
                modified = self.storage.modified(self.path)
                raw, version = self.storage.read_bytes(self.path), None
        except FileNotFoundError:
            return None
        if modified is None:
            return None
        try:
            holder = LockHolder(**json.loads(raw))
        except (ValueError, TypeError) as exc:
            raise LockError(
                f"{self.path} exists but is unreadable ({exc}); if no process is writing this shard, "
                "delete it and rerun"
            ) from exc
        return LockState(holder, max(0.0, time.time() - modified), version)

    def _current_version(self) -> str | None:
        return self.storage.fs.info(self.path)["ETag"] if self.storage.is_s3 else None

    def _take_over(self, stale: LockState, payload: bytes) -> str | None:
        """On S3, replace the stale lock with ours in one conditional PUT: our ETag, or None if another process
        won. Elsewhere remove the stale lock and return None: the next round's exclusive create decides."""
        if self.storage.is_s3:
            return self._put_if(payload, stale.version)
        if self.storage.is_local:
            self._move_aside_if_unchanged(stale.holder)
        else:
            self.storage.remove(self.path)
        return None

    def _put_if(self, payload: bytes, version: str | None) -> str | None:
        """Conditional PUT on S3: the new ETag, or None if the object changed (or vanished) meanwhile."""
        bucket, key, _ = self.storage.fs.split_path(self.path)
        try:
            done = self.storage.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=payload, IfMatch=version)
        except (OSError, FileNotFoundError):
            return None
        return done["ETag"]

    def _move_aside_if_unchanged(self, stale: LockHolder) -> None:
        # Move the lock aside atomically, then check it is the stale one we judged: a racing process may
        # have replaced it with its own live lock in between, which must be put back untouched.
        aside = f"{self.path}.stale-{uuid.uuid4().hex}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        with open(aside, "rb") as f:
            moved = json.loads(f.read())
        if moved.get("token") != stale.token:
            try:
                os.link(aside, self.path)
            except FileExistsError:
                log.warning("lock %s changed hands during stale takeover; keeping the newer holder", self.path)
        os.remove(aside)

    def _start(self, me: LockHolder, version: str | None) -> None:
        self.holder, self._version, self._lost = me, version, None
        self._refreshed_at = time.monotonic()
        self._stop.clear()
        self._refresher = threading.Thread(target=self._refresh_loop, name="batchjob-lock-lease", daemon=True)
        self._refresher.start()

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.refresh_every_s):
            if time.monotonic() - self._refreshed_at > self.timeout_s / 2:
                return  # the lease ran out (this process stalled): another may take over; never refresh again
            try:
                self._refresh()
            except Exception as err:  # a storage hiccup: retried next round, the lease runs out if it persists
                log.warning("could not refresh lock %s: %s", self.path, err)
            if self._lost is not None:
                return

    def _refresh(self) -> None:
        assert self.holder is not None
        if self.storage.is_s3:
            payload = json.dumps(asdict(self.holder)).encode()
            version = self._put_if(payload, self._version)
            if version is None:
                self._lost = "it was replaced or deleted"
                return
            self._version = version
        else:
            state = self.read()
            if state is None or state.holder.token != self.holder.token:
                self._lost = "it was taken over" if state else "it was deleted"
                return
            if self.storage.is_local:
                os.utime(self.path)
            else:
                self.storage.write_durable(self.path, json.dumps(asdict(self.holder)).encode())
        self._refreshed_at = time.monotonic()

    def ensure_held(self) -> None:
        """Raise `LockLost` unless this process still safely holds the shard (call before every commit)."""
        if self.holder is None:
            raise LockLost(f"{self.path} is not held by this process")
        age = time.monotonic() - self._refreshed_at
        if self._lost is None and age > self.timeout_s / 2:
            self._lost = f"it was not refreshed for {age:.0f} s (the process stalled, or its storage did not answer)"
        if self._lost is not None:
            raise LockLost(
                f"this process lost its lock {self.path}: {self._lost}. Another process may now be writing this "
                "shard, so nothing more is committed here; rows committed so far are kept. Rerun the same "
                "command once no other process writes this shard"
            )

    def release(self) -> None:
        if self.holder is None:
            return
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join()
        try:
            current = self.read() if self._lost is None else None
            if current is not None and current.holder.token == self.holder.token:
                with contextlib.suppress(FileNotFoundError):
                    self.storage.remove(self.path)
            else:
                log.warning("lock %s is no longer ours at release (taken over as stale?); left alone", self.path)
        except Exception as err:
            if not is_access_error(err):
                raise
            # The storage went out of reach: the next run takes the lock over (this host's, or stale by then).
            log.warning("could not release lock %s (%s); left for the next run to take over", self.path, err)
        finally:
            self.holder = None
