"""Processes a job starts must not outlive it. A job killed with SIGKILL (by hand, by a node's out-of-memory
killer) runs no code of its own, so each kind of child is tied to it in advance (Linux):

- a child batchjob starts has the kernel signal it when the job dies (`dies_with_us`, or `on_parent_death` in
  the child itself): the data-parallel parent's own signal for a shard (`PARENT_GONE`), which then stops as on
  preemption (commits what it has, exits); SIGKILL for a tensor-parallel rank, which holds no data of its own.
  The kernel ties that signal to the thread that started the child, not to its process: it comes when that
  thread ends, and again for each thread of the job the child is then handed to. So such a child is started by
  a thread that lasts as long as the job (`popen_for_life`), and a shard takes repeats of it for one stop;
- processes another library starts (vLLM's engine) are watched by a small process that outlives the job and
  kills them once it is gone (`reap_when_gone`).

Otherwise they would keep their GPUs, and the job's rerun would find them busy or its shards still written to.
"""

from __future__ import annotations

import functools
import os
import queue
import subprocess
import sys
import threading
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

PR_SET_PDEATHSIG = 1  # prctl(2)

# Run beside the job: once its parent (the job) is gone, it kills the processes it was given.
REAPER = """
import os, signal, sys, time
parent = int(sys.argv[1])
while os.getppid() == parent:
    time.sleep(0.5)
for pid in map(int, sys.argv[2:]):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
"""


def on_parent_death(sig: int) -> None:
    """Have the kernel send `sig` to this process when its parent dies (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        _prctl()(PR_SET_PDEATHSIG, sig)
        if os.getppid() == 1:  # the parent died before the request
            os.kill(os.getpid(), sig)


def dies_with_us(sig: int) -> Callable[[], None] | None:
    """A `preexec_fn` for `subprocess.Popen`: the child gets `sig` when this process dies (Linux; elsewhere None).
    libc's prctl is looked up here, so the child, between fork and exec, only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    prctl, parent = _prctl(), os.getpid()

    def tie() -> None:
        prctl(PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:  # this process died before the request
            os.kill(os.getpid(), sig)

    return tie


def popen_for_life(*args: object, **kwargs: object) -> subprocess.Popen:
    """`subprocess.Popen(*args, **kwargs)`, run by a thread that lasts as long as this process (the main thread, or
    one kept for it), so that a child tied to this process (`dies_with_us`, `on_parent_death`) is not signalled when
    the thread that asked for it ends: a pool's worker, or a thread that built an engine through the Python API."""
    if threading.current_thread() is threading.main_thread():
        return subprocess.Popen(*args, **kwargs)
    started: Future[subprocess.Popen] = Future()
    _starter().put((args, kwargs, started))
    return started.result()


@functools.cache
def _starter() -> queue.SimpleQueue:
    requests: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_start_forever, args=(requests,), name="batchjob-child-starter", daemon=True).start()
    return requests


def _start_forever(requests: queue.SimpleQueue) -> None:
    while True:
        args, kwargs, started = requests.get()
        try:
            started.set_result(subprocess.Popen(*args, **kwargs))
        except BaseException as err:  # the caller's to handle, as Popen's own error
            started.set_exception(err)


def _prctl() -> Callable[..., int]:
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (its children, theirs, ...), read from /proc (empty where there is none)."""
    children = defaultdict(list)
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else ():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # gone meanwhile
                continue
            children[int(stat.rsplit(")", 1)[1].split()[1])].append(int(entry.name))  # "pid (name) state ppid ..."
    found, frontier = [], [pid]
    while frontier:
        below = children[frontier.pop()]
        found += below
        frontier += below
    return found


def reap_when_gone(pids: list[int]) -> subprocess.Popen | None:
    """Start a process that SIGKILLs `pids` once this process is gone; stop it (`kill()`) when they have exited
    on their own. None when there is nothing to watch."""
    if not pids:
        return None
    command = [sys.executable, "-c", REAPER, str(os.getpid()), *map(str, pids)]
    # Its own session: a Ctrl-C meant for the job does not stop the watch.
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True)


def stop(watcher: subprocess.Popen | None) -> None:
    if watcher is not None:
        watcher.kill()
        watcher.wait()
