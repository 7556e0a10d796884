"""One writer per shard: a lock file naming its holder, taken by exclusive create.

A holder that died without releasing (kill -9, OOM, node reboot) leaves the file behind. On the same host a
dead pid (or a pid reused by a newer process) proves the lock stale and it is taken over. A holder on
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

    @classmethod
    def this_process(cls) -> LockHolder:
        return cls(
            pid=os.getpid(),
            host=socket.gethostname(),
            since=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            process_started=psutil.Process().create_time(),
            token=uuid.uuid4().hex,
        )

    def is_dead(self) -> bool:
        """True only when provably dead: same host and the pid is gone or belongs to another process."""
        if self.host != socket.gethostname():
            return False
        try:
            started = psutil.Process(self.pid).create_time()
        except psutil.NoSuchProcess:
            return True
        except psutil.AccessDenied:
            return False
        return abs(started - self.process_started) > 1.0


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
            if not holder.is_dead():
                raise LockError(
                    f"{self.path} is held by pid {holder.pid} on host {holder.host} since {holder.since}: "
                    "another process is writing this shard. Wait for it, or stop it; if it is gone "
                    f"(e.g. its node was lost), delete {self.path} and rerun"
                )
            log.warning(
                "taking over stale lock %s: pid %d on %s (since %s) is no longer running",
                self.path,
                holder.pid,
                holder.host,
                holder.since,
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
