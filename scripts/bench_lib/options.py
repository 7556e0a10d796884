"""`--engine-option KEY=VALUE` as the benchmark scripts read it: VALUE a Python literal, `true`/`false`/`null`
in any case, or else a string."""

from __future__ import annotations

import ast
from typing import Any


def engine_options(pairs: list[str]) -> dict[str, Any]:
    options = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine-option {pair!r}: expected KEY=VALUE, e.g. --engine-option max_num_seqs=256")
        try:
            options[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            options[key] = {"true": True, "false": False, "null": None}.get(raw.lower(), raw)
    return options
