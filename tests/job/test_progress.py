"""Progress without a terminal: periodic log lines with rows done/total, output tok/s and an ETA."""

from __future__ import annotations

import logging

from batchjob.progress import Progress


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
