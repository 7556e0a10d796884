"""batchjob/processes.py with real processes: what a job starts is found and does not outlive a SIGKILL."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

from batchjob.processes import descendants

REPO = Path(__file__).resolve().parents[1]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _job(watch: bool) -> tuple[subprocess.Popen, int]:
    """A process that starts a child, which starts a grandchild (as vLLM's engine starts its workers), and, if
    `watch`, a reaper for both; it prints the grandchild's pid and waits."""
    code = textwrap.dedent(
        f"""
        import os, subprocess, sys, time
        from batchjob.processes import descendants, reap_when_gone
        child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
            "g = subprocess.Popen(['sleep', '300']); print(g.pid, flush=True); time.sleep(300)"],
            stdout=subprocess.PIPE, text=True)
        grandchild = int(child.stdout.readline())
        assert sorted(descendants(os.getpid())) == sorted([child.pid, grandchild])
        if {watch}:
            reap_when_gone(descendants(os.getpid()))
        print(grandchild, flush=True)
        time.sleep(300)
        """
    )
    job = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    return job, int(job.stdout.readline())


def _wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_descendants_are_the_children_and_theirs():
    job, grandchild = _job(watch=False)
    try:
        assert grandchild in descendants(job.pid)
        assert len(descendants(job.pid)) == 2
    finally:
        for pid in descendants(job.pid):
            subprocess.run(["kill", "-9", str(pid)], check=False)
        job.kill()
        job.wait()


def test_a_watched_process_dies_with_a_job_killed_by_sigkill():
    job, grandchild = _job(watch=True)
    job.kill()
    job.wait()
    assert _wait_gone(grandchild), "the watched grandchild outlived its SIGKILLed job"


def test_without_a_watch_it_would_outlive_the_job():
    """The control: the same processes unwatched run on after the job's SIGKILL."""
    job, grandchild = _job(watch=False)
    orphans = descendants(job.pid)
    job.kill()
    job.wait()
    try:
        assert not _wait_gone(grandchild, timeout=2.0)
    finally:
        for pid in orphans:
            subprocess.run(["kill", "-9", str(pid)], check=False)


def test_a_child_tied_to_its_job_outlives_the_thread_that_started_it():
    """The kernel's death signal answers the exit of the thread that started a child: one started for a worker
    thread (as a tensor-parallel engine built through the Python API starts its ranks) must wait for the job."""
    code = textwrap.dedent(
        """
        import subprocess, sys, threading, time
        from batchjob.processes import popen_for_life

        TIED = "import signal, sys, time; from batchjob.processes import on_parent_death; " \\
            "on_parent_death(signal.SIGKILL); print('tied', flush=True); time.sleep(300)"

        def start():
            child = popen_for_life([sys.executable, "-c", TIED], stdout=subprocess.PIPE, text=True)
            assert child.stdout.readline() == "tied\\n"
            print(child.pid, threading.get_native_id(), flush=True)

        worker = threading.Thread(target=start)
        worker.start()
        worker.join()
        time.sleep(300)
        """
    )
    job = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        child, worker = map(int, job.stdout.readline().split())
        assert _wait_gone(worker, timeout=10.0)  # the thread has ended
        assert not _wait_gone(child, timeout=1.0), "the child died with the thread that started it"
    finally:
        job.kill()
        job.wait()
    assert _wait_gone(child), "the child outlived its SIGKILLed job"
