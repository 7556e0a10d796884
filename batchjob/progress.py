"""Progress for people: a tqdm bar on a terminal, a log line every few seconds otherwise."""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("batchjob")


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class Progress:
    """Counts rows finished in this run toward `total` (None when the input cannot say)."""

    def __init__(self, total: int | None, log_every_s: float, tty: bool | None = None) -> None:
        self.total = total
        self.rows = 0
        self.tokens = 0
        self.started = time.perf_counter()
        self._log_every_s = log_every_s
        self._last_log = self.started
        self._bar = None
        if sys.stderr.isatty() if tty is None else tty:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="row", dynamic_ncols=True, smoothing=0.1)

    def update(self, rows: int, tokens: int) -> None:
        self.rows += rows
        self.tokens += tokens
        now = time.perf_counter()
        if self._bar is not None:
            self._bar.update(rows)
            self._bar.set_postfix_str(f"{self.tokens / max(now - self.started, 1e-9):.1f} tok/s", refresh=False)
        elif now - self._last_log >= self._log_every_s:
            self._last_log = now
            log.info("progress: %s", self.line())

    def line(self) -> str:
        elapsed = time.perf_counter() - self.started
        rate = self.tokens / max(elapsed, 1e-9)
        if not self.total:
            return f"{self.rows} rows, {rate:.1f} output tok/s, {_duration(elapsed)} elapsed"
        eta = (self.total - self.rows) * elapsed / self.rows if self.rows else float("nan")
        eta_text = _duration(eta) if self.rows else "?"
        return (
            f"{self.rows}/{self.total} rows ({100 * self.rows / self.total:.0f}%), "
            f"{rate:.1f} output tok/s, ETA {eta_text}"
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
