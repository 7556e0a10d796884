"""A job's stop signals with real processes and real signals: one stop heard by several routes (the signal itself, a
data-parallel parent's relay of it, the parent's death) is one orderly stop; a second stop by one route interrupts.

The job here is a small script around the real `StopSignals`: it waits "on the engine" until a stop, then
"commits" until the test creates a file, so a signal can be made to land in the middle of its commit."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from jobtools import REPO, cli_env

from batchjob.cluster.data_parallel import RELAYED

JOB = textwrap.dedent(
    """
    import os, sys, time
    from batchjob.job.signals import Interrupted, StopSignals, exit_code_for

    release = sys.argv[1]
    with StopSignals() as stop:
        try:
            print("waiting", flush=True)
            with stop.interruptible():
                time.sleep(300)
        except Interrupted:
            pass
        finally:
            print("committing", flush=True)
            while not os.path.exists(release):
                time.sleep(0.01)
            print("committed", flush=True)
    print("stopped", flush=True)
    sys.exit(exit_code_for(stop.signum))
    """
)

# Starts the job from a thread of its own, as a data-parallel parent does (`dies_with_us(PARENT_GONE)`), and ends
# that thread when told to: the kernel then hands the job to the parent's main thread with the death signal, and
# sends it again when that thread goes, as when a parent with two threads is killed.
PARENT = textwrap.dedent(
    """
    import subprocess, sys, threading, time
    from batchjob.cluster.data_parallel import PARENT_GONE
    from batchjob.processes import dies_with_us

    go = threading.Event()

    def start_job():
        subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], preexec_fn=dies_with_us(PARENT_GONE))
        go.wait()

    thread = threading.Thread(target=start_job)
    thread.start()
    sys.stdin.readline()
    go.set()
    thread.join()
    time.sleep(300)
    """
)


def _start(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        env=cli_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _expect(proc: subprocess.Popen, line: str) -> None:
    assert proc.stdout.readline().strip() == line


def _signal_mid_commit(job: subprocess.Popen, first: int, second: int, release: Path) -> tuple[str, str]:
    """The job's output once `first` stopped it and `second` came while it was committing."""
    _expect(job, "waiting")
    job.send_signal(first)
    _expect(job, "committing")
    job.send_signal(second)
    release.touch()
    return job.communicate(timeout=60)


def test_a_stop_heard_from_the_sender_and_from_the_parent_is_one_stop(tmp_path: Path) -> None:
    """A terminal's Ctrl-C reaches every process of the job's group, and the parent relays it too."""
    job = _start(JOB, str(tmp_path / "release"))
    out, err = _signal_mid_commit(job, signal.SIGINT, RELAYED[signal.SIGINT], tmp_path / "release")
    assert out.splitlines() == ["committed", "stopped"], err
    assert job.returncode == 128 + signal.SIGINT


def test_a_second_stop_by_the_same_route_interrupts_the_commit(tmp_path: Path) -> None:
    for route in (signal.SIGINT, RELAYED[signal.SIGINT]):
        job = _start(JOB, str(tmp_path / "release"))
        out, err = _signal_mid_commit(job, route, route, tmp_path / "release")
        assert "stopped" not in out.splitlines()
        assert "Interrupted: interrupted by SIGINT" in err
        (tmp_path / "release").unlink()


def test_a_job_whose_parent_dies_thread_by_thread_stops_once_and_commits(tmp_path: Path) -> None:
    release = tmp_path / "release"
    parent = _start(PARENT, JOB, str(release))
    _expect(parent, "waiting")
    parent.stdin.write("\n")
    parent.stdin.flush()  # the thread that started the job ends: the first death signal
    _expect(parent, "committing")
    parent.kill()  # its last thread ends: the second
    parent.wait()
    release.touch()
    out, err = parent.communicate(timeout=60)  # the job's output: it wrote to its parent's stdout and stderr
    assert out.splitlines() == ["committed", "stopped"], err
