"""One writer per shard: a lock file naming its holder, taken by exclusive create.

A holder that died without releasing (kill -9, OOM, node reboot) leaves the file behind. It is provably
stale, and taken over, when its pid is gone (or reused by a newer process) on this same host, or when it
was an earlier run of this same Slurm job: Slurm requeues a job (preemption, node failure) under the same
SLURM_JOB_ID with a higher SLURM_RESTART_COUNT only once the earlier run is over. Any other holder on
another host cannot be checked from here, so that lock is refused and the message says how to clear it.

Limitations: on object stores exclusive create is only as strong as the backend's conditional write
(fsspec `xb` mode), and stale takeover is check-then-delete; two processes taking over the same stale lock
in the same instant on such a store may both believe they hold it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

import psutil

from batchjob.io.storage import Storage

log = logging.getLogger(__name__)


class LockError(RuntimeError):
    """Another live process holds (or may hold) this shard."""


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

    def stale_reason(self) -> str | None:
        """Why this holder is provably gone, or None if it may still be running."""
        me = LockHolder.this_process()
        requeued = self.slurm_job_id is not None and self.slurm_job_id == me.slurm_job_id
        if requeued and self.slurm_restart_count < me.slurm_restart_count:
            return f"Slurm requeued job {me.slurm_job_id} (restart {me.slurm_restart_count})"
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


class ShardLock:
    def __init__(self, storage: Storage, path: str, tmp_dir: str) -> None:
        self.storage = storage
        self.path = path
        self.tmp_dir = tmp_dir
        self.holder: LockHolder | None = None

    def acquire(self) -> None:
        me = LockHolder.this_process()
        payload = json.dumps(asdict(me)).encode()
        # Two rounds: a stale lock removed in the first round leaves the name free for the second.
        for _ in range(2):
            if self.storage.create_exclusive(self.path, payload, self.tmp_dir):
                self.holder = me
                return
            holder = self.read_holder()
            if holder is None:
                continue  # released between our create and our read
            reason = holder.stale_reason()
            if reason is None:
                raise LockError(
                    f"{self.path} is held by pid {holder.pid} on host {holder.host} since {holder.since}: "
                    "another process is writing this shard. Wait for it, or stop it; if it is gone "
                    f"(e.g. its node was lost), delete {self.path} and rerun"
                )
            log.warning(
                "taking over stale lock %s: pid %d on %s (since %s): %s",
                self.path,
                holder.pid,
                holder.host,
                holder.since,
                reason,
            )
            self._break_stale(holder)
        raise LockError(f"{self.path} was taken by another process while this one was acquiring it; rerun")

    def read_holder(self) -> LockHolder | None:
        try:
            raw = self.storage.read_bytes(self.path)
        except FileNotFoundError:
            return None
        try:
            return LockHolder(**json.loads(raw))
        except (ValueError, TypeError) as exc:
            raise LockError(
                f"{self.path} exists but is unreadable ({exc}); if no process is writing this shard, "
                "delete it and rerun"
            ) from exc

    def _break_stale(self, stale: LockHolder) -> None:
        if not self.storage.is_local:
            self.storage.remove(self.path)
            return
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

    def release(self) -> None:
        if self.holder is None:
            return
        current = self.read_holder()
        if current is not None and current.token == self.holder.token:
            self.storage.remove(self.path)
        else:
            log.warning("lock %s is no longer ours at release (taken over as stale?); left alone", self.path)
        self.holder = None
