"""The job process's links to its tensor-parallel ranks, and the watchdog on every wait.

Each rank process (`rank_process.py`) holds one end of a socket pair; the job process keeps the other and the
process. A dead rank ends the engine instead of hanging it: every wait on a rank polls its process, and a rank
that exits, closes its connection or stays silent past `STEP_TIMEOUT_S` has every rank killed and raises
`EngineFailure`, which the job turns into a resumable exit (finished rows committed). This process never
touches a GPU, so nothing here can block on a collective a dead peer will never join.

A rank that fails sends its traceback, then exits at once: what is reported is that error, not its exit status,
even when the exit is seen before the message is read. A rank's error before every rank is ready (a bad
option, no memory) is a `RuntimeError`: not worth a rerun.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from multiprocessing.connection import Connection, Pipe
from typing import Any, NoReturn

from batchjob.engine.api import EngineFailure
from batchjob.engine.native.executor.messages import RankSetup
from batchjob.processes import popen_for_life

log = logging.getLogger("batchjob.engine.native")

# The longest a step may take before the ranks are presumed hung (a collective whose peer is stuck). Generous:
# a first step may compile kernels.
STEP_TIMEOUT_S = 900.0
POLL_S = 0.5
RANK_MODULE = "batchjob.engine.native.executor.rank_process"


class RankLinks:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self.failed: str | None = None
        self.starting = True  # until every rank is ready: a rank's error then is a start-up error
        # A signal raised while a message was half written or half read: the streams can no longer be trusted.
        self.torn = False

    def start(self, rank: int, env: dict[str, str], setup: RankSetup) -> None:
        """Start rank `rank`'s process and send it `setup`."""
        ours, theirs = Pipe(duplex=True)
        command = [sys.executable, "-m", RANK_MODULE, str(theirs.fileno()), str(rank)]
        # The kernel kills a rank when the thread that started it ends (`on_parent_death`), not the process.
        self.procs.append(popen_for_life(command, pass_fds=(theirs.fileno(),), env=env))
        theirs.close()  # the rank's end lives in the rank only, so its exit is an end of file here
        _limit_send_wait(ours, STEP_TIMEOUT_S)
        self.conns.append(ours)
        ours.send(setup)

    def send_all(self, message: bytes) -> None:
        self.raise_if_failed()
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(message)
            except OSError:
                self.check_alive(grace_s=5.0)
                self.fail(f"tensor-parallel rank {rank} stopped reading its messages")
            except BaseException:  # a signal (the job stopping) in the middle of a message
                self.torn = True
                raise

    def receive(self, rank: int, kind: str, timeout_s: float | None = STEP_TIMEOUT_S) -> Any:
        """The payload of rank `rank`'s next message, which must be of `kind`."""
        self.raise_if_failed()
        conn = self.conns[rank]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not conn.poll(POLL_S):
            self.check_alive()
            if deadline is not None and time.monotonic() > deadline:
                self.fail(f"tensor-parallel rank {rank} gave no {kind} for {timeout_s:.0f} s (a hung collective?)")
        try:
            got, payload = conn.recv()
        except (EOFError, OSError):
            self.check_alive(grace_s=5.0)
            self.fail(f"tensor-parallel rank {rank} closed its connection")
        except BaseException:
            self.torn = True
            raise
        if got == "error":
            self._raise_rank_error(rank, payload, look_for_a_death=True)
        if got != kind:
            self.fail(f"tensor-parallel rank {rank} sent {got!r} where {kind!r} was due")
        return payload

    def check_alive(self, grace_s: float = 0.0, besides: int | None = None) -> None:
        """Raise if a rank (other than `besides`) has exited, waiting up to `grace_s` for one that is exiting: the
        error it sent before exiting if it sent one, else `EngineFailure` with its exit status."""
        deadline = time.monotonic() + grace_s
        while True:
            for rank, proc in enumerate(self.procs):
                status = proc.poll()
                if status is None or rank == besides:
                    continue
                error = self._unread_error(rank)
                if error is not None:
                    self._raise_rank_error(rank, error, look_for_a_death=False)
                self.fail(f"tensor-parallel rank {rank} (pid {proc.pid}) {_describe_exit(status)}")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def fail(self, reason: str) -> NoReturn:
        """Kill every rank (a survivor may be stuck in a collective with the dead one) and raise."""
        self.failed = reason
        self.kill_all()
        log.error("tensor-parallel engine stopped: %s", reason)
        raise EngineFailure(reason)

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()

    def raise_if_failed(self) -> None:
        if self.failed is not None:
            raise EngineFailure(self.failed)

    def close(self) -> None:
        """Stop the ranks (politely, then by force)."""
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(("close", None))
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []

    def _raise_rank_error(self, rank: int, traceback_text: str, look_for_a_death: bool) -> NoReturn:
        # The rank printed its traceback; its last line says what went wrong.
        message = f"tensor-parallel rank {rank} failed: {traceback_text.strip().splitlines()[-1]}"
        if self.starting:
            self.kill_all()
            raise RuntimeError(message)
        if look_for_a_death:
            # A collective fails on every rank when one rank dies: that death is the cause to report. (This rank
            # exits too, having said why.)
            self.check_alive(grace_s=2.0, besides=rank)
        self.fail(message)

    def _unread_error(self, rank: int) -> str | None:
        """The traceback an exited rank sent last, if it is still unread in its connection."""
        if rank >= len(self.conns):
            return None
        conn, error = self.conns[rank], None
        with contextlib.suppress(EOFError, OSError):
            while conn.poll(0):
                got, payload = conn.recv()
                if got == "error":
                    error = payload
        return error


def _describe_exit(status: int) -> str:
    if status < 0:
        return f"was killed by {signal.Signals(-status).name}"
    return f"exited with status {status}"


def _limit_send_wait(conn: Connection, seconds: float) -> None:
    """A send to a rank that stopped reading (hung) fails after `seconds` instead of blocking forever once
    the socket's buffer is full."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(seconds), 0))
    sock.close()
