"""Why a JSON Lines, JSON, CSV or text file of prompts could not be read, in one line with the fix.

`datasets`' builders read these files in blocks and fail with "An error occurred while generating the dataset",
the cause two exceptions down and its row counted within a block. Only after such a failure, the file is read
again here, one line at a time, to name the first line that is not a JSON object (or not UTF-8), or to say the
file holds no rows at all.
"""

from __future__ import annotations

import json

import fsspec

from batchjob.io.inputs import InputError

# What each `datasets` builder a plain file goes through reads, by the builder's name.
BUILDER_KINDS = {"json": "JSON Lines or JSON", "csv": "CSV", "text": "text"}


def unreadable_file(builder: str, path: str, error: BaseException) -> InputError:
    """The error to show for `path`, which `datasets`' `builder` ("json", "csv", "text") failed to read."""
    kind = BUILDER_KINDS.get(builder, builder)
    try:
        lines = _first_lines_problem(path, json_lines=builder == "json", header=builder == "csv")
    except OSError as err:
        return InputError(f"{path} cannot be read ({err}): check the path and its permissions")
    if lines is not None:
        return InputError(f"{path} cannot be read as {kind}: {lines}")
    cause = _innermost(error)
    reason = " ".join(str(cause).split())  # a parser's message may end its own lines
    return InputError(
        f"{path} cannot be read as {kind} ({type(cause).__name__}: {reason}): fix the file, or convert it to Parquet"
    )


def _first_lines_problem(path: str, json_lines: bool, header: bool) -> str | None:
    """What is wrong with the file's lines, when something is: no rows (below its `header` line), not UTF-8, a
    JSON Lines line that is not a JSON object; None when the lines look fine (the builder failed otherwise)."""
    rows = 0
    with fsspec.open(path, "rb", compression="infer") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8").strip()
            except UnicodeDecodeError as err:
                return (
                    f"line {number} is not UTF-8 ({err.reason} at byte {err.start}): save the file as UTF-8, "
                    "e.g. iconv -f latin1 -t utf-8"
                )
            if not line:
                continue
            rows += 1
            if json_lines:
                if rows == 1 and line.startswith("["):
                    return None  # one JSON document, not JSON Lines
                problem = _json_object_problem(line)
                if problem is not None:
                    return f"line {number} {problem}: fix or delete that line"
    if rows <= int(header):
        return f"it holds no rows ({'only a header' if rows else 'no line with text'}): give a file with prompts"
    return None


def _json_object_problem(line: str) -> str | None:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as err:
        return f"is not JSON ({err.msg} at column {err.colno})"
    if not isinstance(value, dict):
        return f"is a JSON {type(value).__name__}, not an object of column values"
    return None


def _innermost(error: BaseException) -> BaseException:
    """The first cause below `datasets`' own wrapper errors (the one whose message says what failed)."""
    while error.__cause__ is not None and type(error).__module__.startswith("datasets"):
        error = error.__cause__
    return error
