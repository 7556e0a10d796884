"""The watchdog on a tensor-parallel engine's ranks (`rank_links.py`), with real processes standing in for ranks:
a rank that sends its error and exits at once is reported by that error, whichever the job process sees first."""

from __future__ import annotations

import subprocess
import sys
from multiprocessing.connection import Pipe

import pytest

from batchjob.engine.api import EngineFailure
from batchjob.engine.native.executor.rank_links import RankLinks

TRACEBACK = "Traceback (most recent call last):\n  File ...\nValueError: no KV block fits\n"
SAYS_WHY_AND_EXITS = (
    "import sys\n"
    "from multiprocessing.connection import Connection\n"
    "Connection(int(sys.argv[1])).send(('error', sys.argv[2]))\n"
    "raise SystemExit(1)\n"
)
EXITS = "raise SystemExit(3)\n"
WAITS = "import time\ntime.sleep(60)\n"


def add_rank(links: RankLinks, script: str) -> subprocess.Popen:
    """A process in rank's place, holding one end of a socket pair as a rank does."""
    ours, theirs = Pipe(duplex=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(theirs.fileno()), TRACEBACK], pass_fds=(theirs.fileno(),)
    )
    theirs.close()
    links.procs.append(proc)
    links.conns.append(ours)
    return proc


@pytest.fixture
def links():
    links = RankLinks()
    yield links
    links.kill_all()
    links.close()


def test_a_rank_that_said_why_and_exited_before_the_next_poll_is_reported_by_its_error(links):
    links.starting = False
    add_rank(links, WAITS)
    add_rank(links, SAYS_WHY_AND_EXITS).wait()  # its exit is there before its message is read
    with pytest.raises(EngineFailure, match=r"^tensor-parallel rank 1 failed: ValueError: no KV block fits$"):
        links.check_alive()
    assert all(proc.poll() is not None for proc in links.procs)  # every rank killed


def test_a_ranks_error_while_starting_is_a_start_up_error_even_when_its_exit_is_seen_first(links):
    add_rank(links, WAITS)
    add_rank(links, SAYS_WHY_AND_EXITS).wait()
    with pytest.raises(RuntimeError, match=r"^tensor-parallel rank 1 failed: ValueError: no KV block fits$") as err:
        links.check_alive()
    assert not isinstance(err.value, EngineFailure)


def test_a_ranks_error_read_first_is_not_replaced_by_its_own_exit(links):
    links.starting = False
    add_rank(links, SAYS_WHY_AND_EXITS)
    add_rank(links, WAITS)  # alive: the error is the cause, not a peer's death
    with pytest.raises(EngineFailure, match=r"^tensor-parallel rank 0 failed: ValueError: no KV block fits$"):
        links.receive(0, "stats")


def test_a_rank_that_dies_while_a_peer_reports_the_failed_collective_is_the_cause(links):
    links.starting = False
    add_rank(links, SAYS_WHY_AND_EXITS).wait()  # its error is read first
    add_rank(links, EXITS).wait()
    with pytest.raises(EngineFailure, match=r"^tensor-parallel rank 1 \(pid \d+\) exited with status 3$"):
        links.receive(0, "stats")


def test_a_rank_that_exits_without_a_word_is_reported_by_its_status(links):
    links.starting = False
    add_rank(links, EXITS).wait()
    with pytest.raises(EngineFailure, match=r"^tensor-parallel rank 0 \(pid \d+\) exited with status 3$"):
        links.receive(0, "stats")
    with pytest.raises(EngineFailure):  # and the links stay failed
        links.send_all(b"")
