"""Progress for people: a tqdm bar on a terminal, a log line every few seconds otherwise.

Rows of a batch job tend to finish together (a model's first rows all end near `max_new_tokens`), so rows
alone can say nothing for minutes. Given the engine's count of generated tokens (`live_tokens`, rows still
running included), a heartbeat thread keeps the line coming every `log_every_s` while no row finishes, with
the tokens generated so far, their rate, and an ETA from the finished rows' mean length.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger("batchjob")


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class Progress:
    """Counts rows finished in this run toward `total` (None when the input cannot say)."""

    def __init__(
        self,
        total: int | None,
        log_every_s: float,
        tty: bool | None = None,
        live_tokens: Callable[[], int] | None = None,
    ) -> None:
        self.total = total
        self.rows = 0
        self.tokens = 0  # output tokens of finished rows
        self.started = time.perf_counter()
        self._log_every_s = log_every_s
        self._last_log = self.started
        self._live_tokens = live_tokens
        self._lock = threading.Lock()  # the loop's updates and the heartbeat's lines
        self._stop = threading.Event()
        self._bar = None
        if sys.stderr.isatty() if tty is None else tty:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="row", dynamic_ncols=True, smoothing=0.1)
        self._heartbeat = None
        if live_tokens is not None and log_every_s > 0:
            self._heartbeat = threading.Thread(target=self._beat, name="batchjob-progress", daemon=True)
            self._heartbeat.start()

    def update(self, rows: int, tokens: int) -> None:
        with self._lock:
            self.rows += rows
            self.tokens += tokens
            now = time.perf_counter()
            if self._bar is not None:
                self._bar.update(rows)
                self._bar.set_postfix_str(f"{self._rate(now, self._live()):.1f} tok/s", refresh=False)
            elif now - self._last_log >= self._log_every_s:
                self._last_log = now
                log.info("progress: %s", self.line())

    def line(self) -> str:
        now = time.perf_counter()
        elapsed = now - self.started
        live = self._live()
        rate = self._rate(now, live)
        generated = f"{live:,} tokens generated (running rows included), " if live is not None else ""
        if not self.total:
            return f"{self.rows} rows, {generated}{rate:.1f} output tok/s, {_duration(elapsed)} elapsed"
        return (
            f"{self.rows}/{self.total} rows ({100 * self.rows / self.total:.0f}%), {generated}"
            f"{rate:.1f} output tok/s, ETA {self._eta(elapsed, rate, live)}"
        )

    def close(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _live(self) -> int | None:
        return None if self._live_tokens is None else max(self._live_tokens(), self.tokens)

    def _rate(self, now: float, live: int | None) -> float:
        return (self.tokens if live is None else live) / max(now - self.started, 1e-9)

    def _eta(self, elapsed: float, rate: float, live: int | None) -> str:
        if not self.rows:
            return "?"
        if live is None or not self.tokens or rate <= 0:
            return _duration((self.total - self.rows) * elapsed / self.rows)
        # The finished rows' mean output length for every row, less what has been generated.
        expected = self.tokens / self.rows * self.total
        return _duration(max(expected - live, 0) / rate)

    def _beat(self) -> None:
        while not self._stop.wait(max(self._last_log + self._log_every_s - time.perf_counter(), 0.05)):
            with self._lock:
                now = time.perf_counter()
                if now - self._last_log < self._log_every_s:
                    continue  # a finished row logged meanwhile
                self._last_log = now
                if self._bar is not None:
                    self._bar.set_postfix_str(f"{self._rate(now, self._live()):.1f} tok/s")
                else:
                    log.info("progress: %s", self.line())
