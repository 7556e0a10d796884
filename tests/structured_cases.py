"""Constraints and checks shared by the CPU (tests/native, tests/engine, tests/job) and GPU structured-output tests.

A tiny random-weight model writes noise: only the constraint can make its text valid, so a valid `stop` row is
the constraint's doing. Strings are bounded (maxLength) so random text inside them ends within the budget.
"""

from __future__ import annotations

import json
import re

import jsonschema

from batchjob.engine import Completion

# Nested objects, an enum, bounded integers, an array with maxItems, strings with maxLength.
PET_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "axolotl"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 99},
                "vip": {"type": "boolean"},
            },
            "required": ["id", "vip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "age", "tags", "owner"],
    "additionalProperties": False,
}
POINT_SCHEMA = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}, "label": {"enum": ["a", "b"]}},
    "required": ["x", "label"],
    "additionalProperties": False,
}
CODE_REGEX = r"[a-z]{3}-[0-9]{2,3}"
CHOICES = ("yes", "no", "not sure")


def valid_json(text: str, schema: dict) -> bool:
    """Strict `json.loads` (no control characters in strings) and `jsonschema` validation."""
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def check_stop_rows(completions: list[Completion], is_valid) -> float:
    """Assert that every `stop` completion is valid; returns the fraction that stopped."""
    for c in completions:
        assert c.error is None, c.error
        if c.finish_reason == "stop":
            assert is_valid(c.text), repr(c.text)
    return sum(c.finish_reason == "stop" for c in completions) / len(completions)


def matches_code(text: str) -> bool:
    return re.fullmatch(CODE_REGEX, text) is not None
