"""A shard's failed rows by reason, and the verdict `job.max_error_fraction` gives on them.

A failed row is one that got no generation: an error row (`on_error=record`) or a dropped one (`on_error=skip`).
Rows fail for a handful of reasons whose messages carry row-specific details (a token count, a byte offset, the
offending value), so each message is counted under its reason, the message with those details masked
(`error_reason`); the per-row `error` column keeps the whole message. Each reason keeps the row with the lowest
`row_id` as its example, so a resumed shard shows the same one as an uninterrupted run.

The verdict counts over all the shard's rows, those committed by earlier runs included (their error rows are read
back from the committed parts), so a resume gives the same verdict as an uninterrupted run. Skipped rows are never
committed: a resume meets them again and skips them again, so the run that completes the shard counts all of them.
The report keeps the counts (`failed_rows`), and a rerun of the complete shard gives its verdict again from there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# Distinct reasons kept; rows of any further reason are counted together (a message quoting free text, such as a
# chat template's exception, could otherwise make one reason per row).
MAX_REASONS = 50
OTHER_REASONS = "(other reasons)"
_REASON_CHARS = 200
_REASONS_SHOWN = 5  # on the end line; the report has them all
# A quoted value starts a word ('x', "x"; not the apostrophe of "model's"); one cut short (`{value!r:.80}`) runs to
# the end. A number is a whole token: the 8 of UTF-8 or the 32 of float32 is no row's detail.
_QUOTED = re.compile(r"""(?<!\w)(?:'[^']*(?:'|$)|"[^"]*(?:"|$))""")
_NUMBER = re.compile(r"(?<![A-Za-z_]-)(?<![\w.])-?\d+(?:\.\d+)?(?![\w.])")
_BRACED = re.compile(r"\{[^{}]*\}|\[[^\[\]]*\]")
_MASKED = re.compile(r"…|\bN\b")


def error_reason(message: str) -> str:
    """`message` with its row-specific parts masked: quoted values as '…', numbers as N, and a dict's or list's
    repr holding them as {…} / […]; so "prompt has 1811 tokens but the context is 1024 tokens" reads "prompt has
    N tokens but the context is N tokens"."""
    reason = _NUMBER.sub("N", _QUOTED.sub("'…'", message))
    while (collapsed := _BRACED.sub(_collapsed, reason)) != reason:
        reason = collapsed
    reason = " ".join(reason.split())
    return reason if len(reason) <= _REASON_CHARS else reason[: _REASON_CHARS - 1] + "…"


def _collapsed(braced: re.Match[str]) -> str:
    """A repr of a row's value (`{'role': 1}`) as {…}; the text of a message itself (`{role: str}`) as it is."""
    text = braced.group(0)
    inner = text[1:-1]
    return text if inner == "…" or not _MASKED.search(inner) else text[0] + "…" + text[-1]


@dataclass
class _Reason:
    rows: int
    example_row_id: int
    example_error: str


class FailedRows:
    """Failed rows counted by reason, each with its lowest-`row_id` example."""

    def __init__(self) -> None:
        self.rows = 0
        self._reasons: dict[str, _Reason] = {}

    def add(self, row_id: int, error: str) -> None:
        self.rows += 1
        reason = error_reason(error)
        if reason not in self._reasons and len(self._reasons) >= MAX_REASONS:
            reason = OTHER_REASONS
        seen = self._reasons.get(reason)
        if seen is None:
            self._reasons[reason] = _Reason(1, row_id, error)
            return
        seen.rows += 1
        if row_id < seen.example_row_id:
            seen.example_row_id, seen.example_error = row_id, error

    def by_reason(self) -> list[dict[str, Any]]:
        """Most rows first: `{reason, rows, example_row_id, example_error}`."""
        ordered = sorted(self._reasons.items(), key=lambda item: (-item[1].rows, item[0]))
        return [
            {"reason": r, "rows": c.rows, "example_row_id": c.example_row_id, "example_error": c.example_error}
            for r, c in ordered
        ]


def failed_rows_report(failed: FailedRows, shard_rows: int) -> dict[str, Any]:
    """The report's `failed_rows`: failed rows of all `shard_rows` (committed ones plus skipped ones), by reason.
    No verdict: a rerun gives its own, under its own `job.max_error_fraction` (`too_many_failed`)."""
    return {
        "rows": failed.rows,
        "of_rows": shard_rows,
        "fraction": failed.rows / shard_rows if shard_rows else 0.0,
        "by_reason": failed.by_reason(),
    }


def exceeds(section: dict[str, Any], max_error_fraction: float) -> bool:
    """Whether the failed rows of `section` (a report's `failed_rows`) are a larger share than allowed."""
    return bool(section["of_rows"]) and section["rows"] / section["of_rows"] > max_error_fraction


def summary(section: dict[str, Any]) -> str:
    """`failed 3 of the shard's 3 rows: 2 x "prompt is null" (first: row 1), ...` for the end line."""
    reasons = section["by_reason"]
    shown = []
    for reason in reasons[:_REASONS_SHOWN]:
        example = "" if reason["example_error"] == reason["reason"] else f": {reason['example_error']!r}"
        shown.append(f'{reason["rows"]} x "{reason["reason"]}" (first: row {reason["example_row_id"]}{example})')
    more = len(reasons) - len(shown)
    tail = f", and {more} more reason{'s' if more > 1 else ''} in the report" if more > 0 else ""
    return f"failed {section['rows']} of the shard's {section['of_rows']} rows: {', '.join(shown)}{tail}"


def too_many_failed(section: dict[str, Any], max_error_fraction: float) -> str | None:
    """The error line when the share of failed rows in `section` (a report's `failed_rows`) exceeds
    `max_error_fraction`, else None."""
    if not exceeds(section, max_error_fraction):
        return None
    rows, of_rows = section["rows"], section["of_rows"]
    top = section["by_reason"][0]
    return (
        f"{rows} of the shard's {of_rows} rows failed ({rows / of_rows:.0%}), more than "
        f'job.max_error_fraction={max_error_fraction:g}; most often {top["rows"]} x "{top["reason"]}" (first: row '
        f"{top['example_row_id']}). Every row is committed and the shard is complete: the `error` column and the "
        "report's failed_rows say why rows failed. Fix the input and rerun with resume=false, or accept them with "
        "job.max_error_fraction=1"
    )
