"""Errors meant for the person running the job."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

# The exit status of a run refused for its config or input (before any model load).
EXIT_USAGE = 2
# The exit status of a shard that is complete (every row committed, its success marker written) but whose share of
# failed rows exceeds `job.max_error_fraction`: a rerun recomputes nothing and gives the same status again.
EXIT_TOO_MANY_FAILED = 3


class ConfigError(ValueError):
    """A problem with the configuration or the inputs, found before any generation: the message names
    what is wrong and how to fix it, and the job exits with status 2 without a traceback."""


def did_you_mean(word: str, choices: Iterable[str], prefix: str = "") -> str:
    """` (did you mean {prefix}X?)` for the closest of `choices` to a misspelt `word`, or an empty string."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""
