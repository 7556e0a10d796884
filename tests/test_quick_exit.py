"""batchjob/quick_exit.py in real processes: the command's exit does what `sys.exit` does before the
interpreter's teardown (the status, the threads, the atexit handlers, the streams) and skips the teardown."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(body: str, tmp_path: Path) -> subprocess.CompletedProcess:
    code = textwrap.dedent(
        """
        import atexit, sys, threading, time
        from batchjob.quick_exit import exit_now

        class TornDown:
            def __del__(self):
                print("torn down", flush=True)

        kept = TornDown()  # a module global: the interpreter's teardown deletes it
        """
    ) + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip


@pytest.mark.parametrize(("code", "status"), [(None, 0), (0, 0), (3, 3), (2, 2)])
def test_the_status_is_the_one_sys_exit_gives(tmp_path, code, status):
    done = _run(f"exit_now({code!r})", tmp_path)
    assert done.returncode == status, done.stderr


def test_a_message_goes_to_stderr_with_status_1(tmp_path):
    done = _run("exit_now('error: the fix')", tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip() == "error: the fix"


def test_threads_atexit_handlers_and_unflushed_output_all_finish_first(tmp_path):
    done = _run(
        """
        def late():
            time.sleep(0.5)
            open("thread-done", "w").write("yes")

        threading.Thread(target=late).start()  # not a daemon: the exit waits for it
        atexit.register(lambda: print("handler ran"))
        sys.stdout.write("no newline, no flush")
        exit_now(0)
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "thread-done").read_text() == "yes"
    assert "handler ran" in done.stdout
    assert "no newline, no flush" in done.stdout


def test_the_interpreters_teardown_is_skipped(tmp_path):
    assert "torn down" in _run("sys.exit(0)", tmp_path).stdout, "sys.exit tears the module's objects down"
    assert "torn down" not in _run("exit_now(0)", tmp_path).stdout


def test_the_command_under_a_profiler_exits_through_sys_exit_so_the_profile_is_written(tmp_path):
    module = tmp_path / "job.py"
    module.write_text(
        "import sys\nfrom batchjob.quick_exit import exit_now\n"
        "def work():\n    return sum(range(1000))\n"
        "if __name__ == '__main__':\n    work()\n    exit_now(3)\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "cProfile", "-o", "profile.out", "job.py"], cwd=tmp_path, capture_output=True,
        text=True, timeout=120, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr  # cProfile takes the SystemExit and returns
    import pstats

    assert any(name == "work" for _, _, name in pstats.Stats(str(tmp_path / "profile.out")).stats)
