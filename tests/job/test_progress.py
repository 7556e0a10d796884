"""Progress without a terminal: periodic log lines with rows done/total, output tok/s and an ETA, and a
heartbeat with the tokens generated while no row finishes."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

from jobtools import HUNG_S, REPO, cli_env

from batchjob.job.progress import Progress


def wait_until(condition) -> None:
    deadline = time.monotonic() + HUNG_S
    while not condition():
        assert time.monotonic() < deadline, "the heartbeat logged nothing new"
        time.sleep(0.01)


def test_without_a_terminal_progress_is_logged_with_rate_and_eta(caplog) -> None:
    caplog.set_level(logging.INFO, logger="batchjob")
    progress = Progress(total=10, log_every_s=0, tty=False)
    progress.update(3, 30)
    progress.close()
    line = caplog.records[-1].getMessage()
    assert line.startswith("progress: 3/10 rows (30%), ")
    assert "output tok/s" in line and "ETA " in line


def test_an_unknown_total_logs_rows_and_elapsed_time(caplog) -> None:
    caplog.set_level(logging.INFO, logger="batchjob")
    progress = Progress(total=None, log_every_s=0, tty=False)
    progress.update(5, 0)
    assert "progress: 5 rows, " in caplog.records[-1].getMessage()
    assert "elapsed" in caplog.records[-1].getMessage()


def test_log_lines_are_spaced_by_the_interval(caplog) -> None:
    caplog.set_level(logging.INFO, logger="batchjob")
    progress = Progress(total=100, log_every_s=3600, tty=False)
    for _ in range(50):
        progress.update(1, 1)
    assert not caplog.records


def test_while_no_row_finishes_a_heartbeat_logs_the_tokens_generated(caplog) -> None:
    caplog.set_level(logging.INFO, logger="batchjob")
    generated = [0]
    progress = Progress(total=8, log_every_s=0.05, tty=False, live_tokens=lambda: generated[0])
    for tokens in (100, 200, 300):
        generated[0] = tokens
        # Each count is awaited in the lines themselves: on a busy machine the heartbeat's thread may run late.
        wait_until(lambda tokens=tokens: any(f" {tokens} tokens generated" in r.getMessage() for r in caplog.records))
    progress.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) >= 3, lines
    assert all(line.startswith("progress: 0/8 rows (0%), ") and line.endswith("ETA ?") for line in lines)
    assert "300 tokens generated (running rows included)" in lines[-1]
    closed = len(caplog.records)
    time.sleep(0.2)
    assert len(caplog.records) == closed  # close() stops the heartbeat
    assert not any(t.name == "batchjob-progress" for t in threading.enumerate())


def test_the_eta_counts_the_tokens_of_rows_still_running() -> None:
    # 2 of 10 rows done with 100 tokens each: about 1,000 tokens in all, 600 of them generated already.
    progress = Progress(total=10, log_every_s=3600, tty=False, live_tokens=lambda: 600)
    progress.update(2, 200)
    progress.started -= 60  # a minute in: 10 tok/s, so 400 tokens to go take 40 s
    line = progress.line()
    progress.close()
    assert "600 tokens generated" in line and "ETA 0m40s" in line, line


def test_a_job_logs_progress_before_its_first_row_finishes(tmp_path) -> None:
    # Four rows of 150 tokens each, side by side: none finishes before the end.
    command = [
        sys.executable,
        "-m",
        "batchjob",
        "engine=native",
        f"output.dir={tmp_path / 'out'}",
        "data.limit=4",
        "sampling.max_new_tokens=150",
        "sampling.ignore_eos=true",
        "progress.log_every_s=0.3",
    ]
    result = subprocess.run(command, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=HUNG_S)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "progress: " in line]
    assert any("progress: 0/4 rows (0%), " in line and "tokens generated" in line for line in lines), lines
